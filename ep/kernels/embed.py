"""Embedding gather: ``out[i] = table[ids[i]]`` on the device, for a table of any dtype.

One dtype-agnostic kernel, ``embed_gather``, copies bytes: 16-byte vectors when the row's byte
width and every address allow it, else 8, 4, 2 or 1 bytes at a time. Launch: one block per id
(grid = count), enough threads (32 to 256) to copy a row in one sweep.

An id outside ``[0, vocab)`` never reads outside the table: its output row is written as zeros
and `KernelFault.TOKEN_ID` is set in the status buffer (`ep.kernels.check_faults` raises it).
Zeros rather than a clamped id, so a bad id cannot pass for a real token downstream.

Row ranges (a table streamed in pieces, `ep.offload`): ``embed(..., first_row=r0, rows=n)`` with
``table`` holding only rows ``[r0, r0 + n)`` of the vocabulary writes the output rows of the ids
in that range and leaves every other row alone; one call per piece fills the output. Bad ids are
answered (zeros, fault) only by the piece that starts at row 0, so a step sets the fault once.
"""

from __future__ import annotations

import numpy as np

from ep.device import Buffer, Device, Stream
from ep.kernels._common import (
    KernelFault,
    check_buffer,
    check_index_buffer,
    check_status,
    need,
    positive,
    register_one,
    set_fault,
    threads_for,
)

__all__ = ["embed"]

_BODY = r"""
template <typename W>
static __device__ __forceinline__ void copy_row(unsigned char* dst, const unsigned char* src,
                                                i64 nbytes, bool zero) {
    W* d = reinterpret_cast<W*>(dst);
    const W* s = reinterpret_cast<const W*>(src);
    const i64 n = nbytes / (i64)sizeof(W);
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        if (zero) {
            d[i] = W{};
        } else {
            d[i] = s[i];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) embed_gather(
    unsigned char* __restrict__ out, const unsigned char* __restrict__ table,
    const void* __restrict__ ids, u32* status, i64 count, i64 vocab, i64 row0, i64 rows,
    i64 row_bytes, int ids_i64, int vec_bytes) {
    const i64 i = blockIdx.x;
    if (i >= count) return;
    const i64 id = load_index(ids, i, ids_i64);
    const bool bad = id < 0 || id >= vocab;
    // One block per id: these returns are uniform over the block. Bad ids: the piece at row 0.
    if (bad ? row0 != 0 : (id < row0 || id >= row0 + rows)) return;
    if (bad && threadIdx.x == 0) set_fault(status, 1u);  // KernelFault.TOKEN_ID
    unsigned char* dst = out + i * row_bytes;
    const unsigned char* src = table + (bad ? 0 : id - row0) * row_bytes;
    switch (vec_bytes) {
        case 16: copy_row<uint4>(dst, src, row_bytes, bad); break;
        case 8: copy_row<uint2>(dst, src, row_bytes, bad); break;
        case 4: copy_row<unsigned int>(dst, src, row_bytes, bad); break;
        case 2: copy_row<unsigned short>(dst, src, row_bytes, bad); break;
        default: copy_row<unsigned char>(dst, src, row_bytes, bad); break;
    }
}
"""


def _cpu(
    out: np.ndarray,
    table: np.ndarray,
    ids: np.ndarray,
    status: np.ndarray,
    count: np.int64,
    vocab: np.int64,
    row0: np.int64,
    rows: np.int64,
    row_bytes: np.int64,
    ids_i64: np.int32,
    vec_bytes: np.int32,
) -> None:
    n, v, first, held, width = int(count), int(vocab), int(row0), int(rows), int(row_bytes)
    index = ids.view(np.int64 if ids_i64 else np.int32)[:n].astype(np.int64)
    bad = (index < 0) | (index >= v)
    mine = ~bad & (index >= first) & (index < first + held)
    target = out[: n * width].reshape(n, width)
    if first == 0 and bad.any():  # bad ids: answered by the piece at row 0 only
        set_fault(status, KernelFault.TOKEN_ID)
        target[bad] = 0
    if mine.any():
        target[mine] = table[: held * width].reshape(held, width)[index[mine] - first]


EMBED_KERNEL = register_one(
    "embed_gather",
    _BODY,
    ("u8*", "u8*", "void*", "u32*", "i64", "i64", "i64", "i64", "i64", "i32", "i32"),
    _cpu,
)


def embed(
    dev: Device,
    out: Buffer,
    table: Buffer,
    ids: Buffer,
    *,
    count: int,
    vocab: int,
    hidden: int,
    status: Buffer,
    stream: Stream,
    first_row: int = 0,
    rows: int | None = None,
) -> None:
    """``out[i, :] = table[ids[i], :]`` for ``count`` int64 or int32 ids; table [vocab, hidden].

    ``out`` and ``table`` share a dtype (any). Bad ids give zero rows and set
    `KernelFault.TOKEN_ID` in ``status`` (uint32[1]). ``first_row``/``rows``: ``table`` holds
    only rows ``[first_row, first_row + rows)`` of the vocabulary (a piece); the ids outside
    it are skipped, and bad ids are answered only when ``first_row == 0`` (see the module).
    """
    op = "Embedding"
    held = vocab if rows is None else rows
    positive(op, count=count, vocab=vocab, hidden=hidden, first_row=first_row, rows=held)
    need(vocab > 0, op, "vocab must be > 0")
    need(
        held > 0 and first_row + held <= vocab,
        op,
        f"rows [{first_row}, {first_row + held}) must be a non-empty range inside the "
        f"vocabulary [0, {vocab})",
    )
    need(
        isinstance(table, Buffer) and isinstance(out, Buffer) and out.dtype == table.dtype,
        op,
        f"out ({getattr(out, 'dtype', None)}) and table ({getattr(table, 'dtype', None)}) must "
        "be Buffers of one dtype",
    )
    check_buffer(op, "table", table, held * hidden)
    check_buffer(op, "out", out, count * hidden)
    ids_i64 = check_index_buffer(op, "ids", ids, count)
    check_status(op, status)
    if count == 0 or hidden == 0:
        return
    row_bytes = hidden * table.dtype.itemsize
    vec = 16
    while vec > 1 and (row_bytes % vec or out.ptr % vec or table.ptr % vec):
        vec //= 2
    kernel = dev.kernel(EMBED_KERNEL)
    kernel.launch(
        count,
        threads_for(row_bytes // vec, most=256),
        out.view(np.uint8),
        table.view(np.uint8),
        ids,
        status,
        count,
        vocab,
        first_row,
        held,
        row_bytes,
        ids_i64,
        vec,
        stream=stream,
    )
