"""Fixtures for the weight store: a realistic small decoder's weights and a fresh CPU device."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
from _devices import cuda_or_skip

from ep.device import CPUDevice, Device
from ep.offload import weight_infos
from ep.seams import WeightInfo
from ep_graphs import ModelSpec, random_weights

SPEC = "hidden=64,layers=4,heads=4,kv_heads=2,vocab=256"


@pytest.fixture(scope="session")
def weights() -> Mapping[str, np.ndarray]:
    return random_weights(ModelSpec.parse(SPEC))


@pytest.fixture(scope="session")
def infos(weights: Mapping[str, np.ndarray]) -> tuple[WeightInfo, ...]:
    return weight_infos(weights)


@pytest.fixture
def cpu() -> Device:
    """A device of its own, so its byte counters hold only this test's work."""
    return CPUDevice()


@pytest.fixture
def cuda_dev() -> Device:
    return cuda_or_skip()
