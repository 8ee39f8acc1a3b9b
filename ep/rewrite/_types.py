"""Options and the report of a rewrite."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ep.errors import ConfigError

__all__ = ["PATTERNS", "LeftAlone", "RewriteOptions", "RewriteReport"]

#: every pattern the rewriter knows: name -> what it turns into what
PATTERNS: dict[str, str] = {
    "gqa_attention": "com.microsoft GroupQueryAttention (packed or separate Q/K/V, fused rotary "
    "from cos/sin caches) -> Split/Reshape, Rotary, KVCommit, KVAttention over the runtime cache",
    "concat_attention": "standard attention (rotate_half rotary, Concat(past, new) present, "
    "scaled causal+padding softmax) -> Rotary, KVCommit, KVAttention over the runtime cache",
    "simplified_layer_norm": "SimplifiedLayerNormalization -> RMSNorm",
    "skip_simplified_layer_norm": "com.microsoft SkipSimplifiedLayerNormalization -> SkipRMSNorm",
    "rms_norm_subgraph": "Pow/ReduceMean/Add/Sqrt/Div/Mul RMS norm -> RMSNorm",
    "skip_rms_norm_subgraph": "residual Add + RMS-norm subgraph -> SkipRMSNorm",
    "swiglu": "Mul(Mul(g, Sigmoid(g)), up) -> SwiGLU",
    "matmul_named_weight": "MatMul on an initializer (or its Transpose) -> MatMul on a named "
    "weight the runtime resolves",
    "matmul_nbits": "com.microsoft MatMulNBits (4 bits, float accuracy) -> MatMulNBits(ZP)",
    "rotary_embedding": "com.microsoft RotaryEmbedding -> Rotary",
}


@dataclass(frozen=True)
class RewriteOptions:
    """What the rewriter may change.

    ``named_weights``: dense MatMuls on an initializer become MatMul on a named weight (the
    runtime resolves it; an offload policy can place it); False keeps ONNX MatMul, which ONNX
    Runtime runs faster on the CPU. ``int4_float``: also rewrite MatMulNBits whose
    ``accuracy_level`` is not float arithmetic (4: int8 activations); the logits then equal the
    float arithmetic of the same 4-bit weights, not ONNX Runtime's. ``strict``: fail instead of
    leaving anything alone. ``context_length``: for a bare ``.onnx`` without genai_config.json.
    """

    named_weights: bool = True
    int4_float: bool = False
    strict: bool = False
    context_length: int | None = None

    def __post_init__(self) -> None:
        for name in ("named_weights", "int4_float", "strict"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"RewriteOptions.{name}={getattr(self, name)!r}; expected a bool")
        ctx = self.context_length
        if ctx is not None and (isinstance(ctx, bool) or not isinstance(ctx, int) or ctx < 2):
            raise ConfigError(f"RewriteOptions.context_length={ctx!r}; expected an integer >= 2")


@dataclass(frozen=True)
class LeftAlone:
    """A node the rewriter did not turn into this project's ops, and why."""

    pattern: str
    node: str
    op_type: str
    reason: str

    def describe(self) -> str:
        return f"{self.op_type} node {self.node!r}: {self.reason}"


@dataclass(frozen=True)
class RewriteReport:
    """What a rewrite did: counts per pattern, what it left alone (with reasons), the KV mode.

    ``kv`` is ``"runtime"`` when attention moved into KVCommit/KVAttention (graph inputs
    input_ids, positions, kv_cache, kv_geometry) and ``"past/present"`` when the attention (and so
    the past/present I/O) was kept.
    """

    source: str
    output: str | None
    rewritten: Mapping[str, int]
    left: tuple[LeftAlone, ...]
    kv: Literal["runtime", "past/present"]
    kv_inputs: Mapping[str, str] = field(default_factory=dict)  # positions/kv_cache/kv_geometry
    ops_before: Mapping[str, int] = field(default_factory=dict)
    ops_after: Mapping[str, int] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(self.rewritten.values())

    def describe(self) -> str:
        lines = [f"rewrote {self.source}" + (f" -> {self.output}" if self.output else "")]
        if self.rewritten:
            lines.append("rewritten:")
            lines += [f"  {name}: {count}" for name, count in sorted(self.rewritten.items())]
        else:
            lines.append("rewritten: nothing")
        lines.append(
            "KV cache: "
            + (
                "runtime-owned (inputs input_ids, positions, kv_cache, kv_geometry)"
                if self.kv == "runtime"
                else "past/present kept (the attention was not rewritten)"
            )
        )
        if self.left:
            lines.append("left alone:")
            lines += [f"  {item.describe()}" for item in self.left]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "output": self.output,
            "rewritten": dict(sorted(self.rewritten.items())),
            "left": [
                {"pattern": i.pattern, "node": i.node, "op_type": i.op_type, "reason": i.reason}
                for i in self.left
            ],
            "kv": self.kv,
            "kv_inputs": dict(self.kv_inputs),
            "ops_before": dict(self.ops_before),
            "ops_after": dict(self.ops_after),
        }


def op_table(counts: Counter[tuple[str, str]]) -> dict[str, int]:
    """``{"domain::OpType": count}``, sorted."""
    return {f"{d}::{t}": n for (d, t), n in sorted(counts.items())}
