"""Checks shared by the ops' infer functions; each raises an OpError a graph author can act on."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ep.errors import OpError
from ep.ops.schema import ArgInfo

__all__ = ["FLOATS", "as_f32", "expect", "expect_rank", "expect_shape", "same_shape"]

# The float dtypes every float op accepts: float16/bfloat16 reach ONNX Runtime through uint16.
FLOATS: tuple[str, ...] = ("float32", "float16", "bfloat16")


def expect(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise OpError(f"{op}: {message}. Fix the graph (or the arrays passed to the op)")


def expect_rank(op: str, name: str, info: ArgInfo, ranks: Sequence[int], meaning: str) -> None:
    expect(
        len(info.shape) in ranks,
        op,
        f"{name} has shape {list(info.shape)}; expected rank {' or '.join(map(str, ranks))} "
        f"({meaning})",
    )


def expect_shape(op: str, name: str, info: ArgInfo, shape: Sequence[int], meaning: str) -> None:
    expect(
        tuple(info.shape) == tuple(shape),
        op,
        f"{name} has shape {list(info.shape)}; expected {list(shape)} ({meaning})",
    )


def same_shape(op: str, a: tuple[str, ArgInfo], b: tuple[str, ArgInfo]) -> None:
    expect(
        a[1].shape == b[1].shape,
        op,
        f"{a[0]} {list(a[1].shape)} and {b[0]} {list(b[1].shape)} must have the same shape",
    )


def as_f32(x: np.ndarray) -> np.ndarray:
    """float32 view or copy (no copy when already float32): references compute in float32."""
    return x.astype(np.float32, copy=False)
