"""KVCommit and KVAttention: write new K/V into a runtime-owned cache, attend over it (causal GQA).

Geometry comes from the KV layout's stride descriptor (`ep.seams.KVStrides`) plus the capacity,
fed as a small int64 input ``geometry`` = [batch, token, head, dim, page, page_size, capacity]
(`kv_geometry`). It is an input, not an attribute, because a capacity bucket change changes the
strides of head-major and seq-major layouts: one graph serves every bucket and every layout.

Addressing (element offsets into the flat buffer): token t of sequence b, head h, feature d is at
``b*batch + t*token + h*head + d*dim``; for a paged layout (page_size > 0) at
``table[b, t // page_size]*page + (t % page_size)*token + h*head + d*dim`` with the block table
given as an extra input (the ``...Paged`` ops).

Positions: ``positions[b, s]`` is the cache slot (= absolute position) of new token s of row b;
a negative position marks padding (a left-padded batch): not written, and its query row outputs
zeros. A query at position p attends to slots 0..p of its row (causal), so per-row valid lengths
need no extra input: slots below p were written by earlier steps or earlier in this one.

Inside ONNX Runtime the cache is not an input (inputs arrive as copies and writes would be lost):
the ops get an int64 ``cache`` handle that `ep.ops.runtime.KV_CACHES` maps to the runtime's
buffers, plus a ``layer`` attribute. KVCommit outputs the rows' lengths, which KVAttention takes
as an input: that edge orders the write before the read in any executor.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ep.errors import OpError
from ep.ops._infer import FLOATS, as_f32, expect, expect_rank, expect_shape
from ep.ops.runtime import KV_CACHES
from ep.ops.schema import ArgInfo, AttrSpec, OpDef, OpSchema, TensorSpec
from ep.seams import KVGeometry, KVStrides

__all__ = [
    "KV_ATTENTION",
    "KV_ATTENTION_PAGED",
    "KV_COMMIT",
    "KV_COMMIT_PAGED",
    "kv_attention",
    "kv_attention_from",
    "kv_commit",
    "kv_commit_into",
    "kv_geometry",
    "parse_kv_geometry",
]

GEOMETRY_FIELDS = ("batch", "token", "head", "dim", "page", "page_size", "capacity")


def kv_geometry(geometry: KVGeometry | KVStrides, capacity: int | None = None) -> np.ndarray:
    """The int64 [7] ``geometry`` input for a layout's `KVGeometry` (or strides + capacity)."""
    if isinstance(geometry, KVGeometry):
        strides, cap = geometry.strides, geometry.capacity
    else:
        if capacity is None:
            raise OpError("kv_geometry(strides, capacity): the capacity is required with strides")
        strides, cap = geometry, capacity
    s = strides
    return np.array([s.batch, s.token, s.head, s.dim, s.page, s.page_size, cap], dtype=np.int64)


def parse_kv_geometry(geometry: np.ndarray) -> tuple[KVStrides, int]:
    """``(strides, capacity)`` from the int64 [7] input, validated."""
    g = np.asarray(geometry)
    if g.shape != (7,) or g.dtype != np.int64:
        raise OpError(
            f"KV geometry is {g.dtype}{list(g.shape)}; expected int64[7] "
            f"({', '.join(GEOMETRY_FIELDS)}); build it with ep.ops.kv_geometry(layout geometry)"
        )
    batch, token, head, dim, page, page_size, capacity = (int(v) for v in g)
    if min(batch, token, head, dim, page, page_size) < 0 or capacity <= 0:
        raise OpError(
            f"KV geometry {g.tolist()} ({', '.join(GEOMETRY_FIELDS)}) has a negative stride or a "
            "capacity <= 0"
        )
    return KVStrides(batch, token, head, dim, page, page_size), capacity


def _token_offsets(
    rows: np.ndarray,
    tokens: np.ndarray,
    strides: KVStrides,
    block_table: np.ndarray | None,
    op: str,
) -> np.ndarray:
    """Element offset of (row, token, head 0, dim 0) for each pair."""
    if strides.page_size == 0:
        if block_table is not None:
            raise OpError(f"{op}: a block table was given but the geometry has page_size 0")
        return rows.astype(np.int64) * strides.batch + tokens.astype(np.int64) * strides.token
    if block_table is None:
        raise OpError(
            f"{op}: the geometry is paged (page_size {strides.page_size}) but the op has no block "
            f"table; use {op}Paged"
        )
    slot = tokens // strides.page_size
    if slot.size and int(slot.max()) >= block_table.shape[1]:
        raise OpError(
            f"{op}: token {int(tokens.max())} needs block-table column {int(slot.max())}; the "
            f"table has {block_table.shape[1]} columns"
        )
    pages = block_table[rows, slot].astype(np.int64)
    if pages.size and int(pages.min()) < 0:
        raise OpError(f"{op}: the block table maps a live token to page {int(pages.min())}")
    return pages * strides.page + (tokens % strides.page_size).astype(np.int64) * strides.token


def _element_index(
    base: np.ndarray, heads: int, head_dim: int, strides: KVStrides, size: int, op: str
) -> np.ndarray:
    """[n, heads, head_dim] element offsets, bounds-checked against the buffer ``size``."""
    idx = (
        base[:, None, None]
        + (np.arange(heads, dtype=np.int64) * strides.head)[None, :, None]
        + (np.arange(head_dim, dtype=np.int64) * strides.dim)[None, None, :]
    )
    if idx.size and (int(idx.max()) >= size or int(idx.min()) < 0):
        raise OpError(
            f"{op}: the geometry addresses element {int(idx.max())} of a buffer of {size} "
            "elements; the strides, capacity or batch do not match the bound buffers"
        )
    return idx


def _check_positions(positions: np.ndarray, capacity: int, op: str) -> None:
    if positions.size and int(positions.max()) >= capacity:
        raise OpError(
            f"{op}: position {int(positions.max())} does not fit the cache capacity {capacity}; "
            "grow the cache (the layout's next capacity bucket) before this step"
        )


def kv_commit_into(
    key_buffer: np.ndarray,
    value_buffer: np.ndarray,
    new_key: np.ndarray,
    new_value: np.ndarray,
    positions: np.ndarray,
    geometry: np.ndarray,
    block_table: np.ndarray | None = None,
) -> np.ndarray:
    """Write new_key/new_value [B,S,Hkv,D] at ``positions`` [B,S] into the flat buffers, in place.

    Returns int64 [B]: 1 + the highest position written per row (0 for a row of padding only).
    """
    op = "KVCommit"
    strides, capacity = parse_kv_geometry(geometry)
    for kind, buf in (("key", key_buffer), ("value", value_buffer)):
        if buf.dtype != new_key.dtype:
            raise OpError(
                f"{op}: the {kind} cache holds {buf.dtype} but the new keys are {new_key.dtype}"
            )
    _check_positions(positions, capacity, op)
    batch, seq, heads, head_dim = new_key.shape
    valid = positions >= 0
    order = np.where(valid, positions, -1)
    if seq > 1 and np.any((np.diff(order, axis=1) <= 0) & valid[:, 1:]):
        raise OpError(
            f"{op}: positions must increase along each row (padding first): {positions.tolist()}"
        )
    rows, cols = np.nonzero(valid)
    tokens = positions[rows, cols]
    base = _token_offsets(rows, tokens, strides, block_table, op)
    idx = _element_index(base, heads, head_dim, strides, key_buffer.size, op)
    key_buffer[idx] = new_key[rows, cols]
    value_buffer[idx] = new_value[rows, cols]
    return (order.max(axis=1) + 1).astype(np.int64) if seq else np.zeros(batch, np.int64)


def kv_attention_from(
    key_buffer: np.ndarray,
    value_buffer: np.ndarray,
    query: np.ndarray,
    positions: np.ndarray,
    lengths: np.ndarray,
    geometry: np.ndarray,
    *,
    kv_heads: int,
    scale: float,
    block_table: np.ndarray | None = None,
) -> np.ndarray:
    """Causal GQA attention of query [B,S,Hq,D] at ``positions`` over the flat buffers.

    Query head h reads KV head ``h // (Hq // kv_heads)``. Scores, softmax and the weighted sum are
    float32; ``scale`` 0 means 1/sqrt(D). Padding rows (position < 0) come back as zeros.
    """
    op = "KVAttention"
    strides, capacity = parse_kv_geometry(geometry)
    if key_buffer.dtype != query.dtype or value_buffer.dtype != query.dtype:
        raise OpError(
            f"{op}: the cache holds {key_buffer.dtype}/{value_buffer.dtype} but the queries are "
            f"{query.dtype}"
        )
    _check_positions(positions, capacity, op)
    batch, _, q_heads, head_dim = query.shape
    group = q_heads // kv_heads
    factor = np.float32(scale if scale else 1.0 / np.sqrt(head_dim))
    out = np.zeros(query.shape, dtype=np.float32)
    for b in range(batch):
        valid = positions[b] >= 0
        if not valid.any():
            continue
        pos = positions[b][valid]
        span = int(pos.max()) + 1
        if span > int(lengths[b]):
            raise OpError(
                f"{op}: row {b} has a query at position {span - 1} but its KVCommit reported "
                f"only {int(lengths[b])} tokens; feed KVCommit's lengths output"
            )
        tokens = np.arange(span, dtype=np.int64)
        base = _token_offsets(np.full(span, b), tokens, strides, block_table, op)
        idx = _element_index(base, kv_heads, head_dim, strides, key_buffer.size, op)
        keys = np.repeat(as_f32(key_buffer[idx]).transpose(1, 0, 2), group, axis=0)  # [Hq,L,D]
        values = np.repeat(as_f32(value_buffer[idx]).transpose(1, 0, 2), group, axis=0)
        q = as_f32(query[b, valid]).transpose(1, 0, 2)  # [Hq, s, D]
        scores = np.matmul(q, keys.transpose(0, 2, 1)) * factor  # [Hq, s, L]
        scores = np.where(tokens[None, None, :] > pos[None, :, None], -np.inf, scores)
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        out[b, valid] = np.matmul(probs, values).transpose(1, 0, 2)
    return out.astype(query.dtype, copy=False)


def kv_commit(
    new_key: np.ndarray,
    new_value: np.ndarray,
    positions: np.ndarray,
    geometry: np.ndarray,
    cache: np.ndarray,
    *,
    layer: int,
) -> np.ndarray:
    """The ``KVCommit`` op: resolve the ``cache`` handle, then `kv_commit_into`."""
    bufs = KV_CACHES.layer(_handle(cache), layer)
    return kv_commit_into(bufs.key, bufs.value, new_key, new_value, positions, geometry)


def kv_commit_paged(
    new_key: np.ndarray,
    new_value: np.ndarray,
    positions: np.ndarray,
    geometry: np.ndarray,
    block_table: np.ndarray,
    cache: np.ndarray,
    *,
    layer: int,
) -> np.ndarray:
    bufs = KV_CACHES.layer(_handle(cache), layer)
    return kv_commit_into(
        bufs.key, bufs.value, new_key, new_value, positions, geometry, block_table
    )


def kv_attention(
    query: np.ndarray,
    positions: np.ndarray,
    lengths: np.ndarray,
    geometry: np.ndarray,
    cache: np.ndarray,
    *,
    layer: int,
    kv_heads: int,
    scale: float,
) -> np.ndarray:
    """The ``KVAttention`` op: resolve the ``cache`` handle, then `kv_attention_from`."""
    bufs = KV_CACHES.layer(_handle(cache), layer)
    return kv_attention_from(
        bufs.key, bufs.value, query, positions, lengths, geometry, kv_heads=kv_heads, scale=scale
    )


def kv_attention_paged(
    query: np.ndarray,
    positions: np.ndarray,
    lengths: np.ndarray,
    geometry: np.ndarray,
    block_table: np.ndarray,
    cache: np.ndarray,
    *,
    layer: int,
    kv_heads: int,
    scale: float,
) -> np.ndarray:
    bufs = KV_CACHES.layer(_handle(cache), layer)
    return kv_attention_from(
        bufs.key,
        bufs.value,
        query,
        positions,
        lengths,
        geometry,
        kv_heads=kv_heads,
        scale=scale,
        block_table=block_table,
    )


def _handle(cache: np.ndarray) -> int:
    return int(cache.reshape(-1)[0])


# --- schemas ---------------------------------------------------------------------------------

_GEOMETRY = TensorSpec("geometry", "int64", "[7]: " + ", ".join(GEOMETRY_FIELDS))
_CACHE = TensorSpec("cache", "int64", "[] or [1]: handle from ep.ops.KV_CACHES.bind")
_POSITIONS = TensorSpec("positions", "int64", "[batch, seq]: cache slot per token, < 0 = padding")
_TABLE = TensorSpec("block_table", "int32", "[batch, max_pages]: physical page per logical page")
_LAYER = AttrSpec("layer", "int", doc="which layer's buffers under the handle")


def _check_common(op: str, positions: ArgInfo, geometry: ArgInfo, cache: ArgInfo) -> None:
    expect_shape(op, "geometry", geometry, (7,), "int64[7] from ep.ops.kv_geometry")
    expect(
        cache.shape in ((), (1,)), op, f"cache has shape {list(cache.shape)}; expected [] or [1]"
    )
    expect_rank(op, "positions", positions, (2,), "[batch, seq]")


def _check_table(op: str, table: ArgInfo, batch: int) -> None:
    expect_rank(op, "block_table", table, (2,), "[batch, max_pages]")
    expect(table.shape[0] == batch, op, f"block_table has {table.shape[0]} rows; batch {batch}")


def _infer_commit_shapes(op: str, k: ArgInfo, v: ArgInfo, pos: ArgInfo) -> tuple[ArgInfo, ...]:
    expect_rank(op, "new_key", k, (4,), "[batch, seq, kv_heads, head_dim]")
    expect(k.shape == v.shape, op, f"new_key {list(k.shape)} and new_value {list(v.shape)} differ")
    expect_shape(op, "positions", pos, k.shape[:2], "[batch, seq] of new_key")
    return (ArgInfo((k.shape[0],), "int64"),)


def _infer_commit(inputs: Sequence[ArgInfo], attrs: Mapping[str, Any]) -> tuple[ArgInfo, ...]:
    k, v, pos, geometry, cache = inputs
    _check_common("KVCommit", pos, geometry, cache)
    expect(attrs["layer"] >= 0, "KVCommit", f"layer={attrs['layer']} must be >= 0")
    return _infer_commit_shapes("KVCommit", k, v, pos)


def _infer_commit_paged(inputs: Sequence[ArgInfo], attrs: Mapping[str, Any]) -> tuple[ArgInfo, ...]:
    k, v, pos, geometry, table, cache = inputs
    _check_common("KVCommitPaged", pos, geometry, cache)
    _check_table("KVCommitPaged", table, pos.shape[0])
    return _infer_commit_shapes("KVCommitPaged", k, v, pos)


def _infer_attention_shapes(
    op: str, q: ArgInfo, pos: ArgInfo, lengths: ArgInfo, attrs: Mapping[str, Any]
) -> tuple[ArgInfo, ...]:
    expect_rank(op, "query", q, (4,), "[batch, seq, heads, head_dim]")
    expect_shape(op, "positions", pos, q.shape[:2], "[batch, seq] of query")
    expect_shape(op, "lengths", lengths, q.shape[:1], "[batch], KVCommit's output")
    kv_heads = attrs["kv_heads"]
    expect(
        kv_heads > 0 and q.shape[2] % kv_heads == 0,
        op,
        f"kv_heads={kv_heads} must be > 0 and divide the query heads ({q.shape[2]})",
    )
    expect(attrs["scale"] >= 0, op, f"scale={attrs['scale']} must be >= 0 (0: 1/sqrt(head_dim))")
    return (q,)


def _infer_attention(inputs: Sequence[ArgInfo], attrs: Mapping[str, Any]) -> tuple[ArgInfo, ...]:
    q, pos, lengths, geometry, cache = inputs
    _check_common("KVAttention", pos, geometry, cache)
    return _infer_attention_shapes("KVAttention", q, pos, lengths, attrs)


def _infer_attention_paged(
    inputs: Sequence[ArgInfo], attrs: Mapping[str, Any]
) -> tuple[ArgInfo, ...]:
    q, pos, lengths, geometry, table, cache = inputs
    _check_common("KVAttentionPaged", pos, geometry, cache)
    _check_table("KVAttentionPaged", table, pos.shape[0])
    return _infer_attention_shapes("KVAttentionPaged", q, pos, lengths, attrs)


_NEW_K = TensorSpec("new_key", "T", "[batch, seq, kv_heads, head_dim]")
_NEW_V = TensorSpec("new_value", "T", "[batch, seq, kv_heads, head_dim]")
_LENGTHS_OUT = TensorSpec("lengths", "int64", "[batch]: 1 + highest position written per row")
_COMMIT_DOC = "Write new tokens' K/V into the runtime-owned cache at their positions (in place)."
_ATTN_ATTRS = (
    _LAYER,
    AttrSpec("kv_heads", "int", doc="KV heads in the cache (query heads are a multiple)"),
    AttrSpec("scale", "float", 0.0, "softmax scale; 0: 1/sqrt(head_dim)"),
)
_ATTN_DOC = "Causal GQA attention of new queries over the runtime-owned cache."
_Q = TensorSpec("query", "T", "[batch, seq, heads, head_dim]")
_LENGTHS_IN = TensorSpec("lengths", "int64", "[batch]: KVCommit's output (orders write, read)")
_OUT = TensorSpec("output", "T", "[batch, seq, heads, head_dim]; zeros for padding rows")

KV_COMMIT = OpDef(
    OpSchema(
        "KVCommit",
        inputs=(_NEW_K, _NEW_V, _POSITIONS, _GEOMETRY, _CACHE),
        outputs=(_LENGTHS_OUT,),
        attributes=(_LAYER,),
        type_vars=(("T", FLOATS),),
        doc=_COMMIT_DOC,
    ),
    reference=kv_commit,
    infer=_infer_commit,
)

KV_COMMIT_PAGED = OpDef(
    OpSchema(
        "KVCommitPaged",
        inputs=(_NEW_K, _NEW_V, _POSITIONS, _GEOMETRY, _TABLE, _CACHE),
        outputs=(_LENGTHS_OUT,),
        attributes=(_LAYER,),
        type_vars=(("T", FLOATS),),
        doc=_COMMIT_DOC + " Paged layout: pages through a block table.",
    ),
    reference=kv_commit_paged,
    infer=_infer_commit_paged,
)

KV_ATTENTION = OpDef(
    OpSchema(
        "KVAttention",
        inputs=(_Q, _POSITIONS, _LENGTHS_IN, _GEOMETRY, _CACHE),
        outputs=(_OUT,),
        attributes=_ATTN_ATTRS,
        type_vars=(("T", FLOATS),),
        doc=_ATTN_DOC,
    ),
    reference=kv_attention,
    infer=_infer_attention,
)

KV_ATTENTION_PAGED = OpDef(
    OpSchema(
        "KVAttentionPaged",
        inputs=(_Q, _POSITIONS, _LENGTHS_IN, _GEOMETRY, _TABLE, _CACHE),
        outputs=(_OUT,),
        attributes=_ATTN_ATTRS,
        type_vars=(("T", FLOATS),),
        doc=_ATTN_DOC + " Paged layout: pages through a block table.",
    ),
    reference=kv_attention_paged,
    infer=_infer_attention_paged,
)
