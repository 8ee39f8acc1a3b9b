"""RMSNorm and SkipRMSNorm (residual add, then norm), computed in float32, rounded once to T."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ep.ops._infer import FLOATS, as_f32, expect, expect_rank, expect_shape, same_shape
from ep.ops.schema import ArgInfo, AttrSpec, OpDef, OpSchema, TensorSpec

__all__ = ["RMS_NORM", "SKIP_RMS_NORM", "rms_norm", "skip_rms_norm"]

_EPS = AttrSpec("epsilon", "float", 1e-6, "added to the mean square before the square root")


def rms_norm(x: np.ndarray, weight: np.ndarray, *, epsilon: float) -> np.ndarray:
    """``x / sqrt(mean(x², last axis) + epsilon) * weight``; the ONNX Runtime
    SimplifiedLayerNormalization semantics over the last axis."""
    xf = as_f32(x)
    # np.add.reduce + divide is np.mean's arithmetic without its Python-level overhead.
    mean_square = np.add.reduce(xf * xf, axis=-1, keepdims=True) / np.float32(x.shape[-1])
    inv = np.float32(1.0) / np.sqrt(mean_square + np.float32(epsilon))
    return (xf * inv * as_f32(weight)).astype(x.dtype, copy=False)


def skip_rms_norm(
    x: np.ndarray, skip: np.ndarray, weight: np.ndarray, *, epsilon: float
) -> tuple[np.ndarray, np.ndarray]:
    """``(rms_norm(x + skip), x + skip)``. The sum is rounded to T first and the norm reads the
    rounded sum, so the fused op equals an Add followed by `rms_norm` in every dtype."""
    total = (as_f32(x) + as_f32(skip)).astype(x.dtype, copy=False)
    return rms_norm(total, weight, epsilon=epsilon), total


def _infer_rms(inputs: Sequence[ArgInfo], attrs: Mapping[str, Any]) -> tuple[ArgInfo, ...]:
    x, weight = inputs
    expect_rank("RMSNorm", "x", x, range(1, 9), "[..., hidden]")
    expect_shape("RMSNorm", "weight", weight, (x.shape[-1],), "[hidden], the last axis of x")
    expect(attrs["epsilon"] >= 0, "RMSNorm", f"epsilon={attrs['epsilon']} must be >= 0")
    return (x,)


def _infer_skip(inputs: Sequence[ArgInfo], attrs: Mapping[str, Any]) -> tuple[ArgInfo, ...]:
    x, skip, weight = inputs
    expect_rank("SkipRMSNorm", "x", x, range(1, 9), "[..., hidden]")
    same_shape("SkipRMSNorm", ("x", x), ("skip", skip))
    expect_shape("SkipRMSNorm", "weight", weight, (x.shape[-1],), "[hidden], the last axis of x")
    expect(attrs["epsilon"] >= 0, "SkipRMSNorm", f"epsilon={attrs['epsilon']} must be >= 0")
    return (x, x)


RMS_NORM = OpDef(
    OpSchema(
        "RMSNorm",
        inputs=(TensorSpec("x", "T", "[..., hidden]"), TensorSpec("weight", "T", "[hidden]")),
        outputs=(TensorSpec("y", "T", "same shape as x"),),
        attributes=(_EPS,),
        type_vars=(("T", FLOATS),),
        doc="Root-mean-square norm over the last axis (SimplifiedLayerNormalization).",
    ),
    reference=rms_norm,
    infer=_infer_rms,
)

SKIP_RMS_NORM = OpDef(
    OpSchema(
        "SkipRMSNorm",
        inputs=(
            TensorSpec("x", "T", "[..., hidden]"),
            TensorSpec("skip", "T", "same shape as x (the residual)"),
            TensorSpec("weight", "T", "[hidden]"),
        ),
        outputs=(
            TensorSpec("y", "T", "rms_norm(x + skip)"),
            TensorSpec("sum", "T", "x + skip, the next residual"),
        ),
        attributes=(_EPS,),
        type_vars=(("T", FLOATS),),
        doc="Residual add then RMS norm (SkipSimplifiedLayerNormalization without bias).",
    ),
    reference=skip_rms_norm,
    infer=_infer_skip,
)
