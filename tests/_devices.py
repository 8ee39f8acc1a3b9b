"""The devices a test runs on: the CPU, and (in tests marked ``cuda``) the GPU, which skips only
when there is genuinely no CUDA driver or GPU (`ep.device.cuda_available`; a present but broken
driver raises: a failure, never a skip). Importable from every test (the root conftest's folder
is on ``sys.path``)."""

from __future__ import annotations

import pytest

from ep.device import Device, cuda_available, get_device


def cuda_or_skip() -> Device:
    """The GPU, or a skip when there is no driver or no GPU."""
    ok, reason = cuda_available()
    if not ok:
        pytest.skip(reason)
    return get_device("cuda")


def device_or_skip(kind: str) -> Device:
    """``get_device(kind)``; for ``"cuda"`` a skip when there is no driver or no GPU."""
    return cuda_or_skip() if kind == "cuda" else get_device(kind)
