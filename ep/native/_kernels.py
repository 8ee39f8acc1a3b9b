"""The few element-wise kernels the native executor needs beyond the op kernels of `ep.kernels`.

``native_add_bias_<dt>``: ``out[r, c] = x[r, c] + bias[c]`` (the ``Add`` after a biased
projection), rounded once to the dtype, as NumPy's same-dtype add does. ``native_cast_f32_<dt>``:
``out = float32(x)`` (the logits ``Cast`` of fp16/bf16 graphs; 4 elements a thread, one 16-byte
store where aligned). ``native_advance``: the device token loop's bookkeeping after sampling: the
sampled id goes to the input ids and to slot ``slot`` of the token history, and every live
position (>= 0) moves one forward.
``native_mask_ids_<dt>``: ``logits[b, ids[i]] = -inf`` for every row and listed id (EOS and stop
ids before ``min_new_tokens``), so the argmax that follows never picks them.
``native_int8_blocks_<dt>``: the activations of a MatMulNBits with ``accuracy_level=4`` as ONNX
Runtime's CPU sees them, rounded to int8 steps of each block's amax
(`ep.ops.matmul.round_to_int8_blocks`; one warp per block of K, bitwise equal to it: the scale,
its inverse and each value are one IEEE division or multiply apiece). Each has a NumPy twin, so
the CPU device runs the same calls.
"""

from __future__ import annotations

import numpy as np

from ep.device import Buffer, Device, Stream
from ep.kernels._common import (
    check_buffer,
    dtype_suffix,
    need,
    positive,
    register_one,
    register_per_dtype,
    threads_for,
)
from ep.ops.matmul import round_to_int8_blocks

__all__ = ["add_bias", "advance", "cast_f32", "int8_blocks", "mask_ids"]

_ADD = r"""
extern "C" __global__ void KERNEL(T* out, const T* x, const T* bias, i64 rows, i64 cols) {
    const i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= rows * cols) return;
    out[i] = from_f32<T>(to_f32(x[i]) + to_f32(bias[i % cols]));
}
"""

_CAST = r"""
// 4 elements a thread (CAST_PER): one vector load and one 16-byte store where both are aligned
struct alignas(4 * sizeof(T)) Quad { T e[4]; };
extern "C" __global__ void KERNEL(float* out, const T* x, i64 n) {
    const i64 i = 4 * ((i64)blockIdx.x * blockDim.x + threadIdx.x);
    if (i >= n) return;
    if (i + 4 <= n && ((size_t)out & 15) == 0 && ((size_t)x & (4 * sizeof(T) - 1)) == 0) {
        const Quad q = *reinterpret_cast<const Quad*>(x + i);
        *reinterpret_cast<float4*>(out + i) =
            make_float4(to_f32(q.e[0]), to_f32(q.e[1]), to_f32(q.e[2]), to_f32(q.e[3]));
    } else {
        for (i64 j = i; j < n && j < i + 4; ++j) out[j] = to_f32(x[j]);
    }
}
"""
CAST_PER = 4  # elements a thread of the cast kernel

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


_INT8 = r"""
extern "C" __global__ void __launch_bounds__(32) KERNEL(
    T* __restrict__ out, const T* __restrict__ x, i64 rows, i64 cols, int block_size,
    int k_blocks) {
    const i64 blk = blockIdx.x;  // one warp per (row, block of K)
    if (blk >= rows * (i64)k_blocks) return;
    const i64 row = blk / k_blocks;
    const i64 lo = row * cols + (blk % k_blocks) * (i64)block_size;
    const int n = (int)min((i64)block_size, row * cols + cols - lo);
    float amax = 0.0f;
    for (int j = threadIdx.x; j < n; j += 32) amax = fmaxf(amax, fabsf(to_f32(x[lo + j])));
    amax = warp_max(amax);
    const float scale = amax / 127.0f;  // IEEE division (NVRTC's default -prec-div=true)
    const float inverse = amax != 0.0f ? 127.0f / amax : 0.0f;
    for (int j = threadIdx.x; j < n; j += 32) {
        const float q = fminf(fmaxf(rintf(to_f32(x[lo + j]) * inverse), -127.0f), 127.0f);
        out[lo + j] = from_f32<T>(q * scale);
    }
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


def _int8_cpu(
    out: np.ndarray,
    x: np.ndarray,
    rows: np.int64,
    cols: np.int64,
    block_size: np.int32,
    k_blocks: np.int32,
) -> None:
    r, c = int(rows), int(cols)
    y = round_to_int8_blocks(x[: r * c].reshape(r, c), block_size=int(block_size))
    out[: r * c] = y.reshape(-1)


def _mask_cpu(
    logits: np.ndarray, ids: np.ndarray, batch: np.int64, count: np.int64, stride: np.int64
) -> None:
    rows = np.arange(int(batch), dtype=np.int64)[:, None] * int(stride)
    logits[(rows + ids[: int(count)][None, :]).reshape(-1)] = -np.inf


ADD_KERNELS = register_per_dtype(
    "native_add_bias", _ADD, ("T*", "T*", "T*", "i64", "i64"), _add_cpu
)
CAST_KERNELS = register_per_dtype("native_cast_f32", _CAST, ("f32*", "T*", "i64"), _cast_cpu)
MASK_KERNELS = register_per_dtype(
    "native_mask_ids", _MASK, ("T*", "i64*", "i64", "i64", "i64"), _mask_cpu
)
INT8_KERNELS = register_per_dtype(
    "native_int8_blocks", _INT8, ("T*", "T*", "i64", "i64", "i32", "i32"), _int8_cpu
)
ADVANCE_KERNEL = register_one(
    "native_advance", _ADVANCE, ("i64*", "i64*", "i64*", "i64*", "i64", "i64"), _advance_cpu
)


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
    grid, threads = _grid(-(-n // CAST_PER))
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


def int8_blocks(
    dev: Device, out: Buffer, x: Buffer, *, rows: int, cols: int, block_size: int, stream: Stream
) -> None:
    """``out = round_to_int8_blocks(x)`` for ``rows`` contiguous rows of ``cols`` (K) values,
    blocks of ``block_size`` along each row (``out`` apart from ``x``). One float dtype."""
    op = "Int8Activations"
    positive(op, rows=rows, cols=cols, block_size=block_size)
    need(block_size > 0, op, f"block_size={block_size} must be > 0")
    suffix = dtype_suffix(x.dtype, op)
    check_buffer(op, "x", x, rows * cols, x.dtype)
    check_buffer(op, "out", out, rows * cols, x.dtype)
    if rows * cols == 0:
        return
    k_blocks = -(-cols // block_size)
    dev.kernel(INT8_KERNELS[suffix].name).launch(
        rows * k_blocks, 32, out, x, rows, cols, block_size, k_blocks, stream=stream
    )
