"""ONNX Runtime sessions for decoder graphs: execution provider choice and the options hook.

Custom ops (ep.ops) must be registered in the ``SessionOptions`` before a session exists; they
come in through a *session options hook*: a callable that receives the ``SessionOptions`` just
before the session is created. Hooks registered with `add_session_options_hook` run for every
session (the op bridge registers itself there once); a hook passed to `create_session` runs
for that session only, after them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import onnxruntime as ort

from ep.errors import ConfigError, DeviceError, EPError, ModelError

__all__ = [
    "SessionConfig",
    "SessionOptionsHook",
    "add_session_options_hook",
    "create_session",
    "remove_session_options_hook",
]

SessionOptionsHook = Callable[[ort.SessionOptions], None]

_HOOKS: list[SessionOptionsHook] = []

_OPT_LEVELS = {
    "disable": ort.GraphOptimizationLevel.ORT_DISABLE_ALL,
    "basic": ort.GraphOptimizationLevel.ORT_ENABLE_BASIC,
    "extended": ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED,
    "all": ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
}


@dataclass(frozen=True)
class SessionConfig:
    """How to build the session. ``device``: "cpu" or "cuda" (needs onnxruntime-gpu).

    ``intra_op_threads`` / ``inter_op_threads``: 0 keeps ONNX Runtime's default.
    ``log_severity``: ONNX Runtime's (0 verbose .. 4 fatal); 3 shows errors only.
    """

    device: str = "cpu"
    device_id: int = 0
    intra_op_threads: int = 0
    inter_op_threads: int = 0
    optimization: str = "all"
    log_severity: int = 3

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device={self.device!r}; expected 'cpu' or 'cuda'")
        if self.optimization not in _OPT_LEVELS:
            raise ConfigError(
                f"optimization={self.optimization!r}; expected one of {', '.join(_OPT_LEVELS)}"
            )
        for name in ("device_id", "intra_op_threads", "inter_op_threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(f"{name}={value!r}; expected an integer >= 0")
        if self.log_severity not in range(5):
            raise ConfigError(f"log_severity={self.log_severity!r}; expected 0..4")

    def providers(self) -> list[str | tuple[str, dict[str, str]]]:
        if self.device == "cpu":
            return ["CPUExecutionProvider"]
        available = ort.get_available_providers()
        if "CUDAExecutionProvider" not in available:
            raise DeviceError(
                f"device 'cuda' asked for, but this onnxruntime ({ort.__version__}) has no CUDA "
                f"execution provider (it has: {', '.join(available)}); install onnxruntime-gpu "
                "instead of onnxruntime (never both: they provide the same module)"
            )
        return [
            ("CUDAExecutionProvider", {"device_id": str(self.device_id)}),
            "CPUExecutionProvider",
        ]


def add_session_options_hook(hook: SessionOptionsHook) -> None:
    """Run ``hook(options)`` before every session is created (idempotent per hook)."""
    if not callable(hook):
        raise ConfigError(f"session options hook {hook!r} is not callable")
    if hook not in _HOOKS:
        _HOOKS.append(hook)


def remove_session_options_hook(hook: SessionOptionsHook) -> None:
    if hook in _HOOKS:
        _HOOKS.remove(hook)


def create_session(
    path: str | Path,
    config: SessionConfig | None = None,
    *,
    session_options_hook: SessionOptionsHook | None = None,
) -> ort.InferenceSession:
    """An ``InferenceSession`` for the model at ``path``; ORT's failures become ModelError."""
    config = config or SessionConfig()
    options = ort.SessionOptions()
    options.log_severity_level = config.log_severity
    options.graph_optimization_level = _OPT_LEVELS[config.optimization]
    if config.intra_op_threads:
        options.intra_op_num_threads = config.intra_op_threads
    if config.inter_op_threads:
        options.inter_op_num_threads = config.inter_op_threads
    hooks = [*_HOOKS, *([session_options_hook] if session_options_hook else [])]
    for hook in hooks:
        try:
            hook(options)
        except EPError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"session options hook {getattr(hook, '__qualname__', hook)!r} failed: "
                f"{type(exc).__name__}: {exc}"
            ) from exc
    providers = config.providers()
    try:
        return ort.InferenceSession(str(path), options, providers=providers)
    except Exception as exc:  # ORT raises its own Fail/InvalidGraph/NoSuchFile... classes
        text = str(exc)
        hint = ""
        if "ai.genai_ep" in text or "custom" in text.lower():
            hint = (
                "; the graph uses this project's custom ops: register them before the session "
                "with a session options hook (ep.ort.session.add_session_options_hook)"
            )
        raise ModelError(
            f"ONNX Runtime {ort.__version__} cannot load {path}: {text.strip()}{hint}"
        ) from None
