"""This project's custom ops: definitions, NumPy references, ONNX node helpers, ORT registration.

Definitions, references and node helpers import without ONNX Runtime; the ONNX Runtime bridge
(`register_session_options`, `run`, ...) is loaded on first use, so the native executor and the
rewriter never pay for it. Sessions run the ops' NumPy references unless `use_device` (or
`set_device`) picks another kernel set, such as the CUDA kernels of `ep.ops.cuda`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ep.ops.core import CORE_OPS, core_op
from ep.ops.graph import (
    BITCAST_OPSET,
    IR_VERSION,
    check_model,
    make_model,
    make_nodes,
    op_types,
    opset_imports,
)
from ep.ops.kv import kv_attention_from, kv_commit_into, kv_geometry, parse_kv_geometry
from ep.ops.matmul import (
    E2M1_VALUES,
    MXFP4_BLOCK,
    decode_e2m1,
    decode_e8m0,
    dequantize_mxfp4,
    dequantize_nbits,
    gather_block_quantized,
    quantize_mxfp4,
    quantize_nbits,
    round_to_int8_blocks,
)
from ep.ops.placement import (
    OpPlacement,
    current_placement,
    placement_for,
    set_device,
    set_placement,
    use_device,
    use_placement,
)
from ep.ops.rotary import rope_cache
from ep.ops.runtime import (
    KV_CACHES,
    DictWeights,
    KVCacheTable,
    KVLayerBuffers,
    WeightResolver,
    get_weight_resolver,
    set_weight_resolver,
    use_weights,
)
from ep.ops.sample import rng_at
from ep.ops.schema import (
    CARRIERS,
    DOMAIN,
    NODE_ATTR,
    ArgInfo,
    AttrSpec,
    OpDef,
    OpSchema,
    TensorSpec,
    float_attr_exact,
)

if TYPE_CHECKING:
    from ep.ops.ort_bridge import (
        install,
        raise_op_errors,
        register_session_options,
        run,
        run_with_iobinding,
        take_op_errors,
    )

__all__ = [
    "BITCAST_OPSET",
    "CARRIERS",
    "CORE_OPS",
    "DOMAIN",
    "E2M1_VALUES",
    "IR_VERSION",
    "KV_CACHES",
    "MXFP4_BLOCK",
    "NODE_ATTR",
    "ArgInfo",
    "AttrSpec",
    "DictWeights",
    "KVCacheTable",
    "KVLayerBuffers",
    "OpDef",
    "OpPlacement",
    "OpSchema",
    "TensorSpec",
    "WeightResolver",
    "check_model",
    "core_op",
    "current_placement",
    "decode_e2m1",
    "decode_e8m0",
    "dequantize_mxfp4",
    "dequantize_nbits",
    "float_attr_exact",
    "gather_block_quantized",
    "get_weight_resolver",
    "install",
    "kv_attention_from",
    "kv_commit_into",
    "kv_geometry",
    "make_model",
    "make_nodes",
    "op_types",
    "opset_imports",
    "parse_kv_geometry",
    "placement_for",
    "quantize_mxfp4",
    "quantize_nbits",
    "raise_op_errors",
    "register_session_options",
    "rng_at",
    "rope_cache",
    "round_to_int8_blocks",
    "run",
    "run_with_iobinding",
    "set_device",
    "set_placement",
    "set_weight_resolver",
    "take_op_errors",
    "use_device",
    "use_placement",
    "use_weights",
]

_BRIDGE = frozenset(
    {
        "install",
        "raise_op_errors",
        "register_session_options",
        "run",
        "run_with_iobinding",
        "take_op_errors",
    }
)


def __getattr__(name: str) -> Any:
    # The ONNX Runtime bridge loads onnxruntime and onnxruntime-extensions: only when asked for.
    if name in _BRIDGE:
        from ep.ops import ort_bridge

        return getattr(ort_bridge, name)
    raise AttributeError(f"module 'ep.ops' has no attribute {name!r}")
