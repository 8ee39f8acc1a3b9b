"""genai-ep: run genai-style ONNX decoders with swappable KV layouts, capture and offload policies.

The public API is re-exported here; everything else is private to its module.
"""

from __future__ import annotations

from typing import Any

from ep.config import Budget, Config, Setting, load_config, parse_budget
from ep.errors import (
    ConfigError,
    ContractError,
    DeviceError,
    EPError,
    GenerationError,
    KernelCompileError,
    ModelError,
    OpError,
    PluginConflictError,
    PluginError,
    PluginLoadError,
)
from ep.hookspecs import hookimpl
from ep.plugins import PluginHost, get_host
from ep.registry import Option, Register, Registry

__version__ = "0.1.0"


def register(session_options: Any, registry: Registry | None = None) -> Any:
    """Let an ``onnxruntime.SessionOptions`` run this project's ops; returns it.

    Use it for your own ``InferenceSession``; run it with ``ep.ops.run`` so that an op's error is
    raised from ``run()`` (onnxruntime is imported only when this is called).
    """
    from ep.ops import register_session_options

    return register_session_options(session_options, registry)


__all__ = [
    "Budget",
    "Config",
    "ConfigError",
    "ContractError",
    "DeviceError",
    "EPError",
    "GenerationError",
    "KernelCompileError",
    "ModelError",
    "OpError",
    "Option",
    "PluginConflictError",
    "PluginError",
    "PluginHost",
    "PluginLoadError",
    "Register",
    "Registry",
    "Setting",
    "__version__",
    "get_host",
    "hookimpl",
    "load_config",
    "parse_budget",
    "register",
]
