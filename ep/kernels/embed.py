"""Embedding gather: ``out[i] = table[ids[i]]`` on the device, for a table of any dtype, and
its 4-bit variant (GatherBlockQuantized): rows of MatMulNBits-packed blocks dequantized on the way.

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

4-bit rows (``embed_q4_<dt>``, `embed_q4`): ``table`` is uint8, ``row_bytes`` bytes a row
(element 2i in the low nibble of byte i, 2i+1 in the high one), with ``scales`` [vocab, k_blocks]
in the output's dtype and optional packed zero points [vocab, ceil(k_blocks/2)] (default 8), the
layout of com.microsoft GatherBlockQuantized (uint8, bits 4) and of MatMulNBits' B (whose rows
are whole blocks: a tied head's B serves as the table). Each value is ``(q - zero) * scale`` in
float32, rounded once to the output's dtype, exactly as `ep.ops.matmul.gather_block_quantized`
computes it, so the kernel is bitwise equal to the reference. One block per id; a thread turns
one byte into two values per sweep (the row is small next to a step's GEMVs). Bad ids, pieces
and the fault follow the rules above.
"""

from __future__ import annotations

import numpy as np

from ep.device import Buffer, Device, Stream
from ep.kernels._common import (
    KernelFault,
    check_buffer,
    check_index_buffer,
    check_status,
    dtype_suffix,
    need,
    positive,
    register_one,
    register_per_dtype,
    set_fault,
    threads_for,
)
from ep.ops.matmul import dequantize_nbits

__all__ = ["embed", "embed_q4"]

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


# --- 4-bit rows (GatherBlockQuantized) ---------------------------------------------------------

_Q4_BODY = r"""
extern "C" __global__ void __launch_bounds__(256) KERNEL(
    T* __restrict__ out, const unsigned char* __restrict__ table, const T* __restrict__ scales,
    const unsigned char* __restrict__ zero_points, const void* __restrict__ ids, u32* status,
    i64 count, i64 vocab, i64 row0, i64 rows, i64 hidden, i64 row_bytes, int k_blocks,
    int block_size, int has_zp, int ids_i64) {
    const i64 i = blockIdx.x;
    if (i >= count) return;
    const i64 id = load_index(ids, i, ids_i64);
    const bool bad = id < 0 || id >= vocab;
    // One block per id: these returns are uniform over the block. Bad ids: the piece at row 0.
    if (bad ? row0 != 0 : (id < row0 || id >= row0 + rows)) return;
    T* dst = out + i * hidden;
    if (bad) {
        if (threadIdx.x == 0) set_fault(status, 1u);  // KernelFault.TOKEN_ID
        for (i64 e = threadIdx.x; e < hidden; e += blockDim.x) dst[e] = from_f32<T>(0.0f);
        return;
    }
    const i64 r = id - row0;
    const unsigned char* src = table + r * row_bytes;
    const T* scale_row = scales + r * (i64)k_blocks;
    const unsigned char* zp_row = zero_points + r * (i64)((k_blocks + 1) / 2);
    const i64 pairs = (hidden + 1) / 2;
    for (i64 p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int byte = (int)src[p];
        const i64 e = 2 * p;
        const int blk = (int)(e / block_size);  // block_size is even: both nibbles share it
        const float scale = to_f32(scale_row[blk]);
        int zp = 8;
        if (has_zp) {
            const int packed = (int)zp_row[blk >> 1];
            zp = (blk & 1) ? (packed >> 4) : (packed & 15);
        }
        // (q - zero) exactly as an integer, one float32 multiply, one rounding to T.
        dst[e] = from_f32<T>((float)((byte & 15) - zp) * scale);
        if (e + 1 < hidden) dst[e + 1] = from_f32<T>((float)((byte >> 4) - zp) * scale);
    }
}
"""


def _q4_cpu(
    out: np.ndarray,
    table: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray,
    ids: np.ndarray,
    status: np.ndarray,
    count: np.int64,
    vocab: np.int64,
    row0: np.int64,
    rows: np.int64,
    hidden: np.int64,
    row_bytes: np.int64,
    k_blocks: np.int32,
    block_size: np.int32,
    has_zp: np.int32,
    ids_i64: np.int32,
) -> None:
    n, v, first, held = int(count), int(vocab), int(row0), int(rows)
    width, stride, kb, bs = int(hidden), int(row_bytes), int(k_blocks), int(block_size)
    index = ids.view(np.int64 if ids_i64 else np.int32)[:n].astype(np.int64)
    bad = (index < 0) | (index >= v)
    mine = ~bad & (index >= first) & (index < first + held)
    target = out[: n * width].reshape(n, width)
    if first == 0 and bad.any():  # bad ids: answered by the piece at row 0 only
        set_fault(status, KernelFault.TOKEN_ID)
        target[bad] = 0
    if not mine.any():
        return
    local = index[mine] - first
    whole = kb * bs // 2  # MatMulNBits rows are whole blocks: pad a shorter row with zeros
    b = np.zeros((local.size, whole), np.uint8)
    used = min(stride, whole)
    b[:, :used] = table[: held * stride].reshape(held, stride)[local, :used]
    s = scales[: held * kb].reshape(held, kb)[local]
    zp = None
    if has_zp:
        zp_cols = (kb + 1) // 2
        zp = zero_points[: held * zp_cols].reshape(held, zp_cols)[local]
    w = dequantize_nbits(b, s, zp, K=width, N=local.size, block_size=bs)
    target[mine] = w.astype(out.dtype)


EMBED_Q4_KERNELS = register_per_dtype(
    "embed_q4",
    _Q4_BODY,
    "T* u8* T* u8* void* u32* i64 i64 i64 i64 i64 i64 i32 i32 i32 i32",
    _q4_cpu,
)


def embed_q4(
    dev: Device,
    out: Buffer,
    table: Buffer,
    scales: Buffer,
    ids: Buffer,
    zero_points: Buffer | None = None,
    *,
    count: int,
    vocab: int,
    hidden: int,
    block_size: int,
    status: Buffer,
    stream: Stream,
    row_bytes: int | None = None,
    first_row: int = 0,
    rows: int | None = None,
) -> None:
    """``out[i, :] = dequantize(table[ids[i]])`` for 4-bit rows (see the module docstring).

    table: uint8, ``row_bytes`` a row (default ceil(hidden/2): GatherBlockQuantized's data;
    MatMulNBits' B has k_blocks * block_size/2); scales: the output's dtype (float32, float16,
    bfloat16) [vocab, ceil(hidden/block_size)]; zero_points: uint8 [vocab, ceil(k_blocks/2)]
    or None (8). Ids, faults and ``first_row``/``rows`` (pieces) as `embed`.
    """
    op = "Embedding4Bit"
    held = vocab if rows is None else rows
    stride = -(-hidden // 2) if row_bytes is None else row_bytes
    positive(op, count=count, vocab=vocab, hidden=hidden, first_row=first_row, rows=held,
             row_bytes=stride, block_size=block_size)  # fmt: skip
    need(vocab > 0 and hidden > 0, op, f"vocab={vocab} and hidden={hidden} must be > 0")
    need(
        block_size >= 16 and block_size & (block_size - 1) == 0,
        op,
        f"block_size={block_size} must be a power of two >= 16",
    )
    need(
        stride >= -(-hidden // 2),
        op,
        f"row_bytes={stride} cannot hold {hidden} 4-bit values (at least {-(-hidden // 2)})",
    )
    need(
        held > 0 and first_row + held <= vocab,
        op,
        f"rows [{first_row}, {first_row + held}) must be a non-empty range inside the "
        f"vocabulary [0, {vocab})",
    )
    need(isinstance(out, Buffer), op, f"out must be a device Buffer, got {type(out).__name__}")
    suffix = dtype_suffix(out.dtype, op)
    k_blocks = -(-hidden // block_size)
    u8 = np.dtype(np.uint8)
    check_buffer(op, "table", table, held * stride, u8)
    check_buffer(op, "scales", scales, held * k_blocks, out.dtype)
    if zero_points is not None:
        check_buffer(op, "zero_points", zero_points, held * ((k_blocks + 1) // 2), u8)
    check_buffer(op, "out", out, count * hidden)
    ids_i64 = check_index_buffer(op, "ids", ids, count)
    check_status(op, status)
    if count == 0:
        return
    kernel = dev.kernel(EMBED_Q4_KERNELS[suffix])
    kernel.launch(
        count,
        threads_for(-(-hidden // 2), most=256),
        out,
        table,
        scales,
        table if zero_points is None else zero_points,  # never read without has_zp
        ids,
        status,
        count,
        vocab,
        first_row,
        held,
        hidden,
        stride,
        k_blocks,
        block_size,
        int(zero_points is not None),
        ids_i64,
        stream=stream,
    )
