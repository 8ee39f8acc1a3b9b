"""The error hierarchy of genai-ep.

Every message names what failed, the value seen, what was expected and how to fix it. Code that
catches errors from the project catches `EPError`; the CLI prints its message without a traceback.
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "ContractError",
    "DeviceError",
    "EPError",
    "GenerationError",
    "KernelCompileError",
    "ModelError",
    "OpError",
    "PluginConflictError",
    "PluginError",
    "PluginLoadError",
]


class EPError(Exception):
    """Base of every error genai-ep raises on purpose."""


# --- configuration and plugins -------------------------------------------------------------


class ConfigError(EPError, ValueError):
    """A configuration value (from any source) is unknown, malformed or out of range."""


class PluginError(EPError):
    """Something is wrong with a plugin."""


class PluginLoadError(PluginError):
    """A plugin could not be imported or registered."""


class PluginConflictError(PluginError):
    """Two plugins registered the same name in the same seam."""


class ContractError(PluginError):
    """A plugin returned something that breaks its seam's contract (addressed to its author)."""


# --- models, generation, ops, devices ------------------------------------------------------


class ModelError(EPError, ValueError):
    """A model path, file or graph is missing, malformed or has I/O we cannot drive."""


class GenerationError(EPError, ValueError):
    """A generation request is invalid: prompt too long, token id out of range, bad sampling."""


class OpError(EPError):
    """A custom op failed while running, or returned an output that breaks its schema."""


class DeviceError(EPError):
    """A device (CPU or CUDA) call failed; the message names the call and what the code means."""


class KernelCompileError(DeviceError):
    """NVRTC rejected a kernel; the message carries the compiler log."""


class KernelUnavailableError(KernelCompileError):
    """A kernel built on one architecture's own instructions (wgmma: sm_90a) was asked for on
    another architecture."""


# --- device layer (ep/device) ------------------------------------------------------------------

__all__ += [
    "CudaCallError",
    "DeviceUnavailableError",
    "KernelRegistryError",
    "KernelUnavailableError",
]


class DeviceUnavailableError(DeviceError):
    """The requested device is not here: no CUDA driver, no GPU, or a device index out of range."""


class CudaCallError(DeviceError):
    """A CUDA driver, runtime or NVRTC call failed; ``call`` and ``code`` name it and its result."""

    def __init__(self, message: str, *, call: str = "", code: str = "") -> None:
        super().__init__(message)
        self.call = call
        self.code = code


class KernelRegistryError(DeviceError, ValueError):
    """A kernel name is unknown, or two different kernels were registered under one name."""


# --- CUDA kernels of the ops (ep/kernels) ------------------------------------------------------

__all__ += ["KernelArgumentError", "KernelFaultError"]


class KernelArgumentError(DeviceError, ValueError):
    """A kernel wrapper got buffers or sizes that do not fit the kernel (dtype, size, range)."""


class KernelFaultError(OpError):
    """A kernel met bad data on the device (an id, position or page out of range) and flagged it.

    ``faults`` holds the `ep.kernels.KernelFault` bits that were set.
    """

    def __init__(self, message: str, *, faults: int = 0) -> None:
        super().__init__(message)
        self.faults = faults


# --- weight store and offload (ep/offload) -----------------------------------------------------

__all__ += ["OffloadBudgetError", "OffloadError"]


class OffloadError(EPError):
    """The weight store was misused: an unknown weight, a closed store, a capture it refuses."""


class OffloadBudgetError(OffloadError, ConfigError):
    """The offload budget cannot hold the plan; the message gives the bytes needed and the fix."""
