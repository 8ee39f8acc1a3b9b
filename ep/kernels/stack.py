"""A decoder stack's whole decode step as one persistent kernel: ``ep_stack_bf16`` (sm_90a,
bf16, one sequence): the native backend's fused decode step (`ep.native.fused`).

The native executor runs a decode step of the 0.5B benchmark model as about 170 dependent
launches; under programmatic dependent launch each still costs 2-3 µs from launch to finish on
the H200, which keeps that step at 0.68 ms against a 0.24 ms weight-bandwidth floor
(docs/benchmarks/native.md). This kernel runs every layer of a Llama/Qwen2-style decoder
(RMSNorm; the QKV projection with its bias and rotary embedding; the KV commit; attention; the
O projection and the residual; RMSNorm; gate/up with SwiGLU; down and the residual), the final
norm and a tied or untied head in one cooperative launch of one block an SM:

- **Weights stream independently of the data.** Each block owns fixed output columns of every
  projection (`block_columns`: a rotation pair of q/k, or gate j with up j, stay in one block);
  `pack_stack` lays a block's columns out contiguously in the order it uses them, and one
  producer thread copies the block's stream, a chunk of whole columns at a time
  (``cp.async.bulk`` completing on an mbarrier), into a ring of shared memory (what the block
  has left, about 195 KB), limited only by free space: the next projections' weights arrive
  while the block waits for its inputs. The head's rows are streamed straight from the
  embedding table ([vocab, hidden] is already column-major for the head).
- **Blocks exchange values as tagged words** (the LL protocol of NCCL): a bf16 value and a 16-bit
  tag (the launch's epoch and the layer) in one 32-bit store; a reader polls the words it needs
  until each carries the tag it waits for. No fence, no counter, no second load: on the H200
  this took the step from 0.58 to 0.53 ms against counters with release/acquire.
- Every block normalises the residual row for itself (hidden elements from L2); attention runs
  on one block a query head, which loads the cached positions' keys and values before its
  inputs arrive, or past `StackTuning.split` positions on `attention_splits` blocks a head, each
  over a share of the positions, one of which merges their results (so a context may run to
  `max_positions`: `SCORES` a block); the head's logits are stored as bf16 values (float32).
- With ``tokens`` and a picking flag on the device (`StackIO`), the launch also takes the
  greedy pick of a device token loop (up to `PICK_MASK` ids masked first): each block's best
  (logit, index) key meets the others' by atomicMax, and the last block to arrive writes the id
  as the next input and into ``tokens``, and moves the position on: a loop step is one launch.

Values are rounded to bf16 where the op-per-launch graph rounds them (each op's output), so the
step is that graph's up to summation order: `reference_step` is the NumPy form (float32 sums),
and on the benchmark model the kernel's logits are as far from it as the native executor's
(tools/bench_stack.py). On the CPU device the launch runs that reference (the kernel's NumPy
twin), so `StackStep` and its tests run without a GPU. The KV cache is the caller's, through
an address table and strides (`StackIO`); by default the step's own,
[layer][kv head][capacity][head_dim] bf16, filled position by position.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ep.device import Buffer, CompileOptions, Device, KernelSource, Stream
from ep.errors import KernelArgumentError
from ep.kernels._common import PRELUDE, SILU_MUL, KernelFault, set_fault
from ep.kernels.sample import ARGMAX_KEYS

__all__ = [
    "PICK_MASK",
    "StackIO",
    "StackShape",
    "StackStep",
    "StackTuning",
    "attention_splits",
    "block_columns",
    "cache_views",
    "default_chunk",
    "kv_addresses",
    "max_positions",
    "pack_stack",
    "reference_step",
    "shared_bytes",
    "stack_kernel",
    "unpack_stack",
]

BF16 = np.dtype(ml_dtypes.bfloat16)
CW = 8  # consumer warps; one more warp produces
SLOTS = 32  # the most chunks in flight (mbarrier pairs)
SCORES = 2048  # positions one attention pass holds in shared memory (a block's share of them)
PICK_MASK = 32  # the most ids a picking launch masks
MAX_SPLITS = 16  # the most blocks one head's attention is split over
SHARED = 232448  # the most shared memory a block may have on sm_90 (227 KiB)
TRACE_STAMPS = 32  # global-timer stamps a layer and block (tools/bench_stack.py --trace)


@dataclass(frozen=True)
class StackShape:
    """A Llama/Qwen2-style decoder: rotary over the whole head (rotate-half), biased QKV."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    inter: int
    layers: int
    eps: float = 1e-6
    scale: float = 0.0  # attention's score scale; 0: 1 / sqrt(head_dim)

    @property
    def attention_scale(self) -> float:
        return self.scale or float(1.0 / np.sqrt(self.head_dim))

    @property
    def qkv(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    def stages(self) -> list[tuple[int, int, int]]:
        """Per projection: (units, columns a unit, K)."""
        return [
            (self.qkv // 2, 2, self.hidden),  # a unit: a rotation pair (i, i + head_dim / 2)
            (self.hidden, 1, self.heads * self.head_dim),
            (self.inter, 2, self.hidden),  # a unit: gate j and up j
            (self.hidden, 1, self.inter),
        ]

    def check(self, tuning: StackTuning) -> None:
        """Refuse a shape (or a tuning of it) the kernel does not handle, saying what it needs."""
        chunk, warps = tuning.chunk_bytes(self.hidden), tuning.warps
        problems = []
        if self.head_dim != 64:
            problems.append(f"head_dim {self.head_dim} (the kernel needs 64)")
        if self.heads % self.kv_heads:
            problems.append(f"{self.heads} heads over {self.kv_heads} KV heads (not a multiple)")
        if self.hidden % 8 or self.inter % 8:
            problems.append("hidden and intermediate sizes must be multiples of 8")
        if not 0 <= tuning.split <= SCORES:
            problems.append(f"split {tuning.split} (0: never, or a context length up to "
                            f"{SCORES}: one block holds an unsplit context's scores)")  # fmt: skip
        if not 1 <= warps <= 15 or tuning.min_cols < 1:
            problems.append(f"{warps} consumer warps (1 to 15) and chunks of {tuning.min_cols} "
                            "columns at least (1 or more)")  # fmt: skip
        elif self.hidden // 8 > 32 * warps:
            problems.append(f"hidden {self.hidden} above {8 * 32 * warps}")
        if 4 * self.hidden > chunk or chunk % 16:  # (long columns get chunks of their own size)
            problems.append(f"chunk {chunk} B must hold a column pair of K = hidden, in 16-byte "
                            "units")  # fmt: skip
        if problems:
            raise KernelArgumentError(f"persistent stack: {self} is not supported: "
                                      + "; ".join(problems))  # fmt: skip


def default_chunk(shape: StackShape, warps: int = CW) -> int:
    """A chunk of ``warps`` columns of K = hidden (one a warp), or one column of the down
    projection: the fastest of the sizes measured on the H200 (docs/benchmarks/native.md)."""
    return max(warps * 2 * shape.hidden, 2 * shape.inter)


@dataclass(frozen=True)
class StackTuning:
    """How the kernel splits a block's work (defaults: the fastest measured on the H200).

    ``warps``: consumer warps a block (one more produces); ``chunk``: bytes of a ring chunk
    (whole columns; 0: `default_chunk`); ``min_cols``: columns a chunk holds at least, so long
    columns (K = intermediate: the down projection) come several a chunk, in a bigger one;
    ``poll``: how a block waits for the values of other blocks (< 0: it reloads all of them each
    round; 0: only those not yet arrived; > 0: that, sleeping ``poll`` ns between rounds);
    ``kv_l2``: an attention block asks its layer's cached keys and values into L2 as the layer
    starts (1), or reads them from memory when attention comes (0). None of these changes a
    bit. ``split``: from a context of more than ``split`` positions, each head's attention is
    split over `attention_splits` blocks, whose partial results one of them merges (0: never);
    that changes the sums' order, and so the bits, of those positions only."""

    warps: int = CW
    chunk: int = 0
    min_cols: int = 4
    poll: int = 0
    kv_l2: int = 1
    split: int = 128

    def resolved(self, shape: StackShape) -> StackTuning:
        return dataclasses.replace(self, chunk=self.chunk or default_chunk(shape, self.warps))

    def chunk_bytes(self, k: int) -> int:
        """A chunk's bytes for columns of ``k`` (the kernel's ``chunk_bytes<K>``)."""
        return self.chunk if self.chunk // (2 * k) >= self.min_cols else 2 * k * self.min_cols

    def largest_chunk(self, shape: StackShape) -> int:
        return max(self.chunk_bytes(k) for k in (shape.hidden, shape.heads * shape.head_dim,
                                                 shape.inter))  # fmt: skip


def attention_splits(shape: StackShape, blocks: int) -> int:
    """Blocks a head's attention is split over past `StackTuning.split`: as many as the grid
    has for every head, at most `MAX_SPLITS` (1: too few blocks to split)."""
    return max(1, min(blocks // shape.heads, MAX_SPLITS))


def max_positions(shape: StackShape, blocks: int, tuning: StackTuning) -> int:
    """The longest context a launch takes (positions 0 .. n - 1): `SCORES`, or `SCORES` a share
    where attention splits (`StackTuning.split`)."""
    splits = attention_splits(shape, blocks)
    return SCORES * splits if tuning.split > 0 and splits > 1 else SCORES


def _range(units: int, b: int, blocks: int) -> tuple[int, int]:
    return units * b // blocks, units * (b + 1) // blocks


def block_columns(shape: StackShape, blocks: int) -> list[list[np.ndarray]]:
    """[block][projection] → the weight columns the block owns, in the order it stores them."""
    half = shape.head_dim // 2
    out = []
    for b in range(blocks):
        per = []
        for s, (units, _, _) in enumerate(shape.stages()):
            u = np.arange(*_range(units, b, blocks))
            if s == 0:
                a = (u // half) * shape.head_dim + u % half
                cols = np.stack([a, a + half], 1).reshape(-1)
            elif s == 2:
                cols = np.stack([u, u + shape.inter], 1).reshape(-1)
            else:
                cols = u
            per.append(cols)
        out.append(per)
    return out


PROJECTIONS = ("qkv", "o", "gate_up", "down")


def pack_stack(
    shape: StackShape, layers: list[dict[str, np.ndarray]], blocks: int
) -> tuple[np.ndarray, np.ndarray]:
    """The blocks' weight streams (bf16 bits, one array) and each block's start in bytes.

    ``layers[l]``: ``qkv`` [hidden, qkv], ``o`` [heads * head_dim, hidden], ``gate_up``
    [hidden, 2 inter] (gate half first), ``down`` [inter, hidden], all [K, N] bf16."""
    cols = block_columns(shape, blocks)
    parts, starts, offset = [], [], 0
    for b in range(blocks):
        starts.append(offset)
        for layer in layers:
            for s, name in enumerate(PROJECTIONS):
                w = np.ascontiguousarray(np.asarray(layer[name], BF16)[:, cols[b][s]].T)
                parts.append(w.view(np.uint16).reshape(-1))
                offset += w.nbytes
    return np.concatenate(parts), np.asarray(starts, np.uint64)


def _resmax(shape: StackShape, blocks: int, t: StackTuning) -> int:
    """Sums a block keeps for one projection (its gate/up columns) or one batch of head rows
    (at least a chunk's)."""
    h = shape.hidden
    return max(2 * (-(-shape.inter // blocks)) + 2, t.chunk_bytes(h) // (2 * h))


def _cuda(shape: StackShape, blocks: int, t: StackTuning, ring: int) -> str:
    defines = {
        "H": shape.hidden, "NH": shape.heads, "NKV": shape.kv_heads, "HD": shape.head_dim,
        "INTER": shape.inter, "L": shape.layers, "NB": blocks, "CHUNK": t.chunk,
        "MIN_COLS": t.min_cols, "SLOTS": SLOTS, "RING": ring, "CW": t.warps, "SCORES": SCORES,
        "RESMAX": _resmax(shape, blocks, t), "TRACE_STAMPS": TRACE_STAMPS, "POLL": t.poll,
        "PICK_MASK": PICK_MASK, "KV_L2": t.kv_l2, "SPLIT_AT": t.split,
        "SMAX": attention_splits(shape, blocks), "MAXPOS": max_positions(shape, blocks, t),
    }  # fmt: skip
    head = "".join(f"#define {k} {v}\n" for k, v in defines.items())
    scale = float(np.float32(shape.attention_scale))
    head += f"#define EPS {float(shape.eps)!r}f\n#define SCALE {scale!r}f\n"
    return head + PRELUDE + SILU_MUL + ARGMAX_KEYS + _SOURCE


_SOURCE = r"""
typedef unsigned char u8;
typedef __nv_bfloat16 bf16;

#define NQKV ((NH + 2 * NKV) * HD)
#define KO (NH * HD)
#define XMAX (INTER > H ? INTER : H)
#define OWNMAX ((H + NB - 1) / NB + 1)
#define CT (CW * 32)
static_assert(H % 8 == 0 && KO % 8 == 0 && INTER % 8 == 0 && HD == 64, "shape");
static_assert(H / 8 <= CT, "a 16-byte unit of the hidden row a consumer thread");
static_assert((NQKV / 2 + NB - 1) / NB <= CT, "a block's QKV units, one a consumer thread");

static __device__ __forceinline__ float rbf(float v) {
    return __bfloat162float(__float2bfloat16_rn(v));
}
static __device__ __forceinline__ void unpack8(const uint4& w, float* f) {
    const __nv_bfloat162* p = reinterpret_cast<const __nv_bfloat162*>(&w);
#pragma unroll
    for (int e = 0; e < 4; ++e) {
        const float2 v = __bfloat1622float2(p[e]);
        f[2 * e] = v.x;
        f[2 * e + 1] = v.y;
    }
}
static __device__ __forceinline__ float dot8(const uint4& w, const float* x) {
    float f[8];
    unpack8(w, f);
    float acc = 0.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc = fmaf(f[e], x[e], acc);
    return acc;
}

// --- values exchanged between blocks: a bf16 and its tag in one 32-bit word ---------------
// A word is (tag << 16) | bf16 bits, stored with one relaxed store; a reader polls the words it
// needs until each carries the tag of the layer it waits for. The data is its own flag: no
// fence, no counter, no second load (the LL protocol of NCCL). Tags are 1 + (epoch * L + layer)
// mod 65535, so a word's previous value (the layer before) never carries the awaited tag, nor
// does fresh zeroed memory. Every word is written once a layer, and its next write depends on
// every reader of this one having read it (each stage reads all of the stage before).
static __device__ __forceinline__ void st_tag(u32* p, float v, u32 tag) {
    const u32 w = (tag << 16) | (u32)__bfloat16_as_ushort(__float2bfloat16_rn(v));
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" :: "l"(p), "r"(w) : "memory");
}
static __device__ __forceinline__ uint4 ld_tagged(const u32* p) {
    uint4 v;
    asm volatile("ld.relaxed.gpu.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p) : "memory");
    return v;
}
// A float32 and a 32-bit tag in one 64-bit word (a split attention's partial results, which
// need more than bf16): the same protocol, with tags that do not wrap (``ptag`` in the layer
// loop: 1 + epoch L + layer), because these words are written only by launches that split, so
// a reader may meet one from any launch before.
static __device__ __forceinline__ void st_tag64(u64* p, float v, u32 tag) {
    const u64 w = ((u64)tag << 32) | (u64)__float_as_uint(v);
    asm volatile("st.relaxed.gpu.global.u64 [%0], %1;" :: "l"(p), "l"(w) : "memory");
}
static __device__ __forceinline__ u64 ld_tagged64(const u64* p) {
    u64 v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
static __device__ __forceinline__ bool has_tag(const uint4& v, u32 tag) {
    return (v.x >> 16) == tag && (v.y >> 16) == tag && (v.z >> 16) == tag && (v.w >> 16) == tag;
}
static __device__ __forceinline__ void untag(const uint4& v, float* f) {
    f[0] = __uint_as_float(v.x << 16);
    f[1] = __uint_as_float(v.y << 16);
    f[2] = __uint_as_float(v.z << 16);
    f[3] = __uint_as_float(v.w << 16);
}
// xs[0..N) = the N tagged values at src once all carry ``tag`` (every consumer thread; the
// caller's barrier publishes xs)
// POLL < 0: every round reloads all of a thread's words; else only those not yet tagged, with
// a __nanosleep(POLL) between rounds when POLL > 0 (less traffic on the words being written).
template <int N>
static __device__ __forceinline__ void gather(const u32* src, u32 tag, float* xs, int tid) {
    constexpr int U = N / 4, PER = (U + CT - 1) / CT;
    static_assert(PER <= 32, "a thread's words as bits of one mask");
    uint4 v[PER];
    if (POLL < 0) {
        bool ok;
        do {
            ok = true;
#pragma unroll
            for (int j = 0; j < PER; ++j) {
                const int i = tid + j * CT;
                if (i < U) {
                    v[j] = ld_tagged(src + 4 * i);
                    ok &= has_tag(v[j], tag);
                }
            }
        } while (!ok);
    } else {
        u32 pending = 0u;
#pragma unroll
        for (int j = 0; j < PER; ++j)
            if (tid + j * CT < U) pending |= 1u << j;
        while (true) {  // a round's loads all issued before any of them is checked
#pragma unroll
            for (int j = 0; j < PER; ++j)
                if (pending & (1u << j)) v[j] = ld_tagged(src + 4 * (tid + j * CT));
            u32 still = 0u;
#pragma unroll
            for (int j = 0; j < PER; ++j)
                if ((pending & (1u << j)) && !has_tag(v[j], tag)) still |= 1u << j;
            pending = still;
            if (pending == 0u) break;
            if (POLL > 0) __nanosleep((unsigned)POLL);
        }
    }
#pragma unroll
    for (int j = 0; j < PER; ++j) {
        const int i = tid + j * CT;
        if (i < U) untag(v[j], xs + 4 * i);
    }
}


// the consumer warps' barrier (the producer warp never joins it)
static __device__ __forceinline__ void cbar() {
    asm volatile("bar.sync 1, %0;" :: "n"(CT) : "memory");
}
static __device__ float csum(float v, float* scratch, int tid) {
    v = warp_sum(v);
    cbar();
    if ((tid & 31) == 0) scratch[tid >> 5] = v;
    cbar();
    float t = 0.0f;
#pragma unroll
    for (int w = 0; w < CW; ++w) t += scratch[w];
    return t;
}
static __device__ float cmax(float v, float* scratch, int tid) {
    v = warp_max(v);
    cbar();
    if ((tid & 31) == 0) scratch[tid >> 5] = v;
    cbar();
    float t = scratch[0];
#pragma unroll
    for (int w = 1; w < CW; ++w) t = fmaxf(t, scratch[w]);
    return t;
}

// --- the weight ring ------------------------------------------------------------------------
static __device__ __forceinline__ u32 sa(const void* p) { return (u32)__cvta_generic_to_shared(p); }
static __device__ __forceinline__ void mbar_init(u64* b, u32 n) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" :: "r"(sa(b)), "r"(n) : "memory");
}
static __device__ __forceinline__ void mbar_expect(u64* b, u32 bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;"
                 :: "r"(sa(b)), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void mbar_arrive(u64* b) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" :: "r"(sa(b)) : "memory");
}
static __device__ __forceinline__ void mbar_wait(u64* b, u32 parity) {
    u32 ok;
    do {
        asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     " selp.u32 %0, 1, 0, p;\n}\n" : "=r"(ok) : "r"(sa(b)), "r"(parity) : "memory");
    } while (!ok);
}
static __device__ __forceinline__ void prefetch_l2(const void* src, u32 bytes) {
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(src), "r"(bytes) : "memory");
}
static __device__ __forceinline__ void bulk_load(void* dst, const void* src, u32 bytes, u64* b) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1], %2, [%3];"
                 :: "r"(sa(dst)), "l"(src), "r"(bytes), "r"(sa(b)) : "memory");
}

// The ring is RING bytes of shared memory holding variable-size chunks (whole columns, at most
// CHUNK bytes) in stream order; a chunk that does not fit before the end starts at 0 and claims
// the skipped tail too. Chunk g uses mbarriers g % SLOTS (full: the bulk copy's bytes arrived;
// empty: the CW consumer warps are done with it), in use (g / SLOTS) & 1. Producer and consumers
// walk the same schedule, so they agree on every chunk's place.
struct Ring {
    u8* bytes; u64* full; u64* empty;
    u32 off;  // where the next chunk would start
    u32 g;    // the next chunk's number
    // the producer's view of chunks in flight
    u32 oldest, used;
    u32* claim;  // [SLOTS] bytes each chunk in flight holds
};
static __device__ __forceinline__ u32 ring_place(Ring& r, u32 bytes, u32& claim) {
    const u32 start = r.off + bytes > RING ? 0u : r.off;
    claim = start == 0u && r.off != 0u ? RING - r.off + bytes : bytes;
    r.off = start + bytes;
    return start;
}

// a chunk of columns of K holds CHUNK bytes, or MIN_COLS columns where those are more
template <int K>
__host__ __device__ constexpr int chunk_bytes() {
    return CHUNK / (K * 2) >= MIN_COLS ? CHUNK : K * 2 * MIN_COLS;
}
template <int K, int PER>
__host__ __device__ constexpr int chunk_cols() { return (chunk_bytes<K>() / (K * 2)) / PER * PER; }

// res[c] = x . column c for the block's ncols columns of one projection, from the ring.
// Short columns (K / 8 <= 4 * 32 16-byte units): a warp takes whole columns, up to CMAX of a
// chunk at once (their loads first, then the arithmetic, then the interleaved shuffle trees),
// a lane holding its slice of x in registers. Long columns: every warp takes a K slice of each
// of the chunk's columns (x slice in registers), writes its partial sums to part[warp][column],
// and the sums are added up once after the last chunk.
static __device__ __forceinline__ u64 gtime() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
template <int K, int PER>
static __device__ void project(int ncols, const float* xs, float* res, float* part, Ring& r,
                               int warp, int lane, int tid, u64* waited = nullptr) {
    constexpr int CPC = chunk_cols<K, PER>();
    constexpr int V = K / 8;
    constexpr bool SHORT = V <= 4 * 32;
    constexpr int CMAX = SHORT ? (CPC + CW - 1) / CW : CPC;  // columns a warp holds at once
    constexpr int VS = SHORT ? V : (V + CW - 1) / CW;         // units of K a warp walks
    constexpr int VPL = (VS + 31) / 32;                       // units a lane walks
    const int vbase = SHORT ? 0 : warp * VS;
    const int vend = SHORT ? V : min(V, vbase + VS);
    float xr[VPL * 8];
#pragma unroll
    for (int j = 0; j < VPL; ++j) {
        const int v = vbase + lane + 32 * j;
#pragma unroll
        for (int e = 0; e < 8; ++e) xr[8 * j + e] = v < vend ? xs[8 * v + e] : 0.0f;
    }
    for (int c0 = 0; c0 < ncols; c0 += CPC) {
        const int n = min(CPC, ncols - c0);
        u32 claim;
        const u32 start = ring_place(r, (u32)n * K * 2, claim);
        const u32 slot = r.g % SLOTS;
        const u64 t0 = waited != nullptr && tid == 0 ? gtime() : 0;
        mbar_wait(&r.full[slot], (r.g / SLOTS) & 1u);
        if (waited != nullptr && tid == 0) *waited += gtime() - t0;
        const uint4* base = reinterpret_cast<const uint4*>(r.bytes + start);
        uint4 w[CMAX][VPL];
#pragma unroll
        for (int i = 0; i < CMAX; ++i) {
            const int c = SHORT ? warp + CW * i : i;
#pragma unroll
            for (int j = 0; j < VPL; ++j) {
                const int v = vbase + lane + 32 * j;
                w[i][j] = c < n && v < vend ? base[(size_t)c * V + v] : make_uint4(0, 0, 0, 0);
            }
        }
        float acc[CMAX];
#pragma unroll
        for (int i = 0; i < CMAX; ++i) {
            acc[i] = 0.0f;
#pragma unroll
            for (int j = 0; j < VPL; ++j) acc[i] += dot8(w[i][j], xr + 8 * j);
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
            for (int i = 0; i < CMAX; ++i) acc[i] += __shfl_xor_sync(0xffffffffu, acc[i], o);
        }
        __syncwarp();
        if (lane == 0) mbar_arrive(&r.empty[slot]);
        ++r.g;
        if (lane == 0) {
#pragma unroll
            for (int i = 0; i < CMAX; ++i) {
                const int c = SHORT ? warp + CW * i : i;
                if (c < n) (SHORT ? res[c0 + c] : part[warp * RESMAX + c0 + c]) = acc[i];
            }
        }
    }
    if (!SHORT) {
        cbar();
        for (int c = tid; c < ncols; c += CT) {
            float t = 0.0f;
#pragma unroll
            for (int w2 = 0; w2 < CW; ++w2) t += part[w2 * RESMAX + c];
            res[c] = t;
        }
    }
}

template <int K, int PER>
static __device__ __forceinline__ void produce(int ncols, const u8*& src, Ring& r, u64* blocked) {
    constexpr int CPC = chunk_cols<K, PER>();
    for (int c0 = 0; c0 < ncols; c0 += CPC) {
        const u32 bytes = (u32)min(CPC, ncols - c0) * K * 2;
        u32 claim;
        const u32 start = ring_place(r, bytes, claim);
        // free the oldest chunks until this one's bytes and mbarriers are free
        const u64 t0 = blocked != nullptr ? gtime() : 0;
        while (r.used + claim > RING || r.g - r.oldest == SLOTS) {
            mbar_wait(&r.empty[r.oldest % SLOTS], (r.oldest / SLOTS) & 1u);
            r.used -= r.claim[r.oldest % SLOTS];
            ++r.oldest;
        }
        if (blocked != nullptr) *blocked += gtime() - t0;
        const u32 slot = r.g % SLOTS;
        r.claim[slot] = claim;
        r.used += claim;
        mbar_expect(&r.full[slot], bytes);
        bulk_load(r.bytes + start, src, bytes, &r.full[slot]);
        src += bytes;
        ++r.g;
    }
}

// The block's columns [c0, c1) of a projection added to the residual (``own``, the block's
// columns of it), rounded as the graph's SkipRMSNorm rounds its sum, kept and stored tagged.
static __device__ __forceinline__ void add_residual(int c0, int c1, const float* res, float* own,
                                                    u32* dst, u32 tag, int tid) {
    for (int c = c0 + tid; c < c1; c += CT) {
        const float r = rbf(own[c - c0] + rbf(res[c - c0]));
        own[c - c0] = r;
        st_tag(dst + c, r, tag);
    }
}

static __device__ __forceinline__ void urange(int units, int b, int& u0, int& u1) {
    u0 = (int)((long long)units * b / NB);
    u1 = (int)((long long)units * (b + 1) / NB);
}

// xs (the gathered row, published) = bf16(rmsnorm(xs) * gamma); thread i < H / 8 owns 8
// elements and holds their gamma (``g``, loaded before the stage's inputs arrived)
static __device__ __forceinline__ uint4 gamma_of(const bf16* gamma, int tid) {
    return tid < H / 8 ? reinterpret_cast<const uint4*>(gamma)[tid] : make_uint4(0, 0, 0, 0);
}
static __device__ void norm_xs(const uint4& g, float* xs, float* scratch, int tid) {
    float f[8], ss = 0.0f;
    if (tid < H / 8) {
#pragma unroll
        for (int e = 0; e < 8; ++e) { f[e] = xs[8 * tid + e]; ss += f[e] * f[e]; }
    }
    const float inv = 1.0f / sqrtf(csum(ss, scratch, tid) / (float)H + EPS);
    if (tid < H / 8) {
        float gf[8];
        unpack8(g, gf);
#pragma unroll
        for (int e = 0; e < 8; ++e) xs[8 * tid + e] = rbf(f[e] * inv * gf[e]);
    }
    cbar();
}

// One query head over positions 0..pos of its KV head: att[h] = softmax(q k^T * SCALE) v, or
// its share of them (`Span`). The cached positions (below pos, committed by earlier launches)
// are read from the cache, the first 32 CW K rows and 4 VG CW V rows of them before the QKV
// values arrive (`Prefetch`); q and position pos's k and v come tagged from this launch's QKV
// stage. A warp reads K and V rows whole and coalesced, a group of 4 rows a load (`row_of`):
// lane l holds 8 elements (16 bytes, part l % 8) of the group's row l / 8; the 8 lanes of a K
// row add up its score, and the lanes of a part add up its share of the output.
//
// Past SPLIT_AT positions a head's attention is split over S = SMAX blocks (block b: head
// b % NH, share b / NH of the positions), each of which stores its share's max score, sum of
// exponentials and unnormalised output as float32 words (`st_tag64`); the head's share-0 block
// merges them (`merge_shares`) into att[h].
struct Span {
    int h, share, shares;  // the head, this block's share of its positions, and how many
    int t0, cached, rows;  // the share's first position, its cached rows, its rows (+ pos's)
};
static __device__ __forceinline__ Span span_of(int b, int pos) {
    const int ctx = pos + 1;
    const int shares = SPLIT_AT > 0 && SMAX > 1 && ctx > SPLIT_AT && ctx >= SMAX ? SMAX : 1;
    Span sp;
    sp.h = b % NH;
    sp.share = b / NH;
    sp.shares = shares;
    sp.t0 = (int)((long long)ctx * sp.share / shares);
    const int t1 = (int)((long long)ctx * (sp.share + 1) / shares);
    sp.rows = t1 - sp.t0;
    sp.cached = min(t1, pos) - sp.t0;
    return sp;
}
#define VG 4  // V loads a lane prefetches (a group of 4 rows each): 4 VG CW rows in all
struct Prefetch { uint4 k[8]; uint4 v[VG]; };
// the row lane holds in its warp's i-th group of 4 rows, counting from group g0: the warps
// take the groups in turn (so every warp has some of a short context)
static __device__ __forceinline__ int row_of(int g0, int i, int warp, int lane) {
    return 4 * (g0 + CW * i) + (4 * warp + (lane >> 3));
}
static __device__ __forceinline__ const uint4* row_part(const bf16* base, int t, i64 ts,
                                                        int lane) {
    return reinterpret_cast<const uint4*>(base + t * ts) + (lane & 7);
}
// o[e] += p * the 8 elements of w (a row's part)
static __device__ __forceinline__ void axpy8(float p, const uint4& w, float* o) {
    float f[8];
    unpack8(w, f);
#pragma unroll
    for (int e = 0; e < 8; ++e) o[e] = fmaf(p, f[e], o[e]);
}
// (kb, vb: the share's first row; a row r of it is position t0 + r, cached while r < cached)
static __device__ __forceinline__ void attend_prefetch(Prefetch& pf, int cached, const bf16* kb,
                                                       const bf16* vb, i64 ts, int warp,
                                                       int lane) {
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int t = row_of(0, i, warp, lane);
        if (t < cached) pf.k[i] = __ldcg(row_part(kb, t, ts, lane));
    }
#pragma unroll
    for (int j = 0; j < VG; ++j) {
        const int t = row_of(0, j, warp, lane);
        if (t < cached) pf.v[j] = __ldcg(row_part(vb, t, ts, lane));
    }
}
static __device__ void attend(Prefetch& pf, const Span& sp, const u32* qkv, u32 tag, u32 ptag,
                              const bf16* kb, const bf16* vb, i64 ts, u32* att, u64* parts,
                              float* sc, float* qs, float* kn, float* vn, float* part,
                              float* scratch, int tid, int warp, int lane, u64* tr) {
    // rows of the share: t < pos are cached, t == pos (the share that ends the context) is the
    // new one, t < ctx are the share's
    const int h = sp.h, kvh = h / (NH / NKV), pos = sp.cached, ctx = sp.rows;
    if (tid < 3 * HD / 4) {  // q, the new k, the new v: 16 words of 4 each
        const int which = tid / (HD / 4), i = tid % (HD / 4);
        const int col = (which == 0 ? h : which == 1 ? NH + kvh : NH + NKV + kvh) * HD + 4 * i;
        uint4 v;
        do { v = ld_tagged(qkv + col); } while (!has_tag(v, tag));
        float f[4];
        untag(v, f);
        float* dst = which == 0 ? qs : which == 1 ? kn : vn;
#pragma unroll
        for (int e = 0; e < 4; ++e) dst[4 * i + e] = which == 0 ? f[e] * SCALE : f[e];
    }
    cbar();
    if (tr != nullptr && tid == 0) tr[0] = gtime();  // q, k, v arrived
    float mx = __int_as_float(0xff800000u);
    const int part8 = 8 * (lane & 7);  // this lane's 8 elements of a row
    const float* q8 = qs + part8;
    for (int g0 = 0; 4 * g0 < ctx; g0 += 8 * CW) {  // 8 groups of 4 rows a warp at a time
        if (g0 > 0) {  // past the prefetched rows: the next ones, all loads first
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int t = row_of(g0, i, warp, lane);
                if (t < pos) pf.k[i] = __ldcg(row_part(kb, t, ts, lane));
            }
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            if (row_of(g0, i, warp, 0) >= ctx) break;  // the warp's groups past the context
            const int t = row_of(g0, i, warp, lane);
            float s = 0.0f;
            if (t == pos) {
#pragma unroll
                for (int e = 0; e < 8; ++e) s = fmaf(kn[part8 + e], q8[e], s);
            } else if (t < pos) {
                s = dot8(pf.k[i], q8);
            }
            s += __shfl_xor_sync(0xffffffffu, s, 1);
            s += __shfl_xor_sync(0xffffffffu, s, 2);
            s += __shfl_xor_sync(0xffffffffu, s, 4);
            if (t < ctx) {
                if ((lane & 7) == 0) sc[t] = s;
                mx = fmaxf(mx, s);
            }
        }
    }
    mx = cmax(mx, scratch, tid);
    if (tr != nullptr && tid == 0) tr[1] = gtime();  // the scores
    float sum = 0.0f;
    for (int t = tid; t < ctx; t += CT) {
        const float p = __expf(sc[t] - mx);
        sc[t] = p;
        sum += p;
    }
    sum = csum(sum, scratch, tid);  // its barriers also publish sc
    if (tr != nullptr && tid == 0) tr[2] = gtime();  // the softmax
    // p v: lane l adds up its rows' parts l % 8 (the prefetched rows, then 8 groups a warp at a
    // time, all loaded first, into the K registers), then the warp's 4 rows a load, then the
    // warps
    float o[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
    for (int j = 0; j < VG; ++j) {
        const int t = row_of(0, j, warp, lane);
        if (t < pos) axpy8(sc[t], pf.v[j], o);
    }
    for (int g0 = VG * CW; 4 * g0 < pos; g0 += 8 * CW) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int t = row_of(g0, i, warp, lane);
            if (t < pos) pf.k[i] = __ldcg(row_part(vb, t, ts, lane));
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int t = row_of(g0, i, warp, lane);
            if (t < pos) axpy8(sc[t], pf.k[i], o);
        }
    }
    if (warp == 0 && lane < 8 && pos < ctx) {
#pragma unroll
        for (int e = 0; e < 8; ++e) o[e] = fmaf(sc[pos], vn[part8 + e], o[e]);
    }
#pragma unroll
    for (int e = 0; e < 8; ++e) {
        o[e] += __shfl_xor_sync(0xffffffffu, o[e], 8);
        o[e] += __shfl_xor_sync(0xffffffffu, o[e], 16);
    }
    if (lane < 8) {
#pragma unroll
        for (int e = 0; e < 8; ++e) part[warp * HD + part8 + e] = o[e];
    }
    cbar();
    if (tr != nullptr && tid == 0) tr[4] = gtime();  // p v
    if (sp.shares > 1) {  // this share's max, sum and output, for the merge
        u64* dst = parts + (size_t)(h * SMAX + sp.share) * (HD + 2);
        if (tid == HD) st_tag64(dst, mx, ptag);
        if (tid == HD + 1) st_tag64(dst + 1, sum, ptag);
    }
    for (int d = tid; d < HD; d += CT) {
        float o = 0.0f;
#pragma unroll
        for (int w = 0; w < CW; ++w) o += part[w * HD + d];
        if (sp.shares > 1) {
            st_tag64(parts + (size_t)(h * SMAX + sp.share) * (HD + 2) + 2 + d, o, ptag);
        } else {
            st_tag(att + h * HD + d, o / sum, tag);
        }
    }
}

// The share-0 block of head h: att[h] from the SMAX shares' (max, sum, output) words, once all
// carry ``ptag``: each share's sum and output scaled by exp(its max - the largest). Out of
// line: the layer loop keeps its registers.
static __device__ __noinline__ void merge_shares(const u64* parts, int h, u32 ptag, u32 tag,
                                                 u32* att, float* buf, int tid) {
    constexpr int W = HD + 2, N = SMAX * W, PER = (N + CT - 1) / CT;
    static_assert(N <= SCORES && PER <= 32, "the shares' words: in the scores, a mask of them");
    const u64* src = parts + (size_t)h * N;
    u64 v[PER];
    u32 pending = 0u;
#pragma unroll
    for (int j = 0; j < PER; ++j)
        if (tid + j * CT < N) pending |= 1u << j;
    while (pending != 0u) {  // a round's loads all issued before any of them is checked
#pragma unroll
        for (int j = 0; j < PER; ++j)
            if (pending & (1u << j)) v[j] = ld_tagged64(src + tid + j * CT);
        u32 still = 0u;
#pragma unroll
        for (int j = 0; j < PER; ++j)
            if ((pending & (1u << j)) && (u32)(v[j] >> 32) != ptag) still |= 1u << j;
        pending = still;
    }
#pragma unroll
    for (int j = 0; j < PER; ++j)
        if (tid + j * CT < N) buf[tid + j * CT] = __uint_as_float((u32)v[j]);
    cbar();
    if (tid < HD) {
        float top = buf[0];
        for (int s = 1; s < SMAX; ++s) top = fmaxf(top, buf[s * W]);
        float sum = 0.0f, o = 0.0f;
        for (int s = 0; s < SMAX; ++s) {
            const float w = __expf(buf[s * W] - top);
            sum = fmaf(buf[s * W + 1], w, sum);
            o = fmaf(buf[s * W + 2 + tid], w, o);
        }
        st_tag(att + h * HD + tid, o / sum, tag);
    }
    cbar();  // buf (the scores) is free again
}

// An attention block asks layer l's cached keys and values of its share (`Span`) into L2, to
// be read from there when its attention comes. Out of line: the layer loop keeps its
// registers.
static __device__ __noinline__ void kv_to_l2(const u64* kv, int l, const Span& sp, i64 ts,
                                             i64 hs) {
    const i64 base = (sp.h / (NH / NKV)) * hs + (i64)sp.t0 * ts;
    const u32 bytes = (u32)(((i64)(sp.cached - 1) * ts + HD) * 2) & ~15u;
    prefetch_l2(reinterpret_cast<const bf16*>(kv[l]) + base, bytes);
    prefetch_l2(reinterpret_cast<const bf16*>(kv[L + l]) + base, bytes);
}

// picking[0] = 1 + m: the greedy pick (np.argmax: the largest logit, the lowest index on ties,
// NaN first), the ids picking[1 .. m] set to -inf first (as the loop's mask). Each block's best
// (logit, index) key (``best``: one a consumer warp) meets the others' in pick[0] by atomicMax,
// pick[1] counts arrivals, and the last block to arrive (every block has read ids and pos by
// then) writes the id as the next input and as tokens[pos + 1], moves the position on, and
// zeroes pick for the next launch. Out of line: the layer loop keeps its registers.
static __device__ __noinline__ void pick_token(const u64* best, u64* pick, i64* tokens, i64* ids,
                                               i64* posp, int pos) {
    u64 key = best[0];
    for (int w = 1; w < CW; ++w) key = best[w] > key ? best[w] : key;
    unsigned long long* meet = reinterpret_cast<unsigned long long*>(pick);
    atomicMax(meet, (unsigned long long)key);
    __threadfence();
    if (atomicAdd(meet + 1, 1ull) + 1ull < (unsigned long long)NB) return;
    __threadfence();
    const i64 token = index_of(atomicExch(meet, 0ull));
    meet[1] = 0ull;
    tokens[pos + 1] = token;
    *ids = token;
    *posp = pos + 1;
}

extern "C" __global__ void __launch_bounds__(CT + 32, 1) ep_stack_bf16(
    const u8* __restrict__ ws, const u64* __restrict__ wstart, const bf16* __restrict__ norms,
    const bf16* __restrict__ qkv_bias, const float* __restrict__ inv_freq,
    const bf16* __restrict__ head, float* logits, int vocab, const bf16* __restrict__ embed,
    int embed_rows, i64* ids, u32* R, u32* R1, u32* qkv, u32* att, u32* act,
    bf16* y, const u64* __restrict__ kv, i64 ts, i64 hs, i64* posp,
    u32* epoch_at, int cap, u32* status, i64* tokens, const i64* picking, u64* pick,
    u64* parts, u64 trace_at) {
    extern __shared__ __align__(128) u8 smem[];
    u64* full = reinterpret_cast<u64*>(smem);
    u64* empty = full + SLOTS;
    u32* claims = reinterpret_cast<u32*>(empty + SLOTS);
    u8* ring_bytes = smem + 1024;
    float* xs = reinterpret_cast<float*>(ring_bytes + RING);
    float* res = xs + XMAX;
    float* own = res + RESMAX;  // the residual's values at the block's own columns
    float* scratch = own + OWNMAX;
    float* qs = scratch + 32;
    float* kn = qs + HD;
    float* vn = kn + HD;
    float* part = vn + HD;  // CW x max(HD, RESMAX)
    float* sc = part + CW * (RESMAX > HD ? RESMAX : HD);
    u64* trace = reinterpret_cast<u64*>(trace_at);
    __shared__ u32 s_epoch;
    __shared__ int s_pos;
    __shared__ int s_masked;  // picking: the ids masked (-1: no pick)
    __shared__ i64 s_mask[PICK_MASK];
    __shared__ u64 s_kv[2 * L];  // the caches' addresses, read once (not a load a layer)
    __shared__ u64 s_best[CW];

    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, b = blockIdx.x;
    for (int i = tid; i < 2 * L; i += blockDim.x) s_kv[i] = kv[i];
    if (tid == 0) {
        for (int s = 0; s < SLOTS; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], CW); }
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
        s_epoch = *reinterpret_cast<volatile u32*>(epoch_at);
        const i64 p = *posp;
        s_pos = p < 0 || p >= cap || p >= MAXPOS ? -1 : (int)p;
        const i64 pk = picking[0];
        s_masked = pk < 1 ? -1 : (int)min(pk - 1, (i64)PICK_MASK);
        for (int k = 0; k < s_masked; ++k) s_mask[k] = picking[1 + k];
        if (s_pos < 0 && b == 0) set_fault(status, 4u);  // KernelFault.KV_POSITION
    }
    __syncthreads();
    // Every block read the same position: all of them (the producers too) leave, or none.
    if (s_pos < 0) return;
    const int pos = s_pos;
    const u32 tag0 = s_epoch * (u32)L;
    Ring ring{ring_bytes, full, empty, 0u, 0u, 0u, 0u, claims};
    int u0[4], u1[4], v0, v1;
    urange(NQKV / 2, b, u0[0], u1[0]);
    urange(H, b, u0[1], u1[1]);
    urange(INTER, b, u0[2], u1[2]);
    urange(H, b, u0[3], u1[3]);
    urange(vocab, b, v0, v1);
    __shared__ Span s_span;  // read where used: registers in the layer loop are scarce
    if (tid == 0) s_span = span_of(b, pos);
    __syncthreads();
    const Span& sp = s_span;

    // a trace slot of layer l (WAITED) or a stamp (TR): tools/bench_stack.py --trace, below
#define WAITED(k) \
    (trace != nullptr ? trace + ((size_t)b * L + l) * TRACE_STAMPS + (k) : nullptr)
    if (warp == CW) {  // the producer: the block's weights in the order the stages use them
        if (lane == 0) {
            const u8* src = ws + wstart[b];
            for (int l = 0; l < L; ++l) {
                u64* tr = WAITED(20);
                if (tr != nullptr) tr[4] = gtime();  // when this layer's first chunk is placed
                produce<H, 2>(2 * (u1[0] - u0[0]), src, ring, tr);
                produce<KO, 1>(u1[1] - u0[1], src, ring, tr);
                produce<H, 2>(2 * (u1[2] - u0[2]), src, ring, tr);
                produce<INTER, 1>(u1[3] - u0[3], src, ring, tr);
            }
            src = reinterpret_cast<const u8*>(head + (size_t)v0 * H);  // rows of [vocab, H]
            produce<H, 1>(v1 - v0, src, ring, nullptr);
        }
        return;
    }

    // tools/bench_stack.py --trace: each block's thread 0 stamps the global timer at 15 points
    // of every layer (trace[block][layer][0..14]), adds up its waits for each projection's
    // weights ([16..19]); the producer adds up its waits for ring space ([20]) and stamps when it
    // places a layer's first chunk ([24]). 0: no stamps.
#define TR(k) \
    if (trace != nullptr && tid == 0) trace[((size_t)b * L + l) * TRACE_STAMPS + (k)] = gtime();
    // the token's embedding row (an id outside the table: zeros, and the fault bit, as Gather)
    const i64 id = *ids;
    const bool id_ok = id >= 0 && id < embed_rows;
    if (!id_ok && b == 0 && tid == 0) set_fault(status, 1u);  // KernelFault.TOKEN_ID
    const bf16* x_in = embed + (id_ok ? id : 0) * H;
    for (int c = u0[1] + tid; c < u1[1]; c += CT)
        own[c - u0[1]] = id_ok ? __bfloat162float(x_in[c]) : 0.0f;
    for (int i = tid; i < H; i += CT) xs[i] = id_ok ? __bfloat162float(x_in[i]) : 0.0f;
    // this thread's QKV unit (a block has at most CT of them): rotation and destinations
    const int unit = u0[0] + tid;
    const bool has_unit = unit < u1[0];
    const int hh = unit / (HD / 2), ri = unit % (HD / 2), ca = hh * HD + ri, cb = ca + HD / 2;
    float sn = 0.0f, cs = 1.0f;
    if (has_unit && hh < NH + NKV) sincosf((float)pos * inv_freq[ri], &sn, &cs);
    // a K or V unit's place in every layer's cache: kv[layer] (keys) or kv[L + layer] (values)
    // + kv head * hs + pos * ts
    const u64* cache = nullptr;
    i64 at = 0;
    if (has_unit && hh >= NH) {
        const int kvh = hh < NH + NKV ? hh - NH : hh - NH - NKV;
        cache = s_kv + (hh < NH + NKV ? 0 : L);
        at = kvh * hs + pos * ts;
    }
    for (int l = 0; l < L; ++l) {
        const u32 tag = 1u + (tag0 + (u32)l) % 65535u;
        const u32 prev = 1u + (tag0 + (u32)l + 65534u) % 65535u;  // the layer before's
        const uint4 g1 = gamma_of(norms + (size_t)(2 * l) * H, tid);
        const uint4 g2 = gamma_of(norms + (size_t)(2 * l + 1) * H, tid);
        float ba = 0.0f, bc = 0.0f;
        if (has_unit) {
            ba = __bfloat162float(qkv_bias[(size_t)l * NQKV + ca]);
            bc = __bfloat162float(qkv_bias[(size_t)l * NQKV + cb]);
        }
        if (KV_L2 && b < NH * sp.shares && tid == 0 && sp.cached > 0) kv_to_l2(s_kv, l, sp, ts, hs);
        // norm, QKV projection, bias, rotary embedding, KV commit
        if (l > 0) gather<H>(R, prev, xs, tid);  // layer 0's: the embedding row, above
        cbar();
        TR(0);
        norm_xs(g1, xs, scratch, tid);
        TR(1);
        project<H, 2>(2 * (u1[0] - u0[0]), xs, res, part, ring, warp, lane, tid, WAITED(16));
        TR(2);
        cbar();
        if (has_unit) {
            float a = rbf(rbf(res[2 * (unit - u0[0])]) + ba);
            float c = rbf(rbf(res[2 * (unit - u0[0]) + 1]) + bc);
            if (hh < NH + NKV) {
                const float ra = rbf(a * cs - c * sn), rc = rbf(c * cs + a * sn);
                a = ra;
                c = rc;
            }
            st_tag(qkv + ca, a, tag);
            st_tag(qkv + cb, c, tag);
            if (cache != nullptr) {
                bf16* dst = reinterpret_cast<bf16*>(cache[l]) + at;
                dst[ri] = __float2bfloat16_rn(a);
                dst[ri + HD / 2] = __float2bfloat16_rn(c);
            }
        }
        TR(3);
        if (b < NH * sp.shares) {
            const i64 base = (sp.h / (NH / NKV)) * hs + (i64)sp.t0 * ts;
            const bf16* kb = reinterpret_cast<const bf16*>(s_kv[l]) + base;
            const bf16* vb = reinterpret_cast<const bf16*>(s_kv[L + l]) + base;
            const u32 ptag = 1u + tag0 + (u32)l;  // 32-bit: no wrap (`st_tag64`)
            Prefetch pf;
            attend_prefetch(pf, sp.cached, kb, vb, ts, warp, lane);
            TR(4);
            attend(pf, sp, qkv, tag, ptag, kb, vb, ts, att, parts, sc, qs, kn, vn, part, scratch,
                   tid, warp, lane, WAITED(21));
            if (sp.shares > 1 && sp.share == 0) merge_shares(parts, sp.h, ptag, tag, att, sc, tid);
            TR(5);
        }
        // O projection and the residual
        gather<KO>(att, tag, xs, tid);
        cbar();
        TR(6);
        project<KO, 1>(u1[1] - u0[1], xs, res, part, ring, warp, lane, tid, WAITED(17));
        TR(7);
        cbar();
        add_residual(u0[1], u1[1], res, own, R1, tag, tid);
        TR(8);
        // MLP: norm, gate/up with SwiGLU, down and the residual
        gather<H>(R1, tag, xs, tid);
        cbar();
        TR(9);
        norm_xs(g2, xs, scratch, tid);
        project<H, 2>(2 * (u1[2] - u0[2]), xs, res, part, ring, warp, lane, tid, WAITED(18));
        TR(10);
        cbar();
        for (int j = u0[2] + tid; j < u1[2]; j += CT) {
            const float g = rbf(res[2 * (j - u0[2])]), u = rbf(res[2 * (j - u0[2]) + 1]);
            st_tag(act + j, silu_mul(g, u), tag);
        }
        TR(11);
        gather<INTER>(act, tag, xs, tid);
        cbar();
        TR(12);
        project<INTER, 1>(u1[3] - u0[3], xs, res, part, ring, warp, lane, tid, WAITED(19));
        TR(13);
        cbar();
        add_residual(u0[3], u1[3], res, own, R, tag, tid);  // the O columns: H split alike
        TR(14);
    }
    // the final norm (every block), then the head's rows of the block
    const uint4 gf = gamma_of(norms + (size_t)(2 * L) * H, tid);
    gather<H>(R, 1u + (tag0 + (u32)L - 1u) % 65535u, xs, tid);
    cbar();
    norm_xs(gf, xs, scratch, tid);
    if (b == 0)
        for (int i = tid; i < H; i += CT) y[i] = __float2bfloat16_rn(xs[i]);
    constexpr int HCPC = chunk_cols<H, 1>();
    constexpr int STEP = RESMAX / HCPC * HCPC;  // whole chunks: the producer's boundaries
    static_assert(STEP > 0, "res must hold a chunk of head rows");
    u64 best = 0ull;  // the block's (logit, index) key, below every real one
    for (int c0 = v0; c0 < v1; c0 += STEP) {
        const int n = min(STEP, v1 - c0);
        project<H, 1>(n, xs, res, part, ring, warp, lane, tid);
        cbar();
        for (int c = tid; c < n; c += CT) {
            float v = rbf(res[c]);
            for (int k = 0; k < s_masked; ++k)
                if (s_mask[k] == c0 + c) v = __int_as_float(0xff800000u);  // -inf
            logits[c0 + c] = v;
            const u64 k = composite(v, c0 + c);
            best = k > best ? k : best;
        }
        cbar();
    }
    // Every block read the epoch before its first store, and block 0's last gather saw every
    // block's last store. Kept modulo 65535, so tags run on without a jump: the tag after
    // epoch 65534's last layer is epoch 0's first.
    if (b == 0 && tid == 0) *epoch_at = (s_epoch + 1u) % 65535u;
    if (s_masked < 0) return;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const u64 other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
    }
    if (lane == 0) s_best[warp] = best;
    cbar();
    if (tid == 0) pick_token(s_best, pick, tokens, ids, posp, pos);
}
"""


SHARED = 232448  # the most shared memory a block may have on sm_90 (227 KiB)


def _float_bytes(shape: StackShape, blocks: int, t: StackTuning) -> int:
    xmax = max(shape.inter, shape.hidden)
    resmax = _resmax(shape, blocks, t)
    own = -(-shape.hidden // blocks) + 1
    hd = shape.head_dim
    return 4 * (xmax + resmax + own + 32 + 3 * hd + t.warps * max(hd, resmax) + SCORES)


def ring_bytes(shape: StackShape, blocks: int, t: StackTuning) -> int:
    """The weight ring: the shared memory left, in 16-byte units (after the static shared
    memory: the caches' 2 L addresses, the masked ids, the warps' best keys, the epoch and
    position, room for the compiler's own)."""
    static = 16 * shape.layers + 8 * PICK_MASK + 8 * t.warps + 256
    return (SHARED - 1024 - _float_bytes(shape, blocks, t) - static) // 16 * 16


def shared_bytes(shape: StackShape, blocks: int, t: StackTuning) -> int:
    """Dynamic shared memory of a block: mbarriers, the ring, the float scratch."""
    return 1024 + ring_bytes(shape, blocks, t) + _float_bytes(shape, blocks, t)


# ws, wstart, norms, qkv_bias, inv_freq, head, logits, vocab, embed, embed_rows, ids, R, R1,
# qkv, att, act, y, kv (2 L addresses), ts, hs, pos, epoch, cap, status, tokens, picking, pick
# scratch, the split attention's shares, trace address
_PARAMS = ("u8*", "u64*", "bf16*", "bf16*", "f32*", "bf16*", "f32*", "i32", "bf16*", "i32",
           "i64*", "u32*", "u32*", "u32*", "u32*", "u32*", "bf16*", "u64*", "i64", "i64", "i64*",
           "u32*", "i32", "u32*", "i64*", "i64*", "u64*", "u64*", "u64")  # fmt: skip


def cache_views(
    shape: StackShape, addresses: np.ndarray, ts: int, hs: int, capacity: int
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The CPU device's K and V caches as the kernel sees them: layer l's keys at address
    ``addresses[l]``, values at ``addresses[L + l]``, element (head, t, d) at head * hs + t * ts + d
    (bf16 views [kv_heads, capacity, head_dim] of the host memory the CPU device's buffers are)."""
    import ctypes

    n = (shape.kv_heads - 1) * hs + (capacity - 1) * ts + shape.head_dim
    views = []
    for address in np.asarray(addresses, np.uint64).reshape(-1)[: 2 * shape.layers]:
        flat = np.frombuffer(memoryview((ctypes.c_uint16 * n).from_address(int(address))), BF16)
        dims = (shape.kv_heads, capacity, shape.head_dim)
        views.append(np.lib.stride_tricks.as_strided(flat, dims, (2 * hs, 2 * ts, 2)))
    return views[: shape.layers], views[shape.layers :]


def unpack_stack(
    shape: StackShape, stream: np.ndarray, starts: np.ndarray, blocks: int
) -> list[dict[str, np.ndarray]]:
    """`pack_stack`'s inverse: each layer's projections ([K, N] bf16) from the blocks' streams."""
    bits = np.asarray(stream).view(np.uint8)
    cols = block_columns(shape, blocks)
    ks = [k for _, _, k in shape.stages()]
    ns = (shape.qkv, shape.hidden, 2 * shape.inter, shape.hidden)
    layers = [
        {name: np.empty((k, n), BF16) for name, k, n in zip(PROJECTIONS, ks, ns, strict=True)}
        for _ in range(shape.layers)
    ]
    for b in range(blocks):
        at = int(starts[b])
        for layer in layers:
            for s, name in enumerate(PROJECTIONS):
                size = len(cols[b][s]) * ks[s] * 2
                chunk = bits[at : at + size].view(BF16).reshape(len(cols[b][s]), ks[s])
                layer[name][:, cols[b][s]] = chunk.T
                at += size
    return layers


def _twin(shape: StackShape, blocks: int, positions: int) -> Callable[..., None]:
    """The NumPy twin the CPU device runs: `reference_step` on the launch's buffers (the
    weights unpacked from the streams, the cache in float32 and back), the head's logits
    rounded to bf16, the epoch advanced; the tagged exchange buffers are the GPU's business."""

    def run(
        ws: np.ndarray, wstart: np.ndarray, norms: np.ndarray, qkv_bias: np.ndarray,
        inv_freq: np.ndarray, head: np.ndarray, logits: np.ndarray, vocab: np.int32,
        embed: np.ndarray, embed_rows: np.int32, ids: np.ndarray, R: np.ndarray, R1: np.ndarray,
        qkv: np.ndarray, att: np.ndarray, act: np.ndarray, y: np.ndarray, kv: np.ndarray,
        ts: np.int64, hs: np.int64, pos: np.ndarray, epoch: np.ndarray, cap: np.int32,
        status: np.ndarray, tokens: np.ndarray, picking: np.ndarray, pick: np.ndarray,
        parts: np.ndarray, trace: np.uint64,
    ) -> None:  # fmt: skip
        h, nl = shape.hidden, shape.layers
        p = int(pos[0])
        if not 0 <= p < min(int(cap), positions):
            set_fault(status, KernelFault.KV_POSITION)  # the kernel does nothing
            return
        token = int(ids[0])
        x = np.zeros(h, np.float32)
        if 0 <= token < int(embed_rows):
            x = embed[token * h : (token + 1) * h].astype(np.float32)
        else:
            set_fault(status, KernelFault.TOKEN_ID)  # a zero row
        layers = unpack_stack(shape, ws, wstart, blocks)
        g = norms[: (2 * nl + 1) * h].reshape(2 * nl + 1, h)
        bias = qkv_bias[: nl * shape.qkv].reshape(nl, shape.qkv)
        for li, w in enumerate(layers):
            w.update(input_norm=g[2 * li], post_norm=g[2 * li + 1], qkv_bias=bias[li])
        kc, vc = cache_views(shape, kv, int(ts), int(hs), int(cap))
        out = reference_step(
            shape, layers, g[2 * nl], inv_freq[: shape.head_dim // 2], x, p, kc, vc
        )
        y[:h] = out
        table = head[: int(vocab) * h].reshape(int(vocab), h).astype(np.float32)
        logits[: int(vocab)] = _bf(table @ out)
        epoch[0] = (int(epoch[0]) + 1) % 65535
        if picking[0] > 0:  # the greedy pick and the loop's advance (np.argmax's, as the kernel)
            masked = picking[1 : 1 + min(int(picking[0]) - 1, PICK_MASK)]
            logits[masked[(masked >= 0) & (masked < int(vocab))]] = -np.inf
            token = int(np.argmax(logits[: int(vocab)]))
            tokens[p + 1], ids[0], pos[0] = token, token, p + 1

    return run


def stack_kernel(shape: StackShape, blocks: int, tuning: StackTuning | None = None) -> KernelSource:
    """The kernel for ``shape`` on a grid of ``blocks`` (the device's SM count); on the CPU
    device its NumPy twin runs (`_twin`)."""
    t = (tuning or StackTuning()).resolved(shape)
    shape.check(t)
    largest = t.largest_chunk(shape)
    if (ring := ring_bytes(shape, blocks, t)) < 2 * largest:
        raise KernelArgumentError(
            f"persistent stack: {shape} leaves {ring} B of shared memory for the weight ring; "
            f"it needs at least two chunks of {largest} B"
        )
    source = _cuda(shape, blocks, t, ring)
    tag = f"h{shape.hidden}_n{shape.heads}_{shape.kv_heads}_i{shape.inter}_l{shape.layers}"
    digest = hashlib.sha256(source.encode()).hexdigest()[:8]  # eps and scale are in the source
    return KernelSource(
        name=f"ep_stack_bf16_{tag}_b{blocks}_w{t.warps}_c{t.chunk}_m{t.min_cols}_p{t.poll}_k{t.kv_l2}_"
        f"s{t.split}_{digest}",
        entry="ep_stack_bf16",
        source=source,
        params=_PARAMS,
        options=CompileOptions(cuda_headers=True),
        cpu=_twin(shape, blocks, max_positions(shape, blocks, t)),
        cooperative=True,
        targets=("sm_90a",),
    )


def _bf(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, np.float32).astype(BF16).astype(np.float32)


def _norm(x: np.ndarray, g: np.ndarray, eps: float) -> np.ndarray:
    inv = np.float32(1.0) / np.sqrt(np.mean(x * x, dtype=np.float32) + np.float32(eps))
    return _bf(x * inv * np.asarray(g, np.float32))


def reference_step(
    shape: StackShape, layers: list[dict[str, np.ndarray]], final_norm: np.ndarray,
    inv_freq: np.ndarray, x: np.ndarray, pos: int, kc: Sequence[np.ndarray],
    vc: Sequence[np.ndarray],
) -> np.ndarray:  # fmt: skip
    """One decode step in NumPy (float32 sums, bf16 where the kernel rounds): the final norm's
    output. ``layers[l]`` as `pack_stack` takes them, plus ``input_norm``, ``post_norm`` and
    ``qkv_bias`` (float32 copies make it faster); ``x`` the token's embedding; ``kc[l]``/``vc[l]``
    (layer l's cache, [kv_heads, capacity, head_dim], float32 or bf16) get position ``pos``."""
    hd, nh, nkv, half = shape.head_dim, shape.heads, shape.kv_heads, shape.head_dim // 2
    f32 = lambda a: np.asarray(a, np.float32)  # noqa: E731
    r = _bf(x)
    ang = np.float32(pos) * f32(inv_freq)
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    for li, w in enumerate(layers):
        xn = _norm(r, w["input_norm"], shape.eps)
        qkv = _bf(_bf(xn @ f32(w["qkv"])) + f32(w["qkv_bias"])).reshape(-1, hd)
        a, c = qkv[: nh + nkv, :half], qkv[: nh + nkv, half:]
        qkv[: nh + nkv] = np.concatenate([_bf(a * cos - c * sin), _bf(c * cos + a * sin)], 1)
        kc[li][:, pos] = qkv[nh : nh + nkv]
        vc[li][:, pos] = qkv[nh + nkv :]
        out = np.empty((nh, hd), np.float32)
        for h in range(nh):
            kvh = h // (nh // nkv)
            s = f32(kc[li][kvh, : pos + 1]) @ (qkv[h] * np.float32(shape.attention_scale))
            p = np.exp(s - s.max())
            out[h] = (p @ f32(vc[li][kvh, : pos + 1])) / p.sum()
        r1 = _bf(r + _bf(_bf(out.reshape(-1)) @ f32(w["o"])))
        gu = _bf(_norm(r1, w["post_norm"], shape.eps) @ f32(w["gate_up"]))
        g, u = gu[: shape.inter], gu[shape.inter :]
        r = _bf(r1 + _bf(_bf(g / (1 + np.exp(-g)) * u) @ f32(w["down"])))
    return _norm(r, final_norm, shape.eps)


@dataclass(frozen=True)
class StackIO:
    """What one launch reads and writes besides the weights: device buffers, so a captured
    launch replays with new values in them. ``ids``/``pos``: int64, the token and its position
    (element 0); ``logits``: float32 [vocab] (bf16-rounded values, as the graph's Cast of its bf16
    logits); ``kv``: uint64 [2 * layers], the address of each layer's K cache, then of each
    layer's V cache, where element (kv head, t, d) is at kv head * ``head_stride`` + t *
    ``token_stride`` + d, for t < ``capacity``.

    ``tokens`` (int64 [`StackStep.positions` + 1]) and ``picking`` (int64 [1 + PICK_MASK]; both
    or neither): while ``picking[0]`` = 1 + m (values on the device, so one captured launch
    serves every way; 0: no pick), the launch also takes the greedy pick, a device token loop's
    step: its logits at the m ids ``picking[1 .. m]`` set to -inf (a mask, as
    ``native_mask_ids``), their argmax (``np.argmax``'s: the lowest index on ties) is the next
    step's input (``ids`` <- the id, ``pos`` + 1) and the token at that position
    (``tokens[pos + 1]``)."""

    ids: Buffer
    pos: Buffer
    logits: Buffer
    kv: Buffer
    token_stride: int
    head_stride: int
    capacity: int
    tokens: Buffer | None = None
    picking: Buffer | None = None


def kv_addresses(keys: list[Buffer], values: list[Buffer]) -> np.ndarray:
    """`StackIO.kv`'s contents for per-layer K and V buffers (16-byte aligned, as the kernel's
    vector loads need)."""
    addresses = np.asarray([b.ptr for b in (*keys, *values)], np.uint64)
    if (addresses % 16).any():
        raise KernelArgumentError("persistent stack: a KV buffer is not 16-byte aligned")
    return addresses


class StackStep:
    """The kernel bound on a device to one model: its layers (as `pack_stack` and
    `reference_step` take them), final norm, rotary frequencies (float32, head_dim / 2), head
    (``head``: [vocab, hidden] bf16 on the device, a tied embedding table or the head's
    transposed weight) and embedding table (``embed``: [rows, hidden] bf16; default the head).

    `launch` runs one step on a `StackIO`: the executor's own buffers (`ep.native.fused`), or,
    by default, this object's ``io``: its own ``ids``, ``pos``, ``logits`` and a KV cache of
    ``capacity`` positions ([layer][kv head][capacity][head_dim] in ``kc``/``vc``; None: no
    ``io``, every launch gets one). The final
    norm's output lands in ``y``. The values blocks exchange live in tagged buffers zeroed here
    (no tag a launch waits for); ``epoch`` counts launches. A position outside the cache (or
    from ``positions`` on: `max_positions`) makes the launch do nothing but set
    `KernelFault.KV_POSITION` in ``status``; an id outside the embedding, a zero row and
    `KernelFault.TOKEN_ID`.
    """

    def __init__(
        self, dev: Device, shape: StackShape, layers: list[dict[str, np.ndarray]],
        final_norm: np.ndarray, inv_freq: np.ndarray, head: Buffer, capacity: int | None, *,
        stream: Stream, tuning: StackTuning | None = None,
        packed: tuple[Buffer, Buffer] | None = None, embed: Buffer | None = None,
        status: Buffer | None = None,
    ) -> None:  # fmt: skip
        from ep.kernels._common import new_status
        from ep.kernels.matmul import sm_count

        blocks = sm_count(dev)
        self.tuning = (tuning or StackTuning()).resolved(shape)
        self.positions = max_positions(shape, blocks, self.tuning)
        if capacity is not None and not 1 <= capacity <= self.positions:
            raise KernelArgumentError(
                f"persistent stack: capacity {capacity}; expected 1 to {self.positions} "
                f"positions ({SCORES} scores a block in shared memory, attention split over "
                f"{self.positions // SCORES} blocks)"
            )
        if len(layers) != shape.layers:
            raise KernelArgumentError(
                f"persistent stack: {len(layers)} layers of weights for a {shape.layers}-layer "
                "shape"
            )
        embed = head if embed is None else embed
        for what, table in (("head", head), ("embedding", embed)):
            if table.dtype != BF16 or table.size % shape.hidden:
                raise KernelArgumentError(
                    f"persistent stack: {what} of {table.size} {table.dtype} values; expected "
                    f"bf16 [rows, {shape.hidden}]"
                )
        self.dev, self.shape, self.blocks = dev, shape, blocks
        self.kernel = dev.kernel(stack_kernel(shape, blocks, self.tuning))
        self.shared = shared_bytes(shape, blocks, self.tuning)
        self.threads = 32 * self.tuning.warps + 32
        resident = self.kernel.resident_blocks(self.threads, self.shared)
        if resident < blocks:
            raise KernelArgumentError(
                f"persistent stack: {resident} blocks of {self.shared} B fit on the device at "
                f"once; the kernel needs one on each of its {blocks} SMs"
            )
        self.head, self.vocab = head, head.size // shape.hidden
        self.embed, self.embed_rows = embed, embed.size // shape.hidden
        up = lambda a: dev.to_device(np.ascontiguousarray(a), stream=stream)  # noqa: E731
        if packed is None:
            bits, starts = pack_stack(shape, layers, blocks)
            packed = up(bits.view(np.uint8)), up(starts)
        self.ws, self.starts = packed
        norms = [n for w in layers for n in (w["input_norm"], w["post_norm"])] + [final_norm]
        self.norms = up(np.concatenate(norms).astype(BF16))
        self.bias = up(np.concatenate([w["qkv_bias"] for w in layers]).astype(BF16))
        self.inv_freq = up(np.asarray(inv_freq, np.float32))
        self.status = status if status is not None else new_status(dev, stream=stream)
        h, nh, hd = shape.hidden, shape.heads, shape.head_dim
        alloc = lambda n, dt: dev.alloc(n, dt, stream=stream)  # noqa: E731
        self.y = alloc(h, BF16)
        self.R, self.R1, self.att = (
            alloc(h, np.uint32),
            alloc(h, np.uint32),
            alloc(nh * hd, np.uint32),
        )
        self.qkv, self.act = alloc(shape.qkv, np.uint32), alloc(shape.inter, np.uint32)
        self.epoch = alloc(1, np.uint32)
        # a split attention's shares: [head][share][max, sum, output] tagged float32 words
        self.parts = alloc(nh * attention_splits(shape, blocks) * (hd + 2), np.uint64)
        # the pick's meeting place (best key, arrivals; zeroed by each launch's last block),
        # and the 0 a launch without tokens and picking reads as its picking
        self.pick, self._unpicked = alloc(2, np.uint64), alloc(1, np.int64)
        for buffer in (self.R, self.R1, self.att, self.qkv, self.act, self.epoch, self.parts,
                       self.pick, self._unpicked):  # fmt: skip
            dev.fill(buffer, 0, stream=stream)
        self.io: StackIO | None = None
        if capacity is None:
            return
        # the default StackIO: its own token, position, logits and cache
        per_layer = shape.kv_heads * capacity * hd
        self.kc = alloc(shape.layers * per_layer, BF16)
        self.vc = alloc(shape.layers * per_layer, BF16)
        for buffer in (self.kc, self.vc):
            dev.fill(buffer, 0, stream=stream)
        item = BF16.itemsize
        addresses = [c.ptr + li * per_layer * item for c in (self.kc, self.vc)
                     for li in range(shape.layers)]  # fmt: skip
        self.io = StackIO(
            ids=alloc(1, np.int64), pos=alloc(1, np.int64), logits=alloc(self.vocab, np.float32),
            kv=up(np.asarray(addresses, np.uint64)), token_stride=hd,
            head_stride=capacity * hd, capacity=capacity,
        )  # fmt: skip

    def check_io(self, io: StackIO) -> None:
        """Refuse buffers the kernel would misread, saying which and why."""
        problems = []
        if io.ids.dtype != np.int64 or io.pos.dtype != np.int64:
            problems.append(f"ids {io.ids.dtype} and pos {io.pos.dtype} must be int64")
        if io.logits.dtype != np.float32 or io.logits.size < self.vocab:
            problems.append(f"logits of {io.logits.size} {io.logits.dtype} values; expected "
                            f"float32 [{self.vocab}]")  # fmt: skip
        if io.kv.dtype != np.uint64 or io.kv.size != 2 * self.shape.layers:
            problems.append(f"kv of {io.kv.size} {io.kv.dtype} values; expected uint64 "
                            f"[{2 * self.shape.layers}] addresses")  # fmt: skip
        if io.token_stride % 8 or io.head_stride % 8 or min(io.token_stride, io.head_stride) < 1:
            problems.append(f"KV strides token {io.token_stride}, head {io.head_stride}: "
                            "positive multiples of 8 elements (16-byte rows) needed")  # fmt: skip
        if io.capacity < 1:
            problems.append(f"capacity {io.capacity}")
        tokens, picking = io.tokens, io.picking
        if (tokens is None) != (picking is None):
            problems.append("a pick needs both tokens and picking")
        elif (
            tokens is not None
            and picking is not None
            and (
                tokens.dtype != np.int64
                or tokens.size < self.positions + 1
                or picking.dtype != np.int64
                or picking.size < 1 + PICK_MASK
            )
        ):
            problems.append(f"tokens of {tokens.size} {tokens.dtype} and picking of "
                            f"{picking.size} {picking.dtype}; expected int64 "
                            f"[{self.positions + 1}] (one a position the kernel takes, and the "
                            f"next) and int64 "
                            f"[{1 + PICK_MASK}] (the flag and the masked ids)")  # fmt: skip
        if problems:
            raise KernelArgumentError("persistent stack: " + "; ".join(problems))

    def launch(
        self, *, stream: Stream, io: StackIO | None = None, trace: Buffer | None = None
    ) -> None:
        """One step on ``io`` (default: ``self.io``; class docstring). ``trace``: uint64
        [blocks, layers, TRACE_STAMPS] global-timer stamps of each block's stages
        (`tools/bench_stack.py --trace`)."""
        io = io or self.io
        if io is None:
            raise KernelArgumentError("persistent stack: launch() without io= on a step made "
                                      "without a cache of its own (capacity None)")  # fmt: skip
        unpicked = io.tokens is None or io.picking is None
        tokens = self._unpicked if unpicked else io.tokens
        picking = self._unpicked if unpicked else io.picking
        self.kernel.launch(
            self.blocks, self.threads, self.ws, self.starts, self.norms, self.bias,
            self.inv_freq, self.head, io.logits, self.vocab, self.embed, self.embed_rows, io.ids,
            self.R, self.R1, self.qkv, self.att, self.act, self.y, io.kv, io.token_stride,
            io.head_stride, io.pos, self.epoch, io.capacity, self.status, tokens, picking,
            self.pick, self.parts,
            0 if trace is None else trace.ptr, stream=stream, shared_mem=self.shared,
        )  # fmt: skip
