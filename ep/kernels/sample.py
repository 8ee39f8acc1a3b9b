"""Token sampling on the device: the logits never leave it, only one int64 id per row does.

``sample_argmax_<dt>`` (greedy): blocks of 512 threads over `ARGMAX_SPAN` entries of a row each;
each thread keeps the best ``(value, index)`` of its strided elements as one 64-bit key
(order-preserving bits of the float above, ``~index`` below), then a warp-shuffle and
shared-memory max. The largest key is the largest value with the lowest index, which is exactly
``np.argmax`` (NaN ranks first, as NumPy's does; -0.0 ties with +0.0). The blocks of a row meet in
a per-row scratch (`argmax_scratch`): each block's best key goes in by atomicMax (exact, and
independent of the order blocks finish), and the last block to arrive writes the id and zeroes
the scratch for the next launch.

``sample_topp_<dt>`` (temperature, top-k, top-p, min-p): blocks of 512 threads over a share of a
row each (`ARGMAX_SPAN` entries, longer where a batch's blocks would not fit on the device at
once: `sample_grid`), launched cooperatively, so all of a row's blocks run together and meet at
barriers in the row's scratch (`sample_scratch`).

*The random number* is the reference's own: ``ep.ops.sample`` draws ``rng_at(key, step).random()``,
i.e. NumPy's ``SeedSequence(key)`` → ``PCG64`` advanced by ``step`` draws → ``random()``. Thread 0
of a row's first block runs that very algorithm (SeedSequence's hash mixing, PCG64's 128-bit LCG,
its jump-ahead, the XSL-RR output, the 53-bit double), so the kernel and the NumPy reference draw
bit-identical uniforms from the same ``rng_keys`` and ``steps`` inputs, with no state kept
between calls. ``advance_steps`` makes the kernel add 1 to ``steps[b]`` after drawing, so a
captured decode step replays with fresh numbers.

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
pass's histogram, so no pass only sums. Each pass, every block of the row histograms its share in
shared memory and adds its non-empty bins to the row's histogram in the scratch; after a barrier
every block reads the whole histogram back and picks the same digit (warp 0: a scan over lanes of
8 digits each), so no block waits for another's decision. The ids equal the reference's except
when the uniform lands within ~2^-43 of the kept mass of a boundary between two tokens (weights
below 2^-44 of the top token count as 0); `sample_fixed_point` is the NumPy twin of this
arithmetic, for tests.

Cost, measured on the H200 at V = 151936: greedy, a graph of the one kernel 5.6 µs at batch 1 and
8.8 at 16, mostly the graph launch (one block a row took 23 µs). Sampling with one block a row
took about 0.4 to 1.3 ms, re-reading the row once per digit pass on one SM;
`tools/bench_sampling.py` measures the kernel as it is now, against the argmax and NumPy in the
same run (docs/benchmarks/native.md, "The sampling kernel").

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
    "ARGMAX_KEYS",
    "FIXED_POINT_BITS",
    "MAX_SAMPLE_VOCAB",
    "SAMPLE_SCRATCH_WORDS",
    "argmax",
    "argmax_scratch",
    "sample",
    "sample_fixed_point",
    "sample_grid",
    "sample_scratch",
]

FIXED_POINT_BITS = 43  # weight of the top candidate: 2**43
MAX_SAMPLE_VOCAB = 1 << 20  # keeps the sum of weights below 2**63
MAX_KEY_WORDS = 16
_SCRATCH_HEADER = 8  # a row's scratch for sampling: 8 words of state, then 3 histograms of
_SCRATCH_HIST = 3 * 256  # weights, counts and lone keys of 256 digits each (the kernel's S_*)
SAMPLE_SCRATCH_WORDS = _SCRATCH_HEADER + 3 * _SCRATCH_HIST
# Both kernels: blocks of 512 threads, each over 8 elements a thread of a row (one load round), so
# the 151936-entry vocabulary of a Qwen2.5 row is 38 blocks, not one block walking it 149 times.
# Sampling takes fewer, longer spans where a batch's blocks would not all fit on the device at
# once (its blocks wait for each other).
_THREADS = 512
ARGMAX_SPAN = _THREADS * 8

# The argmax's keys, also the persistent stack kernel's (ep.kernels.stack)
ARGMAX_KEYS = r"""
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
"""

_KEYS = (
    ARGMAX_KEYS
    + r"""
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
)

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
""".replace("ARGMAX_THREADS", str(_THREADS))
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

// A row's scratch (uint64 words, `sample_scratch`): the blocks of a row meet there. Every launch
// leaves it as it found it (zeros but the barrier's counter and epoch).
#define S_COUNTER 0   // barrier arrivals of the row's blocks, ever growing
#define S_EPOCH 1     // the counter when the last launch ended: this launch's barriers count on
#define S_BEST 2      // the row's largest (value, index) key (atomicMax)
#define S_NAN 3       // a NaN logit was seen (atomicOr)
#define S_UNIFORM 4   // the row's uniform, as double bits (block 0)
#define S_BAD_KEY 5   // a negative key word or step (block 0)
#define S_DEPARTED 6  // blocks done with this launch: the last one resets the scratch
#define S_HIST SCRATCH_HEADER  // three histograms [w 256][c 256][k 256], round robin by the passes
#define S_HIST_WORDS SCRATCH_HIST
#define S_WORDS (S_HIST + 3 * S_HIST_WORDS)
#define SAMPLE_CACHED 8  // a block's share of at most 8 elements a thread stays in registers

static __device__ __forceinline__ u64 load_acquire(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

// The blocks of one row: where they meet and where this block's elements are.
struct RowGrid {
    u64* st;       // the row's scratch
    u64 epoch;     // S_EPOCH at launch
    u32 parts;     // blocks of the row
    u32 barriers;  // barriers passed so far this launch
    u32 passes;    // histograms used so far this launch
    i64 start, len;  // this block's elements [start, start + len) of the row

    // Every block of the row arrives here before any leaves; what each wrote to global memory
    // before is visible to all after (the pattern of a cooperative grid sync, per row).
    __device__ void barrier() {
        ++barriers;
        const u64 target = epoch + (u64)barriers * parts;
        __syncthreads();  // the block's writes happen before thread 0's release
        if (threadIdx.x == 0) {
            asm volatile("red.release.gpu.global.add.u64 [%0], 1;" ::"l"(st + S_COUNTER)
                         : "memory");
            while (load_acquire(st + S_COUNTER) < target) __nanosleep(32);
        }
        __syncthreads();  // and the others' writes before the whole block's reads
    }
};

// The first element in descending key order, among those with key >= lower and weight >= min_w,
// at which the running weight (1 per element unless `mass`) reaches the target; 0 if it never
// does. Each 8-bit digit pass: every block histograms its elements in shared memory, adds its
// non-empty bins to the row's histogram of the pass, meets the others, reads the whole histogram
// back and picks the digit itself (all blocks pick the same one from the same sums).
static __device__ u64 select_first(RowGrid& rg, const T* row, bool cached,
                                   const float (&cache)[SAMPLE_CACHED], double temperature,
                                   double top, bool mass, u64 lower, double min_w,
                                   int target_mode, u64 target, double fraction, u64* hist_w,
                                   u32* hist_c, u64* hist_k, Pick* pick) {
    u64 prefix = 0, above = 0;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const i64 first = (i64)warp * 32;
    const i64 len = rg.len;
    const T* part = row + rg.start;
    for (int shift = 56; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) {
            hist_w[i] = 0ull;
            hist_c[i] = 0u;
        }
        __syncthreads();
        const u64 known = shift == 56 ? 0ull : (~0ull << (shift + 8));
        const i64 stride = blockDim.x;
        // Element i of the block's share (value v) into the histogram; every lane of a warp calls
        // it together (lanes past the share with i >= len).
        auto tally = [&](float v, i64 i) {
            unsigned digit = 256u;  // 256: not counted
            u64 w = 0ull, k = 0ull;
            if (i < len) {
                k = composite(v, rg.start + i);
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
            if (!__any_sync(0xffffffffu, digit < 256u)) return;
            const unsigned peers = __match_any_sync(0xffffffffu, digit);
            const int n = __popc(peers);
            u64 sum = (u64)n;
            if (mass) {  // weights are < 2^44: 22-bit halves keep 32 lanes' sums in 32 bits
                const unsigned lo = __reduce_add_sync(peers, (unsigned)(w & 0x3fffffull));
                const unsigned hi = __reduce_add_sync(peers, (unsigned)(w >> 22));
                sum = ((u64)hi << 22) + (u64)lo;
            }
            if (digit < 256u) {
                if (n == 1) hist_k[digit] = k;  // read only when the whole row has one
                if (lane == __ffs(peers) - 1) {
                    atomicAdd(&hist_w[digit], sum);
                    atomicAdd(&hist_c[digit], (u32)n);
                }
            }
        };
        if (cached) {  // the share is in registers since the max: element threadIdx.x + j * stride
#pragma unroll
            for (int j = 0; j < SAMPLE_CACHED; ++j) {
                if (first + j * stride < len) tally(cache[j], threadIdx.x + j * stride);
            }
        } else {
            for (i64 base = first; base < len; base += 4 * stride) {  // warp-uniform trip count
                float vals[4];
#pragma unroll
                for (int u = 0; u < 4; ++u) {  // four loads in flight before any is used
                    const i64 i = base + u * stride + lane;
                    vals[u] = i < len ? to_f32(part[i]) : 0.0f;
                }
#pragma unroll
                for (int u = 0; u < 4; ++u) tally(vals[u], base + u * stride + lane);
            }
        }
        __syncthreads();
        // The row's histogram of this pass; the one two passes on is cleared once all have met.
        u64* gw = rg.st + S_HIST + (rg.passes % 3) * S_HIST_WORDS;
        u64* gc = gw + 256;
        u64* gk = gw + 512;
        for (int d = threadIdx.x; d < 256; d += blockDim.x) {
            const u32 c = hist_c[d];
            if (c != 0u) {
                atomicAdd(reinterpret_cast<unsigned long long*>(gw + d), hist_w[d]);
                atomicAdd(reinterpret_cast<unsigned long long*>(gc + d), (u64)c);
                if (c == 1u) gk[d] = hist_k[d];  // one block's lone element: the row's if alone
            }
        }
        rg.barrier();
        if (blockIdx.x == 0) {  // every block read that one before it arrived at this barrier
            u64* old = rg.st + S_HIST + ((rg.passes + 2) % 3) * S_HIST_WORDS;
            for (int i = threadIdx.x; i < S_HIST_WORDS; i += blockDim.x) old[i] = 0ull;
        }
        ++rg.passes;
        for (int d = threadIdx.x; d < 256; d += blockDim.x) {
            hist_w[d] = __ldcg(gw + d);
            hist_c[d] = (u32)__ldcg(gc + d);
            hist_k[d] = __ldcg(gk + d);
        }
        __syncthreads();
        // Warp 0 finds the digit: lane L sums digits 255 - 8L - [0, 8), a scan over the lanes
        // gives each lane the weight above its digits, and the first lane whose digits reach the
        // target walks them. An empty digit adds nothing, so it is never the first to reach it.
        if (warp == 0) {
            u64 mine = 0ull;
#pragma unroll
            for (int j = 0; j < 8; ++j) mine += hist_w[255 - 8 * lane - j];
            if (shift == 56 && target_mode != TARGET_ABSOLUTE) {
                u64 total = mine;
#pragma unroll
                for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
                if (target_mode == TARGET_CEIL_FRACTION) {
                    const double want = ceil(fraction * (double)total);
                    target = want < 1.0 ? 1ull : (u64)want;
                } else {
                    target = (u64)floor(fraction * (double)total) + 1ull;
                    if (target > total) target = total;
                }
            }
            u64 inclusive = mine;
#pragma unroll
            for (int o = 1; o < 32; o <<= 1) {
                const u64 other = __shfl_up_sync(0xffffffffu, inclusive, o);
                if (lane >= o) inclusive += other;
            }
            const unsigned reach = __ballot_sync(0xffffffffu, above + inclusive >= target);
            if (lane == 0) {
                pick->target = target;
                pick->digit = -1;
            }
            __syncwarp();
            if (reach != 0u && lane == __ffs(reach) - 1) {
                u64 run = above + inclusive - mine;
                for (int j = 0; j < 8; ++j) {
                    const int d = 255 - 8 * lane - j;
                    if (hist_c[d] != 0u && run + hist_w[d] >= target) {
                        pick->digit = d;
                        pick->above = run;
                        pick->count = hist_c[d];
                        pick->key = hist_k[d];
                        break;
                    }
                    run += hist_w[d];
                }
            }
        }
        __syncthreads();
        target = pick->target;
        const int found = pick->digit;
        const u64 pick_above = pick->above, pick_key = pick->key;
        const u32 pick_count = pick->count;
        __syncthreads();  // pick is rewritten by the next pass
        if (found < 0) return 0ull;
        prefix |= (u64)found << shift;
        above = pick_above;
        if (pick_count == 1u) return pick_key;
    }
    return prefix;
}

// Grid (parts, rows): the blocks of row row0 + blockIdx.y take its elements [start, start + span)
// each and meet in the row's scratch; a cooperative launch, so all are resident together.
extern "C" __global__ void __launch_bounds__(SAMPLE_THREADS, 2) KERNEL(
    i64* ids, i64* steps, const T* __restrict__ logits, const i64* __restrict__ keys, i64 row0,
    i64 rows, i64 vocab, i64 row_stride, int key_words, double temperature, i64 top_k, double top_p,
    double min_p, int advance, u64* scratch, i64 span, u32* status) {
    __shared__ u64 reduce[32];
    __shared__ u64 hist_w[256];
    __shared__ u32 hist_c[256];
    __shared__ u64 hist_k[256];
    __shared__ Pick pick;
    __shared__ int last;
    if ((i64)blockIdx.y >= rows) return;  // the whole row's blocks: none waits for it
    const i64 b = row0 + blockIdx.y;
    const T* row = logits + b * row_stride;
    RowGrid rg;
    rg.st = scratch + b * S_WORDS;
    rg.epoch = __ldcg(rg.st + S_EPOCH);
    rg.parts = gridDim.x;
    rg.barriers = 0;
    rg.passes = 0;
    rg.start = (i64)blockIdx.x * span;
    rg.len = rg.start < vocab ? min(span, vocab - rg.start) : 0;
    if (blockIdx.x == 0 && threadIdx.x == 0) {  // the row's uniform, beside the other threads' max
        const i64* key = keys + b * key_words;
        const i64 step = steps[b];
        bool ok = step >= 0;
        for (int w = 0; w < key_words; ++w) ok = ok && key[w] >= 0;
        rg.st[S_BAD_KEY] = ok ? 0ull : 1ull;
        rg.st[S_UNIFORM] = (u64)__double_as_longlong(ok ? numpy_random(key, key_words, step) : 0.0);
        if (!ok) set_fault(status, 64u);  // KernelFault.SAMPLE_KEY
        else if (advance) steps[b] = step + 1;
    }
    u64 best = 0;
    int nan_seen = 0;
    auto see = [&](float v, i64 i) {
        nan_seen |= v != v;
        const u64 k = composite(v, rg.start + i);
        best = k > best ? k : best;
    };
    const bool cached = rg.len <= SAMPLE_CACHED * (i64)blockDim.x;
    float cache[SAMPLE_CACHED];
    if (cached) {
#pragma unroll
        for (int j = 0; j < SAMPLE_CACHED; ++j) {
            const i64 i = threadIdx.x + (i64)j * blockDim.x;
            cache[j] = i < rg.len ? to_f32(row[rg.start + i]) : 0.0f;
        }
#pragma unroll
        for (int j = 0; j < SAMPLE_CACHED; ++j) {
            const i64 i = threadIdx.x + (i64)j * blockDim.x;
            if (i < rg.len) see(cache[j], i);
        }
    } else {
        for_each_element<8>(row + rg.start, rg.len, see);
    }
    best = block_max_u64(best, reduce);
    nan_seen = __syncthreads_or(nan_seen);
    if (threadIdx.x == 0) {
        atomicMax(reinterpret_cast<unsigned long long*>(rg.st + S_BEST), (unsigned long long)best);
        if (nan_seen) atomicOr(reinterpret_cast<unsigned long long*>(rg.st + S_NAN), 1ull);
    }
    rg.barrier();
    best = __ldcg(rg.st + S_BEST);
    const bool bad_key = __ldcg(rg.st + S_BAD_KEY) != 0ull;
    const double uniform = __longlong_as_double((long long)__ldcg(rg.st + S_UNIFORM));
    const double top = (double)to_f32(row[index_of(best)]) / temperature;
    if (bad_key || __ldcg(rg.st + S_NAN) != 0ull || !isfinite(top)) {
        if (blockIdx.x == 0 && threadIdx.x == 0) {
            if (!bad_key) set_fault(status, 32u);  // KernelFault.SAMPLE_LOGITS
            ids[b] = index_of(best);
        }
    } else {
        // One cut: the first element (in descending key order) where the running weight
        // reaches the target, among the keys >= lower (and weights >= min_w).
        auto cut = [&](bool mass, u64 lower, double min_w, int mode, u64 target, double fraction) {
            return select_first(rg, row, cached, cache, temperature, top, mass, lower, min_w, mode,
                                target, fraction, hist_w, hist_c, hist_k, &pick);
        };
        u64 lower = 0ull;  // candidates: key >= lower
        if (top_k > 0 && top_k < vocab) {
            lower = cut(false, 0ull, 0.0, TARGET_ABSOLUTE, (u64)top_k, 0.0);
        }
        if (top_p < 1.0) {
            const u64 at = cut(true, lower, 0.0, TARGET_CEIL_FRACTION, 0ull, top_p);
            if (at != 0ull) lower = at;
        }
        const double min_w = min_p > 0.0 ? min_p * FIX_SCALE : 0.0;
        const u64 chosen = cut(true, lower, min_w, TARGET_FLOOR_FRACTION, 0ull, uniform);
        if (blockIdx.x == 0 && threadIdx.x == 0) ids[b] = index_of(chosen != 0ull ? chosen : best);
    }
    // The last block of the row to finish leaves the scratch as this launch found it.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence();
        last = atomicAdd(reinterpret_cast<unsigned long long*>(rg.st + S_DEPARTED), 1ull) + 1 ==
               rg.parts;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = threadIdx.x; i < 3 * S_HIST_WORDS; i += blockDim.x) rg.st[S_HIST + i] = 0ull;
    if (threadIdx.x == 0) {
        rg.st[S_BEST] = rg.st[S_NAN] = rg.st[S_BAD_KEY] = rg.st[S_UNIFORM] = 0ull;
        rg.st[S_DEPARTED] = 0ull;
        rg.st[S_EPOCH] = rg.epoch + (u64)rg.barriers * rg.parts;
    }
}
""".replace("SAMPLE_THREADS", str(_THREADS))
    .replace("SCRATCH_HEADER", str(_SCRATCH_HEADER))
    .replace("SCRATCH_HIST", str(_SCRATCH_HIST))
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
    row0: np.int64,
    rows: np.int64,
    vocab: np.int64,
    row_stride: np.int64,
    key_words: np.int32,
    temperature: np.float64,
    top_k: np.int64,
    top_p: np.float64,
    min_p: np.float64,
    advance: np.int32,
    scratch: np.ndarray,
    span: np.int64,
    status: np.ndarray,
) -> None:
    """Rows row0 .. row0 + rows - 1; the scratch is where the kernel's blocks meet, which the
    twin does not need."""
    words, first, n = int(key_words), int(row0), int(rows)
    values = _rows(logits[first * int(row_stride) :], n, int(vocab), int(row_stride))
    row_keys = keys[first * words : (first + n) * words].reshape(n, words)
    for r in range(n):
        b = first + r
        step = int(steps[b])
        key_ok = step >= 0 and int(row_keys[r].min(initial=0)) >= 0
        with np.errstate(over="ignore", invalid="ignore"):
            top = np.float64(values[r].max()) / float(temperature)
        if not key_ok or np.isnan(values[r]).any() or not np.isfinite(top):
            set_fault(status, KernelFault.SAMPLE_KEY if not key_ok else KernelFault.SAMPLE_LOGITS)
            ids[b] = int(np.argmax(values[r]))
            continue
        ids[b] = ref.sample(
            values[r : r + 1],
            row_keys[r : r + 1],
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
    "i64* i64* T* i64* i64 i64 i64 i64 i32 f64 i64 f64 f64 i32 u64* i64 u32*",
    _sample_cpu,
    cooperative=True,
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


def sample_scratch(dev: Device, batch: int, *, stream: Stream) -> Buffer:
    """Scratch for `sample` over ``batch`` rows: uint64 [batch, `SAMPLE_SCRATCH_WORDS`], where a
    row's blocks meet (a barrier counter, the row's max and histograms). Every launch leaves it
    ready for the next, so one serves every call on one stream (not two streams at once)."""
    positive("Sample", batch=batch)
    scratch = dev.alloc((batch, SAMPLE_SCRATCH_WORDS), np.uint64, stream=stream,
                        name="sample-scratch")  # fmt: skip
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
        (parts, batch), _THREADS, ids, logits, batch, vocab, stride, scratch, ARGMAX_SPAN,
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
    scratch: Buffer | None = None,
    status: Buffer,
    stream: Stream,
) -> None:
    """The ``Sample`` op: one int64 id per row of logits [batch, vocab] (rows ``row_stride``
    apart), with `ep.sampling` semantics and the reference's random numbers.

    ``rng_keys`` int64 [batch, words] and ``steps`` int64 [batch] are the op's inputs (each row's
    generator entropy and the draws it made before); greedy (temperature 0) reads neither and may
    pass None. ``advance_steps`` adds 1 to each row's step after drawing (for captured replays).
    A row is shared out over several blocks that meet in ``scratch`` (`sample_scratch`); pass
    one that lives as long as the caller's buffers (a captured loop must), or None for a fresh
    one for this call.
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
    if scratch is None:
        scratch = sample_scratch(dev, batch, stream=stream)
    check_buffer(op, "scratch", scratch, batch * SAMPLE_SCRATCH_WORDS, np.dtype(np.uint64))
    kernel = dev.kernel(SAMPLE_KERNELS[suffix].name)
    for row0, rows, parts, span in sample_grid(kernel.resident_blocks(_THREADS), batch, vocab):
        kernel.launch(
            (parts, rows),
            _THREADS,
            ids, steps, logits, rng_keys, row0, rows, vocab, stride, words,
            float(temperature), int(top_k), float(top_p), float(min_p), int(advance_steps),
            scratch, span, status,
            stream=stream,
        )  # fmt: skip


def sample_grid(resident: int, batch: int, vocab: int) -> list[tuple[int, int, int, int]]:
    """The sampling kernel's launches: (first row, rows, blocks a row, entries a block) each.
    Its blocks wait for each other, so a launch holds at most ``resident`` blocks (what the
    device runs at once): a row takes up to one block per `ARGMAX_SPAN` entries, fewer when the
    batch needs the room, and a batch of more rows than that is sampled in several launches."""
    need(resident >= 1, "Sample", "the sampling kernel cannot run a single block on this device")
    per_launch = min(batch, resident, 65535)
    launches = []
    for row0 in range(0, batch, per_launch):
        rows = min(per_launch, batch - row0)
        parts = max(1, min(-(-vocab // ARGMAX_SPAN), resident // rows))
        launches.append((row0, rows, parts, -(-vocab // parts)))
    return launches


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
