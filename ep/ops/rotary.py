"""Rotary position embedding, from cos/sin caches (``Rotary``) or from theta (``RotaryTheta``).

x is [batch, seq, heads, head_dim]. The first ``rotary_dim`` features of each head rotate, the rest
pass through. Half-split (``interleaved=0``) pairs feature i with i + rotary_dim/2 (Llama in
Hugging Face); interleaved pairs 2i with 2i+1 (GPT-J). A negative position marks a padding token:
it passes through unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ep.errors import OpError
from ep.ops._infer import FLOATS, as_f32, expect, expect_rank, expect_shape
from ep.ops.schema import ArgInfo, AttrSpec, OpDef, OpSchema, TensorSpec

__all__ = ["ROTARY", "ROTARY_THETA", "rope_cache", "rotary", "rotary_theta"]

_INTERLEAVED = AttrSpec("interleaved", "int", 0, "1: rotate pairs (2i, 2i+1); 0: (i, i + R/2)")


def rope_cache(
    theta: float, rotary_dim: int, max_positions: int, dtype: Any = np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin)`` caches [max_positions, rotary_dim/2] the way Hugging Face builds them
    (inverse frequencies and angles in float32, then rounded to ``dtype``)."""
    inv_freq = _inv_freq(theta, rotary_dim)
    angles = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    return np.cos(angles).astype(dtype), np.sin(angles).astype(dtype)


def _inv_freq(theta: float, rotary_dim: int) -> np.ndarray:
    exponents = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(
        rotary_dim
    )
    return (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)


def _apply(
    x: np.ndarray, valid: np.ndarray, cos: np.ndarray, sin: np.ndarray, interleaved: int
) -> np.ndarray:
    """Rotate x [B,S,N,D] with cos/sin [B,S,R/2] (float32); rows where ``valid`` is False pass."""
    half = cos.shape[-1]
    rot = 2 * half
    xf = as_f32(x)
    c = cos[:, :, None, :]
    s = sin[:, :, None, :]
    out = xf.copy()
    if interleaved:
        x1, x2 = xf[..., 0:rot:2], xf[..., 1:rot:2]
        out[..., 0:rot:2] = x1 * c - x2 * s
        out[..., 1:rot:2] = x2 * c + x1 * s
    else:
        x1, x2 = xf[..., :half], xf[..., half:rot]
        out[..., :half] = x1 * c - x2 * s
        out[..., half:rot] = x2 * c + x1 * s
    if not valid.all():
        out = np.where(valid[:, :, None, None], out, xf)
    return out.astype(x.dtype, copy=False)


def _positions(position_ids: np.ndarray, limit: int | None, op: str) -> tuple[np.ndarray, ...]:
    valid = position_ids >= 0
    if limit is not None and valid.any() and int(position_ids.max()) >= limit:
        raise OpError(
            f"{op}: position {int(position_ids.max())} is outside the cos/sin cache of {limit} "
            "positions. Build the caches for the model's whole context"
        )
    return valid, np.where(valid, position_ids, 0)


def rotary(
    x: np.ndarray,
    position_ids: np.ndarray,
    cos_cache: np.ndarray,
    sin_cache: np.ndarray,
    *,
    interleaved: int,
) -> np.ndarray:
    """x [B,S,N,D] rotated at ``position_ids`` [B,S] with caches [P, R/2] (R <= D)."""
    valid, pos = _positions(position_ids, cos_cache.shape[0], "Rotary")
    return _apply(x, valid, as_f32(cos_cache[pos]), as_f32(sin_cache[pos]), interleaved)


def rotary_theta(
    x: np.ndarray, position_ids: np.ndarray, *, theta: float, rotary_dim: int, interleaved: int
) -> np.ndarray:
    """Like `rotary` with ``rope_cache(theta, rotary_dim or D, ..., x.dtype)`` computed on the fly
    (equal to it bit for bit)."""
    rot = rotary_dim or x.shape[-1]
    valid, pos = _positions(position_ids, None, "RotaryTheta")
    angles = pos.astype(np.float32)[..., None] * _inv_freq(theta, rot)
    # Round cos/sin to T as a cache of dtype T would hold them.
    cos = as_f32(np.cos(angles).astype(x.dtype, copy=False))
    sin = as_f32(np.sin(angles).astype(x.dtype, copy=False))
    return _apply(x, valid, cos, sin, interleaved)


def _check_x_pos(op: str, x: ArgInfo, pos: ArgInfo) -> None:
    expect_rank(op, "x", x, (4,), "[batch, seq, heads, head_dim]")
    expect_shape(op, "position_ids", pos, x.shape[:2], "[batch, seq] of x")


def _infer_rotary(inputs: Sequence[ArgInfo], attrs: Mapping[str, Any]) -> tuple[ArgInfo, ...]:
    x, pos, cos, sin = inputs
    _check_x_pos("Rotary", x, pos)
    expect_rank("Rotary", "cos_cache", cos, (2,), "[max_positions, rotary_dim / 2]")
    expect(cos.shape == sin.shape, "Rotary", f"cos {cos.shape} and sin {sin.shape} differ")
    expect(
        0 < 2 * cos.shape[1] <= x.shape[3],
        "Rotary",
        f"cos/sin width {cos.shape[1]} gives rotary_dim {2 * cos.shape[1]}, which must be in "
        f"(0, head_dim={x.shape[3]}]",
    )
    expect(attrs["interleaved"] in (0, 1), "Rotary", "interleaved must be 0 or 1")
    return (x,)


def _infer_theta(inputs: Sequence[ArgInfo], attrs: Mapping[str, Any]) -> tuple[ArgInfo, ...]:
    x, pos = inputs
    _check_x_pos("RotaryTheta", x, pos)
    rot = attrs["rotary_dim"] or x.shape[3]
    expect(
        0 < rot <= x.shape[3] and rot % 2 == 0,
        "RotaryTheta",
        f"rotary_dim={rot} must be even and in (0, head_dim={x.shape[3]}]",
    )
    expect(attrs["theta"] > 0, "RotaryTheta", f"theta={attrs['theta']} must be > 0")
    expect(attrs["interleaved"] in (0, 1), "RotaryTheta", "interleaved must be 0 or 1")
    return (x,)


_X = TensorSpec("x", "T", "[batch, seq, heads, head_dim]")
_POS = TensorSpec("position_ids", "int64", "[batch, seq]; negative = padding (passes through)")
_Y = TensorSpec("y", "T", "same shape as x")

ROTARY = OpDef(
    OpSchema(
        "Rotary",
        inputs=(
            _X,
            _POS,
            TensorSpec("cos_cache", "T", "[max_positions, rotary_dim / 2]"),
            TensorSpec("sin_cache", "T", "[max_positions, rotary_dim / 2]"),
        ),
        outputs=(_Y,),
        attributes=(_INTERLEAVED,),
        type_vars=(("T", FLOATS),),
        doc="Rotary embedding from cos/sin caches (com.microsoft RotaryEmbedding semantics).",
    ),
    reference=rotary,
    infer=_infer_rotary,
)

ROTARY_THETA = OpDef(
    OpSchema(
        "RotaryTheta",
        inputs=(_X, _POS),
        outputs=(_Y,),
        attributes=(
            AttrSpec("theta", "float", 10000.0, "the RoPE base"),
            AttrSpec("rotary_dim", "int", 0, "features rotated per head; 0: all of head_dim"),
            _INTERLEAVED,
        ),
        type_vars=(("T", FLOATS),),
        doc="Rotary embedding with cos/sin computed from theta (Hugging Face inv_freq).",
    ),
    reference=rotary_theta,
    infer=_infer_theta,
)
