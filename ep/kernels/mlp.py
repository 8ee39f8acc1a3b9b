"""SwiGLU, ``silu(gate) * up``, on the device: two inputs, or one packed [gate | up] or
(g0, u0, g1, u1, ...) input.

One kernel per dtype, ``swiglu_<dt>``, reads gate and up through (row, column) element strides, so
the three input forms are the same kernel with different strides (a packed input is two views of
one buffer). Launch: grid (rows, column blocks), 256 threads; each thread handles one 16-byte
vector of columns when both inputs are unit-stride and aligned, else one column. Output rows are
contiguous.
"""

from __future__ import annotations

import numpy as np

from ep.device import Buffer, Device, Stream
from ep.kernels._common import (
    FLOAT_DTYPES,
    SILU_MUL,
    aligned,
    check_buffer,
    dtype_suffix,
    need,
    positive,
    register_per_dtype,
)
from ep.ops import mlp as ref

__all__ = ["swiglu", "swiglu_packed"]

_THREADS = 256

_BODY = (
    SILU_MUL
    + r"""
extern "C" __global__ void __launch_bounds__(256) KERNEL(
    T* __restrict__ out, const T* gate, const T* up, i64 rows, i64 inter,
    i64 g_row, i64 g_col, i64 u_row, i64 u_col, int vec_ok) {
    const i64 row = blockIdx.x;
    if (row >= rows) return;
    const T* gr = gate + row * g_row;
    const T* ur = up + row * u_row;
    T* orow = out + row * inter;
    constexpr int N = Pack<T>::N;
    if (vec_ok) {
        const i64 col = ((i64)blockIdx.y * blockDim.x + threadIdx.x) * N;
        if (col >= inter) return;
        float g[N], u[N];
        load16(gr + col, g);
        load16(ur + col, u);
#pragma unroll
        for (int k = 0; k < N; ++k) g[k] = silu_mul(g[k], u[k]);
        store16(orow + col, g);
    } else {
        const i64 col = (i64)blockIdx.y * blockDim.x + threadIdx.x;
        if (col >= inter) return;
        orow[col] = from_f32<T>(silu_mul(to_f32(gr[col * g_col]), to_f32(ur[col * u_col])));
    }
}
"""
)


def _strided(flat: np.ndarray, offset: int, rows: int, cols: int, rs: int, cs: int) -> np.ndarray:
    """Rows × cols elements of ``flat`` at ``offset + r*rs + c*cs`` (a copy)."""
    index = offset + np.arange(rows)[:, None] * rs + np.arange(cols)[None, :] * cs
    return flat[index]


def _cpu(
    out: np.ndarray,
    gate: np.ndarray,
    up: np.ndarray,
    rows: np.int64,
    inter: np.int64,
    g_row: np.int64,
    g_col: np.int64,
    u_row: np.int64,
    u_col: np.int64,
    vec_ok: np.int32,
) -> None:
    r, n = int(rows), int(inter)
    g = _strided(gate, 0, r, n, int(g_row), int(g_col))
    u = _strided(up, 0, r, n, int(u_row), int(u_col))
    out[: r * n] = ref.swiglu(g, u).reshape(-1)


SWIGLU_KERNELS = register_per_dtype(
    "swiglu",
    _BODY,
    ("T*", "T*", "T*", "i64", "i64", "i64", "i64", "i64", "i64", "i32"),
    _cpu,
)


def _extent(rows: int, cols: int, row_stride: int, col_stride: int) -> int:
    """Elements a strided [rows, cols] view needs from its start."""
    if rows == 0 or cols == 0:
        return 0
    return (rows - 1) * row_stride + (cols - 1) * col_stride + 1


def _launch(
    dev: Device,
    op: str,
    out: Buffer,
    gate: Buffer,
    up: Buffer,
    rows: int,
    inter: int,
    strides: tuple[int, int, int, int],
    stream: Stream,
) -> None:
    g_row, g_col, u_row, u_col = strides
    positive(op, rows=rows, inter=inter, g_row=g_row, g_col=g_col, u_row=u_row, u_col=u_col)
    suffix = dtype_suffix(out.dtype, op)
    check_buffer(op, "out", out, rows * inter, out.dtype)
    check_buffer(op, "gate", gate, _extent(rows, inter, g_row, g_col), out.dtype)
    check_buffer(op, "up", up, _extent(rows, inter, u_row, u_col), out.dtype)
    if rows == 0 or inter == 0:
        return
    per16 = FLOAT_DTYPES[out.dtype][2]
    vec_ok = (
        g_col == 1
        and u_col == 1
        and inter % per16 == 0
        and g_row % per16 == 0
        and u_row % per16 == 0
        and aligned(out, gate, up)
    )
    cols_per_block = _THREADS * (per16 if vec_ok else 1)
    blocks_y = -(-inter // cols_per_block)
    need(blocks_y <= 65535, op, f"inter={inter} is too wide for one launch (at most 16M columns)")
    kernel = dev.kernel(SWIGLU_KERNELS[suffix].name)
    kernel.launch(
        (rows, blocks_y),
        _THREADS,
        out,
        gate,
        up,
        rows,
        inter,
        g_row,
        g_col,
        u_row,
        u_col,
        int(vec_ok),
        stream=stream,
    )


def swiglu(
    dev: Device,
    out: Buffer,
    gate: Buffer,
    up: Buffer,
    *,
    rows: int,
    inter: int,
    gate_row_stride: int = 0,
    up_row_stride: int = 0,
    stream: Stream,
) -> None:
    """``out[r, i] = silu(gate[r, i]) * up[r, i]``; out is [rows, inter] contiguous.

    Row strides (elements) default to ``inter``; pass larger ones for views into wider rows.
    """
    strides = (gate_row_stride or inter, 1, up_row_stride or inter, 1)
    _launch(dev, "SwiGLU", out, gate, up, rows, inter, strides, stream)


def swiglu_packed(
    dev: Device,
    out: Buffer,
    gate_up: Buffer,
    *,
    rows: int,
    inter: int,
    interleaved: int,
    stream: Stream,
) -> None:
    """SwiGLU of a packed [rows, 2*inter] input: [gate | up] halves, or g0, u0, g1, u1, ... when
    ``interleaved`` is 1. ``out`` is [rows, inter]."""
    op = "SwiGLUPacked"
    need(interleaved in (0, 1), op, f"interleaved={interleaved!r} must be 0 or 1")
    positive(op, rows=rows, inter=inter)
    check_buffer(op, "gate_up", gate_up, rows * 2 * inter, out.dtype)
    if rows == 0 or inter == 0:
        check_buffer(op, "out", out, 0, out.dtype)
        return
    itemsize = gate_up.dtype.itemsize
    if interleaved:
        up = gate_up.view(offset=itemsize)
        strides = (2 * inter, 2, 2 * inter, 2)
    else:
        up = gate_up.view(offset=inter * itemsize)
        strides = (2 * inter, 1, 2 * inter, 1)
    _launch(dev, op, out, gate_up, up, rows, inter, strides, stream)
