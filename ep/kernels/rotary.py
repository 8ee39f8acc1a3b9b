"""Rotary position embedding on the device, from cos/sin caches (``Rotary``) or from theta
(``RotaryTheta``), half-split (Hugging Face ``rotate_half``) or interleaved (GPT-J).

One kernel per dtype, ``rotary_<dt>``, rotates up to two tensors in one launch (q and k of a
step, with their own head counts and token strides, so views into a packed QKV projection work),
in place (``out`` is ``x``) or out of place. Launch: one block per token (grid = batch*seq), 256
threads. The block first puts the token's rotary_dim/2 cos/sin values in shared memory (read from
the caches, or ``sincosf(position * inv_freq[i])`` rounded to the dtype as a cache of that dtype
holds them), then each thread rotates (head, pair) items; a thread reads and writes both features
of its pair, so in-place needs no synchronisation.

Theta mode takes ``inv_freq`` as a float32 device buffer made by `rotary_inv_freq` (the exact
float32 values the NumPy reference uses): angles grow with the position, and an inverse frequency
one ulp off would turn into a visible angle error at position 30k.

A negative position is padding: the token passes through. A position outside the cache sets
`KernelFault.ROTARY_POSITION` and passes through too (nothing is read out of bounds).

The rotation rounds each product and sum to float32 (``__fmul_rn``/``__fsub_rn``, no FMA), as
NumPy does; `ROTARY_DEVICE` holds that arithmetic and the cos/sin table for every kernel that
rotates, and such kernels compile without FMA contraction (`EXACT_OPTIONS`, sincosf included),
so the fused QKV commit of `ep.kernels.attention` stores exactly what Rotary stores.
"""

from __future__ import annotations

import numpy as np

from ep.device import Buffer, Device, Stream
from ep.kernels._common import (
    EXACT_OPTIONS,
    KernelFault,
    check_buffer,
    check_index_buffer,
    check_status,
    dtype_suffix,
    need,
    positive,
    register_per_dtype,
    set_fault,
)
from ep.ops import rotary as ref

__all__ = [
    "MAX_ROTARY_DIM",
    "ROTARY_DEVICE",
    "check_rotation",
    "rotary",
    "rotary_inv_freq",
    "rotary_theta",
]

MAX_ROTARY_DIM = 1024  # the shared cos/sin arrays hold rotary_dim/2 floats each
_THREADS = 256

# Device code every rotating kernel shares (this one and `ep.kernels.attention`'s fused QKV
# commit), so both round exactly alike. Needs the prelude and ``T``.
ROTARY_DEVICE = r"""
#define MAX_HALF 512

// y1 = x1*c - x2*s, y2 = x2*c + x1*s with every product and sum rounded to float32 (no FMA
// contraction), as the NumPy reference computes them.
static __device__ __forceinline__ void rotate_pair(float x1, float x2, float c, float s,
                                                   float* y1, float* y2) {
    *y1 = __fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, s));
    *y2 = __fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, s));
}

// The token's cos/sin of pairs 0..half-1 into the shared ``cs``/``sn`` (every thread calls it; a
// __syncthreads must come before they are read). Returns whether the token rotates: a negative
// position is padding; one outside the cache (mode 0) sets KernelFault.ROTARY_POSITION.
static __device__ bool rotary_table(float* cs, float* sn, i64 pos, int mode, i64 max_pos,
                                    const T* __restrict__ cos_cache,
                                    const T* __restrict__ sin_cache,
                                    const void* __restrict__ inv_freq, int half, u32* status) {
    bool rotate = pos >= 0;
    if (rotate && mode == 0 && pos >= max_pos) {
        rotate = false;
        if (threadIdx.x == 0) set_fault(status, 2u);  // KernelFault.ROTARY_POSITION
    }
    if (rotate) {
        const float* freq = reinterpret_cast<const float*>(inv_freq);
        for (int i = threadIdx.x; i < half; i += blockDim.x) {
            float c, s;
            if (mode == 0) {
                c = to_f32(cos_cache[pos * half + i]);
                s = to_f32(sin_cache[pos * half + i]);
            } else {
                // rounded once, as NumPy's float32 product: sincosf sees the reference's angle
                const float angle = __fmul_rn((float)pos, freq[i]);
                sincosf(angle, &s, &c);
                c = to_f32(from_f32<T>(c));  // as a cache of dtype T would hold them
                s = to_f32(from_f32<T>(s));
            }
            cs[i] = c;
            sn[i] = s;
        }
    }
    return rotate;
}
"""

_BODY = (
    ROTARY_DEVICE
    + r"""
static __device__ void rotate_tensor(T* y, const T* x, int heads, i64 x_tok, i64 y_tok, i64 tok,
                                     int dim, int half, int interleaved, bool rotate,
                                     const float* cs, const float* sn) {
    if (heads <= 0) return;
    const T* xt = x + tok * x_tok;
    T* yt = y + tok * y_tok;
    const bool in_place = (const void*)xt == (const void*)yt;
    if (!rotate) {
        if (in_place) return;
        for (int i = threadIdx.x; i < heads * dim; i += blockDim.x) yt[i] = xt[i];
        return;
    }
    const int rot = 2 * half;
    const int units = half + (in_place ? 0 : dim - rot);  // pairs, then pass-through features
    for (int idx = threadIdx.x; idx < heads * units; idx += blockDim.x) {
        const int h = idx / units;
        const int j = idx - h * units;
        const T* xh = xt + (i64)h * dim;
        T* yh = yt + (i64)h * dim;
        if (j < half) {
            const int a = interleaved ? 2 * j : j;
            const int b = interleaved ? 2 * j + 1 : j + half;
            float r1, r2;
            rotate_pair(to_f32(xh[a]), to_f32(xh[b]), cs[j], sn[j], &r1, &r2);
            yh[a] = from_f32<T>(r1);
            yh[b] = from_f32<T>(r2);
        } else {
            const int d = rot + (j - half);
            yh[d] = xh[d];
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) KERNEL(
    T* y1, const T* x1, int heads1, i64 x1_tok, i64 y1_tok,
    T* y2, const T* x2, int heads2, i64 x2_tok, i64 y2_tok,
    const void* __restrict__ positions, int pos_i64,
    const T* __restrict__ cos_cache, const T* __restrict__ sin_cache,
    const void* __restrict__ inv_freq, i64 max_pos, int mode, double theta_for_cpu_twin,
    i64 tokens, int dim, int half, int interleaved, u32* status) {
    __shared__ float cs[MAX_HALF];
    __shared__ float sn[MAX_HALF];
    const i64 tok = blockIdx.x;
    if (tok >= tokens) return;
    const i64 pos = load_index(positions, tok, pos_i64);
    const bool rotate = rotary_table(cs, sn, pos, mode, max_pos, cos_cache, sin_cache, inv_freq,
                                     half, status);
    __syncthreads();
    rotate_tensor(y1, x1, heads1, x1_tok, y1_tok, tok, dim, half, interleaved, rotate, cs, sn);
    rotate_tensor(y2, x2, heads2, x2_tok, y2_tok, tok, dim, half, interleaved, rotate, cs, sn);
}
"""
)


def _token_index(tokens: int, per_token: int, stride: int) -> np.ndarray:
    return np.arange(tokens)[:, None] * stride + np.arange(per_token)[None, :]


def rotary_twin(
    y1: np.ndarray,
    x1: np.ndarray,
    heads1: np.int32,
    x1_tok: np.int64,
    y1_tok: np.int64,
    y2: np.ndarray,
    x2: np.ndarray,
    heads2: np.int32,
    x2_tok: np.int64,
    y2_tok: np.int64,
    positions: np.ndarray,
    pos_i64: np.int32,
    cos_cache: np.ndarray,
    sin_cache: np.ndarray,
    inv_freq: np.ndarray,
    max_pos: np.int64,
    mode: np.int32,
    theta: np.float64,
    tokens: np.int64,
    dim: np.int32,
    half: np.int32,
    interleaved: np.int32,
    status: np.ndarray,
) -> None:
    """The NumPy twin of ``rotary_<dt>`` (the fused QKV commit's twin runs it too)."""
    n, d, h = int(tokens), int(dim), int(half)
    pos = positions.view(np.int64 if pos_i64 else np.int32)[:n].astype(np.int64)
    if mode == 0:
        bad = pos >= int(max_pos)
        if bad.any():
            set_fault(status, KernelFault.ROTARY_POSITION)
            pos = np.where(bad, -1, pos)  # passes through, as on the GPU
    results = []
    for y, x, heads, x_tok, y_tok in (
        (y1, x1, heads1, x1_tok, y1_tok),
        (y2, x2, heads2, x2_tok, y2_tok),
    ):
        if int(heads) <= 0:
            continue
        per = int(heads) * d
        xs = x[_token_index(n, per, int(x_tok))].reshape(1, n, int(heads), d)
        if mode == 0:
            cache_cos = cos_cache[: int(max_pos) * h].reshape(int(max_pos), h)
            cache_sin = sin_cache[: int(max_pos) * h].reshape(int(max_pos), h)
            out = ref.rotary(xs, pos[None], cache_cos, cache_sin, interleaved=int(interleaved))
        else:
            out = ref.rotary_theta(
                xs,
                pos[None],
                theta=float(theta),
                rotary_dim=2 * h,
                interleaved=int(interleaved),
            )
        results.append((y, _token_index(n, per, int(y_tok)), out.reshape(n, per)))
    for y, index, values in results:  # write after reading both: y2 may alias x1's memory
        y[index] = values


ROTARY_KERNELS = register_per_dtype(
    "rotary",
    _BODY,
    ("T* T* i32 i64 i64 T* T* i32 i64 i64 void* i32 T* T* void* i64 i32 f64 i64 i32 i32 i32 u32*"),
    rotary_twin,
    EXACT_OPTIONS,  # the fused QKV commit rotates with the same code: the same bits
)


def rotary_inv_freq(dev: Device, theta: float, rotary_dim: int, *, stream: Stream) -> Buffer:
    """float32 [rotary_dim/2] inverse frequencies on ``dev``, exactly as the NumPy reference
    computes them (Hugging Face ``inv_freq``); build once per model, before any capture."""
    need(theta > 0, "RotaryTheta", f"theta={theta} must be > 0")
    need(
        isinstance(rotary_dim, int) and 0 < rotary_dim <= MAX_ROTARY_DIM and rotary_dim % 2 == 0,
        "RotaryTheta",
        f"rotary_dim={rotary_dim!r} must be even and in (0, {MAX_ROTARY_DIM}]",
    )
    values = ref._inv_freq(theta, rotary_dim)  # the reference's own float32 values
    return dev.to_device(values, stream=stream, name=f"inv_freq-{theta:g}-{rotary_dim}")


def check_rotation(op: str, head_dim: int, rotary_dim: int, interleaved: int) -> int:
    """The rotated features per head (``rotary_dim`` 0: head_dim), checked; ``interleaved`` 0/1."""
    rot = rotary_dim or head_dim
    need(
        0 < rot <= head_dim and rot % 2 == 0 and rot <= MAX_ROTARY_DIM,
        op,
        f"rotary_dim={rot} must be even, in (0, head_dim={head_dim}] and at most {MAX_ROTARY_DIM}",
    )
    need(interleaved in (0, 1), op, f"interleaved={interleaved!r} must be 0 or 1")
    return rot


def _launch(
    dev: Device,
    op: str,
    out: Buffer,
    x: Buffer,
    positions: Buffer,
    cos: Buffer,
    sin: Buffer,
    freq: Buffer,
    *,
    mode: int,
    theta: float,
    max_positions: int,
    batch: int,
    seq: int,
    heads: int,
    head_dim: int,
    rotary_dim: int,
    interleaved: int,
    strides: tuple[int, int],
    k_out: Buffer | None,
    k: Buffer | None,
    kv_heads: int,
    k_strides: tuple[int, int],
    status: Buffer,
    stream: Stream,
) -> None:
    positive(op, batch=batch, seq=seq, heads=heads, head_dim=head_dim, kv_heads=kv_heads)
    rot = check_rotation(op, head_dim, rotary_dim, interleaved)
    suffix = dtype_suffix(x.dtype, op)
    tokens = batch * seq
    targets = [(out, x, heads, strides)]
    if k is not None or k_out is not None:
        need(k is not None and k_out is not None, op, "pass both k and k_out, or neither")
        need(kv_heads > 0, op, "kv_heads must be > 0 when k is given")
        assert k is not None and k_out is not None
        targets.append((k_out, k, kv_heads, k_strides))
    checked = []
    for target_out, target_x, n_heads, (x_tok, y_tok) in targets:
        per = n_heads * head_dim
        x_tok, y_tok = x_tok or per, y_tok or per
        need(
            x_tok >= per and y_tok >= per,
            op,
            f"token strides ({x_tok}, {y_tok}) must be >= heads*head_dim={per}",
        )
        need(
            (target_out.ptr == target_x.ptr and x_tok == y_tok)
            or not _overlap(target_out, target_x),
            op,
            "out must be x itself (same token stride) or not overlap it",
        )
        extent = (tokens - 1) * x_tok + per if tokens else 0
        check_buffer(op, "x", target_x, extent, x.dtype)
        check_buffer(op, "out", target_out, (tokens - 1) * y_tok + per if tokens else 0, x.dtype)
        checked.append((target_out, target_x, n_heads, x_tok, y_tok))
    pos_i64 = check_index_buffer(op, "positions", positions, tokens)
    check_status(op, status)
    if mode == 0:
        positive(op, max_positions=max_positions)
        check_buffer(op, "cos_cache", cos, max_positions * rot // 2, x.dtype)
        check_buffer(op, "sin_cache", sin, max_positions * rot // 2, x.dtype)
    else:
        check_buffer(op, "inv_freq", freq, rot // 2, np.dtype(np.float32))
    if tokens == 0 or heads == 0:
        return
    if len(checked) == 1:
        checked.append((out, x, 0, 0, 0))
    (y1, x1, h1, x1t, y1t), (y2, x2, h2, x2t, y2t) = checked
    kernel = dev.kernel(ROTARY_KERNELS[suffix].name)
    kernel.launch(
        tokens,
        _THREADS,
        y1, x1, h1, x1t, y1t,
        y2, x2, h2, x2t, y2t,
        positions, pos_i64, cos, sin, freq, max_positions, mode, float(theta),
        tokens, head_dim, rot // 2, interleaved, status,
        stream=stream,
    )  # fmt: skip


def _overlap(a: Buffer, b: Buffer) -> bool:
    return a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes


def rotary(
    dev: Device,
    out: Buffer,
    x: Buffer,
    positions: Buffer,
    cos_cache: Buffer,
    sin_cache: Buffer,
    *,
    batch: int,
    seq: int,
    heads: int,
    head_dim: int,
    max_positions: int,
    rotary_dim: int = 0,
    interleaved: int = 0,
    x_token_stride: int = 0,
    out_token_stride: int = 0,
    k_out: Buffer | None = None,
    k: Buffer | None = None,
    kv_heads: int = 0,
    k_token_stride: int = 0,
    k_out_token_stride: int = 0,
    status: Buffer,
    stream: Stream,
) -> None:
    """Rotate x [batch, seq, heads, head_dim] (and optionally k with ``kv_heads``) at int64/int32
    ``positions`` [batch, seq] with cos/sin caches [max_positions, rotary_dim/2] of x's dtype.

    ``rotary_dim`` 0 means head_dim. Token strides (elements between consecutive tokens) default to
    heads*head_dim; heads within a token are head_dim apart. ``out`` may be ``x`` (in place).
    """
    _launch(
        dev,
        "Rotary",
        out,
        x,
        positions,
        cos_cache,
        sin_cache,
        cos_cache,  # inv_freq is unused in cache mode; any buffer fills the slot
        mode=0,
        theta=0.0,
        max_positions=max_positions,
        batch=batch,
        seq=seq,
        heads=heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        interleaved=interleaved,
        strides=(x_token_stride, out_token_stride),
        k_out=k_out,
        k=k,
        kv_heads=kv_heads,
        k_strides=(k_token_stride, k_out_token_stride),
        status=status,
        stream=stream,
    )


def rotary_theta(
    dev: Device,
    out: Buffer,
    x: Buffer,
    positions: Buffer,
    inv_freq: Buffer,
    *,
    theta: float,
    batch: int,
    seq: int,
    heads: int,
    head_dim: int,
    rotary_dim: int = 0,
    interleaved: int = 0,
    x_token_stride: int = 0,
    out_token_stride: int = 0,
    k_out: Buffer | None = None,
    k: Buffer | None = None,
    kv_heads: int = 0,
    k_token_stride: int = 0,
    k_out_token_stride: int = 0,
    status: Buffer,
    stream: Stream,
) -> None:
    """Like `rotary` with cos/sin computed from ``inv_freq`` = `rotary_inv_freq` (theta,
    rotary_dim). ``theta`` must be the one ``inv_freq`` was built from (the CPU twin uses it)."""
    need(theta > 0, "RotaryTheta", f"theta={theta} must be > 0")
    _launch(
        dev,
        "RotaryTheta",
        out,
        x,
        positions,
        x,  # no caches in theta mode; x fills the typed slots
        x,
        inv_freq,
        mode=1,
        theta=theta,
        max_positions=0,
        batch=batch,
        seq=seq,
        heads=heads,
        head_dim=head_dim,
        rotary_dim=rotary_dim,
        interleaved=interleaved,
        strides=(x_token_stride, out_token_stride),
        k_out=k_out,
        k=k,
        kv_heads=kv_heads,
        k_strides=(k_token_stride, k_out_token_stride),
        status=status,
        stream=stream,
    )
