"""The built-in op pack: RMS norms, rotary, KV commit/attention, MatMuls (named, 4-bit, MXFP4),
SwiGLU and Sample, registered exactly as a third-party op pack registers its ops."""

from __future__ import annotations

from ep.hookspecs import hookimpl
from ep.ops.core import CORE_OPS
from ep.registry import PluginRef, Register

__all__ = ["PLUGIN_REF", "ep_register_ops"]

# How this pack is named when it is registered without the plugin host (ep.ops falls back to it).
PLUGIN_REF = PluginRef("ops_core", "ep_builtin.ops_core", "genai-ep", "0.1.0")


@hookimpl(trylast=True)
def ep_register_ops(register: Register) -> None:
    for op in CORE_OPS:
        register.add(op.name, op, description=op.schema.doc)
