"""Everything that touches ONNX Runtime: sessions (with the custom-op hook) and the ort backend."""

from __future__ import annotations

from ep.ort.backend import OrtBackend
from ep.ort.session import (
    SessionConfig,
    SessionOptionsHook,
    add_session_options_hook,
    create_session,
    remove_session_options_hook,
)

__all__ = [
    "OrtBackend",
    "SessionConfig",
    "SessionOptionsHook",
    "add_session_options_hook",
    "create_session",
    "remove_session_options_hook",
]
