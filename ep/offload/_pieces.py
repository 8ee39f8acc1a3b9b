"""Weights streamed in pieces: a weight larger than the piece size is split along its output axis.

A staging slot must hold the largest streamed weight, and the store keeps at least two slots, so
one large weight (a tied [vocab, hidden] table is a quarter of a small model) decides the
smallest workable budget. Split along the axis of the outputs, each piece is a weight of its own
(a name, bytes, a layer, an op, an order) that the policies place like any other, and a slot is
the size of the largest piece. The executor runs one call per piece: a MatMul piece computes its
own output columns, a Gather piece the ids in its rows.

Axes: 0 slices the leading axis (a [N, K] MatMul weight with ``transpose_b=1``, a Gather table's
vocabulary rows, MatMulNBits ``b`` [N, ...], ``scales`` and ``zero_points``: any layout whose size
is a multiple of N); 1 slices the columns of a 2-D [K, N] weight (``transpose_b=0``), each piece
stored contiguous [K, n]. Weights that must share boundaries (MatMulNBits b, scales, zero
points) form one `SplitSpec`; piece boundaries fall on multiples of `PIECE_ROWS` output indices
when a piece holds that many, so every piece but the last keeps the kernels' column grouping.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ep.errors import OffloadError

__all__ = [
    "DEFAULT_PIECE_BYTES",
    "PIECE_ROWS",
    "Piece",
    "SplitSpec",
    "SplitWeight",
    "piece_name",
    "split_weights",
]

DEFAULT_PIECE_BYTES = 32 * 2**20  # a 25 % budget holds the Qwen2.5-0.5B shape's slots with room
PIECE_ROWS = 64  # output indices: a multiple of every GEMV's column group (8, 16, 64)


@dataclass(frozen=True)
class SplitSpec:
    """Weights that may be split at shared output indices: ``names[i]`` along ``axes[i]``."""

    names: tuple[str, ...]
    axes: tuple[int, ...]  # 0: leading axis (rows); 1: columns of a 2-D [K, N] weight
    size: int  # N: output indices along the axis


@dataclass(frozen=True)
class Piece:
    """Output indices ``[start, stop)`` of a split weight, stored as weight ``name``."""

    name: str
    start: int
    stop: int


@dataclass(frozen=True)
class SplitWeight:
    """A weight held as pieces: ``size`` output indices along ``axis``, in order."""

    name: str
    axis: int
    size: int
    pieces: tuple[Piece, ...]
    shape: tuple[int, ...]  # the whole weight's shape
    dtype: np.dtype


def piece_name(name: str, start: int, stop: int) -> str:
    """``model.embed_tokens.weight[0:2048]``: the store's name of one piece."""
    return f"{name}[{start}:{stop}]"


def _check_spec(spec: SplitSpec, weights: Mapping[str, np.ndarray]) -> None:
    if len(spec.names) != len(spec.axes) or not spec.names or spec.size < 1:
        raise OffloadError(f"split spec {spec!r}: one axis per name and size >= 1 expected")
    for name, axis in zip(spec.names, spec.axes, strict=True):
        array = weights.get(name)
        if array is None:
            raise OffloadError(f"split spec names {name!r}, which is not among the weights")
        if axis == 0 and array.size % spec.size == 0 and array.size:
            continue
        if axis == 1 and array.ndim == 2 and array.shape[1] == spec.size:
            continue
        raise OffloadError(
            f"weight {name!r} {array.dtype}{list(array.shape)} cannot be split into {spec.size} "
            f"output indices along axis {axis}: axis 0 needs a size that is a multiple of "
            f"{spec.size}, axis 1 a 2-D [K, {spec.size}] weight"
        )


def _rows_per_piece(spec: SplitSpec, weights: Mapping[str, np.ndarray], piece_bytes: int) -> int:
    """Output indices per piece: the most whose largest member fits ``piece_bytes`` (>= 1)."""
    per_index = max(weights[n].nbytes // spec.size for n in spec.names)
    rows = max(1, piece_bytes // max(per_index, 1))
    if rows >= PIECE_ROWS:
        rows -= rows % PIECE_ROWS
    return rows


def _slice(array: np.ndarray, axis: int, size: int, start: int, stop: int) -> np.ndarray:
    if axis == 1:
        return np.ascontiguousarray(array[:, start:stop])
    rows = np.ascontiguousarray(array).reshape(size, -1)[start:stop]
    if array.ndim >= 2 and array.shape[0] == size:
        return np.ascontiguousarray(rows.reshape((stop - start, *array.shape[1:])))
    return np.ascontiguousarray(rows.reshape(-1))


def split_weights(
    weights: Mapping[str, np.ndarray], specs: Sequence[SplitSpec], piece_bytes: int
) -> tuple[dict[str, np.ndarray], dict[str, SplitWeight]]:
    """``weights`` with each spec whose largest member exceeds ``piece_bytes`` cut in pieces.

    Returns the weights to store (every split weight replaced, in place, by its pieces in
    order; the others as they are) and the split weights by their whole name. A piece holds at
    least one output index, so a single row wider than ``piece_bytes`` makes a larger piece.
    """
    if isinstance(piece_bytes, bool) or not isinstance(piece_bytes, int) or piece_bytes < 1:
        raise OffloadError(
            f"piece_bytes={piece_bytes!r}: the piece size must be a positive byte count "
            "(offload.piece, e.g. '32MiB')"
        )
    splits: dict[str, SplitWeight] = {}
    for spec in specs:
        _check_spec(spec, weights)
        taken = [n for n in spec.names if n in splits]
        if taken:
            raise OffloadError(f"weight {taken[0]!r} is in two split specs; list it in one")
        if max(weights[n].nbytes for n in spec.names) <= piece_bytes:
            continue
        rows = _rows_per_piece(spec, weights, piece_bytes)
        if rows >= spec.size:
            continue
        bounds = [(s, min(s + rows, spec.size)) for s in range(0, spec.size, rows)]
        for name, axis in zip(spec.names, spec.axes, strict=True):
            array = weights[name]
            pieces = tuple(Piece(piece_name(name, s, e), s, e) for s, e in bounds)
            splits[name] = SplitWeight(
                name, axis, spec.size, pieces, tuple(array.shape), array.dtype
            )
    stored: dict[str, np.ndarray] = {}
    for name, array in weights.items():
        split = splits.get(name)
        if split is None:
            stored[name] = array
            continue
        for piece in split.pieces:
            if piece.name in weights:
                raise OffloadError(
                    f"piece name {piece.name!r} of {name!r} is already a weight's name"
                )
            stored[piece.name] = _slice(array, split.axis, split.size, piece.start, piece.stop)
    return stored, splits
