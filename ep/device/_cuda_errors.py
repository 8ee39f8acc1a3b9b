"""CUDA failures as sentences: the call, the error code's name and what it usually means.

Nothing here imports `cuda`: codes arrive either as a `CUresult`-like enum (anything with a
``.name``) or inside the text of an exception raised by `cuda.core`, which starts with the name
("CUDA_ERROR_OUT_OF_MEMORY: out of memory").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ep.errors import CudaCallError

__all__ = ["CUDA_ERROR_MEANINGS", "check_cuda", "cuda_error", "describe_cuda_error"]

# The codes people actually meet, each with the usual cause and the usual fix.
CUDA_ERROR_MEANINGS: Mapping[str, str] = {
    "CUDA_ERROR_OUT_OF_MEMORY": (
        "the GPU ran out of memory: free buffers, lower the batch or the KV capacity, or choose an "
        "offload policy with a smaller device budget"
    ),
    "CUDA_ERROR_INVALID_VALUE": (
        "an argument was out of range or inconsistent (a size, an offset, a pointer, a launch "
        "dimension or a shared-memory size)"
    ),
    "CUDA_ERROR_ILLEGAL_ADDRESS": (
        "a kernel read or wrote memory outside every allocation (an index or size bug in a "
        "kernel or its arguments); the CUDA context is now unusable: restart the process"
    ),
    "CUDA_ERROR_MISALIGNED_ADDRESS": (
        "a kernel accessed memory at an address not aligned to the access size (a view offset "
        "not a multiple of the element size); restart the process"
    ),
    "CUDA_ERROR_ILLEGAL_INSTRUCTION": (
        "a kernel executed an illegal instruction (often a trap or a wrong architecture); "
        "restart the process"
    ),
    "CUDA_ERROR_LAUNCH_FAILED": (
        "a kernel failed while running (an exception on the device); the context is now "
        "unusable: restart the process"
    ),
    "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES": (
        "the kernel needs more registers or shared memory than a block of this size can have: "
        "lower the block size or the shared memory"
    ),
    "CUDA_ERROR_LAUNCH_TIMEOUT": "a kernel ran longer than the watchdog allows on this GPU",
    "CUDA_ERROR_NOT_SUPPORTED": "this GPU or driver does not support the operation",
    "CUDA_ERROR_NOT_PERMITTED": "the operation is not permitted in the current state",
    "CUDA_ERROR_INVALID_HANDLE": (
        "a handle (stream, event, graph, module, kernel) was already destroyed or belongs to "
        "another context"
    ),
    "CUDA_ERROR_INVALID_CONTEXT": (
        "no valid CUDA context is current on this thread: call the device's set_current first"
    ),
    "CUDA_ERROR_INVALID_DEVICE": "the device ordinal does not name a device on this machine",
    "CUDA_ERROR_NO_DEVICE": "no CUDA-capable GPU is visible (check CUDA_VISIBLE_DEVICES)",
    "CUDA_ERROR_NOT_INITIALIZED": "the CUDA driver was not initialised (cuInit was not called)",
    "CUDA_ERROR_DEINITIALIZED": "the CUDA driver is shutting down (the process is exiting)",
    "CUDA_ERROR_INSUFFICIENT_DRIVER": (
        "the installed NVIDIA driver is older than this CUDA version needs: update the driver "
        "or install cuda-python built for the driver's CUDA version"
    ),
    "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH": (
        "the kernel-mode and user-mode NVIDIA driver versions differ: reboot, or reinstall "
        "the driver"
    ),
    "CUDA_ERROR_NO_BINARY_FOR_GPU": (
        "the cubin was built for another architecture: compile for this GPU's own sm_XX"
    ),
    "CUDA_ERROR_INVALID_IMAGE": "the module image (cubin) is corrupt or not for this GPU",
    "CUDA_ERROR_INVALID_PTX": (
        "the driver cannot load this PTX; compile to cubin for the GPU's own architecture instead"
    ),
    "CUDA_ERROR_UNSUPPORTED_PTX_VERSION": (
        "the PTX comes from an NVRTC newer than the driver: compile to cubin (never PTX)"
    ),
    "CUDA_ERROR_NOT_FOUND": "a named symbol (for example a kernel entry) is not in the module",
    "CUDA_ERROR_NOT_READY": "the work is still running (not an error for queries)",
    "CUDA_ERROR_ALREADY_MAPPED": "this virtual address range is already mapped",
    "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED": (
        "the operation is not allowed while a stream is being captured into a graph "
        "(allocations, synchronisation, pageable copies)"
    ),
    "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED": (
        "the graph capture was invalidated by an earlier error or an illegal call during capture"
    ),
    "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED": "a capture was ended on a stream that did not begin it",
    "CUDA_ERROR_CAPTURED_EVENT": "the operation is not allowed on an event recorded in a capture",
    "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE": "the graph changed in a way an update cannot apply",
    "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE": "too many blocks for a cooperative launch",
    "CUDA_ERROR_ECC_UNCORRECTABLE": "the GPU reported an uncorrectable memory (ECC) error",
    "CUDA_ERROR_UNKNOWN": "the driver reported an unknown error",
    "NVRTC_ERROR_COMPILATION": "the CUDA C source did not compile (see the compiler log)",
    "NVRTC_ERROR_INVALID_OPTION": "NVRTC rejected a compiler option (for example the architecture)",
    "NVRTC_ERROR_BUILTIN_OPERATION_FAILURE": "NVRTC failed internally",
}

_CODE_IN_TEXT = re.compile(r"\b((?:CUDA|NVRTC)_ERROR_[A-Z0-9_]+)\b")


def describe_cuda_error(call: str, code: str, detail: str = "") -> str:
    """One sentence: ``"<call> failed with <code>: <usual meaning> (<detail>)"``."""
    meaning = CUDA_ERROR_MEANINGS.get(
        code, "an uncommon code; see the CUDA driver API documentation for it"
    )
    text = f"{call} failed with {code}: {meaning}"
    if detail and detail.strip() != code:
        text += f" (driver said: {detail.strip()})"
    return text


def cuda_error(call: str, exc: BaseException) -> CudaCallError:
    """Turn any exception from a `cuda.core` / `cuda.bindings` call into a `CudaCallError`."""
    text = str(exc)
    found = _CODE_IN_TEXT.search(text)
    code = found.group(1) if found else type(exc).__name__
    return CudaCallError(describe_cuda_error(call, code, text), call=call, code=code)


def _code_name(result: Any) -> str:
    name = getattr(result, "name", None)
    return str(name) if name is not None else str(result)


def check_cuda(call: str, result: Any) -> None:
    """Raise `CudaCallError` unless ``result`` (a `CUresult`, or a tuple led by one) is success."""
    if isinstance(result, tuple):
        result = result[0]
    name = _code_name(result)
    if name not in ("CUDA_SUCCESS", "0"):
        raise CudaCallError(describe_cuda_error(call, name), call=call, code=name)
