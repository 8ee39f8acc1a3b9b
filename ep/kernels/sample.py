"""Token sampling on the device: the logits never leave it, only one int64 id per row does.

``sample_argmax_<dt>`` (greedy): blocks of 512 threads over `ARGMAX_SPAN` entries of a row each;
each thread keeps the best ``(value, index)`` of its strided elements as one 64-bit key
(order-preserving bits of the float above, ``~index`` below), then a warp-shuffle and
shared-memory max. The largest key is the largest value with the lowest index, which is exactly
``np.argmax`` (NaN ranks first, as NumPy's does; -0.0 ties with +0.0). The blocks of a row meet in
a per-row scratch (`argmax_scratch`): each block's best key goes in by atomicMax (exact, and
independent of the order blocks finish), and the last block to arrive writes the id and zeroes
the scratch for the next launch.

``sample_topp_<dt>`` (temperature, top-k, top-p, min-p): one block of 1024 threads per row.

*The random number* is the reference's own: ``ep.ops.sample`` draws ``rng_at(key, step).random()``,
i.e. NumPy's ``SeedSequence(key)`` → ``PCG64`` advanced by ``step`` draws → ``random()``. Thread 0
runs that very algorithm (SeedSequence's hash mixing, PCG64's 128-bit LCG, its jump-ahead, the
XSL-RR output, the 53-bit double), so the kernel and the NumPy reference draw bit-identical
uniforms from the same ``rng_keys`` and ``steps`` inputs, with no state kept between calls.
``advance_steps`` makes the kernel add 1 to ``steps[b]`` after drawing, so a captured decode step
replays with fresh numbers.

*The distribution* is the reference's: candidates ordered by (scaled logit descending, index
ascending), top-k, then the top-p prefix (the candidates whose mass ranked above them is below
top_p), then min-p (probability >= min_p × the top one), then inverse-CDF with ``u × kept mass``.
The reference sums float64 probabilities sequentially in sorted order, which a parallel kernel
cannot reproduce bit for bit; the kernel instead gives each candidate the integer weight
``round(exp(logit/T - max/T) × 2^43)`` (float64 exp) and does every sum, cut and search on these
integers, which is exact and order-independent (so also deterministic run to run). A row is never
sorted: each cut is a radix select over 64-bit (value, index) keys, 8 bits a pass, with
warp-aggregated histograms in shared memory (``__match_any_sync`` + ``__reduce_add_sync``, one
shared atomic per distinct digit per warp), stopping as soon as the selected bucket holds one
element; a cut's target that depends on the total mass (top-p, the draw) is set from its first
pass's histogram, so no pass only sums. The ids equal the reference's except when the uniform
lands within ~2^-43 of the kept mass of a boundary between two tokens (weights below 2^-44 of
the top token count as 0); `sample_fixed_point` is the NumPy twin of this arithmetic, for tests.

Cost, measured on the H200 at V = 151936: greedy, a graph of the one kernel 5.6 µs at batch 1 and
8.8 at 16, mostly the graph launch (one block a row took 23 µs); sampling 0.4 to 1 ms, as one SM
per row re-reads the row once per digit pass. Fine where sampling is occasional; multi-block
rows and compacting the surviving bucket into shared memory are the next steps.

Bad data never crashes: a NaN, +inf or all -inf row (no finite top logit) or a negative key or
step returns the row's argmax and sets `KernelFault.SAMPLE_LOGITS` / ``SAMPLE_KEY``.
"""

from __future__ import annotations

import math

import numpy as np

from ep.device import Buffer, Device, Stream
from ep.errors import GenerationError, KernelArgumentError
from ep.kernels._common import (
    KernelFault,
    check_buffer,
    check_status,
    dtype_suffix,
    need,
    positive,
    register_per_dtype,
    set_fault,
)
from ep.ops import sample as ref
from ep.sampling import SamplingParams

__all__ = [
    "FIXED_POINT_BITS",
    "MAX_SAMPLE_VOCAB",
    "argmax",
    "argmax_scratch",
    "sample",
    "sample_fixed_point",
]

FIXED_POINT_BITS = 43  # weight of the top candidate: 2**43
MAX_SAMPLE_VOCAB = 1 << 20  # keeps the sum of weights below 2**63
MAX_KEY_WORDS = 16
_THREADS = 1024
# Greedy: blocks of 512 threads, each over 8 elements a thread of a row (one load round), so the
# 151936-entry vocabulary of a Qwen2.5 row is 38 blocks, not one block walking it 149 times.
_ARGMAX_THREADS = 512
ARGMAX_SPAN = _ARGMAX_THREADS * 8

_KEYS = r"""
// An order-preserving 32-bit key of a float: larger value, larger key; NaN above everything.
static __device__ __forceinline__ u32 order_key(float v) {
    if (v != v) return 0xffffffffu;
    u32 bits = __float_as_uint(v);
    if (v == 0.0f) bits = 0u;  // -0.0 ties with +0.0, as in NumPy
    return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}
// (value, index) as one key: the largest key is the largest value with the lowest index.
static __device__ __forceinline__ u64 composite(float v, i64 i) {
    return ((u64)order_key(v) << 32) | (u64)(0xffffffffu - (u32)i);
}
static __device__ __forceinline__ i64 index_of(u64 key) {
    return (i64)(0xffffffffu - (u32)(key & 0xffffffffull));
}
// Calls f(value, index) for this thread's elements of a row (stride blockDim.x), reading
// UNROLL elements before using any so each thread keeps several loads in flight.
template <int UNROLL, typename X, typename F>
static __device__ __forceinline__ void for_each_element(const X* row, i64 vocab, F f) {
    const i64 stride = blockDim.x;
    i64 i = threadIdx.x;
    for (; i + (UNROLL - 1) * stride < vocab; i += UNROLL * stride) {
        float v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u] = to_f32(row[i + u * stride]);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) f(v[u], i + u * stride);
    }
    for (; i < vocab; i += stride) f(to_f32(row[i]), i);
}

static __device__ u64 block_max_u64(u64 v, u64* scratch) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(0xffffffffu, v, o);
        v = other > v ? other : v;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? scratch[lane] : 0ull;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(0xffffffffu, v, o);
        v = other > v ? other : v;
    }
    return v;
}
"""

_ARGMAX_BODY = (
    _KEYS
    + r"""
// Grid (parts, rows): block (p, b) takes the best key of elements [p * span, (p + 1) * span) of
// row b. One part writes ids[b] itself; several meet in scratch[2b] (the row's best key, by
// atomicMax: exact and order-free) and scratch[2b + 1] (arrivals), and the last to arrive writes
// ids[b] and zeroes both, so the scratch is zero again for the next launch.
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) KERNEL(
    i64* ids, const T* __restrict__ logits, i64 rows, i64 vocab, i64 row_stride, u64* scratch,
    i64 span) {
    __shared__ u64 shared[32];
    const i64 b = blockIdx.y;
    if (b >= rows) return;
    const i64 start = (i64)blockIdx.x * span;
    const T* row = logits + b * row_stride + start;
    u64 best = 0;
    for_each_element<8>(row, min(span, vocab - start), [&](float v, i64 i) {
        const u64 k = composite(v, start + i);
        best = k > best ? k : best;
    });
    best = block_max_u64(best, shared);
    if (threadIdx.x != 0) return;
    if (gridDim.x == 1) {
        ids[b] = index_of(best);
        return;
    }
    u64* slot = scratch + 2 * b;
    atomicMax(reinterpret_cast<unsigned long long*>(slot), (unsigned long long)best);
    __threadfence();
    const u64 arrived = atomicAdd(reinterpret_cast<unsigned long long*>(slot + 1), 1ull);
    if (arrived + 1 < gridDim.x) return;
    __threadfence();
    ids[b] = index_of(atomicExch(reinterpret_cast<unsigned long long*>(slot), 0ull));
    slot[1] = 0ull;
}
""".replace("ARGMAX_THREADS", str(_ARGMAX_THREADS))
)

_SAMPLE_BODY = (
    _KEYS
    + r"""
#define FIX_SCALE 8796093022208.0  /* 2^43 */

// --- NumPy's SeedSequence + PCG64 + random(), as ep.ops.sample.rng_at(key, step).random() ---
struct U128 { u64 hi, lo; };
static __device__ __forceinline__ U128 mul128(U128 a, U128 b) {
    U128 r;
    r.lo = a.lo * b.lo;
    r.hi = __umul64hi(a.lo, b.lo) + a.lo * b.hi + a.hi * b.lo;
    return r;
}
static __device__ __forceinline__ U128 add128(U128 a, U128 b) {
    U128 r;
    r.lo = a.lo + b.lo;
    r.hi = a.hi + b.hi + (r.lo < a.lo ? 1ull : 0ull);
    return r;
}
static __device__ __forceinline__ u32 hashmix(u32 value, u32& hash_const) {
    value ^= hash_const;
    hash_const *= 0x931e8875u;
    value *= hash_const;
    value ^= value >> 16;
    return value;
}
static __device__ __forceinline__ u32 mix32(u32 x, u32 y) {
    u32 r = 0xca01f9ddu * x - 0x4973f715u * y;
    r ^= r >> 16;
    return r;
}
static __device__ double numpy_random(const i64* key, int words, i64 step) {
    u32 entropy[32];
    int n = 0;
    for (int i = 0; i < words; ++i) {  // each int as its 32-bit words, lowest first
        u64 v = (u64)key[i];
        if (v == 0) entropy[n++] = 0u;
        while (v != 0) {
            entropy[n++] = (u32)(v & 0xffffffffull);
            v >>= 32;
        }
    }
    u32 hash_const = 0x43b0d7e5u;
    u32 pool[4];
    for (int i = 0; i < 4; ++i) pool[i] = hashmix(i < n ? entropy[i] : 0u, hash_const);
    for (int s = 0; s < 4; ++s)
        for (int d = 0; d < 4; ++d)
            if (s != d) pool[d] = mix32(pool[d], hashmix(pool[s], hash_const));
    for (int s = 4; s < n; ++s)
        for (int d = 0; d < 4; ++d) pool[d] = mix32(pool[d], hashmix(entropy[s], hash_const));
    u32 words32[8];
    u32 hb = 0x8b51f9ddu;
    for (int i = 0; i < 8; ++i) {
        u32 v = pool[i & 3];
        v ^= hb;
        hb *= 0x58f38dedu;
        v *= hb;
        v ^= v >> 16;
        words32[i] = v;
    }
    u64 seed[4];
    for (int i = 0; i < 4; ++i) seed[i] = (u64)words32[2 * i] | ((u64)words32[2 * i + 1] << 32);
    const U128 mult = {0x2360ed051fc65da4ull, 0x4385df649fccf645ull};
    const U128 one = {0ull, 1ull};
    const U128 initstate = {seed[0], seed[1]};
    const U128 inc = {(seed[2] << 1) | (seed[3] >> 63), (seed[3] << 1) | 1ull};
    U128 state = inc;  // state = 0; step
    state = add128(state, initstate);
    state = add128(mul128(state, mult), inc);
    U128 acc_mult = one, acc_plus = {0ull, 0ull}, cur_mult = mult, cur_plus = inc;
    for (u64 delta = (u64)step; delta != 0; delta >>= 1) {  // jump ahead `step` draws
        if (delta & 1ull) {
            acc_mult = mul128(acc_mult, cur_mult);
            acc_plus = add128(mul128(acc_plus, cur_mult), cur_plus);
        }
        cur_plus = mul128(add128(cur_mult, one), cur_plus);
        cur_mult = mul128(cur_mult, cur_mult);
    }
    state = add128(mul128(acc_mult, state), acc_plus);
    state = add128(mul128(state, mult), inc);
    const u64 x = state.hi ^ state.lo;
    const unsigned rot = (unsigned)(state.hi >> 58);
    const u64 bits = (x >> rot) | (x << ((64u - rot) & 63u));
    return (double)(bits >> 11) * (1.0 / 9007199254740992.0);
}

// --- the filtered distribution on integer weights ---
static __device__ __forceinline__ u64 weight_of(float v, double temperature, double top) {
    return __double2ull_rn(exp((double)v / temperature - top) * FIX_SCALE);
}

struct Pick { int digit; u32 count; u64 above; u64 key; u64 target; };

// How select_first's target is given: as is, or from the total weight W of the elements it
// considers (known after its first pass, which saves a pass over the row to sum them).
#define TARGET_ABSOLUTE 0
#define TARGET_CEIL_FRACTION 1   // max(1, ceil(fraction * W)): the top-p cut
#define TARGET_FLOOR_FRACTION 2  // min(W, floor(fraction * W) + 1): the inverse-CDF draw

// The first element in descending key order, among those with key >= lower and weight >= min_w,
// at which the running weight (1 per element unless `mass`) reaches the target; 0 if it never
// does.
static __device__ u64 select_first(const T* row, i64 vocab, double temperature, double top,
                                   bool mass, u64 lower, double min_w, int target_mode,
                                   u64 target, double fraction, u64* hist_w, u32* hist_c,
                                   u64* hist_k, Pick* pick) {
    u64 prefix = 0, above = 0;
    const int lane = threadIdx.x & 31;
    const i64 first = (i64)(threadIdx.x >> 5) * 32;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) {
            hist_w[i] = 0ull;
            hist_c[i] = 0u;
        }
        __syncthreads();
        const u64 known = shift == 56 ? 0ull : (~0ull << (shift + 8));
        const i64 stride = blockDim.x;
        for (i64 base = first; base < vocab; base += 4 * stride) {  // warp-uniform trip count
            float vals[4];
#pragma unroll
            for (int u = 0; u < 4; ++u) {  // four loads in flight before any is used
                const i64 i = base + u * stride + lane;
                vals[u] = i < vocab ? to_f32(row[i]) : 0.0f;
            }
#pragma unroll
            for (int u = 0; u < 4; ++u) {
                const i64 i = base + u * stride + lane;
                unsigned digit = 256u;  // 256: not counted
                u64 w = 0ull, k = 0ull;
                if (i < vocab) {
                    const float v = vals[u];
                    k = composite(v, i);
                    if (k >= lower && (k & known) == prefix) {
                        w = (mass || min_w > 0.0) ? weight_of(v, temperature, top) : 1ull;
                        if ((double)w >= min_w) {
                            digit = (unsigned)((k >> shift) & 255ull);
                            if (!mass) w = 1ull;
                        } else {
                            w = 0ull;
                        }
                    }
                }
                // Past the first pass most warps hold none of the selected bucket: skip them.
                if (!__any_sync(0xffffffffu, digit < 256u)) continue;
                const unsigned peers = __match_any_sync(0xffffffffu, digit);
                const int n = __popc(peers);
                u64 sum = (u64)n;
                if (mass) {  // weights are < 2^44: 22-bit halves keep 32 lanes' sums in 32 bits
                    const unsigned lo = __reduce_add_sync(peers, (unsigned)(w & 0x3fffffull));
                    const unsigned hi = __reduce_add_sync(peers, (unsigned)(w >> 22));
                    sum = ((u64)hi << 22) + (u64)lo;
                }
                if (digit < 256u) {
                    if (n == 1) hist_k[digit] = k;  // read only when the whole block has one
                    if (lane == __ffs(peers) - 1) {
                        atomicAdd(&hist_w[digit], sum);
                        atomicAdd(&hist_c[digit], (u32)n);
                    }
                }
            }
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            if (shift == 56 && target_mode != TARGET_ABSOLUTE) {
                u64 total = 0ull;
                for (int d = 0; d < 256; ++d) total += hist_w[d];
                if (target_mode == TARGET_CEIL_FRACTION) {
                    const double want = ceil(fraction * (double)total);
                    target = want < 1.0 ? 1ull : (u64)want;
                } else {
                    target = (u64)floor(fraction * (double)total) + 1ull;
                    if (target > total) target = total;
                }
                pick->target = target;
            }
            u64 run = above;
            int found = -1;
            for (int d = 255; d >= 0; --d) {
                if (hist_c[d] == 0u) continue;
                if (run + hist_w[d] >= target) {
                    found = d;
                    break;
                }
                run += hist_w[d];
            }
            pick->digit = found;
            pick->above = run;
            pick->count = found >= 0 ? hist_c[found] : 0u;
            pick->key = found >= 0 ? hist_k[found] : 0ull;
        }
        __syncthreads();
        if (shift == 56 && target_mode != TARGET_ABSOLUTE) target = pick->target;
        const int found = pick->digit;
        if (found < 0) return 0ull;
        prefix |= (u64)found << shift;
        above = pick->above;
        if (pick->count == 1u) return pick->key;
    }
    return prefix;
}

extern "C" __global__ void __launch_bounds__(1024) KERNEL(
    i64* ids, i64* steps, const T* __restrict__ logits, const i64* __restrict__ keys, i64 rows,
    i64 vocab, i64 row_stride, int key_words, double temperature, i64 top_k, double top_p,
    double min_p, int advance, u32* status) {
    __shared__ u64 scratch[32];
    __shared__ u64 hist_w[256];
    __shared__ u32 hist_c[256];
    __shared__ u64 hist_k[256];
    __shared__ Pick pick;
    __shared__ double uniform;
    __shared__ int bad_key;
    const i64 b = blockIdx.x;
    if (b >= rows) return;
    const T* row = logits + b * row_stride;
    if (threadIdx.x == 0) {
        const i64* key = keys + b * key_words;
        const i64 step = steps[b];
        bool ok = step >= 0;
        for (int w = 0; w < key_words; ++w) ok = ok && key[w] >= 0;
        bad_key = ok ? 0 : 1;
        uniform = ok ? numpy_random(key, key_words, step) : 0.0;
        if (!ok) set_fault(status, 64u);  // KernelFault.SAMPLE_KEY
        else if (advance) steps[b] = step + 1;
    }
    u64 best = 0;
    int nan_seen = 0;
    for_each_element<8>(row, vocab, [&](float v, i64 i) {
        nan_seen |= v != v;
        const u64 k = composite(v, i);
        best = k > best ? k : best;
    });
    best = block_max_u64(best, scratch);
    nan_seen = __syncthreads_or(nan_seen);
    const double top = (double)to_f32(row[index_of(best)]) / temperature;
    if (bad_key || nan_seen || !isfinite(top)) {
        if (threadIdx.x == 0) {
            if (!bad_key) set_fault(status, 32u);  // KernelFault.SAMPLE_LOGITS
            ids[b] = index_of(best);
        }
        return;
    }
    u64 lower = 0ull;  // candidates: key >= lower
    if (top_k > 0 && top_k < vocab) {
        lower = select_first(row, vocab, temperature, top, false, 0ull, 0.0, TARGET_ABSOLUTE,
                             (u64)top_k, 0.0, hist_w, hist_c, hist_k, &pick);
    }
    if (top_p < 1.0) {
        const u64 cut = select_first(row, vocab, temperature, top, true, lower, 0.0,
                                     TARGET_CEIL_FRACTION, 0ull, top_p, hist_w, hist_c, hist_k,
                                     &pick);
        if (cut != 0ull) lower = cut;
    }
    const double min_w = min_p > 0.0 ? min_p * FIX_SCALE : 0.0;
    const u64 chosen = select_first(row, vocab, temperature, top, true, lower, min_w,
                                    TARGET_FLOOR_FRACTION, 0ull, uniform, hist_w, hist_c,
                                    hist_k, &pick);
    if (threadIdx.x == 0) ids[b] = index_of(chosen != 0ull ? chosen : best);
}
"""
)


def _rows(logits: np.ndarray, rows: int, vocab: int, stride: int) -> np.ndarray:
    index = np.arange(rows)[:, None] * stride + np.arange(vocab)[None, :]
    return logits[index].astype(np.float32)


def _argmax_cpu(
    ids: np.ndarray,
    logits: np.ndarray,
    rows: np.int64,
    vocab: np.int64,
    row_stride: np.int64,
    scratch: np.ndarray,
    span: np.int64,
) -> None:
    n = int(rows)
    values = _rows(logits, n, int(vocab), int(row_stride))
    keys, steps = np.zeros((n, 1), np.int64), np.zeros(n, np.int64)
    ids[:n] = ref.sample(values, keys, steps, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0)


def _sample_cpu(
    ids: np.ndarray,
    steps: np.ndarray,
    logits: np.ndarray,
    keys: np.ndarray,
    rows: np.int64,
    vocab: np.int64,
    row_stride: np.int64,
    key_words: np.int32,
    temperature: np.float64,
    top_k: np.int64,
    top_p: np.float64,
    min_p: np.float64,
    advance: np.int32,
    status: np.ndarray,
) -> None:
    n, words = int(rows), int(key_words)
    values = _rows(logits, n, int(vocab), int(row_stride))
    row_keys = keys[: n * words].reshape(n, words)
    for b in range(n):
        step = int(steps[b])
        key_ok = step >= 0 and int(row_keys[b].min(initial=0)) >= 0
        with np.errstate(over="ignore", invalid="ignore"):
            top = np.float64(values[b].max()) / float(temperature)
        if not key_ok or np.isnan(values[b]).any() or not np.isfinite(top):
            set_fault(status, KernelFault.SAMPLE_KEY if not key_ok else KernelFault.SAMPLE_LOGITS)
            ids[b] = int(np.argmax(values[b]))
            continue
        ids[b] = ref.sample(
            values[b : b + 1],
            row_keys[b : b + 1],
            steps[b : b + 1],
            temperature=float(temperature),
            top_k=int(top_k),
            top_p=float(top_p),
            min_p=float(min_p),
        )[0]
        if advance:
            steps[b] = step + 1


ARGMAX_KERNELS = register_per_dtype(
    "sample_argmax", _ARGMAX_BODY, ("i64*", "T*", "i64", "i64", "i64", "u64*", "i64"), _argmax_cpu
)
SAMPLE_KERNELS = register_per_dtype(
    "sample_topp",
    _SAMPLE_BODY,
    "i64* i64* T* i64* i64 i64 i64 i32 f64 i64 f64 f64 i32 u32*",
    _sample_cpu,
)


def _check_logits(
    op: str, logits: Buffer, batch: int, vocab: int, row_stride: int
) -> tuple[str, int]:
    positive(op, batch=batch, vocab=vocab, row_stride=row_stride)
    need(vocab > 0, op, "the vocabulary is empty (vocab=0)")
    suffix = dtype_suffix(logits.dtype, op)
    stride = row_stride or vocab
    need(stride >= vocab, op, f"row_stride={stride} must be >= vocab={vocab}")
    check_buffer(op, "logits", logits, (batch - 1) * stride + vocab if batch else 0)
    return suffix, stride


def argmax_scratch(dev: Device, batch: int, *, stream: Stream) -> Buffer:
    """Zeroed scratch for `argmax` over ``batch`` rows: uint64 [batch, 2] (a row's best key and
    its arrival count). Every launch leaves it zero again, so one scratch serves every call and
    every graph replay on one stream (not two streams at once)."""
    positive("Sample", batch=batch)
    scratch = dev.alloc((batch, 2), np.uint64, stream=stream, name="argmax-scratch")
    dev.fill(scratch, 0, stream=stream)
    return scratch


def argmax(
    dev: Device,
    ids: Buffer,
    logits: Buffer,
    *,
    batch: int,
    vocab: int,
    row_stride: int = 0,
    scratch: Buffer | None = None,
    stream: Stream,
) -> None:
    """Greedy: ``ids[b] = argmax(logits[b])`` (int64; the lowest index wins a tie).

    A row of more than `ARGMAX_SPAN` entries is split over several blocks that meet in
    ``scratch`` (`argmax_scratch`); pass one that lives as long as the caller's buffers (a
    captured loop must), or None for a fresh one for this call.
    """
    op = "Sample"
    suffix, stride = _check_logits(op, logits, batch, vocab, row_stride)
    need(vocab < 2**31, op, f"vocab={vocab} must be below 2**31")
    check_buffer(op, "ids", ids, batch, np.dtype(np.int64))
    if batch == 0:
        return
    parts = -(-vocab // ARGMAX_SPAN)
    need(batch <= 65535, op, f"batch={batch} rows; at most 65535")
    if scratch is None:
        scratch = argmax_scratch(dev, batch, stream=stream)
    check_buffer(op, "scratch", scratch, 2 * batch, np.dtype(np.uint64))
    kernel = dev.kernel(ARGMAX_KERNELS[suffix].name)
    kernel.launch(
        (parts, batch), _ARGMAX_THREADS, ids, logits, batch, vocab, stride, scratch, ARGMAX_SPAN,
        stream=stream,
    )  # fmt: skip


def sample(
    dev: Device,
    ids: Buffer,
    logits: Buffer,
    rng_keys: Buffer | None,
    steps: Buffer | None,
    *,
    batch: int,
    vocab: int,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    row_stride: int = 0,
    advance_steps: bool = False,
    status: Buffer,
    stream: Stream,
) -> None:
    """The ``Sample`` op: one int64 id per row of logits [batch, vocab] (rows ``row_stride``
    apart), with `ep.sampling` semantics and the reference's random numbers.

    ``rng_keys`` int64 [batch, words] and ``steps`` int64 [batch] are the op's inputs (each row's
    generator entropy and the draws it made before); greedy (temperature 0) reads neither and may
    pass None. ``advance_steps`` adds 1 to each row's step after drawing (for captured replays).
    """
    op = "Sample"
    try:
        SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    except GenerationError as exc:
        raise KernelArgumentError(f"{op}: {exc}") from None
    if temperature == 0.0:
        argmax(dev, ids, logits, batch=batch, vocab=vocab, row_stride=row_stride, stream=stream)
        return
    suffix, stride = _check_logits(op, logits, batch, vocab, row_stride)
    need(vocab <= MAX_SAMPLE_VOCAB, op, f"vocab={vocab} exceeds {MAX_SAMPLE_VOCAB} for sampling")
    check_buffer(op, "ids", ids, batch, np.dtype(np.int64))
    need(rng_keys is not None and steps is not None, op, "sampling needs rng_keys and steps")
    assert rng_keys is not None and steps is not None
    words = rng_keys.shape[-1] if len(rng_keys.shape) == 2 else 0
    need(
        len(rng_keys.shape) == 2 and rng_keys.shape[0] >= batch and 0 < words <= MAX_KEY_WORDS,
        op,
        f"rng_keys has shape {list(rng_keys.shape)}; expected [batch, words] with 1 to "
        f"{MAX_KEY_WORDS} words",
    )
    check_buffer(op, "rng_keys", rng_keys, batch * words, np.dtype(np.int64))
    check_buffer(op, "steps", steps, batch, np.dtype(np.int64))
    check_status(op, status)
    if batch == 0:
        return
    kernel = dev.kernel(SAMPLE_KERNELS[suffix].name)
    kernel.launch(
        batch,
        _THREADS,
        ids, steps, logits, rng_keys, batch, vocab, stride, words,
        float(temperature), int(top_k), float(top_p), float(min_p), int(advance_steps), status,
        stream=stream,
    )  # fmt: skip


def sample_fixed_point(
    logits: np.ndarray,
    uniforms: np.ndarray,
    *,
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> np.ndarray:
    """The sampling kernel's arithmetic in NumPy: int64 ids for logits [B, V] and one uniform in
    [0, 1) per row (what the kernel draws with `ep.ops.sample.rng_at`). For tests and for aligning
    the float64 reference (`ep.sampling.sample`) with the device."""
    values = np.asarray(logits, dtype=np.float32)
    out = np.empty(values.shape[0], dtype=np.int64)
    scale = float(2**FIXED_POINT_BITS)
    for b, row in enumerate(values):
        order = np.argsort(-row, kind="stable")  # value descending, index ascending
        scaled = row.astype(np.float64)[order] / temperature
        weights = np.rint(np.exp(scaled - scaled[0]) * scale).astype(np.uint64)
        count = top_k if 0 < top_k < row.size else row.size
        weights = weights[:count]
        if top_p < 1.0:
            target = max(1, math.ceil(top_p * float(weights.sum(dtype=np.uint64))))
            reach = int(np.searchsorted(np.cumsum(weights, dtype=np.uint64), target, "left"))
            count = min(count, reach + 1)
        kept = weights[:count]
        if min_p > 0.0:
            kept = np.where(kept.astype(np.float64) >= min_p * scale, kept, np.uint64(0))
        cdf = np.cumsum(kept, dtype=np.uint64)
        total = int(cdf[-1])
        target = min(math.floor(float(uniforms[b]) * float(total)) + 1, total)
        out[b] = order[int(np.searchsorted(cdf, target, "left"))]
    return out
