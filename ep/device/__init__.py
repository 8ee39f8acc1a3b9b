"""The device layer: one contract, a CPU (NumPy) and a CUDA (cuda.core) implementation.

>>> import numpy as np
>>> dev = get_device("cpu")  # or "cuda", "cuda:0": the same calls
>>> s = dev.default_stream
>>> x = dev.to_device(np.arange(4, dtype=np.float32), stream=s, name="x")
>>> y = dev.alloc(4, np.float32, stream=s, name="y")
>>> dev.fill(y, 1.0, stream=s)
>>> _ = dev.compile_all()  # every registered kernel, before any capture
>>> axpy = dev.kernel("axpy_f32")  # y = a*x + y
>>> with dev.capture(stream=s) as cap:  # records; nothing runs yet
...     axpy.launch(1, 256, y, x, 2.0, 4, stream=s)
>>> y.to_host(stream=s)
array([1., 1., 1., 1.], dtype=float32)
>>> cap.graph.launch(stream=s)  # replays
>>> y.to_host(stream=s)
array([1., 3., 5., 7.], dtype=float32)
>>> bool(cap.graph.check(binding_signature([x, y])))
True

Kernels are registered by name (`register_kernel`) and compiled to cubin for the device's own
architecture, cached on disk (`GENAI_EP_KERNEL_CACHE`, default ``~/.cache/genai-ep/kernels``).
"""

from __future__ import annotations

import re

from ep.device import _builtin_kernels as _builtin_kernels  # registers fill_* and axpy_f32
from ep.device._base import (
    Buffer,
    Capture,
    Device,
    DeviceCounters,
    Event,
    Graph,
    GraphCheck,
    GrowableBuffer,
    Kernel,
    LaunchRecord,
    PinnedBuffer,
    Stream,
    as_dtype,
    binding_signature,
)
from ep.device._cpu import CPUDevice
from ep.device._cuda_errors import CUDA_ERROR_MEANINGS, describe_cuda_error
from ep.device._kernels import (
    CACHE_ENV,
    KERNELS,
    CompileOptions,
    KernelCache,
    KernelRegistry,
    KernelReport,
    KernelSource,
    compile_all,
    compile_all_kernels,
    compile_kernel,
    default_cache,
    kernel_target,
    register_kernel,
)
from ep.device._probe import CudaProbe, cuda_available, probe_cuda
from ep.errors import ConfigError, DeviceUnavailableError

__all__ = [
    "CACHE_ENV",
    "CUDA_ERROR_MEANINGS",
    "KERNELS",
    "Buffer",
    "CPUDevice",
    "Capture",
    "CompileOptions",
    "CudaProbe",
    "Device",
    "DeviceCounters",
    "Event",
    "Graph",
    "GraphCheck",
    "GrowableBuffer",
    "Kernel",
    "KernelCache",
    "KernelRegistry",
    "KernelReport",
    "KernelSource",
    "LaunchRecord",
    "PinnedBuffer",
    "Stream",
    "as_dtype",
    "binding_signature",
    "compile_all",
    "compile_all_kernels",
    "compile_kernel",
    "cuda_available",
    "default_cache",
    "describe_cuda_error",
    "get_device",
    "kernel_target",
    "probe_cuda",
    "register_kernel",
]

_DEVICES: dict[str, Device] = {}
_SPEC = re.compile(r"^(cpu|cuda)(?::(\d+))?$")


def get_device(spec: str | Device = "cpu") -> Device:
    """The device named ``"cpu"``, ``"cuda"`` or ``"cuda:N"`` (one object per device).

    A missing CUDA driver or GPU raises `DeviceUnavailableError` with the reason in words.
    """
    if isinstance(spec, Device):
        return spec
    text = str(spec).strip().lower()
    found = _SPEC.match(text)
    if found is None or (found.group(1) == "cpu" and found.group(2) is not None):
        raise ConfigError(
            f"device {spec!r} is not a device name: expected 'cpu', 'cuda' or 'cuda:N'"
        )
    key = "cpu" if found.group(1) == "cpu" else f"cuda:{int(found.group(2) or 0)}"
    device = _DEVICES.get(key)
    if device is not None:
        return device
    if key == "cpu":
        device = CPUDevice()
    else:
        ordinal = int(key.split(":")[1])
        probe = probe_cuda()
        if not probe.available:
            raise DeviceUnavailableError(probe.reason)
        if ordinal >= probe.device_count:
            raise DeviceUnavailableError(
                f"device {spec!r} asked for GPU {ordinal}, but this machine has "
                f"{probe.device_count} (cuda:0 to cuda:{probe.device_count - 1})"
            )
        from ep.device._cuda import CUDADevice

        device = CUDADevice(ordinal)
    _DEVICES[key] = device
    return device
