"""SwiGLU: ``silu(gate) * up`` from two inputs, or from one packed input (halves or interleaved)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ep.ops._infer import FLOATS, as_f32, expect, expect_rank, same_shape
from ep.ops.schema import ArgInfo, AttrSpec, OpDef, OpSchema, TensorSpec

__all__ = ["SWIGLU", "SWIGLU_PACKED", "swiglu", "swiglu_packed"]


def swiglu(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """``gate * sigmoid(gate) * up`` in float32, rounded to the input dtype."""
    g = as_f32(gate)
    return (g / (np.float32(1.0) + np.exp(-g)) * as_f32(up)).astype(gate.dtype, copy=False)


def swiglu_packed(gate_up: np.ndarray, *, interleaved: int) -> np.ndarray:
    """`swiglu` of a packed [..., 2I] input: [gate | up] halves, or (g0, u0, g1, u1, ...)."""
    if interleaved:
        return swiglu(gate_up[..., 0::2], gate_up[..., 1::2])
    half = gate_up.shape[-1] // 2
    return swiglu(gate_up[..., :half], gate_up[..., half:])


def _infer_swiglu(inputs: Sequence[ArgInfo], attrs: Mapping[str, Any]) -> tuple[ArgInfo, ...]:
    gate, up = inputs
    expect_rank("SwiGLU", "gate", gate, range(1, 9), "[..., intermediate]")
    same_shape("SwiGLU", ("gate", gate), ("up", up))
    return (gate,)


def _infer_packed(inputs: Sequence[ArgInfo], attrs: Mapping[str, Any]) -> tuple[ArgInfo, ...]:
    (packed,) = inputs
    expect_rank("SwiGLUPacked", "gate_up", packed, range(1, 9), "[..., 2 * intermediate]")
    expect(
        packed.shape[-1] % 2 == 0,
        "SwiGLUPacked",
        f"gate_up's last axis ({packed.shape[-1]}) must be even: gate and up packed together",
    )
    expect(attrs["interleaved"] in (0, 1), "SwiGLUPacked", "interleaved must be 0 or 1")
    return (ArgInfo((*packed.shape[:-1], packed.shape[-1] // 2), packed.dtype),)


SWIGLU = OpDef(
    OpSchema(
        "SwiGLU",
        inputs=(
            TensorSpec("gate", "T", "[..., intermediate]"),
            TensorSpec("up", "T", "same shape as gate"),
        ),
        outputs=(TensorSpec("y", "T", "silu(gate) * up"),),
        type_vars=(("T", FLOATS),),
        doc="The gated MLP activation silu(gate) * up.",
    ),
    reference=swiglu,
    infer=_infer_swiglu,
)

SWIGLU_PACKED = OpDef(
    OpSchema(
        "SwiGLUPacked",
        inputs=(TensorSpec("gate_up", "T", "[..., 2 * intermediate]"),),
        outputs=(TensorSpec("y", "T", "[..., intermediate]"),),
        attributes=(
            AttrSpec("interleaved", "int", 0, "0: [gate | up] halves; 1: g0, u0, g1, u1, ..."),
        ),
        type_vars=(("T", FLOATS),),
        doc="silu(gate) * up from one packed gate/up projection.",
    ),
    reference=swiglu_packed,
    infer=_infer_packed,
)
