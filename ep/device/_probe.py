"""Is there a usable CUDA driver and GPU here? Asked once per process, answered in words.

Two kinds of "no" are kept apart on purpose. *Absent* (no driver library, or a driver that sees no
GPU) is an ordinary fact about a machine: GPU tests skip and ``device="cuda"`` says so plainly.
*Broken* (a driver too old, an initialisation error, cuda-bindings missing) is a fault to fix:
it is never turned into a skip.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ep.device._cuda_errors import describe_cuda_error
from ep.errors import DeviceUnavailableError

__all__ = ["NO_DRIVER_MESSAGE", "CudaProbe", "cuda_available", "is_missing_driver", "probe_cuda"]

NO_DRIVER_MESSAGE = (
    "no CUDA driver found (libcuda.so could not be loaded): install the NVIDIA driver or use "
    "device='cpu'"
)
NO_DEVICE_MESSAGE = (
    "no CUDA device found (the driver sees no GPU; check CUDA_VISIBLE_DEVICES): use device='cpu'"
)


@dataclass(frozen=True)
class CudaProbe:
    """What the one-time CUDA probe found."""

    available: bool
    absent: bool  # True only for "no driver library" or "no GPU": the sole reasons to skip
    reason: str
    device_count: int = 0
    driver_version: int = 0  # as cuDriverGetVersion reports it, e.g. 13000 for 13.0


def is_missing_driver(exc: BaseException) -> bool:
    """Whether an exception from the first driver call means "libcuda.so is not installed"."""
    # cuda.bindings loads libcuda lazily through cuda.pathfinder, which raises
    # DynamicLibNotFoundError (a RuntimeError); older releases raised OSError from dlopen.
    if type(exc).__name__ == "DynamicLibNotFoundError" or isinstance(exc, OSError):
        return True
    text = str(exc)
    return "libcuda" in text or "NVIDIA driver library" in text


@functools.cache
def probe_cuda() -> CudaProbe:
    """Initialise the driver once and report what is there (cached for the process)."""
    try:
        from cuda.bindings import driver
    except ImportError as exc:
        return CudaProbe(
            False,
            False,
            f"cuda-bindings cannot be imported ({exc}): install it with "
            "pip install 'cuda-bindings>=13,<14'",
        )
    try:
        result = driver.cuInit(0)[0]
    except Exception as exc:  # any failure to even reach the driver is classified below
        if is_missing_driver(exc):
            return CudaProbe(False, True, NO_DRIVER_MESSAGE)
        return CudaProbe(False, False, f"cuInit raised {type(exc).__name__}: {exc}")
    code = getattr(result, "name", str(result))
    if code == "CUDA_ERROR_NO_DEVICE":
        return CudaProbe(False, True, NO_DEVICE_MESSAGE)
    if code != "CUDA_SUCCESS":
        return CudaProbe(False, False, describe_cuda_error("cuInit", code))
    result, count = driver.cuDeviceGetCount()
    code = getattr(result, "name", str(result))
    if code != "CUDA_SUCCESS":
        return CudaProbe(False, False, describe_cuda_error("cuDeviceGetCount", code))
    if int(count) == 0:
        return CudaProbe(False, True, NO_DEVICE_MESSAGE)
    result, version = driver.cuDriverGetVersion()
    version = int(version) if getattr(result, "name", "") == "CUDA_SUCCESS" else 0
    return CudaProbe(
        True,
        False,
        f"{int(count)} CUDA device(s), driver CUDA {version // 1000}.{version % 1000 // 10}",
        device_count=int(count),
        driver_version=version,
    )


def cuda_available() -> tuple[bool, str]:
    """``(True, description)`` when CUDA works, ``(False, reason)`` when it is genuinely absent.

    A driver that is present but broken raises `DeviceUnavailableError` instead of answering
    ``False``, so a test that skips on ``False`` never hides a real failure.
    """
    probe = probe_cuda()
    if probe.available or probe.absent:
        return probe.available, probe.reason
    raise DeviceUnavailableError(f"CUDA is installed but not usable: {probe.reason}")
