"""KVCommit and KVAttention on the device, addressed through the layout's stride descriptor.

Every KV kernel takes the layout's `KVStrides` (batch, token, head, dim, page, page_size) and the
capacity as scalar arguments, so ONE compiled kernel serves head-major [B, Hkv, C, D], seq-major
[B, C, Hkv, D] and paged layouts: token t of row b, head h, feature d is at
``b*batch + t*token + h*head + d*dim``, or, paged, at ``table[b, t // page_size]*page +
(t % page_size)*token + h*head + d*dim``. Semantics are `ep.ops.kv`'s: ``positions[b, s]`` is the
cache slot of new token s of row b, negative = padding (not written; its query row outputs
zeros); a query at position p attends to slots 0..p of its row (left-padded batches need no other
mask, since padding is never written).

Kernels
-------
``kv_commit`` (dtype-agnostic, copies bytes): one block per new token (grid = batch*seq), 256
threads copying kv_heads*head_dim elements of K and of V, in 16-byte vectors when strides and
addresses allow. The blocks of token 0 also write ``lengths[b] = 1 + max position`` of the row.

``kv_commit_rotary_<dt>``: a layer's whole step between its QKV projection and its attention,
in the same grid: the projection's bias added (rounded to the dtype, as the Add), q and k rotated
(`ep.kernels.rotary`'s device code: the same cos/sin and float32 roundings), q stored for the
attention, rotated k and v written into the caches as ``kv_commit`` writes them, and
``lengths``. Bitwise what the three launches store; the native executor binds it where the graph
allows (`ep.native.plan`).

``kv_attention_<dt>``: causal GQA attention, float32 online softmax. Grid (batch * query tiles,
kv_heads, splits), 256 threads. A block takes ``q_tile`` consecutive query tokens of one row and
all ``G = heads/kv_heads`` query heads that share one KV head (R = q_tile*G query rows, so a K/V
tile read from memory serves all of them), and walks its slice of the context in tiles of
``kv_tile`` tokens: K and V tiles go to shared memory (converted to float32; 16-byte loads when
the layout allows), scores for R × kv_tile pairs (``lanes`` threads per dot product when there
are few pairs), one warp per query row updates the running max and sum, and each thread
accumulates its (row, feature) outputs in registers. Decode is q_tile = 1; prefill uses
q_tile > 1 (the flash-attention pattern on CUDA cores: correctness first).

Split-K ("flash-decoding"): the grid's z axis holds ``splits`` blocks per (row, KV head), and
each block takes an equal share of the row's *live* context (its query's position + 1, read on
the device, rounded up to a loop step), so a batch-1 decode runs many blocks instead of
kv_heads, and a graph captured for a large capacity still spreads a short context over every
split. Each block writes its unnormalised output, running max and sum (float32) to a workspace,
and ``kv_attention_reduce_<dt>`` (one block of 256 threads per output row) merges the splits:
``out = Σ exp(m_i - M) o_i / Σ exp(m_i - M) l_i``. A block with no share writes an empty partial
(max -inf, sum 0). With one split the kernel writes the output itself. The split count depends
only on host-known sizes (batch, seq, capacity or a ``max_context`` bound: at most one split per
64 slots), so a captured graph stays valid while positions change.

``kv_decode_<dt>`` (one query token per row, 16-byte loads, at most 8 query heads per KV head):
the same contract and workspace with 128 threads and no shared-memory tiles. L = head_dim / (16
bytes of elements) lanes read a token's K and V row, so a warp takes 32 / L tokens at a time and
each lane group keeps its own online softmax for the G query heads; groups merge by shuffles,
warps through shared memory. Since ``kv_decode_tc`` it runs fp32 and the shapes that kernel does
not take, and every decode under ``GENAI_EP_ATTENTION=v1`` (A/B runs). Where its time went (H200,
2048-slot graph: 4.8 µs with no live token, ~175 ns a token in one block): the G query loads are
serial (each 16-byte load is converted and scaled inside its ``g < G`` branch, so it waits before
the next is issued), the next token's "prefetch" is converted inside its branch too (a full load
latency every 16 tokens of a block), and per token a lane does G x (log2 L shuffles, 2 exps, a
rescale of its G x 8 accumulators).

``kv_decode_tc<d>_<dt>`` (fp16/bf16, head_dim d = 64 or 128, one query token per row, at most 8
query heads per KV head, 16-byte loads): decode on tensor cores. Grid (batch, kv_heads, splits),
256 threads = 8 warps; a warp takes 16-token tiles (UNITS of them a round: 2 at 64, 1 at 128).
Scores are mma.m16n8k16 with the G query heads as A's rows (padded to 16, the padding's results
never kept) and K rows as B (token n of 8 = the lane group; the 16-byte piece a lane loads is
its fragment as is: within an MMA the feature order is a permutation Q and K share, as in the
GEMVs); the score fragment (head g, tokens 2t, 2t+1) is P's A fragment for P·V, where V's
fragment (tokens 2t, 2t+1 / 2t+8, 2t+9; feature 8g + i of each 64) is two byte permutes of the
lane's own 16-byte V loads. Softmax in base 2 (scale·log2 e folded into the scores, ex2.approx),
the max of each head shared by its 4 lanes per round, P rounded to T for the MMA (its sum from
the rounded values), accumulation in fp32. Every load of a round is issued before any is used;
split 0 issues its first tile per warp (tokens 0..127) before the row's position arrives.

The cut is made on the device from the row's live length (a graph captured for 2048 slots
serves every length): ``share = round_up(max(ceil(live / splits), min_share), 16)`` tokens a
split (``AttentionPlan.share`` = ``min_share``, default `DECODE_SHARE` = 256 live tokens),
``nlive = ceil(live / share)`` live splits; the blocks of the other splits exit at once. One live
split writes the output itself (no workspace touched); 2..16 live splits each write a partial
(sum, max, weight sum) and the last to arrive (a counter per row and KV head at the workspace's
end, reset by that block) merges them; more than 16 (long contexts: one block merging many
partials is slow, its loads serial) are merged by ``kv_decode_merge_<dt>``, one block per output
row reading only the live splits, launched only when the plan allows that many and exiting at
once otherwise. So a 2048-slot graph at batch 1 is one launch at every live length.

Device data never causes an out-of-bounds access: a query position >= capacity or >= its row's
committed length outputs zeros and sets `KernelFault.KV_POSITION`; a token whose block-table
column or page is out of range (or whose address falls outside the cache) is skipped (masked;
``kv_decode_tc`` reads it as zeros) and sets `KernelFault.KV_PAGE`. What a faulted query outputs
is unspecified.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ep.device import Buffer, Device, KernelSource, Stream
from ep.errors import OpError
from ep.kernels import matmul
from ep.kernels._common import (
    BF16,
    EXACT_OPTIONS,
    FLOAT_DTYPES,
    PRELUDE,
    KernelFault,
    aligned,
    check_buffer,
    check_index_buffer,
    check_status,
    dtype_suffix,
    need,
    positive,
    register_one,
    register_per_dtype,
    round_up,
    set_fault,
)
from ep.kernels.rotary import ROTARY_DEVICE, check_rotation, rotary_twin
from ep.ops import kv as ref
from ep.seams import KVStrides

__all__ = [
    "ATTENTION_ENV",
    "DECODE_SHARE",
    "AttentionPlan",
    "attention_plan",
    "attention_version",
    "attention_workspace",
    "kv_attention",
    "kv_commit",
    "kv_commit_rotary",
    "rope_epilogue",
]

_THREADS = 256
_MAX_ACC = 16  # output rows per thread: R <= 16 * (256 // round_up(head_dim, 4))
_MAX_ROWS = 64  # query rows (q_tile * G) per block
_MAX_SPLITS = 1024
_TARGET_BLOCKS = 264  # two resident blocks per SM on an H200 (132 SMs)
_MIN_CHUNK = 64  # capacity per split at least (the kernels share the live context out)
_DECODE_MAX_GROUP = 8  # query heads per KV head the decode kernel holds (MAX_G)
_DECODE_THREADS = 128  # the decode kernel's 4 warps (WARPS)
_SHARED_BUDGET = 96 * 1024
_MAX_HEAD_DIM = 256
# kv_decode_tc: 8 warps a block; a split takes at least DECODE_SHARE live tokens (one round of
# loads at head_dim 64, two at 128); its last block merges up to _TC_MERGE_MAX live splits, more
# go to kv_decode_merge (one block merging many splits is slow: its loads are serial).
_TC_THREADS = 256
DECODE_SHARE = 256
_TC_MERGE_MAX = 16
_TC_MAX_SLOTS = 2**31 - 2**16  # token indices are int32 on the device
# GENAI_EP_ATTENTION=v1 runs the earlier decode kernels (kv_decode + reduce) only, for A/B runs.
ATTENTION_ENV = "GENAI_EP_ATTENTION"
_ATTENTION_VERSIONS = ("v1", "v2")

# --- shared device code ------------------------------------------------------------------------

_ADDRESSING = r"""
#define NEG_INF (__int_as_float(0xff800000u))

// The parameters of both attention kernels (kv_attention and kv_decode share one CPU twin).
#define ATTENTION_PARAMS                                                                        \
    T *out, float *ws, const T *query, const void *__restrict__ positions, int pos_i64,         \
        const i64 *__restrict__ lengths, const T *kcache, const T *vcache,                      \
        const void *__restrict__ block_table, i64 table_cols, i64 batch, i64 seq, int heads,    \
        int kv_heads, int dim, i64 q_tok, i64 s_batch, i64 s_token, i64 s_head, i64 s_dim,      \
        i64 s_page, i64 page_size, i64 capacity, i64 cache_elems, float scale, int q_tile,      \
        int kv_tile, int lanes, int splits, i64 chunk, int vec, u32 *status

// Context tokens per split for a live context of ``live`` tokens: an equal share, rounded up to
// ``unit`` (a loop step of the kernel).
static __device__ __forceinline__ i64 split_share(i64 live, int splits, int unit) {
    const i64 share = (live + splits - 1) / splits;
    return (share + unit - 1) / unit * unit;
}

// Element offset of (row b, token t, head 0, feature 0), or -1 when the token cannot be addressed
// (a fault is set when ``report``). ``span`` = elements one token covers over all heads.
static __device__ __forceinline__ i64 kv_token_base(
    i64 b, i64 t, const int* table, i64 table_cols, i64 s_batch, i64 s_token, i64 s_page,
    i64 page_size, i64 span, i64 cache_elems, u32* status, bool report) {
    i64 base;
    if (page_size > 0) {
        const i64 col = t / page_size;
        if (col >= table_cols) {
            if (report) set_fault(status, 8u);  // KernelFault.KV_PAGE
            return -1;
        }
        const i64 page = (i64)table[b * table_cols + col];
        if (page < 0) {
            if (report) set_fault(status, 8u);
            return -1;
        }
        base = page * s_page + (t - col * page_size) * s_token;
    } else {
        base = b * s_batch + t * s_token;
    }
    if (base < 0 || base + span > cache_elems) {
        if (report) set_fault(status, page_size > 0 ? 8u : 4u);  // KV_PAGE / KV_POSITION
        return -1;
    }
    return base;
}
"""

# --- KVCommit ----------------------------------------------------------------------------------

# What KVCommit and the fused QKV commit share: each row's length, and where a token goes.
_COMMIT_DEVICE = r"""
// lengths[b] = 1 + the row's highest position (0 for padding only). The whole block calls it;
// ``row_max`` holds 32 i64 of shared memory.
static __device__ void commit_length(i64* lengths, const void* __restrict__ positions,
                                     int pos_i64, i64 b, i64 seq, i64* row_max) {
    i64 best = -1;
    for (i64 j = threadIdx.x; j < seq; j += blockDim.x) {
        const i64 p = load_index(positions, b * seq + j, pos_i64);
        best = p > best ? p : best;
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const i64 other = __shfl_xor_sync(0xffffffffu, best, o);
        best = other > best ? other : best;
    }
    if ((threadIdx.x & 31) == 0) row_max[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int)(blockDim.x >> 5); ++w) {
            best = row_max[w] > best ? row_max[w] : best;
        }
        lengths[b] = best + 1;
    }
}

// The cache offset (elements) of new token s of row b (token ``tok`` of the step) at ``pos``, or
// -1 when it is not written: padding, or a fault (set by thread 0: KV_ORDER is only reported,
// the token is still written).
static __device__ i64 commit_slot(i64 b, i64 s, i64 tok, i64 pos,
                                  const void* __restrict__ positions, int pos_i64,
                                  const void* __restrict__ block_table, i64 table_cols,
                                  int kv_heads, int dim, i64 s_batch, i64 s_token, i64 s_head,
                                  i64 s_dim, i64 s_page, i64 page_size, i64 capacity,
                                  i64 cache_elems, u32* status) {
    if (pos < 0) return -1;
    if (threadIdx.x == 0 && s > 0) {
        const i64 prev = load_index(positions, tok - 1, pos_i64);
        if (prev >= 0 && pos <= prev) set_fault(status, 16u);  // KernelFault.KV_ORDER
    }
    if (pos >= capacity) {
        if (threadIdx.x == 0) set_fault(status, 4u);  // KernelFault.KV_POSITION
        return -1;
    }
    const i64 span = (i64)(kv_heads - 1) * s_head + (i64)(dim - 1) * s_dim + 1;
    return kv_token_base(b, pos, reinterpret_cast<const int*>(block_table), table_cols, s_batch,
                         s_token, s_page, page_size, span, cache_elems, status,
                         threadIdx.x == 0);
}
"""

_COMMIT_BODY = (
    _ADDRESSING
    + _COMMIT_DEVICE
    + r"""
extern "C" __global__ void __launch_bounds__(256) kv_commit(
    unsigned char* kcache, unsigned char* vcache, i64* lengths,
    const unsigned char* new_k, const unsigned char* new_v,
    const void* __restrict__ positions, int pos_i64, const void* __restrict__ block_table,
    i64 table_cols, i64 batch, i64 seq, int kv_heads, int dim, i64 src_tok,
    i64 s_batch, i64 s_token, i64 s_head, i64 s_dim, i64 s_page, i64 page_size,
    i64 capacity, i64 cache_elems, int itemsize, int vec, u32* status) {
    __shared__ i64 row_max[32];
    const i64 tok = blockIdx.x;
    if (tok >= batch * seq) return;
    const i64 b = tok / seq;
    const i64 s = tok - b * seq;
    if (s == 0) commit_length(lengths, positions, pos_i64, b, seq, row_max);
    const i64 pos = load_index(positions, tok, pos_i64);
    const i64 base = commit_slot(b, s, tok, pos, positions, pos_i64, block_table, table_cols,
                                 kv_heads, dim, s_batch, s_token, s_head, s_dim, s_page,
                                 page_size, capacity, cache_elems, status);
    if (base < 0) return;
    const unsigned char* sk = new_k + tok * src_tok * itemsize;
    const unsigned char* sv = new_v + tok * src_tok * itemsize;
    if (vec) {  // 16-byte chunks: s_dim == 1 and every stride a multiple of 16 bytes
        const int chunks = dim * itemsize / 16;
        for (int i = threadIdx.x; i < kv_heads * chunks; i += blockDim.x) {
            const int h = i / chunks, c = i - h * chunks;
            const i64 dst = (base + h * s_head) * itemsize + (i64)c * 16;
            const i64 src = (i64)h * dim * itemsize + (i64)c * 16;
            *reinterpret_cast<uint4*>(kcache + dst) = *reinterpret_cast<const uint4*>(sk + src);
            *reinterpret_cast<uint4*>(vcache + dst) = *reinterpret_cast<const uint4*>(sv + src);
        }
    } else {
        for (int i = threadIdx.x; i < kv_heads * dim; i += blockDim.x) {
            const int h = i / dim, d = i - h * dim;
            const i64 dst = (base + h * s_head + d * s_dim) * itemsize;
            const i64 src = (i64)i * itemsize;
            if (itemsize == 4) {
                *reinterpret_cast<u32*>(kcache + dst) = *reinterpret_cast<const u32*>(sk + src);
                *reinterpret_cast<u32*>(vcache + dst) = *reinterpret_cast<const u32*>(sv + src);
            } else {
                *reinterpret_cast<unsigned short*>(kcache + dst) =
                    *reinterpret_cast<const unsigned short*>(sk + src);
                *reinterpret_cast<unsigned short*>(vcache + dst) =
                    *reinterpret_cast<const unsigned short*>(sv + src);
            }
        }
    }
}
"""
)


def _geometry(strides: tuple[int, ...], capacity: int) -> np.ndarray:
    return np.array([*strides, capacity], dtype=np.int64)


def _token_bases(
    rows: np.ndarray,
    tokens: np.ndarray,
    table: np.ndarray | None,
    strides: KVStrides,
    span: int,
    cache_elems: int,
) -> tuple[np.ndarray, int]:
    """The kernels' addressing on the host: base offsets (-1 where unaddressable) and faults."""
    faults = 0
    if strides.page_size > 0:
        assert table is not None
        cols = tokens // strides.page_size
        ok = cols < table.shape[1]
        pages = np.where(ok, table[rows, np.minimum(cols, table.shape[1] - 1)], -1).astype(np.int64)
        ok &= pages >= 0
        base = pages * strides.page + (tokens - cols * strides.page_size) * strides.token
        bad_bit = KernelFault.KV_PAGE
    else:
        ok = np.ones(tokens.shape, dtype=bool)
        base = rows.astype(np.int64) * strides.batch + tokens.astype(np.int64) * strides.token
        bad_bit = KernelFault.KV_POSITION
    inside = (base >= 0) & (base + span <= cache_elems)
    if (ok & ~inside).any():
        faults |= bad_bit
    if (~ok).any():
        faults |= KernelFault.KV_PAGE
    return np.where(ok & inside, base, -1), faults


def _strides_of(
    s_batch: np.int64,
    s_token: np.int64,
    s_head: np.int64,
    s_dim: np.int64,
    s_page: np.int64,
    page_size: np.int64,
) -> KVStrides:
    return KVStrides(
        int(s_batch), int(s_token), int(s_head), int(s_dim), int(s_page), int(page_size)
    )


def _commit_cpu(
    kcache: np.ndarray,
    vcache: np.ndarray,
    lengths: np.ndarray,
    new_k: np.ndarray,
    new_v: np.ndarray,
    positions: np.ndarray,
    pos_i64: np.int32,
    block_table: np.ndarray,
    table_cols: np.int64,
    batch: np.int64,
    seq: np.int64,
    kv_heads: np.int32,
    dim: np.int32,
    src_tok: np.int64,
    s_batch: np.int64,
    s_token: np.int64,
    s_head: np.int64,
    s_dim: np.int64,
    s_page: np.int64,
    page_size: np.int64,
    capacity: np.int64,
    cache_elems: np.int64,
    itemsize: np.int32,
    vec: np.int32,
    status: np.ndarray,
) -> None:
    nb, ns, heads, d = int(batch), int(seq), int(kv_heads), int(dim)
    word = np.uint32 if int(itemsize) == 4 else np.uint16
    strides = _strides_of(s_batch, s_token, s_head, s_dim, s_page, page_size)
    kc, vc = kcache.view(word), vcache.view(word)
    pos = positions.view(np.int64 if pos_i64 else np.int32)[: nb * ns].astype(np.int64)
    pos = pos.reshape(nb, ns)
    lengths[:nb] = np.where(pos >= 0, pos, -1).max(axis=1, initial=-1) + 1
    table = None
    if strides.page_size > 0:
        table = block_table.view(np.int32)[: nb * int(table_cols)].reshape(nb, int(table_cols))
    index = np.arange(nb * ns)[:, None] * int(src_tok) + np.arange(heads * d)[None, :]
    keys = new_k.view(word)[index].reshape(nb, ns, heads, d)
    values = new_v.view(word)[index].reshape(nb, ns, heads, d)
    order = np.where(pos >= 0, pos, -1)
    faults = 0
    if ns > 1 and np.any((np.diff(order, axis=1) <= 0) & (pos[:, 1:] >= 0)):
        faults |= KernelFault.KV_ORDER
    clean = pos.copy()
    too_far = clean >= int(capacity)
    if too_far.any():
        faults |= KernelFault.KV_POSITION
        clean[too_far] = -1
    rows, cols = np.nonzero(clean >= 0)
    span = (heads - 1) * strides.head + (d - 1) * strides.dim + 1
    base, bad = _token_bases(rows, clean[rows, cols], table, strides, span, int(cache_elems))
    faults |= bad
    clean[rows[base < 0], cols[base < 0]] = -1
    if faults:
        set_fault(status, KernelFault(faults))
    geometry = _geometry(
        tuple(int(v) for v in (s_batch, s_token, s_head, s_dim, s_page, page_size)), int(capacity)
    )
    if faults & KernelFault.KV_ORDER:
        # The reference refuses unordered positions; write token by token, in order, as the GPU
        # writes every valid token (which copy of a repeated slot wins is unspecified there).
        for r, c in zip(*np.nonzero(clean >= 0), strict=True):
            one = np.full((nb, 1), -1, dtype=np.int64)
            one[r, 0] = clean[r, c]
            ref.kv_commit_into(
                kc, vc, keys[:, c : c + 1], values[:, c : c + 1], one, geometry, table
            )
        return
    ref.kv_commit_into(kc, vc, keys, values, clean, geometry, table)


KV_COMMIT_KERNEL = register_one(
    "kv_commit",
    _COMMIT_BODY,
    (
        "u8* u8* i64* u8* u8* void* i32 void* i64 i64 i64 i32 i32 i64 "
        "i64 i64 i64 i64 i64 i64 i64 i64 i32 i32 u32*"
    ),
    _commit_cpu,
)

# --- KVCommit with the q/k rotation and the projection's bias ----------------------------------

_ROTARY_COMMIT_BODY = (
    ROTARY_DEVICE
    + _ADDRESSING
    + _COMMIT_DEVICE
    + r"""
// One token's value at feature i of x, plus bias[i] rounded to T when there is a bias (what the
// projection's Add stores).
static __device__ __forceinline__ T biased(const T* x, const T* bias, i64 i) {
    return bias ? from_f32<T>(__fadd_rn(to_f32(x[i]), to_f32(bias[i]))) : x[i];
}

// One token's ``heads`` heads of (x + bias) into y, feature d of head h at y[h*y_head + d*y_dim]:
// the first 2*half features of each head rotated (unless ``rotate`` is false), the rest copied.
static __device__ void rotate_into(T* y, i64 y_head, i64 y_dim, const T* x, const T* bias,
                                   int heads, int dim, int half, int interleaved, bool rotate,
                                   const float* cs, const float* sn) {
    const int pairs = rotate ? half : 0;
    const int units = pairs + dim - 2 * pairs;  // pairs, then the features that pass through
    for (int idx = threadIdx.x; idx < heads * units; idx += blockDim.x) {
        const int h = idx / units;
        const int j = idx - h * units;
        const i64 at = (i64)h * dim;
        T* yh = y + h * y_head;
        if (j < pairs) {
            const int a = interleaved ? 2 * j : j;
            const int b = interleaved ? 2 * j + 1 : j + half;
            float r1, r2;
            rotate_pair(to_f32(biased(x, bias, at + a)), to_f32(biased(x, bias, at + b)), cs[j],
                        sn[j], &r1, &r2);
            yh[a * y_dim] = from_f32<T>(r1);
            yh[b * y_dim] = from_f32<T>(r2);
        } else {
            const int d = 2 * pairs + (j - pairs);
            yh[d * y_dim] = biased(x, bias, at + d);
        }
    }
}

// Rotary(q) and Rotary(k) of one projection, then KVCommit(k, v), with the projection's bias
// Add first when ``has_bias``: one block per token, as each of them.
extern "C" __global__ void __launch_bounds__(256) KERNEL(
    T* q_out, i64 q_out_tok, const T* q, i64 q_tok, int heads,
    const T* k, i64 k_tok, const T* v, i64 v_tok, int kv_heads,
    const T* bias, int has_bias, i64 q_bias, i64 k_bias, i64 v_bias,
    const void* __restrict__ positions, int pos_i64,
    const T* __restrict__ cos_cache, const T* __restrict__ sin_cache,
    const void* __restrict__ inv_freq, i64 max_pos, int mode, double theta_for_cpu_twin,
    int dim, int half, int interleaved,
    T* kcache, T* vcache, i64* lengths, const void* __restrict__ block_table, i64 table_cols,
    i64 batch, i64 seq, i64 s_batch, i64 s_token, i64 s_head, i64 s_dim, i64 s_page,
    i64 page_size, i64 capacity, i64 cache_elems, u32* status) {
    __shared__ float cs[MAX_HALF];
    __shared__ float sn[MAX_HALF];
    __shared__ i64 row_max[32];
    const i64 tok = blockIdx.x;
    if (tok >= batch * seq) return;
    const i64 b = tok / seq;
    const i64 s = tok - b * seq;
    if (s == 0) commit_length(lengths, positions, pos_i64, b, seq, row_max);
    const i64 pos = load_index(positions, tok, pos_i64);
    const bool rotate = rotary_table(cs, sn, pos, mode, max_pos, cos_cache, sin_cache, inv_freq,
                                     half, status);
    __syncthreads();
    rotate_into(q_out + tok * q_out_tok, dim, 1, q + tok * q_tok, has_bias ? bias + q_bias : 0,
                heads, dim, half, interleaved, rotate, cs, sn);
    const i64 base = commit_slot(b, s, tok, pos, positions, pos_i64, block_table, table_cols,
                                 kv_heads, dim, s_batch, s_token, s_head, s_dim, s_page,
                                 page_size, capacity, cache_elems, status);
    if (base < 0) return;
    rotate_into(kcache + base, s_head, s_dim, k + tok * k_tok, has_bias ? bias + k_bias : 0,
                kv_heads, dim, half, interleaved, rotate, cs, sn);
    rotate_into(vcache + base, s_head, s_dim, v + tok * v_tok, has_bias ? bias + v_bias : 0,
                kv_heads, dim, half, interleaved, false, cs, sn);
}
"""
)


def _rotary_commit_cpu(
    q_out: np.ndarray,
    q_out_tok: np.int64,
    q: np.ndarray,
    q_tok: np.int64,
    heads: np.int32,
    k: np.ndarray,
    k_tok: np.int64,
    v: np.ndarray,
    v_tok: np.int64,
    kv_heads: np.int32,
    bias: np.ndarray,
    has_bias: np.int32,
    q_bias: np.int64,
    k_bias: np.int64,
    v_bias: np.int64,
    positions: np.ndarray,
    pos_i64: np.int32,
    cos_cache: np.ndarray,
    sin_cache: np.ndarray,
    inv_freq: np.ndarray,
    max_pos: np.int64,
    mode: np.int32,
    theta: np.float64,
    dim: np.int32,
    half: np.int32,
    interleaved: np.int32,
    kcache: np.ndarray,
    vcache: np.ndarray,
    lengths: np.ndarray,
    block_table: np.ndarray,
    table_cols: np.int64,
    batch: np.int64,
    seq: np.int64,
    s_batch: np.int64,
    s_token: np.int64,
    s_head: np.int64,
    s_dim: np.int64,
    s_page: np.int64,
    page_size: np.int64,
    capacity: np.int64,
    cache_elems: np.int64,
    status: np.ndarray,
) -> None:
    """The unfused chain's twins in a row: the bias add, `rotary`'s, `kv_commit`'s."""
    n, d = int(batch) * int(seq), int(dim)

    def source(x: np.ndarray, tok: np.int64, count: np.int32, at: np.int64) -> np.ndarray:
        per = int(count) * d
        rows = x[np.arange(n)[:, None] * int(tok) + np.arange(per)[None, :]]
        if has_bias:  # same-dtype NumPy add, as the native Add's twin: rounded once
            rows = rows + bias[int(at) : int(at) + per]
        return np.ascontiguousarray(rows).reshape(-1)

    qs, ks = source(q, q_tok, heads, q_bias), source(k, k_tok, kv_heads, k_bias)
    vs = source(v, v_tok, kv_heads, v_bias)
    k_rot = np.empty_like(ks)
    per_q, per_k = np.int64(int(heads) * d), np.int64(int(kv_heads) * d)
    rotary_twin(
        q_out, qs, heads, per_q, q_out_tok, k_rot, ks, kv_heads, per_k, per_k,
        positions, pos_i64, cos_cache, sin_cache, inv_freq, max_pos, mode, theta,
        np.int64(n), dim, half, interleaved, status,
    )  # fmt: skip
    _commit_cpu(
        kcache.view(np.uint8), vcache.view(np.uint8), lengths, k_rot.view(np.uint8),
        vs.view(np.uint8), positions, pos_i64, block_table, table_cols, batch, seq, kv_heads,
        dim, per_k, s_batch, s_token, s_head, s_dim, s_page, page_size, capacity, cache_elems,
        np.int32(kcache.dtype.itemsize), np.int32(0), status,
    )  # fmt: skip


ROTARY_COMMIT_KERNELS = register_per_dtype(
    "kv_commit_rotary",
    _ROTARY_COMMIT_BODY,
    (
        "T* i64 T* i64 i32 T* i64 T* i64 i32 T* i32 i64 i64 i64 void* i32 T* T* void* i64 i32 "
        "f64 i32 i32 i32 T* T* i64* void* i64 i64 i64 i64 i64 i64 i64 i64 i64 i64 i64 u32*"
    ),
    _rotary_commit_cpu,
    EXACT_OPTIONS,  # as rotary_<dt>: the same bits from the same device code
)


@dataclass(frozen=True)
class _RotaryCommit:
    """The checked table and index arguments of a rotary commit (both of its kernels)."""

    mode: int  # 0: cos/sin caches, 1: theta
    cos: Buffer
    sin: Buffer
    freq: Buffer
    max_pos: int
    half: int
    table: Buffer
    cols: int
    pos_i64: int


def _check_rotary_commit(
    op: str,
    key_cache: Buffer,
    value_cache: Buffer,
    lengths: Buffer,
    q_out: Buffer,
    positions: Buffer,
    sources: dict[str, tuple[Buffer, int, int]],
    *,
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    strides: KVStrides,
    capacity: int,
    cos_cache: Buffer | None,
    sin_cache: Buffer | None,
    max_positions: int,
    inv_freq: Buffer | None,
    theta: float,
    rotary_dim: int,
    interleaved: int,
    bias: Buffer | None,
    bias_offsets: tuple[int, int, int],
    block_table: Buffer | None,
    table_cols: int,
    status: Buffer,
) -> _RotaryCommit:
    """What `kv_commit_rotary` and `rope_epilogue` check; ``sources``: name -> (buffer, token
    stride, elements a token) of the q/k/v inputs (none for the epilogue: the GEMV's sums) and
    of ``q_out``."""
    positive(op, batch=batch, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    need(heads > 0 and kv_heads > 0, op, f"heads={heads}, kv_heads={kv_heads} must be > 0")
    _check_strides(op, strides)
    table, cols = _cache_checks(
        op, key_cache, value_cache, strides, capacity, batch, block_table, table_cols
    )
    dtype = key_cache.dtype
    dtype_suffix(dtype, op)
    rot = check_rotation(op, head_dim, rotary_dim, interleaved)
    tokens = batch * seq
    for name, (buf, tok, per) in sources.items():
        need(tok >= per, op, f"{name} token stride {tok} must be >= {per}")
        check_buffer(op, name, buf, (tokens - 1) * tok + per if tokens else 0, dtype)
    inputs = [b for name, (b, _, _) in sources.items() if name != "q_out"]
    need(
        not any(_overlap(c, x) for c in (key_cache, value_cache) for x in (*inputs, q_out)),
        op,
        "q, k, v and q_out must not overlap the caches",
    )
    if cos_cache is not None or sin_cache is not None:
        need(
            cos_cache is not None and sin_cache is not None and inv_freq is None,
            op,
            "pass cos_cache and sin_cache (Rotary), or inv_freq and theta (RotaryTheta)",
        )
        assert cos_cache is not None and sin_cache is not None
        positive(op, max_positions=max_positions)
        need(max_positions > 0, op, "max_positions must be > 0 with cos/sin caches")
        check_buffer(op, "cos_cache", cos_cache, max_positions * rot // 2, dtype)
        check_buffer(op, "sin_cache", sin_cache, max_positions * rot // 2, dtype)
        mode, cos, sin, freq = 0, cos_cache, sin_cache, cos_cache
    else:
        need(
            inv_freq is not None and theta > 0,
            op,
            "pass cos_cache and sin_cache (Rotary), or inv_freq and theta > 0 (RotaryTheta)",
        )
        assert inv_freq is not None
        check_buffer(op, "inv_freq", inv_freq, rot // 2, np.dtype(np.float32))
        mode, cos, sin, freq = 1, q_out, q_out, inv_freq  # no caches: q_out fills the typed slots
    if bias is not None:
        q_per, kv_per = heads * head_dim, kv_heads * head_dim
        need(
            all(isinstance(o, int) and o >= 0 for o in bias_offsets),
            op,
            f"bias_offsets {bias_offsets!r} must be three non-negative ints (q, k, v)",
        )
        top = max(o + w for o, w in zip(bias_offsets, (q_per, kv_per, kv_per), strict=True))
        check_buffer(op, "bias", bias, top, dtype)
    pos_i64 = check_index_buffer(op, "positions", positions, tokens)
    check_buffer(op, "lengths", lengths, batch, np.dtype(np.int64))
    check_status(op, status)
    return _RotaryCommit(
        mode, cos, sin, freq, max_positions if mode == 0 else 0, rot // 2, table, cols, pos_i64
    )


def kv_commit_rotary(
    dev: Device,
    key_cache: Buffer,
    value_cache: Buffer,
    lengths: Buffer,
    q_out: Buffer,
    q: Buffer,
    k: Buffer,
    v: Buffer,
    positions: Buffer,
    *,
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    strides: KVStrides,
    capacity: int,
    cos_cache: Buffer | None = None,
    sin_cache: Buffer | None = None,
    max_positions: int = 0,
    inv_freq: Buffer | None = None,
    theta: float = 0.0,
    rotary_dim: int = 0,
    interleaved: int = 0,
    bias: Buffer | None = None,
    bias_offsets: tuple[int, int, int] = (0, 0, 0),
    q_token_stride: int = 0,
    q_out_token_stride: int = 0,
    k_token_stride: int = 0,
    v_token_stride: int = 0,
    block_table: Buffer | None = None,
    table_cols: int = 0,
    status: Buffer,
    stream: Stream,
) -> None:
    """`kv_commit` of (rotated k, v) plus q rotated into ``q_out``, in one launch; with ``bias``,
    ``bias[bias_offsets[i] + c]`` is first added to feature c of q, k and v (rounded to the dtype,
    as the projection's Add).

    Stores exactly what `ep.kernels.rotary.rotary` (or `rotary_theta`) of q and k followed by
    `kv_commit` store: the same rounding, faults and ``lengths``. Rotary from cos/sin caches
    [max_positions, rotary_dim/2] (``cos_cache``, ``sin_cache``, ``max_positions``) or from theta
    (``inv_freq`` = `rotary_inv_freq` (theta, rotary_dim), and ``theta``). q is [batch, seq, heads,
    head_dim], k and v [batch, seq, kv_heads, head_dim], each with its own token stride (default:
    packed), so they may be views into one QKV projection; ``q_out`` may be ``q`` itself.
    """
    op = "KVCommitRotary"
    q_per, kv_per = heads * head_dim, kv_heads * head_dim
    sources = {
        "q": (q, q_token_stride or q_per, q_per),
        "q_out": (q_out, q_out_token_stride or q_per, q_per),
        "k": (k, k_token_stride or kv_per, kv_per),
        "v": (v, v_token_stride or kv_per, kv_per),
    }
    rc = _check_rotary_commit(
        op, key_cache, value_cache, lengths, q_out, positions, sources, batch=batch, seq=seq,
        heads=heads, kv_heads=kv_heads, head_dim=head_dim, strides=strides, capacity=capacity,
        cos_cache=cos_cache, sin_cache=sin_cache, max_positions=max_positions, inv_freq=inv_freq,
        theta=theta, rotary_dim=rotary_dim, interleaved=interleaved, bias=bias,
        bias_offsets=bias_offsets, block_table=block_table, table_cols=table_cols, status=status,
    )  # fmt: skip
    q_tok, q_out_tok = sources["q"][1], sources["q_out"][1]
    need(
        (q_out.ptr == q.ptr and q_out_tok == q_tok)
        or not any(_overlap(q_out, x) for x in (q, k, v)),
        op,
        "q_out must be q itself (same token stride) or overlap none of q, k and v",
    )
    if batch == 0:
        return
    if seq == 0:
        dev.fill(lengths.view(np.int64, (batch,)), 0, stream=stream)
        return
    dev.kernel(ROTARY_COMMIT_KERNELS[dtype_suffix(key_cache.dtype, op)].name).launch(
        batch * seq,
        _THREADS,
        q_out, q_out_tok, q, q_tok, heads,
        k, sources["k"][1], v, sources["v"][1], kv_heads,
        bias if bias is not None else q, int(bias is not None), *bias_offsets,
        positions, rc.pos_i64, rc.cos, rc.sin, rc.freq, rc.max_pos, rc.mode,
        float(theta), head_dim, rc.half, interleaved,
        key_cache, value_cache, lengths, rc.table, rc.cols,
        batch, seq,
        strides.batch, strides.token, strides.head, strides.dim, strides.page, strides.page_size,
        capacity, key_cache.size, status,
        stream=stream,
    )  # fmt: skip


# --- the same as the QKV projection's GEMV epilogue --------------------------------------------

ROPE_COLS = (
    ROTARY_DEVICE
    + _ADDRESSING
    + r"""
// --- the rotary/KV-commit epilogue of the QKV projection's split-K GEMV -----------------------

// `RopeCols<COLS>`, the column map of ``ep_gemv_<fmt>_rope_<dt>`` (`ep.kernels.matmul`'s split-K
// GEMV): the weight's N outputs are the packed [q | k | v] heads of ``dim`` features, taken as
// dim / 2 pairs a head: (i, i + half) for the rotated i < half and then adjacent pass-through
// features (interleaved: (2i, 2i + 1), rotated while i < half). Launch column n is, within its
// group of COLS, the first (n % COLS < H) or second feature of pair (n / COLS) * H + n % H, so
// one block finishes both features of a pair: it rounds the two sums to T as the GEMV stores
// them and then does what `kv_commit_rotary` does with them (bias, rotation, q into q_out, k and
// v into the caches), with the same device code. Needs dim % COLS == 0 (the plan checks: a
// group's pairs lie in one head). Faults and ``lengths`` are per token: `tokens`, run once.
template <int COLS>
struct RopeCols {
    static constexpr bool kPairs = true;
    static constexpr bool kTokens = true;
    static constexpr int H = COLS / 2;
    int N;
    T* q_out;
    i64 q_out_tok;
    int heads, kv_heads, dim, half, interleaved;
    const T* bias;  // null: no bias
    const void* positions;
    int pos_i64;
    const T* cos_cache;
    const T* sin_cache;
    const void* inv_freq;
    i64 max_pos;
    int mode;
    T* kcache;
    T* vcache;
    i64* lengths;
    const int* table;
    i64 table_cols, batch, seq, s_batch, s_token, s_head, s_dim, s_page, page_size, capacity,
        cache_elems;
    u32* status;

    __device__ __forceinline__ int pair(int n) const { return (n / COLS) * H + n % H; }
    // The features (fa, fb) of pair i of a head.
    __device__ __forceinline__ void features(int i, int& fa, int& fb) const {
        if (interleaved) {
            fa = 2 * i;
        } else if (i < half) {
            fa = i;
            fb = i + half;
            return;
        } else {
            fa = 2 * i;  // past the rotated features: 2 half + 2 (i - half)
        }
        fb = fa + 1;
    }
    __device__ __forceinline__ int row(int n) const {
        const int p = pair(n), hd = dim >> 1, h = p / hd;
        int fa, fb;
        features(p - h * hd, fa, fb);
        return h * dim + ((n % COLS) < H ? fa : fb);
    }
    __device__ __forceinline__ bool ok(int n) const { return pair(n) < (N >> 1); }
    __device__ __forceinline__ i64 slot(i64 tok, i64 pos, bool report) const {
        const i64 span = (i64)(kv_heads - 1) * s_head + (i64)(dim - 1) * s_dim + 1;
        return kv_token_base(tok / seq, pos, table, table_cols, s_batch, s_token, s_page,
                             page_size, span, cache_elems, status, report);
    }

    // Row m's pair of features starting at column n, with float sums sa, sb.
    template <typename X>
    __device__ __forceinline__ void store(X*, int m, int n, float sa, float sb) const {
        const int p = pair(n), hd = dim >> 1, h = p / hd, i = p - h * hd;
        int fa, fb;
        features(i, fa, fb);
        T va = from_f32<T>(sa), vb = from_f32<T>(sb);  // the GEMV's outputs
        if (bias) {  // the projection's Add, as `biased`
            va = from_f32<T>(__fadd_rn(to_f32(va), to_f32(bias[h * dim + fa])));
            vb = from_f32<T>(__fadd_rn(to_f32(vb), to_f32(bias[h * dim + fb])));
        }
        const i64 tok = m;
        const i64 pos = load_index(positions, tok, pos_i64);
        T* dst;
        i64 step = 1;
        if (h < heads) {
            dst = q_out + tok * q_out_tok + (i64)h * dim;
        } else {
            if (pos < 0 || pos >= capacity) return;  // padding, or a fault `tokens` reports
            const i64 base = slot(tok, pos, false);
            if (base < 0) return;
            const bool key = h < heads + kv_heads;
            dst = (key ? kcache : vcache) + base +
                  (i64)(h - heads - (key ? 0 : kv_heads)) * s_head;
            step = s_dim;
        }
        if (h < heads + kv_heads && i < half && pos >= 0 && !(mode == 0 && pos >= max_pos)) {
            float c, s;
            if (mode == 0) {
                c = to_f32(cos_cache[pos * half + i]);
                s = to_f32(sin_cache[pos * half + i]);
            } else {  // as `rotary_table`
                const float angle =
                    __fmul_rn((float)pos, reinterpret_cast<const float*>(inv_freq)[i]);
                sincosf(angle, &s, &c);
                c = to_f32(from_f32<T>(c));
                s = to_f32(from_f32<T>(s));
            }
            float r1, r2;
            rotate_pair(to_f32(va), to_f32(vb), c, s, &r1, &r2);
            va = from_f32<T>(r1);
            vb = from_f32<T>(r2);
        }
        dst[fa * step] = va;
        dst[fb * step] = vb;
    }

    // Per token, once a launch: ``lengths`` and the faults `rotary_table`, `commit_length` and
    // `commit_slot` set in `kv_commit_rotary`.
    __device__ void tokens(int M) const {
        for (int tok = threadIdx.x; tok < M; tok += blockDim.x) {
            const i64 b = tok / seq, s = tok - b * seq;
            const i64 pos = load_index(positions, tok, pos_i64);
            if (s == 0) {
                i64 best = -1;
                for (i64 j = 0; j < seq; ++j) {
                    const i64 q = load_index(positions, b * seq + j, pos_i64);
                    best = q > best ? q : best;
                }
                lengths[b] = best + 1;
            }
            if (pos < 0) continue;
            if (mode == 0 && pos >= max_pos) set_fault(status, 2u);  // ROTARY_POSITION
            if (s > 0) {
                const i64 prev = load_index(positions, tok - 1, pos_i64);
                if (prev >= 0 && pos <= prev) set_fault(status, 16u);  // KV_ORDER
            }
            if (pos >= capacity) {
                set_fault(status, 4u);  // KV_POSITION
                continue;
            }
            slot(tok, pos, true);
        }
    }
};
"""
)
# The kernel parameters `RopeCols` reads, after the GEMV's flags (the `RopeEpilogue`'s args).
_ROPE_PARAMS = (
    ", T* q_out, i64 q_out_tok, int heads, int kv_heads, int dim, int half, int interleaved, "
    "const T* bias, int has_bias, const void* positions, int pos_i64, const T* cos_cache, "
    "const T* sin_cache, const void* inv_freq, i64 max_pos, int mode, double theta, T* kcache, "
    "T* vcache, i64* lengths, const void* block_table, i64 table_cols, i64 batch, i64 seq, "
    "i64 s_batch, i64 s_token, i64 s_head, i64 s_dim, i64 s_page, i64 page_size, i64 capacity, "
    "i64 cache_elems, u32* status"
)
_ROPE_TYPES = (
    "T*", "i64", "i32", "i32", "i32", "i32", "i32", "T*", "i32", "void*", "i32", "T*", "T*",
    "void*", "i64", "i32", "f64", "T*", "T*", "i64*", "void*", *["i64"] * 11, "u32*",
)  # fmt: skip


def _rope_cols(cols: int) -> str:
    return (
        f"const RopeCols<{cols}> oc{{N, q_out, q_out_tok, heads, kv_heads, dim, half, "
        "interleaved, has_bias ? bias : nullptr, positions, pos_i64, cos_cache, sin_cache, "
        "inv_freq, max_pos, mode, kcache, vcache, lengths, "
        "reinterpret_cast<const int*>(block_table), table_cols, batch, seq, s_batch, s_token, "
        "s_head, s_dim, s_page, page_size, capacity, cache_elems, status};"
    )


def _rope_finish(_y: Any, rows: np.ndarray, *params: Any) -> None:
    """`kv_commit_rotary`'s twin on the q, k and v columns of the GEMV's product."""
    (q_out, q_out_tok, heads, kv_heads, dim, half, interleaved, bias, has_bias) = params[:9]
    packed, n = rows.reshape(-1), np.int64(rows.shape[1])
    q_per, kv_per = int(heads) * int(dim), int(kv_heads) * int(dim)
    tables, commit = params[9:17], params[17:]  # positions .. theta; the caches .. status
    _rotary_commit_cpu(
        q_out, q_out_tok, packed, n, heads, packed[q_per:], n, packed[q_per + kv_per :], n,
        kv_heads, bias, has_bias, np.int64(0), np.int64(q_per), np.int64(q_per + kv_per),
        *tables, dim, half, interleaved, *commit,  # type: ignore[call-arg]
    )  # fmt: skip


ROPE_GEMV_KERNELS = matmul.register_gemv_epilogue(
    "rope",
    (_ROPE_PARAMS, _rope_cols),
    _ROPE_TYPES,
    _rope_finish,
    head=PRELUDE,
    tail=ROPE_COLS,
    options=EXACT_OPTIONS,  # sincosf as the rotary kernels compile it (theta tables)
)


def rope_epilogue(
    key_cache: Buffer,
    value_cache: Buffer,
    lengths: Buffer,
    q_out: Buffer,
    positions: Buffer,
    *,
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    strides: KVStrides,
    capacity: int,
    cos_cache: Buffer | None = None,
    sin_cache: Buffer | None = None,
    max_positions: int = 0,
    inv_freq: Buffer | None = None,
    theta: float = 0.0,
    rotary_dim: int = 0,
    interleaved: int = 0,
    bias: Buffer | None = None,
    q_out_token_stride: int = 0,
    block_table: Buffer | None = None,
    table_cols: int = 0,
    status: Buffer,
) -> matmul.RopeEpilogue:
    """`kv_commit_rotary` as the epilogue of the packed QKV projection's GEMV (`ep.kernels.matmul`
    ``gemm``/``gemm_nbits``/``gemm_mxfp4``'s ``rope``): the projection's N = (heads + 2 kv_heads)
    * head_dim outputs of each of its batch * seq rows are q, k and v (in that order, head by
    head), ``bias`` (when given) is that projection's [N] bias. The arguments are
    `kv_commit_rotary`'s without q, k and v; head_dim must be a multiple of 16 (the GEMV's column
    groups hold whole pairs of one head). The GEMV then stores what the GEMV followed by
    `kv_commit_rotary` stores, bitwise, and nothing at its own output."""
    op = "KVCommitRotary"
    need(
        head_dim % 16 == 0,
        op,
        f"head_dim={head_dim}: the GEMV epilogue needs a multiple of 16; run the GEMV and "
        "kv_commit_rotary",
    )
    q_per = heads * head_dim
    columns = (heads + 2 * kv_heads) * head_dim
    q_out_tok = q_out_token_stride or q_per
    rc = _check_rotary_commit(
        op, key_cache, value_cache, lengths, q_out, positions,
        {"q_out": (q_out, q_out_tok, q_per)}, batch=batch, seq=seq, heads=heads,
        kv_heads=kv_heads, head_dim=head_dim, strides=strides, capacity=capacity,
        cos_cache=cos_cache, sin_cache=sin_cache, max_positions=max_positions, inv_freq=inv_freq,
        theta=theta, rotary_dim=rotary_dim, interleaved=interleaved, bias=bias,
        bias_offsets=(0, q_per, q_per + kv_heads * head_dim), block_table=block_table,
        table_cols=table_cols, status=status,
    )  # fmt: skip
    args = (
        q_out, q_out_tok, heads, kv_heads, head_dim, rc.half, interleaved,
        bias if bias is not None else q_out, int(bias is not None), positions, rc.pos_i64,
        rc.cos, rc.sin, rc.freq, rc.max_pos, rc.mode, float(theta), key_cache, value_cache,
        lengths, rc.table, rc.cols, batch, seq, strides.batch, strides.token, strides.head,
        strides.dim, strides.page, strides.page_size, capacity, key_cache.size, status,
    )  # fmt: skip
    return matmul.RopeEpilogue(
        columns, batch * seq, args, (q_out, key_cache, value_cache, lengths, status)
    )


def _overlap(a: Buffer, b: Buffer) -> bool:
    return a.ptr < b.ptr + b.nbytes and b.ptr < a.ptr + a.nbytes


# --- KVAttention -------------------------------------------------------------------------------

_ATTENTION_BODY = (
    _ADDRESSING
    + r"""
#define MAX_ACC 16

// acc[j] += Σ_t p[row j][t] * v[t][own_d] for RPT rows (a compile-time count: no predicates).
template <int RPT>
static __device__ __forceinline__ void pv_rows(float* acc, const float* pcol, int row_step,
                                               const float* v_s, int D4, int own_d, int TT) {
    for (int t = 0; t < TT; ++t) {
        const float v = v_s[t * D4 + own_d];
#pragma unroll
        for (int j = 0; j < RPT; ++j) acc[j] += pcol[j * row_step + t] * v;
    }
}

extern "C" __global__ void __launch_bounds__(256, 2) KERNEL(ATTENTION_PARAMS) {
    extern __shared__ __align__(16) unsigned char smem[];
    const int G = heads / kv_heads;
    const int R = q_tile * G;
    const int D4 = (dim + 3) & ~3;
    const int KS = D4 + 4;  // padded K rows: float4 reads of consecutive rows hit distinct banks
    const int TT = kv_tile;
    // Output ownership: thread tid owns feature own_d = tid % D4 of rows g0, g0 + dgroups, ...
    // (head_dim <= 256 and 256 threads, so dgroups >= 1); a V value read once serves all its
    // rows. Each thread walks rpt rows (a power of two), so p/m/l/alpha hold RP = rpt * dgroups
    // rows, those past R unused.
    const int dgroups = (int)blockDim.x / D4;
    const int own_d = threadIdx.x % D4;
    const int g0 = threadIdx.x / D4;
    int rpt = 1;
    while (rpt * dgroups < R) rpt <<= 1;
    const int RP = rpt * dgroups;
    const int nrows = g0 < dgroups && g0 < R ? (R - g0 + dgroups - 1) / dgroups : 0;
    i64* tok_base = reinterpret_cast<i64*>(smem);
    i64* qpos = tok_base + TT;
    float* q_s = reinterpret_cast<float*>(tok_base + ((TT + q_tile + 1) & ~1));
    float* k_s = q_s + R * D4;
    float* v_s = k_s + TT * KS;
    float* p_s = v_s + TT * D4;
    float* m_s = p_s + RP * TT;
    float* l_s = m_s + RP;
    float* a_s = l_s + RP;

    const i64 n_qtiles = (seq + q_tile - 1) / q_tile;
    const i64 b = blockIdx.x / n_qtiles;
    const i64 s0 = ((i64)blockIdx.x - b * n_qtiles) * q_tile;
    const int kvh = blockIdx.y;
    const int split = blockIdx.z;
    const int tid = threadIdx.x;
    const int* table = reinterpret_cast<const int*>(block_table);
    const i64 span = (i64)(kv_heads - 1) * s_head + (i64)(dim - 1) * s_dim + 1;
    const i64 head_off = (i64)kvh * s_head;

    // 1. The query tile: positions (-1 when padding or faulted) and queries pre-scaled. The
    // queries are loaded into registers beside the positions (not after), then masked.
    float qv[MAX_ACC];  // R * D4 <= MAX_ACC * blockDim.x
#pragma unroll
    for (int i = 0; i < MAX_ACC; ++i) {
        const int idx = tid + i * (int)blockDim.x;
        qv[i] = 0.0f;
        if (idx < R * D4) {
            const int r = idx / D4, d = idx - r * D4;
            const int qi = r / G, g = r - qi * G;
            if (d < dim && s0 + qi < seq) {
                const i64 row = b * seq + s0 + qi;
                qv[i] = to_f32(query[row * q_tok + (i64)(kvh * G + g) * dim + d]);
            }
        }
    }
    if (tid < q_tile) {
        const i64 s = s0 + tid;
        i64 p = -1;
        if (s < seq) {
            const i64 committed = lengths[b];  // loaded beside the position, not after it
            p = load_index(positions, b * seq + s, pos_i64);
            if (p >= 0 && (p >= capacity || p >= committed)) {
                if (kvh == 0 && split == 0) set_fault(status, 4u);  // KernelFault.KV_POSITION
                p = -1;
            }
        }
        qpos[tid] = p < 0 ? -1 : p;
    }
    __syncthreads();
#pragma unroll
    for (int i = 0; i < MAX_ACC; ++i) {
        const int idx = tid + i * (int)blockDim.x;
        if (idx < R * D4) q_s[idx] = qpos[idx / D4 / G] >= 0 ? qv[i] * scale : 0.0f;
    }
    for (int r = tid; r < R; r += blockDim.x) {
        m_s[r] = NEG_INF;
        l_s[r] = 0.0f;
    }
    i64 last = -1;
    for (int qi = 0; qi < q_tile; ++qi) last = qpos[qi] > last ? qpos[qi] : last;
    // This split's share of the live context [0, last]: cut on the device, so a graph captured
    // for a large capacity spreads a short context over all its splits.
    const i64 share = split_share(last + 1, splits, TT);
    const i64 begin = (i64)split * share;
    const i64 end = (begin + share) < (last + 1) ? (begin + share) : (last + 1);

    float acc[MAX_ACC];
#pragma unroll
    for (int j = 0; j < MAX_ACC; ++j) acc[j] = 0.0f;
    constexpr int N = Pack<T>::N;
    const int groups = blockDim.x / lanes;
    const int lane_in = tid & (lanes - 1);
    const int pairs = R * TT;
    const int rounds = (pairs + groups - 1) / groups;
    const int C4 = D4 / 4;
    const int warp = tid >> 5, lane = tid & 31, nwarps = blockDim.x >> 5;
    __syncthreads();

    for (i64 t0 = begin; t0 < end; t0 += TT) {
        // 2. Where each token of the tile lives (-1: past the end, or unaddressable).
        if (tid < TT) {
            const i64 t = t0 + tid;
            tok_base[tid] = t < end ? kv_token_base(b, t, table, table_cols, s_batch, s_token,
                                                    s_page, page_size, span, cache_elems, status,
                                                    kvh == 0)
                                    : -1;
        }
        __syncthreads();
        // 3. K and V tiles to shared memory, as float32.
        if (vec) {  // dim % N == 0 (so D4 == dim), s_dim == 1, 16-byte aligned rows
            const int cpr = dim / N;
            for (int i = tid; i < TT * cpr; i += blockDim.x) {
                const int t = i / cpr, c = i - t * cpr;
                const i64 base = tok_base[t];
                float kv[N], vv[N];
                if (base >= 0) {
                    load16(kcache + base + head_off + (i64)c * N, kv);
                    load16(vcache + base + head_off + (i64)c * N, vv);
                } else {
#pragma unroll
                    for (int k = 0; k < N; ++k) kv[k] = vv[k] = 0.0f;
                }
#pragma unroll
                for (int k = 0; k < N; ++k) {
                    k_s[t * KS + c * N + k] = kv[k];
                    v_s[t * D4 + c * N + k] = vv[k];
                }
            }
        } else {
            for (int i = tid; i < TT * D4; i += blockDim.x) {
                const int t = i / D4, d = i - t * D4;
                const i64 base = tok_base[t];
                float kx = 0.0f, vx = 0.0f;
                if (base >= 0 && d < dim) {
                    const i64 e = base + head_off + (i64)d * s_dim;
                    kx = to_f32(kcache[e]);
                    vx = to_f32(vcache[e]);
                }
                k_s[t * KS + d] = kx;
                v_s[t * D4 + d] = vx;
            }
        }
        __syncthreads();
        // 4. Scores, masked: causal (token <= the query's position) and unaddressable tokens.
        for (int round = 0; round < rounds; ++round) {
            const int w = round * groups + tid / lanes;
            float part = 0.0f;
            int r = 0, t = 0;
            if (w < pairs) {
                r = w / TT;
                t = w - r * TT;
                const float4* q4 = reinterpret_cast<const float4*>(q_s + r * D4);
                const float4* k4 = reinterpret_cast<const float4*>(k_s + t * KS);
                for (int c = lane_in; c < C4; c += lanes) {
                    const float4 x = q4[c], y = k4[c];
                    part += x.x * y.x + x.y * y.y + x.z * y.z + x.w * y.w;
                }
            }
            for (int o = lanes >> 1; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
            if (w < pairs && lane_in == 0) {
                const bool live = tok_base[t] >= 0 && t0 + t <= qpos[r / G];
                p_s[r * TT + t] = live ? part : NEG_INF;
            }
        }
        __syncthreads();
        // 5. Online softmax: one warp per query row.
        for (int r = warp; r < R; r += nwarps) {
            float* row = p_s + r * TT;
            float mx = NEG_INF;
            for (int t = lane; t < TT; t += 32) mx = fmaxf(mx, row[t]);
            mx = warp_max(mx);
            const float m_old = m_s[r];
            const float m_new = fmaxf(m_old, mx);
            float sum = 0.0f;
            for (int t = lane; t < TT; t += 32) {
                const float p = m_new == NEG_INF ? 0.0f : expf(row[t] - m_new);
                row[t] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                const float alpha = m_old == NEG_INF ? 0.0f : expf(m_old - m_new);
                l_s[r] = l_s[r] * alpha + sum;
                m_s[r] = m_new;
                a_s[r] = alpha;
            }
        }
        __syncthreads();
        // 6. Weighted sum of V into the registers.
#pragma unroll
        for (int j = 0; j < MAX_ACC; ++j) {
            if (j < nrows) acc[j] *= a_s[g0 + j * dgroups];
        }
        if (nrows > 0) {
            const float* pcol = p_s + g0 * TT;
            const int step = dgroups * TT;
            switch (rpt) {  // rows past nrows accumulate unused values, never written out
                case 1: pv_rows<1>(acc, pcol, step, v_s, D4, own_d, TT); break;
                case 2: pv_rows<2>(acc, pcol, step, v_s, D4, own_d, TT); break;
                case 4: pv_rows<4>(acc, pcol, step, v_s, D4, own_d, TT); break;
                case 8: pv_rows<8>(acc, pcol, step, v_s, D4, own_d, TT); break;
                default: pv_rows<16>(acc, pcol, step, v_s, D4, own_d, TT); break;
            }
        }
        __syncthreads();
    }

    // 7. The output (one split), or this split's partial result for the reduce kernel.
    const i64 rows_total = batch * seq * heads;
    float* ml = ws + rows_total * splits * dim;
#pragma unroll
    for (int j = 0; j < MAX_ACC; ++j) {
        if (j >= nrows || own_d >= dim) continue;
        const int r = g0 + j * dgroups;
        const int qi = r / G, g = r - qi * G;
        const i64 s = s0 + qi;
        if (s >= seq) continue;
        const i64 orow = (b * seq + s) * heads + kvh * G + g;
        if (splits == 1) {
            const float l = l_s[r];
            out[orow * dim + own_d] = from_f32<T>(qpos[qi] >= 0 && l > 0.0f ? acc[j] / l : 0.0f);
        } else {
            const i64 at = orow * splits + split;
            ws[at * dim + own_d] = acc[j];
            if (own_d == 0) {
                ml[2 * at] = m_s[r];
                ml[2 * at + 1] = l_s[r];
            }
        }
    }
}
"""
)

_EX2 = r"""
#define NEG_INF (__int_as_float(0xff800000u))

static __device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
"""

# The split merge of kv_attention_reduce and kv_decode_merge (after _EX2).
_MERGE_SPLITS = r"""
// One output row from the first ``count`` splits' partials (256 threads; dim <= 256): each split
// left its unnormalised output o[i][dim] and (m, l), the max and sum of its softmax, in ml[i];
// the row is sum(w_i o_i) / sum(w_i l_i) with w_i = exp(m_i - max m), or 2^(m_i - max m) when
// BASE2 (kv_decode_tc's softmax runs in base 2). The splits are spread over the threads (each
// one's loads are independent), then 256 / dim thread groups sum the features over interleaved
// splits.
template <typename T, bool BASE2>
static __device__ void merge_splits(T* out, const float* __restrict__ o,
                                    const float* __restrict__ ml, int count, int dim) {
    __shared__ float weight[1024];
    __shared__ float part[256];
    __shared__ float scratch[32];
    float big = NEG_INF;
    for (int i = threadIdx.x; i < count; i += blockDim.x) big = fmaxf(big, ml[2 * i]);
    big = block_max(big, scratch);
    const float ref = big == NEG_INF ? 0.0f : big;
    float total = 0.0f;
    for (int i = threadIdx.x; i < count; i += blockDim.x) {
        const float m = ml[2 * i];
        float w;
        if constexpr (BASE2) {
            w = ex2(m - ref);  // 0 for an empty split (m = -inf)
        } else {
            w = m == NEG_INF ? 0.0f : expf(m - big);
        }
        weight[i] = w;
        total += w * ml[2 * i + 1];
    }
    total = block_sum(total, scratch);  // its barriers also publish weight[]
    const int groups = (int)blockDim.x / dim;
    const int g = threadIdx.x / dim, d = threadIdx.x - g * dim;
    if (g < groups) {
        float acc = 0.0f;
#pragma unroll 4
        for (int i = g; i < count; i += groups) acc += weight[i] * o[(i64)i * dim + d];
        part[threadIdx.x] = acc;
    }
    __syncthreads();
    if (threadIdx.x < dim) {
        float sum = 0.0f;
        for (int k = 0; k < groups; ++k) sum += part[k * dim + threadIdx.x];
        out[threadIdx.x] = from_f32<T>(total > 0.0f ? sum / total : 0.0f);
    }
}
"""

_REDUCE_BODY = (
    _EX2
    + _MERGE_SPLITS
    + r"""
// 256 threads; head_dim <= 256; every split of the row.
extern "C" __global__ void __launch_bounds__(256) KERNEL(
    T* out, const float* __restrict__ ws, i64 rows, int dim, int splits) {
    const i64 row = blockIdx.x;
    if (row >= rows) return;
    merge_splits<T, false>(out + row * dim, ws + row * splits * dim,
                           ws + rows * splits * dim + row * splits * 2, splits, dim);
}
"""
)


_DECODE_BODY = (
    _ADDRESSING
    + r"""
#define MAX_G 8
#define WARPS 4

// Decode (one query token per row): grid (batch, kv_heads, splits), 128 threads = 4 warps. A
// token's K or V row is read as 16-byte pieces by L = dim / N lanes (N elements a piece), so a
// warp takes 32 / L tokens at a time; each lane group runs its own online softmax over every
// (4 * 32 / L)-th token of the split's share for all G query heads of the KV head, with the
// next token's K and V loads issued before this one's arithmetic. Groups merge by shuffles, warps
// through shared memory. Same parameters and workspace format as the tiled kernel (q_tile,
// kv_tile and lanes unused).
extern "C" __global__ void __launch_bounds__(128) KERNEL(ATTENTION_PARAMS) {
    constexpr int N = Pack<T>::N;
    __shared__ float sm_m[WARPS][MAX_G], sm_l[WARPS][MAX_G];
    __shared__ __align__(16) float sm_acc[WARPS][MAX_G][256];
    __shared__ i64 sm_pos;
    const int G = heads / kv_heads;
    const int L = dim / N;  // lanes per token: a power of two <= 32 (the host checks)
    const int TPW = 32 / L;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
    const int grp = lane / L, sub = lane - grp * L;
    const i64 b = blockIdx.x;
    const int kvh = blockIdx.y, split = blockIdx.z;
    const int* table = reinterpret_cast<const int*>(block_table);
    const i64 span = (i64)(kv_heads - 1) * s_head + (i64)(dim - 1) * s_dim + 1;
    const i64 head_off = (i64)kvh * s_head + (i64)sub * N;

    if (tid == 0) {
        const i64 committed = lengths[b];
        i64 p = load_index(positions, b, pos_i64);
        if (p >= 0 && (p >= capacity || p >= committed)) {
            if (kvh == 0 && split == 0) set_fault(status, 4u);  // KernelFault.KV_POSITION
            p = -1;
        }
        sm_pos = p;
    }
    // This lane's slice of the G queries, pre-scaled.
    float q[MAX_G][N];
#pragma unroll
    for (int g = 0; g < MAX_G; ++g) {
        if (g < G) {
            load16(query + b * q_tok + (i64)(kvh * G + g) * dim + sub * N, q[g]);
#pragma unroll
            for (int i = 0; i < N; ++i) q[g][i] *= scale;
        }
    }
    __syncthreads();
    const i64 qpos = sm_pos;
    const i64 share = split_share(qpos + 1, splits, 16);
    const i64 begin = (i64)split * share;
    const i64 end = (begin + share) < (qpos + 1) ? (begin + share) : (qpos + 1);

    float m[MAX_G], l[MAX_G], acc[MAX_G][N];
#pragma unroll
    for (int g = 0; g < MAX_G; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < N; ++i) acc[g][i] = 0.0f;
    }
    const int step = WARPS * TPW;
    // Warp-uniform trip count (shuffles need every lane); a group past the end computes on zeros.
    i64 t = begin + warp * TPW + grp;
    i64 base = -1;
    float kc[N], vc[N];
    if (t < end) base = kv_token_base(b, t, table, table_cols, s_batch, s_token, s_page,
                                      page_size, span, cache_elems, status, kvh == 0);
#pragma unroll
    for (int i = 0; i < N; ++i) kc[i] = vc[i] = 0.0f;
    if (base >= 0) {
        load16(kcache + base + head_off, kc);
        load16(vcache + base + head_off, vc);
    }
    for (i64 t0 = begin + warp * TPW; t0 < end; t0 += step) {
        // the next token's loads first
        const i64 tn = t + step;
        i64 bn = -1;
        float kn[N], vn[N];
#pragma unroll
        for (int i = 0; i < N; ++i) kn[i] = vn[i] = 0.0f;
        if (tn < end) {
            bn = kv_token_base(b, tn, table, table_cols, s_batch, s_token, s_page, page_size,
                               span, cache_elems, status, kvh == 0);
            if (bn >= 0) {
                load16(kcache + bn + head_off, kn);
                load16(vcache + bn + head_off, vn);
            }
        }
        float sc[MAX_G];
#pragma unroll
        for (int g = 0; g < MAX_G; ++g) {
            float part = 0.0f;
#pragma unroll
            for (int i = 0; i < N; ++i) part += q[g][i] * kc[i];
            for (int o = L >> 1; o > 0; o >>= 1) part += __shfl_xor_sync(0xffffffffu, part, o);
            sc[g] = part;
        }
        if (t < end && base >= 0) {
#pragma unroll
            for (int g = 0; g < MAX_G; ++g) {
                if (g >= G) continue;
                const float m_new = fmaxf(m[g], sc[g]);
                const float alpha = m[g] == NEG_INF ? 0.0f : expf(m[g] - m_new);
                const float pr = expf(sc[g] - m_new);
                l[g] = l[g] * alpha + pr;
#pragma unroll
                for (int i = 0; i < N; ++i) acc[g][i] = acc[g][i] * alpha + pr * vc[i];
                m[g] = m_new;
            }
        }
        t = tn;
        base = bn;
#pragma unroll
        for (int i = 0; i < N; ++i) {
            kc[i] = kn[i];
            vc[i] = vn[i];
        }
    }
    // Merge the lane groups of the warp (xor over the group bits).
    for (int o = L; o < 32; o <<= 1) {
#pragma unroll
        for (int g = 0; g < MAX_G; ++g) {
            const float mo = __shfl_xor_sync(0xffffffffu, m[g], o);
            const float lo = __shfl_xor_sync(0xffffffffu, l[g], o);
            const float mm = fmaxf(m[g], mo);
            const float a = m[g] == NEG_INF ? 0.0f : expf(m[g] - mm);
            const float c = mo == NEG_INF ? 0.0f : expf(mo - mm);
            l[g] = l[g] * a + lo * c;
#pragma unroll
            for (int i = 0; i < N; ++i) {
                const float ao = __shfl_xor_sync(0xffffffffu, acc[g][i], o);
                acc[g][i] = acc[g][i] * a + ao * c;
            }
            m[g] = mm;
        }
    }
    if (grp == 0) {
#pragma unroll
        for (int g = 0; g < MAX_G; ++g) {
            if (g >= G) continue;
            if (sub == 0) {
                sm_m[warp][g] = m[g];
                sm_l[warp][g] = l[g];
            }
#pragma unroll
            for (int i = 0; i < N; ++i) sm_acc[warp][g][sub * N + i] = acc[g][i];
        }
    }
    __syncthreads();
    // Merge the warps; write the output (one split) or the partial for the reduce kernel.
    const i64 rows_total = batch * heads;
    float* ml = ws + rows_total * splits * dim;
    for (int idx = tid; idx < G * dim; idx += blockDim.x) {
        const int g = idx / dim, d = idx - g * dim;
        float mm = NEG_INF;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, sm_m[w][g]);
        float total = 0.0f, sum = 0.0f;
        if (mm != NEG_INF) {
#pragma unroll
            for (int w = 0; w < WARPS; ++w) {
                const float e = sm_m[w][g] == NEG_INF ? 0.0f : expf(sm_m[w][g] - mm);
                total += e * sm_l[w][g];
                sum += e * sm_acc[w][g][d];
            }
        }
        const i64 orow = b * heads + kvh * G + g;
        if (splits == 1) {
            out[orow * dim + d] = from_f32<T>(qpos >= 0 && total > 0.0f ? sum / total : 0.0f);
        } else {
            const i64 at = orow * splits + split;
            ws[at * dim + d] = sum;
            if (d == 0) {
                ml[2 * at] = mm;
                ml[2 * at + 1] = total;
            }
        }
    }
}
"""
)


# The decode cut both tensor-core kernels compute from a row's position (kv_decode_tc and the merge
# of its partials must agree on it exactly).
_DECODE_CUT = (
    _EX2
    + r"""
// Tokens a decode query attends to: its position + 1, or 0 for padding and a faulted position.
static __device__ __forceinline__ int decode_live(i64 pos, i64 committed, i64 capacity) {
    return (pos < 0 || pos >= capacity || pos >= committed) ? 0 : (int)pos + 1;
}

// How ``live`` tokens are shared out: ``share`` tokens a split (an equal share over ``splits``, at
// least ``min_share``, rounded up to a 16-token tile) and ``nlive`` splits that hold any.
static __device__ __forceinline__ void decode_cut(int live, int splits, int min_share, int& share,
                                                  int& nlive) {
    share = (live + splits - 1) / splits;
    share = share > min_share ? share : min_share;
    share = (share + 15) & ~15;
    nlive = (live + share - 1) / share;
}
"""
)

_DECODE_TC_BODY = (
    _DECODE_CUT
    + r"""
#define TC_WARPS 8
#define TC_THREADS 256

static __device__ __forceinline__ u32 half_bits(__half x) { return __half_as_ushort(x); }
static __device__ __forceinline__ u32 half_bits(__nv_bfloat16 x) {
    return __bfloat16_as_ushort(x);
}
static __device__ __forceinline__ u32 word_of(const uint4& v, int i) {
    return i == 0 ? v.x : (i == 1 ? v.y : (i == 2 ? v.z : v.w));
}

// (d0, d1) += row g, columns 2t and 2t + 1 of A (16x16, row-major) * B (16x8, col-major), the
// m16n8k16 MMA with fp32 accumulators (lane = 4 g + t; fragments as in the PTX ISA and as the
// GEMVs use them). a0 holds A[g][2t, 2t+1], a2 A[g][2t+8, 2t+9], b0 B[2t, 2t+1][g], b1
// B[2t+8, 2t+9][g]. A's rows 8-15 are zero (at most 8 query heads a KV head): their results are
// scratch outputs, so no register keeps them between MMAs.
template <typename X>
static __device__ __forceinline__ void mma8(float& d0, float& d1, u32 a0, u32 a2, u32 b0, u32 b1);

template <>
__device__ __forceinline__ void mma8<__half>(float& d0, float& d1, u32 a0, u32 a2, u32 b0,
                                             u32 b1) {
    float x2, x3;
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %10, %11};"
        : "+f"(d0), "+f"(d1), "=f"(x2), "=f"(x3)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(0.0f), "f"(0.0f));
}

template <>
__device__ __forceinline__ void mma8<__nv_bfloat16>(float& d0, float& d1, u32 a0, u32 a2, u32 b0,
                                                    u32 b1) {
    float x2, x3;
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %10, %11};"
        : "+f"(d0), "+f"(d1), "=f"(x2), "=f"(x3)
        : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1), "f"(0.0f), "f"(0.0f));
}

// Element offset of (row b, token tok, head 0, feature 0), or -1 when it cannot be addressed.
// Paged layouts pass the token's block-table entry ``page`` (-1: none), loaded beforehand so
// that the lookups of a round are in flight together.
static __device__ __forceinline__ i64 tc_token_base(i64 b, int tok, int page, i64 s_batch,
                                                    i64 s_token, i64 s_page, int page_size,
                                                    i64 span, i64 cache_elems) {
    i64 base;
    if (page_size > 0) {
        if (page < 0) return -1;
        base = (i64)page * s_page + (i64)(tok % page_size) * s_token;
    } else {
        base = b * s_batch + (i64)tok * s_token;
    }
    return (base >= 0 && base + span <= cache_elems) ? base : -1;
}

// The block-table entry of token ``tok`` of row b (-1 past the bound or the table).
static __device__ __forceinline__ int tc_page(i64 b, int tok, int bound, const int* table,
                                              i64 table_cols, int page_size) {
    const int col = tok / page_size;
    return tok < bound && col < table_cols ? __ldg(table + b * table_cols + col) : -1;
}

// Decode attention on tensor cores: grid (batch, kv_heads, splits), 256 threads = 8 warps. See
// the module docstring for the design; DIM (64 or 128) and UNITS (tiles a warp per round) are
// defined per kernel.
extern "C" __global__ void __launch_bounds__(TC_THREADS) KERNEL(
    T* out, float* ws, const T* __restrict__ query, const void* __restrict__ positions,
    int pos_i64, const i64* __restrict__ lengths, const T* __restrict__ kcache,
    const T* __restrict__ vcache, const void* __restrict__ block_table, i64 table_cols,
    i64 batch, int heads, int kv_heads, i64 q_tok, i64 s_batch, i64 s_token, i64 s_head,
    i64 s_page, i64 page_size, i64 capacity, i64 cache_elems, float scale, int splits,
    int min_share, int merge_limit, u32* status) {
    constexpr int KS = DIM / 32;  // a lane's 16-byte pieces of a K row: features 32 s + 8 t + [0,8)
    constexpr int VS = DIM / 64;  // a lane's 16-byte pieces of a V row: features 64 a + 8 g + [0,8)
    constexpr int NJ = DIM / 8;   // P.V MMAs a tile, 8 output features each
    constexpr int ROUND = TC_WARPS * UNITS * 16;  // tokens a block loads per round
    constexpr int QUADS = DIM / 4;
    constexpr int ITEMS = 8 * QUADS;              // (head, 4 features) items of a KV head
    constexpr int SGROUPS = TC_THREADS / ITEMS;   // lanes sharing an item in the merge (1 or 2)
    __shared__ __align__(16) float sm_o[TC_WARPS][8][DIM + 4];
    __shared__ float sm_m[TC_WARPS][8], sm_l[TC_WARPS][8];
    __shared__ u32 sm_last;

    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int g = lane >> 2, t = lane & 3;
    const i64 b = blockIdx.x;
    const int kvh = blockIdx.y, split = blockIdx.z;
    const int G = heads / kv_heads;
    const int* table = reinterpret_cast<const int*>(block_table);
    const int psize = (int)page_size;
    const i64 span = (i64)(kv_heads - 1) * s_head + DIM;
    const T* kbase = kcache + (i64)kvh * s_head;
    const T* vbase = vcache + (i64)kvh * s_head;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);

    // 1. The row's position and committed length, and this lane's pieces of query head g (the
    // A operand of the score MMAs; zero past the G heads), loaded together.
    const i64 committed = lengths[b];
    const i64 pos = load_index(positions, b, pos_i64);
    uint4 qa[KS];
    {
        const T* qrow = query + b * q_tok + (i64)(kvh * G + (g < G ? g : 0)) * DIM + 8 * t;
#pragma unroll
        for (int s = 0; s < KS; ++s) {
            qa[s] = __ldg(reinterpret_cast<const uint4*>(qrow + 32 * s));
        }
#pragma unroll
        for (int s = 0; s < KS; ++s) qa[s] = g < G ? qa[s] : zero;
    }

    // K and V of one round. Tile k = u * TC_WARPS + warp holds tokens r0 + 16 k + [0, 16). As the
    // B operand of the score MMAs this lane reads K rows 8 h + g (h = 0, 1: the tile's halves); as
    // the B operand of the P.V MMAs, V rows 2t, 2t+1, 2t+8, 2t+9 (c = 0..3) at features 64 a + 8 g.
    uint4 kr[UNITS][2][KS], vr[UNITS][VS][4];
    u32 unaddressed = 0;  // bit 2u + h: the K row this lane reads of tile u, half h, has no address
    // Loads tiles ulo..uhi-1 of the round at r0 (tokens at or past ``bound`` read as zeros).
    auto issue = [&](int r0, int bound, int ulo, int uhi) {
        // The tokens: K rows 8 h + g (i = h), V rows 2t, 2t+1, 2t+8, 2t+9 (i = 2 + c).
        int tok[UNITS][6], page[UNITS][6];
#pragma unroll
        for (int u = 0; u < UNITS; ++u) {
            const int tb = r0 + 16 * (u * TC_WARPS + warp);
#pragma unroll
            for (int i = 0; i < 6; ++i) {
                tok[u][i] = tb + (i < 2 ? 8 * i + g : 2 * t + (i & 1) + 8 * ((i - 2) >> 1));
                page[u][i] = -1;
            }
        }
        if (psize > 0) {  // every lookup in flight before any is used
#pragma unroll
            for (int u = 0; u < UNITS; ++u) {
                if (u < ulo || u >= uhi) continue;
#pragma unroll
                for (int i = 0; i < 6; ++i) {
                    page[u][i] = tc_page(b, tok[u][i], bound, table, table_cols, psize);
                }
            }
        }
        i64 base[UNITS][6];
#pragma unroll
        for (int u = 0; u < UNITS; ++u) {
            if (u < ulo || u >= uhi) continue;
#pragma unroll
            for (int i = 0; i < 6; ++i) {
                base[u][i] = tok[u][i] < bound
                                 ? tc_token_base(b, tok[u][i], page[u][i], s_batch, s_token,
                                                 s_page, psize, span, cache_elems)
                                 : -1;
            }
            unaddressed &= ~(3u << (2 * u));
            if (tok[u][0] < bound && base[u][0] < 0) unaddressed |= 1u << (2 * u);
            if (tok[u][1] < bound && base[u][1] < 0) unaddressed |= 2u << (2 * u);
        }
#pragma unroll
        for (int u = 0; u < UNITS; ++u) {
            if (u < ulo || u >= uhi) continue;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
#pragma unroll
                for (int s = 0; s < KS; ++s) {
                    kr[u][h][s] = zero;
                    if (base[u][h] >= 0) {
                        kr[u][h][s] = __ldg(
                            reinterpret_cast<const uint4*>(kbase + base[u][h] + 32 * s + 8 * t));
                    }
                }
            }
#pragma unroll
            for (int c = 0; c < 4; ++c) {
#pragma unroll
                for (int a = 0; a < VS; ++a) {
                    vr[u][a][c] = zero;
                    const i64 at = base[u][2 + c];
                    if (at >= 0) {
                        vr[u][a][c] =
                            __ldg(reinterpret_cast<const uint4*>(vbase + at + 64 * a + 8 * g));
                    }
                }
            }
        }
    };
    // Split 0 starts at token 0 whatever the live length: the first tile of each warp (tokens
    // 0..127) is loaded beside the position (tokens past the end are masked below, their V rows
    // zeroed); the rest only once the end is known, so that a short context does not pull a
    // whole round through the SM.
    const bool early = split == 0;
    if (early) issue(0, capacity < ROUND ? (int)capacity : ROUND, 0, 1);

    // 2. The live context and this split's share of it (on the device: a graph captured for a
    // large capacity serves every live length). Splits past the live ones exit at once.
    const int live = decode_live(pos, committed, capacity);
    if (pos >= 0 && live == 0 && kvh == 0 && split == 0 && tid == 0) {
        set_fault(status, 4u);  // KernelFault.KV_POSITION
    }
    int share, nlive;
    decode_cut(live, splits, min_share, share, nlive);
    if (split >= (nlive > 1 ? nlive : 1)) return;
    const int begin = split * share;
    const int end = begin + share < live ? begin + share : live;
    issue(begin, end, early ? 1 : 0, UNITS);

    // 3. Rounds: scores S = Q K^T on tensor cores (lane: head g, tokens 2t, 2t+1 of each half
    // tile), an online softmax in base 2 (each head's max shared by its 4 lanes), P V on tensor
    // cores (P rounded to T; lane: head g, features 64 a + 16 t + [0, 16)).
    const float sl2 = scale * 1.4426950408889634f;
    float o[NJ][2];
#pragma unroll
    for (int j = 0; j < NJ; ++j) o[j][0] = o[j][1] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    for (int r0 = begin; r0 < end; r0 += ROUND) {
        if (r0 != begin) issue(r0, end, 0, UNITS);
        if (unaddressed && kvh == 0) {
#pragma unroll
            for (int u = 0; u < UNITS; ++u) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const int tok = r0 + 16 * (u * TC_WARPS + warp) + 8 * h + g;
                    if ((unaddressed >> (2 * u + h)) & 1u && tok < end) {
                        set_fault(status, psize > 0 ? 8u : 4u);  // KV_PAGE / KV_POSITION
                    }
                }
            }
        }
        float sc[UNITS][4];
        float cmax = NEG_INF;
#pragma unroll
        for (int u = 0; u < UNITS; ++u) {
            const int tb = r0 + 16 * (u * TC_WARPS + warp);
            sc[u][0] = sc[u][1] = sc[u][2] = sc[u][3] = NEG_INF;
            if (tb < end) {  // the same for the whole warp: the MMAs stay converged
                float s0a = 0.0f, s0b = 0.0f, s1a = 0.0f, s1b = 0.0f;
#pragma unroll
                for (int s = 0; s < KS; ++s) {
                    mma8<T>(s0a, s0b, qa[s].x, qa[s].y, kr[u][0][s].x, kr[u][0][s].y);
                    mma8<T>(s1a, s1b, qa[s].x, qa[s].y, kr[u][1][s].x, kr[u][1][s].y);
                    mma8<T>(s0a, s0b, qa[s].z, qa[s].w, kr[u][0][s].z, kr[u][0][s].w);
                    mma8<T>(s1a, s1b, qa[s].z, qa[s].w, kr[u][1][s].z, kr[u][1][s].w);
                }
                const int ta = tb + 2 * t;
                sc[u][0] = ta < end ? s0a * sl2 : NEG_INF;
                sc[u][1] = ta + 1 < end ? s0b * sl2 : NEG_INF;
                sc[u][2] = ta + 8 < end ? s1a * sl2 : NEG_INF;
                sc[u][3] = ta + 9 < end ? s1b * sl2 : NEG_INF;
                cmax = fmaxf(cmax, fmaxf(fmaxf(sc[u][0], sc[u][1]), fmaxf(sc[u][2], sc[u][3])));
            }
        }
        cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, 1));
        cmax = fmaxf(cmax, __shfl_xor_sync(0xffffffffu, cmax, 2));
        const float m_new = fmaxf(m, cmax);
        const float ref = m_new == NEG_INF ? 0.0f : m_new;
        const float alpha = ex2(m - ref);  // 0 while m is -inf
        l *= alpha;
#pragma unroll
        for (int j = 0; j < NJ; ++j) {
            o[j][0] *= alpha;
            o[j][1] *= alpha;
        }
        m = m_new;
#pragma unroll
        for (int u = 0; u < UNITS; ++u) {
            const int tb = r0 + 16 * (u * TC_WARPS + warp);
            if (tb >= end) continue;  // warp-uniform
            u32 bits[4];
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const T p = from_f32<T>(ex2(sc[u][e] - ref));  // 0 for a masked token
                l += to_f32(p);  // the sum of the weights the MMA uses
                bits[e] = half_bits(p);
            }
            const u32 p0 = bits[0] | (bits[1] << 16), p1 = bits[2] | (bits[3] << 16);
#pragma unroll
            for (int c = 0; c < 4; ++c) {
                const int tok = tb + 2 * t + (c & 1) + 8 * (c >> 1);
#pragma unroll
                for (int a = 0; a < VS; ++a) vr[u][a][c] = tok < end ? vr[u][a][c] : zero;
            }
#pragma unroll
            for (int a = 0; a < VS; ++a) {
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const u32 sel = (i & 1) ? 0x7632u : 0x5410u;  // high or low halves
                    const u32 b0 = __byte_perm(word_of(vr[u][a][0], i >> 1),
                                               word_of(vr[u][a][1], i >> 1), sel);
                    const u32 b1 = __byte_perm(word_of(vr[u][a][2], i >> 1),
                                               word_of(vr[u][a][3], i >> 1), sel);
                    mma8<T>(o[8 * a + i][0], o[8 * a + i][1], p0, p1, b0, b1);
                }
            }
        }
    }

    // 4. Merge the warps through shared memory: item (head ig, features 4 iq + [0, 4)).
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    if (t == 0) {
        sm_m[warp][g] = m;
        sm_l[warp][g] = l;
    }
#pragma unroll
    for (int a = 0; a < VS; ++a) {
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            sm_o[warp][g][64 * a + 16 * t + i] = o[8 * a + i][0];
            sm_o[warp][g][64 * a + 16 * t + 8 + i] = o[8 * a + i][1];
        }
    }
    __syncthreads();
    const i64 rows = batch * heads;
    const i64 orow0 = b * heads + (i64)kvh * G;  // the output row of query head 0 of this KV head
    float* ml = ws + rows * splits * DIM;
    u32* arrivals = reinterpret_cast<u32*>(ml + rows * splits * 2);
    if (tid < ITEMS) {
        const int ig = tid / QUADS, iq = tid - ig * QUADS;
        float mx = NEG_INF;
#pragma unroll
        for (int w = 0; w < TC_WARPS; ++w) mx = fmaxf(mx, sm_m[w][ig]);
        const float ref = mx == NEG_INF ? 0.0f : mx;
        float tot = 0.0f, acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#pragma unroll
        for (int w = 0; w < TC_WARPS; ++w) {
            const float e = ex2(sm_m[w][ig] - ref);
            tot += e * sm_l[w][ig];
            const float4 v = *reinterpret_cast<const float4*>(&sm_o[w][ig][4 * iq]);
            acc[0] += e * v.x;
            acc[1] += e * v.y;
            acc[2] += e * v.z;
            acc[3] += e * v.w;
        }
        if (ig < G) {
            const i64 orow = orow0 + ig;
            if (nlive <= 1) {  // the whole context in this block: the output itself
                const float inv = tot > 0.0f ? 1.0f / tot : 0.0f;
                const u32 lo = half_bits(from_f32<T>(acc[0] * inv)) |
                               (half_bits(from_f32<T>(acc[1] * inv)) << 16);
                const u32 hi = half_bits(from_f32<T>(acc[2] * inv)) |
                               (half_bits(from_f32<T>(acc[3] * inv)) << 16);
                *reinterpret_cast<uint2*>(out + orow * DIM + 4 * iq) = make_uint2(lo, hi);
            } else {  // this split's partial: unnormalised sum, max (base 2) and weight sum
                const i64 at = orow * splits + split;
                *reinterpret_cast<float4*>(ws + at * DIM + 4 * iq) =
                    make_float4(acc[0], acc[1], acc[2], acc[3]);
                if (iq == 0) {
                    ml[2 * at] = mx;
                    ml[2 * at + 1] = tot;
                }
            }
        }
    }
    if (nlive <= 1 || nlive > merge_limit) return;  // done, or kv_decode_merge merges

    // 5. The last live split to arrive merges the live splits' partials and resets the counter.
    __threadfence();  // this block's partial is visible before it is counted
    __syncthreads();
    if (tid == 0) {
        sm_last = atomicAdd(&arrivals[b * kv_heads + kvh], 1u) == (u32)(nlive - 1) ? 1u : 0u;
    }
    __syncthreads();
    if (!sm_last) return;
    __threadfence();
    const int it = tid % ITEMS, sg = tid / ITEMS;
    const int mg = it / QUADS, mq = it - mg * QUADS;
    float mx = NEG_INF, tot = 0.0f, acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (mg < G) {
        const i64 orow = orow0 + mg;
        for (int s0 = sg; s0 < nlive; s0 += 8 * SGROUPS) {
            float ms[8], ls[8];
            float4 os[8];
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const int s = s0 + k * SGROUPS;
                ms[k] = NEG_INF;
                ls[k] = 0.0f;
                os[k] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
                if (s < nlive) {
                    const i64 at = orow * splits + s;
                    ms[k] = __ldcg(ml + 2 * at);
                    ls[k] = __ldcg(ml + 2 * at + 1);
                    os[k] = __ldcg(reinterpret_cast<const float4*>(ws + at * DIM + 4 * mq));
                }
            }
            float bm = mx;
#pragma unroll
            for (int k = 0; k < 8; ++k) bm = fmaxf(bm, ms[k]);
            const float ref = bm == NEG_INF ? 0.0f : bm;
            const float keep = ex2(mx - ref);
            tot *= keep;
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[i] *= keep;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const float e = ex2(ms[k] - ref);
                tot += e * ls[k];
                acc[0] += e * os[k].x;
                acc[1] += e * os[k].y;
                acc[2] += e * os[k].z;
                acc[3] += e * os[k].w;
            }
            mx = bm;
        }
    }
    if (SGROUPS > 1) {  // two lanes an item: the second hands its half over (sm_o is free now)
        float* scratch = &sm_o[0][0][0];
        if (sg == 1) {
            scratch[6 * it] = mx;
            scratch[6 * it + 1] = tot;
#pragma unroll
            for (int i = 0; i < 4; ++i) scratch[6 * it + 2 + i] = acc[i];
        }
        __syncthreads();
        if (sg == 0) {
            const float mo = scratch[6 * it];
            const float bm = fmaxf(mx, mo);
            const float ref = bm == NEG_INF ? 0.0f : bm;
            const float e0 = ex2(mx - ref), e1 = ex2(mo - ref);
            tot = tot * e0 + scratch[6 * it + 1] * e1;
#pragma unroll
            for (int i = 0; i < 4; ++i) acc[i] = acc[i] * e0 + scratch[6 * it + 2 + i] * e1;
        }
    }
    if (sg == 0 && mg < G) {
        const float inv = tot > 0.0f ? 1.0f / tot : 0.0f;
        const u32 lo = half_bits(from_f32<T>(acc[0] * inv)) |
                       (half_bits(from_f32<T>(acc[1] * inv)) << 16);
        const u32 hi = half_bits(from_f32<T>(acc[2] * inv)) |
                       (half_bits(from_f32<T>(acc[3] * inv)) << 16);
        *reinterpret_cast<uint2*>(out + (orow0 + mg) * DIM + 4 * mq) = make_uint2(lo, hi);
    }
    if (tid == 0) arrivals[b * kv_heads + kvh] = 0u;  // ready for the next launch
}
"""
)

_DECODE_MERGE_BODY = (
    _DECODE_CUT
    + _MERGE_SPLITS
    + r"""
// Merges kv_decode_tc's partials when more than ``merge_limit`` splits are live (fewer: it exits,
// the decode kernel merged them itself). One block of 256 threads per output row; only the live
// splits are read (their count is recomputed from the row's position, as the decode kernel did).
extern "C" __global__ void __launch_bounds__(256) KERNEL(
    T* out, const float* __restrict__ ws, const void* __restrict__ positions, int pos_i64,
    const i64* __restrict__ lengths, i64 batch, int heads, int dim, i64 capacity, int splits,
    int min_share, int merge_limit) {
    const i64 rows = batch * heads;
    const i64 row = blockIdx.x;
    if (row >= rows) return;
    const i64 b = row / heads;
    const int live = decode_live(load_index(positions, b, pos_i64), lengths[b], capacity);
    int share, nlive;
    decode_cut(live, splits, min_share, share, nlive);
    if (nlive <= merge_limit) return;
    merge_splits<T, true>(out + row * dim, ws + row * splits * dim,
                          ws + rows * splits * dim + row * splits * 2, nlive, dim);
}
"""
)


def _attention_cpu(
    out: np.ndarray,
    ws: np.ndarray,
    query: np.ndarray,
    positions: np.ndarray,
    pos_i64: np.int32,
    lengths: np.ndarray,
    kcache: np.ndarray,
    vcache: np.ndarray,
    block_table: np.ndarray,
    table_cols: np.int64,
    batch: np.int64,
    seq: np.int64,
    heads: np.int32,
    kv_heads: np.int32,
    dim: np.int32,
    q_tok: np.int64,
    s_batch: np.int64,
    s_token: np.int64,
    s_head: np.int64,
    s_dim: np.int64,
    s_page: np.int64,
    page_size: np.int64,
    capacity: np.int64,
    cache_elems: np.int64,
    scale: np.float32,
    q_tile: np.int32,
    kv_tile: np.int32,
    lanes: np.int32,
    splits: np.int32,
    chunk: np.int64,
    vec: np.int32,
    status: np.ndarray,
) -> None:
    # Computes the whole output, as the last split's merge does on the device.
    nb, ns, hq, hk, d = int(batch), int(seq), int(heads), int(kv_heads), int(dim)
    strides = _strides_of(s_batch, s_token, s_head, s_dim, s_page, page_size)
    pos = positions.view(np.int64 if pos_i64 else np.int32)[: nb * ns].astype(np.int64)
    pos = pos.reshape(nb, ns)
    lens = lengths[:nb].astype(np.int64)
    table = None
    if strides.page_size > 0:
        table = block_table.view(np.int32)[: nb * int(table_cols)].reshape(nb, int(table_cols))
    index = np.arange(nb * ns)[:, None] * int(q_tok) + np.arange(hq * d)[None, :]
    q = query[index].reshape(nb, ns, hq, d)
    clean = pos.copy()
    faults = 0
    bad = (clean >= 0) & ((clean >= int(capacity)) | (clean >= lens[:, None]))
    if bad.any():
        faults |= KernelFault.KV_POSITION
        clean[bad] = -1
    span = (hk - 1) * strides.head + (d - 1) * strides.dim + 1
    for b in range(nb):  # a query whose context holds an unaddressable token: faulted
        live = clean[b] >= 0
        if not live.any():
            continue
        tokens = np.arange(int(clean[b].max()) + 1)
        base, bits = _token_bases(
            np.full(tokens.shape, b), tokens, table, strides, span, int(cache_elems)
        )
        if bits:
            faults |= bits
            first_bad = int(tokens[base < 0].min())
            clean[b, clean[b] >= first_bad] = -1
    if faults:
        set_fault(status, KernelFault(faults))
    geometry = _geometry(
        tuple(int(v) for v in (s_batch, s_token, s_head, s_dim, s_page, page_size)),
        int(capacity),
    )
    try:
        result = ref.kv_attention_from(
            kcache,
            vcache,
            q,
            clean,
            lens,
            geometry,
            kv_heads=hk,
            scale=float(scale),
            block_table=table,
        )
    except OpError:  # a fault the checks above did not model: flag it, output zeros
        set_fault(status, KernelFault.KV_POSITION)
        result = np.zeros_like(q)
    out[: nb * ns * hq * d] = result.reshape(-1)


def _reduce_cpu(
    out: np.ndarray, ws: np.ndarray, rows: np.int64, dim: np.int32, splits: np.int32
) -> None:
    """Nothing to do on the CPU: the attention twin already wrote the whole output."""


ATTENTION_KERNELS = register_per_dtype(
    "kv_attention",
    _ATTENTION_BODY,
    (
        "T* void* T* void* i32 i64* T* T* void* i64 i64 i64 i32 i32 i32 i64 "
        "i64 i64 i64 i64 i64 i64 i64 i64 f32 i32 i32 i32 i32 i64 i32 u32*"
    ),
    _attention_cpu,
)

REDUCE_KERNELS = register_per_dtype(
    "kv_attention_reduce",
    _REDUCE_BODY,
    ("T*", "f32*", "i64", "i32", "i32"),
    _reduce_cpu,
)
DECODE_KERNELS = register_per_dtype(
    "kv_decode",
    _DECODE_BODY,
    (
        "T* void* T* void* i32 i64* T* T* void* i64 i64 i64 i32 i32 i32 i64 "
        "i64 i64 i64 i64 i64 i64 i64 i64 f32 i32 i32 i32 i32 i64 i32 u32*"
    ),
    _attention_cpu,
)


def _decode_tc_twin(dim: int) -> Callable[..., None]:
    """The CPU twin of ``kv_decode_tc<dim>``: `_attention_cpu` with its fixed arguments."""

    def twin(
        out: np.ndarray,
        ws: np.ndarray,
        query: np.ndarray,
        positions: np.ndarray,
        pos_i64: np.int32,
        lengths: np.ndarray,
        kcache: np.ndarray,
        vcache: np.ndarray,
        block_table: np.ndarray,
        table_cols: np.int64,
        batch: np.int64,
        heads: np.int32,
        kv_heads: np.int32,
        q_tok: np.int64,
        s_batch: np.int64,
        s_token: np.int64,
        s_head: np.int64,
        s_page: np.int64,
        page_size: np.int64,
        capacity: np.int64,
        cache_elems: np.int64,
        scale: np.float32,
        splits: np.int32,
        min_share: np.int32,
        merge_limit: np.int32,
        status: np.ndarray,
    ) -> None:
        one, i32 = np.int64(1), np.int32
        _attention_cpu(
            out, ws, query, positions, pos_i64, lengths, kcache, vcache, block_table, table_cols,
            batch, one, heads, kv_heads, i32(dim), q_tok, s_batch, s_token, s_head, one, s_page,
            page_size, capacity, cache_elems, scale, i32(1), i32(16), i32(1), splits, np.int64(0),
            i32(1), status,
        )  # fmt: skip

    return twin


def _merge_cpu(
    out: np.ndarray,
    ws: np.ndarray,
    positions: np.ndarray,
    pos_i64: np.int32,
    lengths: np.ndarray,
    batch: np.int64,
    heads: np.int32,
    dim: np.int32,
    capacity: np.int64,
    splits: np.int32,
    min_share: np.int32,
    merge_limit: np.int32,
) -> None:
    """Nothing to do on the CPU: the decode twin already wrote the whole output."""


# kv_decode_tc<dim>_<dt> (fp16/bf16): head_dim -> UNITS, the 16-token tiles a warp loads per
# round (a lane holds 2 x UNITS x dim / 8 bytes of K and V in flight; 128 takes one tile so that
# the registers stay under 255 without spills).
_TC_UNITS = {64: 2, 128: 1}
DECODE_TC_KERNELS: dict[int, dict[str, KernelSource]] = {
    dim: register_per_dtype(
        f"kv_decode_tc{dim}",
        f"#define DIM {dim}\n#define UNITS {units}\n" + _DECODE_TC_BODY,
        (
            "T* void* T* void* i32 i64* T* T* void* i64 i64 i32 i32 i64 "
            "i64 i64 i64 i64 i64 i64 i64 f32 i32 i32 i32 u32*"
        ),
        _decode_tc_twin(dim),
        suffixes=("f16", "bf16"),
    )
    for dim, units in _TC_UNITS.items()
}
DECODE_MERGE_KERNELS = register_per_dtype(
    "kv_decode_merge",
    _DECODE_MERGE_BODY,
    "T* f32* void* i32 i64* i64 i32 i32 i64 i32 i32 i32",
    _merge_cpu,
    suffixes=("f16", "bf16"),
)


# --- host side -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionPlan:
    """How one KVAttention launch is cut up; `attention_plan` chooses it from host-known sizes."""

    q_tile: int  # query tokens per block
    kv_tile: int  # context tokens per shared-memory tile
    lanes: int  # threads per query·key dot product
    splits: int  # context chunks (grid z); 1: no reduce kernel, no workspace
    chunk: int  # capacity per split (a multiple of kv_tile); the kernels share the live context
    share: int  # kv_decode_tc: live tokens a split takes at least (rounded up to 16)
    shared_bytes: int
    workspace_elems: int  # elements (4 bytes) the workspace needs, counters included (0: 1 split)
    counters: int  # of which uint32 arrival counters at the end (decode: one a row and KV head)
    grid: tuple[int, int, int]
    reason: str


def _shared_bytes(q_tile: int, rows: int, kv_tile: int, d4: int) -> int:
    """The kernel's carve-up: see the pointer arithmetic at the top of its body."""
    dgroups = _THREADS // d4
    rpt = 1
    while rpt * dgroups < rows:
        rpt *= 2
    padded = rpt * dgroups
    ints = round_up(kv_tile + q_tile, 2)
    floats = rows * d4 + kv_tile * (d4 + 4) + kv_tile * d4 + padded * kv_tile + 3 * padded
    return 8 * ints + 4 * floats


def attention_plan(
    *,
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    capacity: int,
    max_context: int | None = None,
    split: bool = True,
    target_blocks: int = _TARGET_BLOCKS,
    min_chunk: int = _MIN_CHUNK,
    min_share: int = DECODE_SHARE,
) -> AttentionPlan:
    """Tiles, lanes and split-K for a launch. ``max_context`` bounds every query's position + 1
    (default: the capacity); ``split=False`` forces one split (no workspace); a split takes at
    least ``min_chunk`` slots of capacity and (``kv_decode_tc``, on the device) at least
    ``min_share`` live tokens (tests lower both to split short contexts)."""
    op = "KVAttention"
    positive(op, batch=batch, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    need(
        kv_heads > 0 and heads % kv_heads == 0, op, f"kv_heads={kv_heads} must divide heads={heads}"
    )
    need(0 < head_dim <= _MAX_HEAD_DIM, op, f"head_dim={head_dim} must be in (0, {_MAX_HEAD_DIM}]")
    need(capacity > 0, op, f"capacity={capacity} must be > 0")
    need(
        isinstance(min_share, int) and 0 < min_share <= _TC_MAX_SLOTS,
        op,
        f"min_share={min_share!r} must be a positive int (live tokens a decode split takes)",
    )
    group = heads // kv_heads
    d4 = round_up(head_dim, 4)
    max_rows = min(_MAX_ROWS, _MAX_ACC * (_THREADS // d4))
    need(
        group <= max_rows,
        op,
        f"{group} query heads per KV head with head_dim {head_dim} exceed what one block holds "
        f"({max_rows} rows): use fewer query heads per KV head",
    )
    q_tile = 1 if seq <= 1 else max(1, min(seq, max_rows // group))
    rows = q_tile * group
    kv_tile = 16
    for candidate in (64, 32):
        if _shared_bytes(q_tile, rows, candidate, d4) <= _SHARED_BUDGET:
            kv_tile = candidate
            break
    shared = _shared_bytes(q_tile, rows, kv_tile, d4)
    context = min(capacity, max_context) if max_context else capacity
    context = max(context, 1)
    n_qtiles = -(-seq // q_tile) if seq else 0
    base_blocks = batch * n_qtiles * kv_heads
    splits, chunk = 1, round_up(context, kv_tile)
    reason = "one split: "
    if not split:
        reason += "splitting was turned off (no workspace)"
    elif base_blocks >= target_blocks:
        reason += f"{base_blocks} blocks already fill the GPU"
    else:
        # At least _MIN_CHUNK tokens a split: a block's fixed cost (query load, barriers, its
        # partial and its arrival) is worth that much work, and in a graph captured for a large
        # capacity the splits past the live context are blocks that only arrive.
        want = min(-(-target_blocks // max(base_blocks, 1)), _MAX_SPLITS)
        want = max(1, min(want, context // max(min_chunk, 1)))
        while kv_tile > 16 and -(-context // kv_tile) < want:
            kv_tile //= 2  # chunks shorter than a tile: smaller tiles
        shared = _shared_bytes(q_tile, rows, kv_tile, d4)
        chunk = round_up(-(-context // want), kv_tile)
        splits = -(-context // chunk)
        if splits > 1:
            reason = (
                f"{splits} split(s) sharing out the live context (up to {chunk} slots each): "
                f"{base_blocks} blocks alone would leave the GPU idle (target {target_blocks}; "
                f"at least {min_chunk} slots of capacity a split)"
            )
        else:
            reason += f"a context of {context} tokens is one chunk (< 2 x {min_chunk})"
    lanes = 1
    while lanes < 8 and rows * kv_tile * lanes < _THREADS and d4 // 4 >= 2 * lanes:
        lanes *= 2
    counters = batch * kv_heads if splits > 1 and seq == 1 else 0
    workspace = batch * seq * heads * splits * (head_dim + 2) + counters if splits > 1 else 0
    grid = (batch * n_qtiles, kv_heads, splits)
    return AttentionPlan(
        q_tile, kv_tile, lanes, splits, chunk, min_share, shared, workspace, counters, grid, reason
    )


def attention_workspace(
    dev: Device, plan: AttentionPlan, *, stream: Stream, name: str = "attention-workspace"
) -> Buffer | None:
    """The float32 workspace ``plan`` needs (None with one split), zeroed: its arrival counters
    must start at zero (each launch leaves them so). Use one per stream."""
    if not plan.workspace_elems:
        return None
    workspace = dev.alloc(plan.workspace_elems, np.float32, stream=stream, name=name)
    dev.fill(workspace, 0, stream=stream)
    return workspace


def _check_strides(op: str, strides: KVStrides) -> None:
    need(isinstance(strides, KVStrides), op, f"strides must be a KVStrides, got {strides!r}")
    values = (strides.batch, strides.token, strides.head, strides.dim, strides.page)
    need(
        all(isinstance(v, int) and v >= 0 for v in (*values, strides.page_size)),
        op,
        f"strides {strides} must be non-negative ints",
    )


def _vector_ok(strides: KVStrides, head_dim: int, per16: int, *buffers: Buffer) -> bool:
    """Whether 16-byte loads of a token's features are aligned in this layout."""
    return (
        strides.dim == 1
        and head_dim % per16 == 0
        and all(v % per16 == 0 for v in (strides.batch, strides.token, strides.head, strides.page))
        and aligned(*buffers)
    )


def _cache_checks(
    op: str,
    key_cache: Buffer,
    value_cache: Buffer,
    strides: KVStrides,
    capacity: int,
    batch: int,
    block_table: Buffer | None,
    table_cols: int,
) -> tuple[Buffer, int]:
    check_buffer(op, "key_cache", key_cache, 1)
    need(
        isinstance(value_cache, Buffer)
        and value_cache.dtype == key_cache.dtype
        and value_cache.size == key_cache.size,
        op,
        "key_cache and value_cache must be Buffers of one dtype and size",
    )
    need(capacity > 0, op, f"capacity={capacity} must be > 0")
    if strides.page_size > 0:
        need(
            block_table is not None and block_table.dtype == np.dtype(np.int32),
            op,
            f"the layout is paged (page_size {strides.page_size}): pass the int32 block_table",
        )
        assert block_table is not None
        need(table_cols > 0, op, "table_cols (block-table columns) must be > 0 for a paged layout")
        check_buffer(op, "block_table", block_table, batch * table_cols)
        return block_table, table_cols
    need(block_table is None, op, "a block table was given but the layout is not paged")
    return key_cache, 0


def kv_commit(
    dev: Device,
    key_cache: Buffer,
    value_cache: Buffer,
    lengths: Buffer,
    new_key: Buffer,
    new_value: Buffer,
    positions: Buffer,
    *,
    batch: int,
    seq: int,
    kv_heads: int,
    head_dim: int,
    strides: KVStrides,
    capacity: int,
    block_table: Buffer | None = None,
    table_cols: int = 0,
    src_token_stride: int = 0,
    status: Buffer,
    stream: Stream,
) -> None:
    """Write new K/V [batch, seq, kv_heads, head_dim] at ``positions`` [batch, seq] (int64 or
    int32, negative = padding) into the caches, and ``lengths`` (int64 [batch]) = 1 + the highest
    position per row.

    ``src_token_stride`` (elements between consecutive tokens of new_key/new_value, default
    kv_heads*head_dim) lets them be views into a packed QKV projection. Paged layouts pass the
    int32 ``block_table`` [batch, table_cols].
    """
    op = "KVCommit"
    positive(op, batch=batch, seq=seq, kv_heads=kv_heads, head_dim=head_dim)
    _check_strides(op, strides)
    table, cols = _cache_checks(
        op, key_cache, value_cache, strides, capacity, batch, block_table, table_cols
    )
    per_token = kv_heads * head_dim
    src_tok = src_token_stride or per_token
    need(src_tok >= per_token, op, f"src_token_stride={src_tok} must be >= {per_token}")
    extent = (batch * seq - 1) * src_tok + per_token if batch * seq else 0
    for name, buf in (("new_key", new_key), ("new_value", new_value)):
        check_buffer(op, name, buf, extent, key_cache.dtype)
    pos_i64 = check_index_buffer(op, "positions", positions, batch * seq)
    check_buffer(op, "lengths", lengths, batch, np.dtype(np.int64))
    check_status(op, status)
    if batch == 0:
        return
    if seq == 0 or per_token == 0:
        dev.fill(lengths.view(np.int64, (batch,)), 0, stream=stream)
        return
    itemsize = key_cache.dtype.itemsize
    need(itemsize in (2, 4), op, f"cache dtype {key_cache.dtype} is not 2 or 4 bytes wide")
    per16 = 16 // itemsize
    vec = _vector_ok(strides, head_dim, per16, key_cache, value_cache, new_key, new_value) and (
        src_tok % per16 == 0
    )
    kernel = dev.kernel(KV_COMMIT_KERNEL)
    kernel.launch(
        batch * seq,
        _THREADS,
        key_cache.view(np.uint8),
        value_cache.view(np.uint8),
        lengths,
        new_key.view(np.uint8),
        new_value.view(np.uint8),
        positions, pos_i64, table, cols,
        batch, seq, kv_heads, head_dim, src_tok,
        strides.batch, strides.token, strides.head, strides.dim, strides.page, strides.page_size,
        capacity, key_cache.size, itemsize, int(vec), status,
        stream=stream,
    )  # fmt: skip


def kv_attention(
    dev: Device,
    out: Buffer,
    query: Buffer,
    positions: Buffer,
    lengths: Buffer,
    key_cache: Buffer,
    value_cache: Buffer,
    *,
    batch: int,
    seq: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    strides: KVStrides,
    capacity: int,
    scale: float = 0.0,
    block_table: Buffer | None = None,
    table_cols: int = 0,
    query_token_stride: int = 0,
    workspace: Buffer | None = None,
    max_context: int | None = None,
    plan: AttentionPlan | None = None,
    status: Buffer,
    stream: Stream,
) -> AttentionPlan:
    """Causal GQA attention of query [batch, seq, heads, head_dim] at ``positions`` over the
    caches; ``out`` [batch, seq, heads, head_dim] contiguous, zeros for padding rows.

    ``lengths`` (int64 [batch]) is KVCommit's output. ``scale`` 0 means 1/sqrt(head_dim).
    Split-K needs ``workspace`` = `attention_workspace` (``plan.workspace_elems`` float32
    elements); without one the launch uses one split. ``plan`` (from `attention_plan`)
    pins the cut, as a captured graph must; otherwise it is chosen here from the sizes and
    ``max_context``. Returns the plan used.
    """
    op = "KVAttention"
    _check_strides(op, strides)
    if plan is None:
        plan = attention_plan(
            batch=batch,
            seq=seq,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            capacity=capacity,
            max_context=max_context,
            split=workspace is not None,
        )
    suffix = dtype_suffix(query.dtype, op)
    positive(op, batch=batch, seq=seq, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    need(kv_heads > 0 and heads % kv_heads == 0, op, f"kv_heads={kv_heads} must divide {heads}")
    d4 = round_up(head_dim, 4)
    rows = plan.q_tile * (heads // kv_heads)
    need(
        plan.grid[:2] == (batch * -(-seq // plan.q_tile), kv_heads)
        and plan.shared_bytes == _shared_bytes(plan.q_tile, rows, plan.kv_tile, d4)
        and rows <= _MAX_ACC * (_THREADS // d4),
        op,
        f"the plan {plan.grid} was made for other sizes than batch={batch}, seq={seq}, "
        f"heads={heads}, kv_heads={kv_heads}, head_dim={head_dim}: build it with attention_plan",
    )
    table, cols = _cache_checks(
        op, key_cache, value_cache, strides, capacity, batch, block_table, table_cols
    )
    need(
        key_cache.dtype == query.dtype,
        op,
        f"the cache holds {key_cache.dtype}, query is {query.dtype}",
    )
    per_token = heads * head_dim
    q_tok = query_token_stride or per_token
    need(q_tok >= per_token, op, f"query_token_stride={q_tok} must be >= {per_token}")
    extent = (batch * seq - 1) * q_tok + per_token if batch * seq else 0
    check_buffer(op, "query", query, extent, query.dtype)
    check_buffer(op, "out", out, batch * seq * per_token, query.dtype)
    pos_i64 = check_index_buffer(op, "positions", positions, batch * seq)
    check_buffer(op, "lengths", lengths, batch, np.dtype(np.int64))
    check_status(op, status)
    if plan.splits > 1:
        need(
            workspace is not None,
            op,
            f"the plan has {plan.splits} splits; pass workspace=attention_workspace(dev, plan, "
            "stream=...)",
        )
        assert workspace is not None
        check_buffer(op, "workspace", workspace, plan.workspace_elems, np.dtype(np.float32))
        ws = workspace
    else:
        ws = out  # one split never touches the workspace; any buffer fills the slot
    if batch * seq * heads == 0:
        return plan
    if scale == 0.0:
        scale = float(np.float32(1.0 / np.sqrt(head_dim)))  # what the reference uses
    per16 = FLOAT_DTYPES[query.dtype][2]
    vec = _vector_ok(strides, head_dim, per16, key_cache, value_cache)
    group = heads // kv_heads
    if _decode_tc_ok(plan, seq, group, head_dim, vec, query, out, q_tok, capacity):
        # The most live splits a launch can have: positions < capacity, share >= min_share.
        most = min(plan.splits, -(-capacity // round_up(plan.share, 16)))
        merge_limit = plan.splits if most <= _TC_MERGE_MAX else _TC_MERGE_MAX
        dev.kernel(DECODE_TC_KERNELS[head_dim][suffix].name).launch(
            plan.grid,
            _TC_THREADS,
            out, ws, query, positions, pos_i64, lengths, key_cache, value_cache, table, cols,
            batch, heads, kv_heads, q_tok, strides.batch, strides.token, strides.head,
            strides.page, strides.page_size, capacity, key_cache.size, scale, plan.splits,
            plan.share, merge_limit, status,
            stream=stream,
        )  # fmt: skip
        if most > _TC_MERGE_MAX:  # exits at once unless more than merge_limit splits are live
            rows = batch * heads
            dev.kernel(DECODE_MERGE_KERNELS[suffix].name).launch(
                rows, _THREADS, out, ws, positions, pos_i64, lengths, batch, heads, head_dim,
                capacity, plan.splits, plan.share, merge_limit, stream=stream,
            )  # fmt: skip
        return plan
    decode = _decode_ok(plan, seq, group, head_dim, per16, vec, query, q_tok)
    kernel = dev.kernel((DECODE_KERNELS if decode else ATTENTION_KERNELS)[suffix].name)
    kernel.launch(
        plan.grid,
        _DECODE_THREADS if decode else _THREADS,
        out, ws, query, positions, pos_i64, lengths, key_cache, value_cache, table, cols,
        batch, seq, heads, kv_heads, head_dim, q_tok,
        strides.batch, strides.token, strides.head, strides.dim, strides.page, strides.page_size,
        capacity, key_cache.size, scale, plan.q_tile, plan.kv_tile, plan.lanes, plan.splits,
        plan.chunk, int(vec), status,
        stream=stream,
        shared_mem=0 if decode else plan.shared_bytes,
    )  # fmt: skip
    if plan.splits > 1:
        rows = batch * seq * heads
        reduce = dev.kernel(REDUCE_KERNELS[suffix].name)
        reduce.launch(rows, _THREADS, out, ws, rows, head_dim, plan.splits, stream=stream)
    return plan


def attention_version() -> str:
    """The decode kernels `ATTENTION_ENV` asks for: ``v1`` only the earlier ``kv_decode`` (and its
    reduce kernel); ``v2`` (also when unset or empty) ``kv_decode_tc`` where it applies."""
    value = os.environ.get(ATTENTION_ENV, "").strip().lower() or "v2"
    need(
        value in _ATTENTION_VERSIONS,
        "KVAttention",
        f"{ATTENTION_ENV}={value!r} is not an attention version; expected v1 (only the earlier "
        "decode kernel) or v2 (the default: kv_decode_tc where it applies); unset it for the "
        "default",
    )
    return value


def _decode_tc_ok(
    plan: AttentionPlan,
    seq: int,
    group: int,
    head_dim: int,
    vec: bool,
    query: Buffer,
    out: Buffer,
    q_tok: int,
    capacity: int,
) -> bool:
    """Whether ``kv_decode_tc`` runs this launch: fp16/bf16, one query token a row, head_dim 64
    or 128, at most 8 query heads a KV head, 16-byte loads of K, V and the query, a 16-byte
    aligned output, fewer than 2**31 slots, and `ATTENTION_ENV` not ``v1``."""
    return (
        seq == 1
        and plan.q_tile == 1
        and vec
        and query.dtype in (np.dtype(np.float16), BF16)
        and head_dim in DECODE_TC_KERNELS
        and group <= _DECODE_MAX_GROUP
        and q_tok % 8 == 0
        and capacity <= _TC_MAX_SLOTS
        and aligned(query, out)
        and attention_version() == "v2"
    )


def _decode_ok(
    plan: AttentionPlan,
    seq: int,
    group: int,
    head_dim: int,
    per16: int,
    vec: bool,
    query: Buffer,
    q_tok: int,
) -> bool:
    """Whether ``kv_decode`` runs this launch: one query token a row, 16-byte loads of K, V and
    the query, at most 8 query heads a KV head, a row's 16-byte pieces a power of two <= 32.
    Otherwise the tiled ``kv_attention`` does (same plan, same workspace format)."""
    lanes = head_dim // per16
    return (
        seq == 1
        and plan.q_tile == 1
        and vec
        and group <= _DECODE_MAX_GROUP
        and head_dim % per16 == 0
        and lanes & (lanes - 1) == 0
        and lanes <= 32
        and q_tok % per16 == 0
        and aligned(query)
    )
