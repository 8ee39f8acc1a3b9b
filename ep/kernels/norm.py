"""RMSNorm and SkipRMSNorm (residual add, then norm) on the device.

One kernel per dtype, ``rms_norm_<dt>``, serves both ops (``has_skip`` picks). Launch: one block
per row (grid = rows), a block of enough warps to cover the row in one sweep (32 to 1024
threads), 16-byte vector loads when the row length and every address allow it, float32 sums
reduced with warp shuffles and one shared-memory step. With vector loads and at most 1024
16-byte units a row (hidden <= 8192 in fp16/bf16, 4096 in fp32) each thread holds one unit (and
gamma's, loaded with it) in registers from the sum of squares to the scaled write: one memory
round trip. Otherwise a row is read twice (sum of squares, then the scaled write). A thread only
ever writes the elements it read itself, so ``y`` may alias ``x`` and ``sum`` may alias ``x`` or
``skip``.
"""

from __future__ import annotations

import numpy as np

from ep.device import Buffer, Device, Stream
from ep.kernels._common import (
    FLOAT_DTYPES,
    aligned,
    check_buffer,
    dtype_suffix,
    need,
    positive,
    register_per_dtype,
    threads_for,
)
from ep.ops import norm as ref

__all__ = ["rms_norm", "skip_rms_norm"]

_BODY = r"""
// Unit i (16 bytes) of a row into a[]: x, or x + skip rounded to T (stored to the sum); its
// squares added to ss in order.
static __device__ __forceinline__ void sum_unit(float* a, float& ss, const T* xr, const T* sr,
                                                T* tr, i64 i, int has_skip) {
    constexpr int N = Pack<T>::N;
    load16(xr + i * N, a);
    if (has_skip) {
        float b[N];
        load16(sr + i * N, b);
#pragma unroll
        for (int k = 0; k < N; ++k) a[k] = to_f32(from_f32<T>(a[k] + b[k]));
        store16(tr + i * N, a);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) ss += a[k] * a[k];
}

extern "C" __global__ void __launch_bounds__(1024) KERNEL(
    T* y, T* sum_out, const T* x, const T* skip, const T* __restrict__ w,
    i64 rows, int hidden, float eps, int has_skip, int vec_ok) {
    __shared__ float scratch[32];
    const i64 row = blockIdx.x;
    if (row >= rows) return;
    const i64 base = row * (i64)hidden;
    const T* xr = x + base;
    const T* sr = skip + base;
    T* tr = sum_out + base;
    T* yr = y + base;
    constexpr int N = Pack<T>::N;
    float ss = 0.0f;
    if (vec_ok && hidden / N <= (int)blockDim.x) {
        // One 16-byte unit a thread (the launch's shape up to 1024 units): gamma is loaded with
        // x and skip, and the values stay in registers for the scaling, so the row costs one
        // memory round trip instead of three. The same arithmetic as the loops below.
        const int i = threadIdx.x;
        const bool mine = i < hidden / N;
        float a[N], g[N];
        if (mine) {
            load16(w + (i64)i * N, g);
            sum_unit(a, ss, xr, sr, tr, i, has_skip);
        }
        ss = block_sum(ss, scratch);
        const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
        if (mine) {
#pragma unroll
            for (int k = 0; k < N; ++k) a[k] = a[k] * inv * g[k];
            store16(yr + (i64)i * N, a);
        }
        return;
    }
    if (vec_ok) {
        for (int i = threadIdx.x; i < hidden / N; i += blockDim.x) {
            float a[N];
            sum_unit(a, ss, xr, sr, tr, i, has_skip);
        }
    } else {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
            float a = to_f32(xr[i]);
            if (has_skip) {
                const T t = from_f32<T>(a + to_f32(sr[i]));
                tr[i] = t;
                a = to_f32(t);
            }
            ss += a * a;
        }
    }
    ss = block_sum(ss, scratch);
    const float inv = 1.0f / sqrtf(ss / (float)hidden + eps);
    // The values to scale: the rounded sum this very thread just wrote, or x.
    const T* src = has_skip ? (const T*)tr : xr;
    if (vec_ok) {
        for (int i = threadIdx.x; i < hidden / N; i += blockDim.x) {
            float a[N], g[N];
            load16(src + (i64)i * N, a);
            load16(w + (i64)i * N, g);
#pragma unroll
            for (int k = 0; k < N; ++k) a[k] = a[k] * inv * g[k];
            store16(yr + (i64)i * N, a);
        }
    } else {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
            yr[i] = from_f32<T>(to_f32(src[i]) * inv * to_f32(w[i]));
        }
    }
}
"""


def _cpu(
    y: np.ndarray,
    total: np.ndarray,
    x: np.ndarray,
    skip: np.ndarray,
    w: np.ndarray,
    rows: np.int64,
    hidden: np.int32,
    eps: np.float32,
    has_skip: np.int32,
    vec_ok: np.int32,
) -> None:
    n = int(rows) * int(hidden)
    shape = (int(rows), int(hidden))
    xs = x[:n].reshape(shape)
    if has_skip:
        out, summed = ref.skip_rms_norm(
            xs, skip[:n].reshape(shape), w[: int(hidden)], epsilon=float(eps)
        )
        total[:n] = summed.reshape(-1)
    else:
        out = ref.rms_norm(xs, w[: int(hidden)], epsilon=float(eps))
    y[:n] = out.reshape(-1)


RMS_NORM_KERNELS = register_per_dtype(
    "rms_norm",
    _BODY,
    ("T*", "T*", "T*", "T*", "T*", "i64", "i32", "f32", "i32", "i32"),
    _cpu,
)


def _launch(
    dev: Device,
    op: str,
    y: Buffer,
    total: Buffer,
    x: Buffer,
    skip: Buffer,
    weight: Buffer,
    rows: int,
    hidden: int,
    epsilon: float,
    has_skip: bool,
    stream: Stream,
) -> None:
    positive(op, rows=rows, hidden=hidden)
    need(0 < hidden < 2**31, op, f"hidden={hidden} must be in [1, 2**31)")
    need(epsilon >= 0, op, f"epsilon={epsilon} must be >= 0")
    suffix = dtype_suffix(x.dtype, op)
    names = ("y", "sum", "x", "skip") if has_skip else ("y", "x")
    bufs = (y, total, x, skip) if has_skip else (y, x)
    for name, buf in zip(names, bufs, strict=True):
        check_buffer(op, name, buf, rows * hidden, x.dtype)
    check_buffer(op, "weight", weight, hidden, x.dtype)
    if rows == 0:
        return
    per16 = FLOAT_DTYPES[x.dtype][2]
    vec_ok = hidden % per16 == 0 and aligned(y, total, x, skip, weight)
    units = hidden // per16 if vec_ok else hidden
    kernel = dev.kernel(RMS_NORM_KERNELS[suffix].name)
    kernel.launch(
        rows,
        threads_for(units),
        y,
        total,
        x,
        skip,
        weight,
        rows,
        hidden,
        float(epsilon),
        int(has_skip),
        int(vec_ok),
        stream=stream,
    )


def rms_norm(
    dev: Device,
    y: Buffer,
    x: Buffer,
    weight: Buffer,
    *,
    rows: int,
    hidden: int,
    epsilon: float,
    stream: Stream,
) -> None:
    """``y[r] = x[r] / sqrt(mean(x[r]²) + epsilon) * weight`` for ``rows`` contiguous rows.

    ``y`` may be ``x`` (in place). float32, float16 or bfloat16; all buffers one dtype.
    """
    _launch(dev, "RMSNorm", y, y, x, x, weight, rows, hidden, epsilon, False, stream)


def skip_rms_norm(
    dev: Device,
    y: Buffer,
    sum_out: Buffer,
    x: Buffer,
    skip: Buffer,
    weight: Buffer,
    *,
    rows: int,
    hidden: int,
    epsilon: float,
    stream: Stream,
) -> None:
    """``sum_out = x + skip`` (rounded to the dtype), ``y = rms_norm(sum_out)``.

    ``sum_out`` may alias ``x`` or ``skip`` and ``y`` may alias ``x`` (the residual stream
    updated in place).
    """
    _launch(dev, "SkipRMSNorm", y, sum_out, x, skip, weight, rows, hidden, epsilon, True, stream)
