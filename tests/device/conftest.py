"""Fixtures for the device layer: the same test body runs on the CPU and (marked ``cuda``) a GPU."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from _devices import cuda_or_skip

from ep.device import CACHE_ENV, Device, get_device


@pytest.fixture(scope="session", autouse=True)
def _kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep compiled test kernels out of the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("kernel-cache")))
        yield


@pytest.fixture
def cuda_dev() -> Device:
    """The GPU, or a skip when there is genuinely no driver or no GPU (never on other errors)."""
    return cuda_or_skip()


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def device(request: pytest.FixtureRequest) -> Device:
    """Each contract test once per device; kernels compiled up front, as before any capture."""
    dev = cuda_or_skip() if request.param == "cuda" else get_device("cpu")
    dev.compile_all()
    return dev


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng()
