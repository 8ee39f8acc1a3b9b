"""The few element-wise kernels the native executor needs beyond the op kernels of `ep.kernels`.

``native_add_bias_<dt>``: ``out[r, c] = x[r, c] + bias[c]`` (the ``Add`` after a biased
projection), rounded once to the dtype, as NumPy's same-dtype add does. ``native_cast_f32_<dt>``:
``out = float32(x)`` (the logits ``Cast`` of fp16/bf16 graphs). ``native_advance``: the device
token loop's bookkeeping after sampling: the sampled id goes to the input ids and to slot
``slot`` of the token history, and every live position (>= 0) moves one forward.
``native_mask_ids_<dt>``: ``logits[b, ids[i]] = -inf`` for every row and listed id (EOS and stop
ids before ``min_new_tokens``), so the argmax that follows never picks them.
``native_l2_prefetch``: asks the L2 to fetch byte ranges of device memory (a [count, 2] table of
(address, bytes) rows, `prefetch_rows`) and returns without waiting for them: on sm_90 one
``cp.async.bulk.prefetch.L2`` per row (its 16-byte-aligned interior; a line prefetch for each
ragged end) from one thread of the row's block, elsewhere ``prefetch.global.L2`` per 128-byte
line from every thread of it. Each has a NumPy twin, so the CPU device runs the same calls (the
prefetch's does nothing: the CPU device has no such cache).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ep.device import Buffer, Device, KernelSource, Stream, register_kernel
from ep.errors import KernelArgumentError
from ep.kernels._common import (
    check_buffer,
    dtype_suffix,
    register_one,
    register_per_dtype,
    threads_for,
)

__all__ = [
    "PREFETCH_BLOCKS",
    "PREFETCH_MIN_CHUNK",
    "add_bias",
    "advance",
    "cast_f32",
    "l2_prefetch",
    "mask_ids",
    "prefetch_chunk",
    "prefetch_rows",
]

_ADD = r"""
extern "C" __global__ void KERNEL(T* out, const T* x, const T* bias, i64 rows, i64 cols) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    out[i] = from_f32<T>(to_f32(x[i]) + to_f32(bias[i % cols]));
}
"""

_CAST = r"""
extern "C" __global__ void KERNEL(float* out, const T* x, i64 n) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = to_f32(x[i]);
}
"""

_ADVANCE = r"""
extern "C" __global__ void native_advance(
    long long* input_ids, long long* positions, long long* history, const long long* sampled,
    long long batch, long long slot) {
    const long long b = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= batch) return;
    input_ids[b] = sampled[b];
    history[slot * batch + b] = sampled[b];
    if (positions[b] >= 0) positions[b] += 1;
}
"""


_MASK = r"""
extern "C" __global__ void KERNEL(T* logits, const long long* ids, long long batch,
                                  long long count, long long stride) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= batch * count) return;
    logits[(i / count) * stride + ids[i % count]] = from_f32<T>(__int_as_float(0xff800000u));
}
"""

# No PDL prologue: the prefetches read only weights, which no kernel writes, so they are issued
# before waiting for the kernel before this one (they overlap its tail); the wait comes last,
# so the kernel after this one still sees every result from before it. Every thread reaches it.
# One row a block, one bulk prefetch instruction a row: the SM's copy engine (TMA) works through
# a row's lines by itself, so no thread waits on a queue of many requests (`prefetch_chunk`
# sizes the rows so that one call's rows spread over about every SM).
_PREFETCH = r"""
typedef unsigned long long u64;

static __device__ __forceinline__ void prefetch_line(u64 address) {
    const u64 global = (u64)__cvta_generic_to_global((const void*)address);
    asm volatile("prefetch.global.L2 [%0];" :: "l"(global));
}

extern "C" __global__ void native_l2_prefetch(const u64* table, long long count) {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    const long long row = blockIdx.x;
    if (row < count && table[2 * row + 1] > 0) {
        const u64 start = table[2 * row], end = start + table[2 * row + 1];
#if __CUDA_ARCH__ >= 900
        // the bulk prefetch takes a 16-byte-aligned global address and a multiple of 16 bytes
        const u64 first = (start + 15) & ~15ull, last = end & ~15ull;
        if (threadIdx.x == 0) {
            for (u64 at = first; at < last; at += (1u << 20)) {  // at most 1 MiB an instruction
                const unsigned size = (unsigned)(last - at < (1u << 20) ? last - at : (1u << 20));
                const u64 global = (u64)__cvta_generic_to_global((const void*)at);
                asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;"
                             :: "l"(global), "r"(size) : "memory");
            }
            if (first != start || first >= last) prefetch_line(start);
            if (last != end) prefetch_line(end - 1);
        }
#else
        for (u64 line = (start & ~127ull) + 128ull * threadIdx.x; line < end;
             line += 128ull * blockDim.x)
            prefetch_line(line < start ? start : line);
#endif
    }
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
"""


def _add_cpu(
    out: np.ndarray, x: np.ndarray, bias: np.ndarray, rows: np.int64, cols: np.int64
) -> None:
    r, c = int(rows), int(cols)
    # Same-dtype NumPy add: float32 arithmetic for fp32; fp16/bf16 round once (as ONNX Add).
    out[: r * c] = (x[: r * c].reshape(r, c) + bias[:c]).reshape(-1)


def _cast_cpu(out: np.ndarray, x: np.ndarray, n: np.int64) -> None:
    out[: int(n)] = x[: int(n)].astype(np.float32)


def _advance_cpu(
    input_ids: np.ndarray,
    positions: np.ndarray,
    history: np.ndarray,
    sampled: np.ndarray,
    batch: np.int64,
    slot: np.int64,
) -> None:
    b, s = int(batch), int(slot)
    input_ids[:b] = sampled[:b]
    history[s * b : (s + 1) * b] = sampled[:b]
    live = positions[:b] >= 0
    positions[:b][live] += 1


def _mask_cpu(
    logits: np.ndarray, ids: np.ndarray, batch: np.int64, count: np.int64, stride: np.int64
) -> None:
    rows = np.arange(int(batch), dtype=np.int64)[:, None] * int(stride)
    logits[(rows + ids[: int(count)][None, :]).reshape(-1)] = -np.inf


def _prefetch_cpu(table: np.ndarray, count: np.int64) -> None:
    """Nothing: the CPU device has no cache to warm (the call stays, so plans are the same)."""


ADD_KERNELS = register_per_dtype(
    "native_add_bias", _ADD, ("T*", "T*", "T*", "i64", "i64"), _add_cpu
)
CAST_KERNELS = register_per_dtype("native_cast_f32", _CAST, ("f32*", "T*", "i64"), _cast_cpu)
MASK_KERNELS = register_per_dtype(
    "native_mask_ids", _MASK, ("T*", "i64*", "i64", "i64", "i64"), _mask_cpu
)
ADVANCE_KERNEL = register_one(
    "native_advance", _ADVANCE, ("i64*", "i64*", "i64*", "i64*", "i64", "i64"), _advance_cpu
)
PREFETCH_KERNEL = register_kernel(
    KernelSource(
        "native_l2_prefetch", _PREFETCH, ("u64*", "i64"), cpu=_prefetch_cpu, pdl_prologue=False
    )
).name
# A call's rows are about its bytes / PREFETCH_BLOCKS each (the H200 has 132 SMs), at least
# PREFETCH_MIN_CHUNK: a 29.8 MB layer window is ~132 rows of ~230 KB, a 2 MB one ~128 of 16 KB.
PREFETCH_BLOCKS = 128
PREFETCH_MIN_CHUNK = 16384
_PREFETCH_THREADS = 32  # one warp a block: thread 0 issues a row's bulk prefetch


def _grid(n: int) -> tuple[int, int]:
    threads = threads_for(n, most=256)
    return max(1, -(-n // threads)), threads


def add_bias(
    dev: Device, out: Buffer, x: Buffer, bias: Buffer, *, rows: int, cols: int, stream: Stream
) -> None:
    """``out[r, c] = x[r, c] + bias[c]``; all one float dtype, rows contiguous."""
    op = "Add"
    suffix = dtype_suffix(x.dtype, op)
    check_buffer(op, "x", x, rows * cols, x.dtype)
    check_buffer(op, "bias", bias, cols, x.dtype)
    check_buffer(op, "out", out, rows * cols, x.dtype)
    if rows * cols == 0:
        return
    grid, threads = _grid(rows * cols)
    dev.kernel(ADD_KERNELS[suffix].name).launch(
        grid, threads, out, x, bias, rows, cols, stream=stream
    )


def cast_f32(dev: Device, out: Buffer, x: Buffer, *, n: int, stream: Stream) -> None:
    """``out = float32(x)`` for ``n`` elements of a float16/bfloat16/float32 ``x``."""
    op = "Cast"
    suffix = dtype_suffix(x.dtype, op)
    check_buffer(op, "x", x, n, x.dtype)
    check_buffer(op, "out", out, n, np.dtype(np.float32))
    if n == 0:
        return
    grid, threads = _grid(n)
    dev.kernel(CAST_KERNELS[suffix].name).launch(grid, threads, out, x, n, stream=stream)


def advance(
    dev: Device,
    input_ids: Buffer,
    positions: Buffer,
    history: Buffer,
    sampled: Buffer,
    *,
    batch: int,
    slot: int,
    stream: Stream,
) -> None:
    """After sampling step ``slot`` of a device loop: ids <- sampled, history[slot] <- sampled,
    live positions += 1 (int64 buffers of ``batch`` elements; history holds k slots)."""
    i64 = np.dtype(np.int64)
    for name, buf, n in (
        ("input_ids", input_ids, batch),
        ("positions", positions, batch),
        ("history", history, (slot + 1) * batch),
        ("sampled", sampled, batch),
    ):
        check_buffer("advance", name, buf, n, i64)
    grid, threads = _grid(batch)
    dev.kernel(ADVANCE_KERNEL).launch(
        grid, threads, input_ids, positions, history, sampled, batch, slot, stream=stream
    )


def mask_ids(
    dev: Device,
    logits: Buffer,
    ids: Buffer,
    *,
    batch: int,
    count: int,
    vocab: int,
    stream: Stream,
) -> None:
    """``logits[b, ids[i]] = -inf`` for rows ``b < batch`` of a [batch, vocab] float buffer and
    the first ``count`` int64 ``ids`` (each in ``[0, vocab)``: the caller checks them)."""
    op = "MaskIds"
    suffix = dtype_suffix(logits.dtype, op)
    check_buffer(op, "logits", logits, batch * vocab, logits.dtype)
    check_buffer(op, "ids", ids, count, np.dtype(np.int64))
    if batch * count == 0:
        return
    grid, threads = _grid(batch * count)
    dev.kernel(MASK_KERNELS[suffix].name).launch(
        grid, threads, logits, ids, batch, count, vocab, stream=stream
    )


def prefetch_chunk(nbytes: int) -> int:
    """Bytes a row covers at most in a call asking for ``nbytes`` in all: about
    ``nbytes / PREFETCH_BLOCKS`` (a multiple of 4 KiB), at least `PREFETCH_MIN_CHUNK`."""
    share = -(-max(nbytes, 1) // PREFETCH_BLOCKS)
    return max(PREFETCH_MIN_CHUNK, -(-share // 4096) * 4096)


def prefetch_rows(ranges: Sequence[tuple[int, int]], chunk: int | None = None) -> np.ndarray:
    """The [rows, 2] uint64 table of ``(address, bytes)`` ``ranges`` cut into rows of at most
    ``chunk`` bytes (default: `prefetch_chunk` of their total); the first row of a range starts
    at its address, aligned or not; an empty range gives no row."""
    if chunk is None:
        chunk = prefetch_chunk(sum(nbytes for _, nbytes in ranges))
    if chunk <= 0:
        raise KernelArgumentError(f"L2Prefetch: chunk={chunk}; expected a positive byte count")
    parts = [np.zeros((0, 2), np.uint64)]
    for address, nbytes in ranges:
        if address < 0 or nbytes < 0:
            raise KernelArgumentError(
                f"L2Prefetch: range ({address}, {nbytes}); expected a non-negative address and "
                "byte count"
            )
        at = np.arange(0, nbytes, chunk, dtype=np.uint64)
        part = np.empty((at.size, 2), np.uint64)
        part[:, 0] = np.uint64(address) + at
        part[:, 1] = np.minimum(np.uint64(chunk), np.uint64(nbytes) - at)
        parts.append(part)
    return np.concatenate(parts)


def l2_prefetch(dev: Device, table: Buffer, *, count: int, stream: Stream) -> None:
    """Ask the L2 for the first ``count`` rows of ``table`` (uint64 [>= count, 2] of address,
    bytes: `prefetch_rows`); returns once they are issued, not fetched. Every address must
    lie in memory this device owns for all its bytes (a prefetch never writes)."""
    check_buffer("L2Prefetch", "table", table, 2 * count, np.dtype(np.uint64))
    if count == 0:
        return
    dev.kernel(PREFETCH_KERNEL).launch(count, _PREFETCH_THREADS, table, count, stream=stream)
