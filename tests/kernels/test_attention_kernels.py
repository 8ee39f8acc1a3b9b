"""KVCommit and KVAttention kernels against `ep.ops.kv`, in head-major, seq-major and paged
layouts (one compiled kernel each, strides as arguments), GQA 1 and 7, prefill and split-K decode,
a left-padded batch of 3."""

from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

from ep.device import Buffer, Device
from ep.errors import KernelArgumentError, KernelFaultError
from ep.kernels import KernelFault, attention, check_faults, new_status
from ep.ops import kv as ref
from ep.seams import KVStrides

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
# Max |kernel - reference| / max |reference|. float32: online softmax and summation order only.
TOL = {F32: 1e-5, np.dtype(np.float16): 1e-2, BF16: 1e-2}
LAYOUTS = ["head_major", "seq_major", "paged", "paged_head_major"]


def upload(device: Device, array: np.ndarray) -> Buffer:
    return device.to_device(np.ascontiguousarray(array), stream=device.default_stream)


def poisoned(device: Device, shape: int | tuple[int, ...], dtype: np.dtype) -> Buffer:
    buf = device.alloc(shape, dtype, stream=device.default_stream)
    device.fill(buf.view(np.uint8), 0xFF, stream=device.default_stream)
    return buf


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert not np.isnan(g).any(), "the kernel left NaN (poison) in its output"
    return float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30))


@dataclass
class Cache:
    """One layer's K/V in a layout, mirrored: NumPy arrays for the reference, device buffers."""

    strides: KVStrides
    capacity: int
    key: np.ndarray
    value: np.ndarray
    dkey: Buffer
    dvalue: Buffer
    table: np.ndarray | None
    dtable: Buffer | None

    @property
    def geometry(self) -> np.ndarray:
        return ref.kv_geometry(self.strides, self.capacity)

    @property
    def table_cols(self) -> int:
        return 0 if self.table is None else self.table.shape[1]


def make_cache(
    device: Device,
    kind: str,
    *,
    batch: int,
    capacity: int,
    kv_heads: int,
    head_dim: int,
    dtype: np.dtype,
    rng: np.random.Generator,
    page: int = 16,
) -> Cache:
    hk, d, c = kv_heads, head_dim, capacity
    table = None
    if kind == "head_major":  # [B, Hkv, C, D]
        strides, elems = KVStrides(hk * c * d, d, c * d, 1), batch * hk * c * d
    elif kind == "seq_major":  # [B, C, Hkv, D]
        strides, elems = KVStrides(c * hk * d, hk * d, d, 1), batch * c * hk * d
    else:  # pages of `page` tokens: [pages, P, Hkv, D] or [pages, Hkv, P, D]; shuffled table
        per_row = -(-c // page)
        pages = batch * per_row + 3  # spare pages nobody maps
        if kind == "paged":
            strides = KVStrides(0, hk * d, d, 1, page * hk * d, page)
        else:
            strides = KVStrides(0, d, page * d, 1, hk * page * d, page)
        elems = pages * page * hk * d
        table = rng.permutation(pages)[: batch * per_row].reshape(batch, per_row).astype(np.int32)
    key = np.full(elems, 0xFF, np.uint8).view(np.uint8)
    raw = np.full(elems * dtype.itemsize, 0xFF, np.uint8)
    key, value = raw.view(dtype).copy(), raw.view(dtype).copy()
    return Cache(
        strides,
        capacity,
        key,
        value,
        upload(device, key),
        upload(device, value),
        table,
        None if table is None else upload(device, table),
    )


def left_padded(lengths: list[int], seq: int) -> np.ndarray:
    pos = np.full((len(lengths), seq), -1, dtype=np.int64)
    for b, n in enumerate(lengths):
        pos[b, seq - n :] = np.arange(n)
    return pos


def commit(device: Device, cache: Cache, k: np.ndarray, v: np.ndarray, pos: np.ndarray) -> Buffer:
    """KVCommit on both sides; checks the caches byte for byte and the lengths; returns them."""
    batch, seq, hk, d = k.shape
    want_len = ref.kv_commit_into(cache.key, cache.value, k, v, pos, cache.geometry, cache.table)
    lengths = poisoned(device, batch, np.dtype(np.int64))
    status = new_status(device, stream=device.default_stream)
    attention.kv_commit(
        device,
        cache.dkey,
        cache.dvalue,
        lengths,
        upload(device, k),
        upload(device, v),
        upload(device, pos),
        batch=batch,
        seq=seq,
        kv_heads=hk,
        head_dim=d,
        strides=cache.strides,
        capacity=cache.capacity,
        block_table=cache.dtable,
        table_cols=cache.table_cols,
        status=status,
        stream=device.default_stream,
    )
    check_faults(device, status, stream=device.default_stream)
    s = device.default_stream
    np.testing.assert_array_equal(lengths.to_host(stream=s), want_len)
    np.testing.assert_array_equal(
        cache.dkey.to_host(stream=s).view(np.uint8), cache.key.view(np.uint8)
    )
    np.testing.assert_array_equal(
        cache.dvalue.to_host(stream=s).view(np.uint8), cache.value.view(np.uint8)
    )
    return lengths


def workspace_for(device: Device, plan: attention.AttentionPlan) -> Buffer | None:
    """`attention_workspace` with its partial results poisoned (NaN): a merge that reads a partial
    no split wrote leaves NaN in the output. The arrival counters stay zero, as they must."""
    workspace = attention.attention_workspace(device, plan, stream=device.default_stream)
    if workspace is not None:
        floats = plan.workspace_elems - plan.counters
        device.fill(workspace.view(np.uint32, (floats,)), 0xFFFFFFFF, stream=device.default_stream)
    return workspace


def attend(
    device: Device,
    cache: Cache,
    q: np.ndarray,
    pos: np.ndarray,
    lengths: Buffer,
    *,
    kv_heads: int,
    split: bool,
    scale: float = 0.0,
    min_chunk: int = 16,
    min_share: int = 16,
) -> tuple[np.ndarray, np.ndarray, attention.AttentionPlan]:
    """KVAttention against the reference; by default even short contexts split (16 slots a
    split, 16 live tokens a decode split)."""
    batch, seq, heads, d = q.shape
    plan = attention.attention_plan(
        batch=batch,
        seq=seq,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=d,
        capacity=cache.capacity,
        split=split,
        min_chunk=min_chunk,
        min_share=min_share,
    )
    workspace = workspace_for(device, plan) if split else None
    out = poisoned(device, q.shape, q.dtype)
    status = new_status(device, stream=device.default_stream)
    attention.kv_attention(
        device,
        out,
        upload(device, q),
        upload(device, pos),
        lengths,
        cache.dkey,
        cache.dvalue,
        batch=batch,
        seq=seq,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=d,
        strides=cache.strides,
        capacity=cache.capacity,
        scale=scale,
        block_table=cache.dtable,
        table_cols=cache.table_cols,
        workspace=workspace,
        plan=plan,
        status=status,
        stream=device.default_stream,
    )
    check_faults(device, status, stream=device.default_stream)
    host_len = lengths.to_host(stream=device.default_stream)
    want = ref.kv_attention_from(
        cache.key,
        cache.value,
        q,
        pos,
        host_len,
        cache.geometry,
        kv_heads=kv_heads,
        scale=scale,
        block_table=cache.table,
    )
    return out.to_host(stream=device.default_stream), want, plan


def random_kv(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (4, 4, 128)])
def test_prefill_then_split_k_decode(
    device: Device, layout: str, heads: int, kv_heads: int, head_dim: int
) -> None:
    """A left-padded batch of 3: prefill commit + attention, then decode steps with split-K."""
    rng = np.random.default_rng(hash((layout, heads)) % 2**32)
    dtype = F32
    batch, seq, capacity = 3, 21, 64
    cache = make_cache(
        device,
        layout,
        batch=batch,
        capacity=capacity,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        rng=rng,
    )
    lens = [seq, seq - 4, 9]
    pos = left_padded(lens, seq)
    kv_shape = (batch, seq, kv_heads, head_dim)
    lengths = commit(
        device, cache, random_kv(rng, kv_shape, dtype), random_kv(rng, kv_shape, dtype), pos
    )
    q = rng.standard_normal((batch, seq, heads, head_dim)).astype(dtype)
    got, want, plan = attend(device, cache, q, pos, lengths, kv_heads=kv_heads, split=False)
    assert plan.q_tile > 1 and plan.splits == 1
    assert rel_err(got, want) <= TOL[dtype]
    assert (got[2, : seq - 9] == 0).all()  # padding query rows are zeros
    for step in range(3):
        dpos = np.array([[n + step] for n in lens], dtype=np.int64)
        one = (batch, 1, kv_heads, head_dim)
        lengths = commit(
            device, cache, random_kv(rng, one, dtype), random_kv(rng, one, dtype), dpos
        )
        dq = rng.standard_normal((batch, 1, heads, head_dim)).astype(dtype)
        got, want, plan = attend(device, cache, dq, dpos, lengths, kv_heads=kv_heads, split=True)
        assert plan.splits > 1, plan.reason
        assert rel_err(got, want) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [np.dtype(np.float16), BF16], ids=str)
@pytest.mark.parametrize("layout", ["seq_major", "paged"])
def test_half_precision_decode_with_gqa_7(device: Device, dtype: np.dtype, layout: str) -> None:
    rng = np.random.default_rng(77)
    batch, kv_heads, heads, d, capacity = 3, 2, 14, 64, 96
    cache = make_cache(
        device,
        layout,
        batch=batch,
        capacity=capacity,
        kv_heads=kv_heads,
        head_dim=d,
        dtype=dtype,
        rng=rng,
    )
    lens = [40, 17, 1]
    seq = max(lens)
    pos = left_padded(lens, seq)
    shape = (batch, seq, kv_heads, d)
    commit(device, cache, random_kv(rng, shape, dtype), random_kv(rng, shape, dtype), pos)
    dpos = np.array([[n] for n in lens], dtype=np.int64)
    one = (batch, 1, kv_heads, d)
    lengths = commit(device, cache, random_kv(rng, one, dtype), random_kv(rng, one, dtype), dpos)
    q = rng.standard_normal((batch, 1, heads, d)).astype(dtype)
    for split in (False, True):
        got, want, _ = attend(
            device, cache, q, dpos, lengths, kv_heads=kv_heads, split=split, scale=0.1
        )
        assert rel_err(got, want) <= TOL[dtype]


def test_query_and_new_kv_as_views_into_a_packed_projection(device: Device) -> None:
    """q, k, v as strided views of one [B, S, (Hq + 2 Hkv) * D] buffer, as the model makes them."""
    rng = np.random.default_rng(5)
    batch, seq, hq, hk, d, capacity = 2, 6, 14, 2, 64, 32
    width = (hq + 2 * hk) * d
    qkv = rng.standard_normal((batch, seq, width)).astype(F32)
    cache = make_cache(
        device,
        "seq_major",
        batch=batch,
        capacity=capacity,
        kv_heads=hk,
        head_dim=d,
        dtype=F32,
        rng=rng,
    )
    pos = left_padded([6, 3], seq)
    buf = upload(device, qkv)
    isz = F32.itemsize
    qv, kv, vv = (buf.view(F32, offset=o * d * isz) for o in (0, hq, hq + hk))
    lengths = poisoned(device, batch, np.dtype(np.int64))
    status = new_status(device, stream=device.default_stream)
    attention.kv_commit(
        device,
        cache.dkey,
        cache.dvalue,
        lengths,
        kv,
        vv,
        upload(device, pos),
        batch=batch,
        seq=seq,
        kv_heads=hk,
        head_dim=d,
        strides=cache.strides,
        capacity=capacity,
        src_token_stride=width,
        status=status,
        stream=device.default_stream,
    )
    k = qkv[..., hq * d : (hq + hk) * d].reshape(batch, seq, hk, d)
    v = qkv[..., (hq + hk) * d :].reshape(batch, seq, hk, d)
    q = qkv[..., : hq * d].reshape(batch, seq, hq, d)
    host_len = ref.kv_commit_into(cache.key, cache.value, k, v, pos, cache.geometry)
    out = poisoned(device, (batch, seq, hq, d), F32)
    attention.kv_attention(
        device,
        out,
        qv,
        upload(device, pos),
        lengths,
        cache.dkey,
        cache.dvalue,
        batch=batch,
        seq=seq,
        heads=hq,
        kv_heads=hk,
        head_dim=d,
        strides=cache.strides,
        capacity=capacity,
        query_token_stride=width,
        status=status,
        stream=device.default_stream,
    )
    check_faults(device, status, stream=device.default_stream)
    want = ref.kv_attention_from(
        cache.key, cache.value, q, pos, host_len, cache.geometry, kv_heads=hk, scale=0.0
    )
    assert rel_err(out.to_host(stream=device.default_stream), want) <= TOL[F32]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (7, 7, 128)])
def test_long_context_decode(
    device: Device, layout: str, heads: int, kv_heads: int, head_dim: int
) -> None:
    """Decode over a few thousand cached tokens (a few hundred on the CPU) with split-K."""
    rng = np.random.default_rng(123)
    context = 3000 if device.kind == "cuda" else 300
    batch, capacity = 3, context + 64
    cache = make_cache(
        device,
        layout,
        batch=batch,
        capacity=capacity,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=BF16,
        rng=rng,
        page=64,
    )
    lens = [context, context // 2 + 3, 5]
    pos = left_padded(lens, context)
    shape = (batch, context, kv_heads, head_dim)
    lengths = commit(device, cache, random_kv(rng, shape, BF16), random_kv(rng, shape, BF16), pos)
    last = np.array([[n - 1] for n in lens], dtype=np.int64)
    q = (rng.standard_normal((batch, 1, heads, head_dim)) * 2).astype(BF16)
    got, want, plan = attend(device, cache, q, last, lengths, kv_heads=kv_heads, split=True)
    assert plan.splits > 1
    assert rel_err(got, want) <= TOL[BF16]


def test_split_k_plans_fill_the_gpu_and_stay_one_split_when_full() -> None:
    decode = attention.attention_plan(
        batch=1, seq=1, heads=14, kv_heads=2, head_dim=64, capacity=32768
    )
    assert decode.splits >= 128 and decode.chunk % decode.kv_tile == 0
    assert decode.splits * decode.chunk >= 32768 > (decode.splits - 1) * decode.chunk
    # partial outputs, (max, sum) pairs, then one arrival counter per row and KV head
    assert decode.workspace_elems == 14 * decode.splits * 66 + 2 and decode.counters == 2
    assert decode.share == 256
    short = attention.attention_plan(
        batch=1, seq=1, heads=14, kv_heads=2, head_dim=64, capacity=2048
    )  # at most one split per 64 slots (the kernel shares out the live context)
    assert short.splits == 32 and short.workspace_elems > 0
    one = attention.attention_plan(batch=1, seq=1, heads=14, kv_heads=2, head_dim=64, capacity=100)
    assert one.splits == 1 and one.workspace_elems == 0 and "one chunk" in one.reason
    busy = attention.attention_plan(
        batch=16, seq=512, heads=14, kv_heads=2, head_dim=64, capacity=4096
    )
    assert busy.splits == 1 and busy.workspace_elems == 0 and "fill the GPU" in busy.reason
    prefill = attention.attention_plan(
        batch=1, seq=8, heads=14, kv_heads=2, head_dim=64, capacity=4096
    )
    assert prefill.splits > 1 and prefill.counters == 0  # only decode merges in the kernel
    assert prefill.workspace_elems == 8 * 14 * prefill.splits * 66
    off = attention.attention_plan(
        batch=1, seq=1, heads=14, kv_heads=2, head_dim=64, capacity=32768, split=False
    )
    assert off.splits == 1
    bounded = attention.attention_plan(
        batch=1, seq=1, heads=14, kv_heads=2, head_dim=64, capacity=32768, max_context=100
    )
    assert bounded.splits * bounded.chunk < 200
    with pytest.raises(KernelArgumentError, match="must divide"):
        attention.attention_plan(batch=1, seq=1, heads=14, kv_heads=3, head_dim=64, capacity=8)
    with pytest.raises(KernelArgumentError, match="min_share=0 must be a positive int"):
        attention.attention_plan(
            batch=1, seq=1, heads=14, kv_heads=2, head_dim=64, capacity=8, min_share=0
        )


def test_faults_are_flagged_and_nothing_is_written_out_of_place(device: Device) -> None:
    rng = np.random.default_rng(9)
    batch, hk, d, capacity = 2, 2, 64, 32
    cache = make_cache(
        device, "paged", batch=batch, capacity=capacity, kv_heads=hk, head_dim=d, dtype=F32, rng=rng
    )
    assert cache.table is not None and cache.dtable is not None
    before = cache.dkey.to_host(stream=device.default_stream).view(np.uint8).copy()
    k = random_kv(rng, (batch, 1, hk, d), F32)
    status = new_status(device, stream=device.default_stream)
    lengths = poisoned(device, batch, np.dtype(np.int64))

    def run_commit(positions: np.ndarray, table: Buffer) -> None:
        attention.kv_commit(
            device,
            cache.dkey,
            cache.dvalue,
            lengths,
            upload(device, k),
            upload(device, k),
            upload(device, positions),
            batch=batch,
            seq=1,
            kv_heads=hk,
            head_dim=d,
            strides=cache.strides,
            capacity=capacity,
            block_table=table,
            table_cols=cache.table_cols,
            status=status,
            stream=device.default_stream,
        )

    run_commit(np.array([[capacity], [-1]], dtype=np.int64), cache.dtable)
    with pytest.raises(KernelFaultError) as info:
        check_faults(device, status, stream=device.default_stream)
    assert info.value.faults == KernelFault.KV_POSITION
    bad_table = cache.table.copy()
    bad_table[0, 0] = -1
    bad_table[1, 0] = 10**6  # a page far outside the cache
    run_commit(np.array([[0], [1]], dtype=np.int64), upload(device, bad_table))
    with pytest.raises(KernelFaultError) as info:
        check_faults(device, status, stream=device.default_stream)
    assert info.value.faults == KernelFault.KV_PAGE
    after = cache.dkey.to_host(stream=device.default_stream).view(np.uint8)
    np.testing.assert_array_equal(after, before)  # nothing written
    np.testing.assert_array_equal(lengths.to_host(stream=device.default_stream), [1, 2])

    # A query past its row's committed length: zeros and a fault, no read past the row.
    pos = np.array([[0], [0]], dtype=np.int64)
    commit(device, cache, k, k, pos)
    out = poisoned(device, (batch, 1, 14, d), F32)
    attention.kv_attention(
        device,
        out,
        upload(device, rng.standard_normal((batch, 1, 14, d)).astype(F32)),
        upload(device, np.array([[0], [5]], dtype=np.int64)),
        upload(device, np.array([1, 1])),
        cache.dkey,
        cache.dvalue,
        batch=batch,
        seq=1,
        heads=14,
        kv_heads=hk,
        head_dim=d,
        strides=cache.strides,
        capacity=capacity,
        block_table=cache.dtable,
        table_cols=cache.table_cols,
        status=status,
        stream=device.default_stream,
    )
    with pytest.raises(KernelFaultError, match="committed length"):
        check_faults(device, status, stream=device.default_stream)
    got = out.to_host(stream=device.default_stream)
    assert (got[1] == 0).all() and np.isfinite(got[0]).all() and (got[0] != 0).any()


def test_commit_and_attention_refuse_bad_arguments(device: Device) -> None:
    rng = np.random.default_rng(1)
    cache = make_cache(
        device, "paged", batch=1, capacity=16, kv_heads=1, head_dim=8, dtype=F32, rng=rng
    )
    k = upload(device, np.zeros((1, 1, 1, 8), np.float32))
    pos = upload(device, np.zeros((1, 1), np.int64))
    lengths = poisoned(device, 1, np.dtype(np.int64))
    status = new_status(device, stream=device.default_stream)
    common = dict(
        batch=1,
        seq=1,
        kv_heads=1,
        head_dim=8,
        strides=cache.strides,
        capacity=16,
        status=status,
        stream=device.default_stream,
    )
    with pytest.raises(KernelArgumentError, match=r"paged .* pass the int32 block_table"):
        attention.kv_commit(device, cache.dkey, cache.dvalue, lengths, k, k, pos, **common)
    k16 = upload(device, np.zeros((1, 1, 1, 8), np.float16))
    with pytest.raises(KernelArgumentError, match=r"new_key .* is float16"):
        attention.kv_commit(
            device,
            cache.dkey,
            cache.dvalue,
            lengths,
            k16,
            k16,
            pos,
            block_table=cache.dtable,
            table_cols=cache.table_cols,
            **common,
        )
    out = poisoned(device, (1, 1, 2, 8), F32)
    plan = attention.attention_plan(
        batch=1, seq=1, heads=2, kv_heads=1, head_dim=8, capacity=4096, max_context=4096
    )
    assert plan.splits > 1
    with pytest.raises(KernelArgumentError, match="workspace"):
        attention.kv_attention(
            device,
            out,
            upload(device, np.zeros((1, 1, 2, 8), np.float32)),
            pos,
            lengths,
            cache.dkey,
            cache.dvalue,
            heads=2,
            block_table=cache.dtable,
            table_cols=cache.table_cols,
            plan=plan,
            **common,
        )


def test_a_plan_for_other_sizes_is_refused(device: Device) -> None:
    rng = np.random.default_rng(2)
    cache = make_cache(
        device, "head_major", batch=2, capacity=16, kv_heads=2, head_dim=64, dtype=F32, rng=rng
    )
    plan = attention.attention_plan(batch=1, seq=1, heads=14, kv_heads=2, head_dim=64, capacity=16)
    out = poisoned(device, (2, 1, 14, 64), F32)
    with pytest.raises(KernelArgumentError, match="made for other sizes"):
        attention.kv_attention(
            device,
            out,
            upload(device, np.zeros((2, 1, 14, 64), np.float32)),
            upload(device, np.zeros((2, 1), np.int64)),
            upload(device, np.ones(2, np.int64)),
            cache.dkey,
            cache.dvalue,
            batch=2,
            seq=1,
            heads=14,
            kv_heads=2,
            head_dim=64,
            strides=cache.strides,
            capacity=16,
            plan=plan,
            status=new_status(device, stream=device.default_stream),
            stream=device.default_stream,
        )


@pytest.mark.parametrize("version", ["v1", "v2"])
@pytest.mark.parametrize("dtype", [F32, BF16], ids=str)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (8, 8, 128), (16, 2, 64)])
@pytest.mark.parametrize("live", [1, 40, 300])
def test_decode_kernel_against_the_reference(
    device: Device,
    monkeypatch: pytest.MonkeyPatch,
    version: str,
    dtype: np.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    live: int,
) -> None:
    """kv_decode (one query a row; G = 7, 1 and 8 query heads a KV head), split and not; bf16
    runs kv_decode_tc unless GENAI_EP_ATTENTION=v1."""
    monkeypatch.setenv(attention.ATTENTION_ENV, version)
    rng = np.random.default_rng(live + heads)
    batch, capacity = 2, 512
    cache = make_cache(
        device,
        "seq_major",
        batch=batch,
        capacity=capacity,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        rng=rng,
    )
    lens = [live, max(1, live // 2)]
    seq = max(lens)
    shape = (batch, seq, kv_heads, head_dim)
    pos = left_padded(lens, seq)
    commit(device, cache, random_kv(rng, shape, dtype), random_kv(rng, shape, dtype), pos)
    dpos = np.array([[n] for n in lens], dtype=np.int64)
    one = (batch, 1, kv_heads, head_dim)
    lengths = commit(device, cache, random_kv(rng, one, dtype), random_kv(rng, one, dtype), dpos)
    q = rng.standard_normal((batch, 1, heads, head_dim)).astype(dtype)
    for split in (False, True):
        got, want, plan = attend(device, cache, q, dpos, lengths, kv_heads=kv_heads, split=split)
        per16 = 16 // dtype.itemsize
        dq = upload(device, q)
        assert attention._decode_ok(
            plan, 1, heads // kv_heads, head_dim, per16, True, dq, heads * head_dim
        )
        tc = attention._decode_tc_ok(
            plan, 1, heads // kv_heads, head_dim, True, dq, dq, heads * head_dim, capacity
        )
        assert tc == (version == "v2" and dtype == BF16)
        assert rel_err(got, want) <= TOL[dtype], (split, plan.splits)


def test_decode_kernel_is_chosen_only_where_it_applies(device: Device) -> None:
    plan = attention.attention_plan(batch=1, seq=1, heads=14, kv_heads=2, head_dim=64, capacity=64)
    q = upload(device, np.zeros((1, 1, 14, 64), BF16))
    assert attention._decode_ok(plan, 1, 7, 64, 8, True, q, 14 * 64)
    assert not attention._decode_ok(plan, 1, 9, 64, 8, True, q, 14 * 64)  # > 8 heads a KV head
    assert not attention._decode_ok(plan, 1, 7, 64, 8, False, q, 14 * 64)  # no 16-byte loads
    assert not attention._decode_ok(plan, 1, 7, 64, 8, True, q, 14 * 64 + 1)  # odd query stride
    assert not attention._decode_ok(plan, 1, 7, 48, 8, True, q, 14 * 48)  # 6 pieces a row
    prefill = attention.attention_plan(
        batch=1, seq=4, heads=14, kv_heads=2, head_dim=64, capacity=64
    )
    assert not attention._decode_ok(prefill, 4, 7, 64, 8, True, q, 14 * 64)


# --- kv_decode_tc (fp16/bf16 decode on tensor cores) -------------------------------------------

TC_DTYPES = [np.dtype(np.float16), BF16]


def filled(
    device: Device,
    layout: str,
    *,
    dtype: np.dtype,
    lens: list[int],
    kv_heads: int,
    head_dim: int,
    capacity: int,
    rng: np.random.Generator,
) -> tuple[Cache, Buffer, np.ndarray]:
    """A cache whose row b holds lens[b] random tokens; returns it, KVCommit's lengths and the
    decode positions (each row's last token; -1, padding, for an empty row)."""
    cache = make_cache(
        device,
        layout,
        batch=len(lens),
        capacity=capacity,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        rng=rng,
    )
    seq = max(max(lens), 1)
    shape = (len(lens), seq, kv_heads, head_dim)
    pos = left_padded(lens, seq)
    lengths = commit(device, cache, random_kv(rng, shape, dtype), random_kv(rng, shape, dtype), pos)
    last = np.array([[n - 1] for n in lens], dtype=np.int64)  # 0 tokens: position -1
    return cache, lengths, last


@pytest.mark.parametrize("dtype", TC_DTYPES, ids=str)
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim"),
    [
        (14, 2, 64),
        (16, 2, 128),
        (2, 2, 64),
        (8, 4, 128),
        (12, 3, 64),
        (6, 2, 128),
        (10, 2, 64),
        (12, 2, 64),
    ],  # G = 7, 8, 1, 2, 4, 3, 5, 6
)
@pytest.mark.parametrize(
    ("lens", "min_share"),
    [
        ([0, 1, 17], 16),  # padding, one token, two splits (in-kernel merge)
        ([16, 33, 255], 16),  # a split boundary, an odd length, 16 live splits (in-kernel)
        ([257, 300, 40], 16),  # 17 and 19 live splits: kv_decode_merge
        ([1, 255, 300], 256),  # the default share: one or two splits
    ],
)
def test_decode_tc_against_the_reference(
    device: Device,
    dtype: np.dtype,
    heads: int,
    kv_heads: int,
    head_dim: int,
    lens: list[int],
    min_share: int,
) -> None:
    """G = 1..8 query heads a KV head, head_dim 64 and 128, every way a row can be cut."""
    rng = np.random.default_rng(sum(lens) + heads + head_dim)
    cache, lengths, last = filled(
        device,
        "seq_major",
        dtype=dtype,
        lens=lens,
        kv_heads=kv_heads,
        head_dim=head_dim,
        capacity=512,
        rng=rng,
    )
    q = (rng.standard_normal((len(lens), 1, heads, head_dim)) * 2).astype(dtype)
    for split in (False, True):
        got, want, plan = attend(
            device, cache, q, last, lengths, kv_heads=kv_heads, split=split, min_share=min_share
        )
        dq = upload(device, q)
        assert attention._decode_tc_ok(
            plan, 1, heads // kv_heads, head_dim, True, dq, dq, heads * head_dim, 512
        )
        assert rel_err(got, want) <= TOL[dtype], (split, plan.splits)
        assert (got[np.array(lens) == 0] == 0).all()  # a padding query outputs zeros


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (4, 2, 128)])
@pytest.mark.parametrize("min_share", [16, 256])
def test_decode_tc_in_every_layout(
    device: Device, layout: str, heads: int, kv_heads: int, head_dim: int, min_share: int
) -> None:
    rng = np.random.default_rng(hash((layout, head_dim, min_share)) % 2**32)
    lens = [5, 100, 300]
    cache, lengths, last = filled(
        device,
        layout,
        dtype=BF16,
        lens=lens,
        kv_heads=kv_heads,
        head_dim=head_dim,
        capacity=320,
        rng=rng,
    )
    q = rng.standard_normal((len(lens), 1, heads, head_dim)).astype(BF16)
    got, want, _ = attend(
        device, cache, q, last, lengths, kv_heads=kv_heads, split=True, min_share=min_share
    )
    assert rel_err(got, want) <= TOL[BF16]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(14, 2, 64), (12, 2, 128)])
def test_decode_tc_replayed_as_the_context_grows(
    device: Device, heads: int, kv_heads: int, head_dim: int
) -> None:
    """The decode graph's case: one launch captured for 2048 slots with the executor's plan,
    replayed for live lengths 0..2048 (the share is cut on the device). Every slot holds data, so
    the tokens past the position (split 0 loads them before it knows the position) must be
    masked; the output is poisoned before each replay, and the arrival counters are zero after
    each (a replay that left one behind would never merge again)."""
    rng = np.random.default_rng(head_dim)
    s = device.default_stream
    capacity = 2048
    cache, lengths, _ = filled(
        device,
        "seq_major",
        dtype=BF16,
        lens=[capacity],
        kv_heads=kv_heads,
        head_dim=head_dim,
        capacity=capacity,
        rng=rng,
    )
    plan = attention.attention_plan(
        batch=1, seq=1, heads=heads, kv_heads=kv_heads, head_dim=head_dim, capacity=capacity
    )
    assert plan.splits == 32 and plan.share == 256
    workspace = workspace_for(device, plan)
    assert workspace is not None
    positions = upload(device, np.zeros((1, 1), np.int64))
    q = rng.standard_normal((1, 1, heads, head_dim)).astype(BF16)
    dq = upload(device, q)
    out = poisoned(device, q.shape, BF16)
    status = new_status(device, stream=s)
    for name in (
        attention.DECODE_TC_KERNELS[head_dim]["bf16"].name,
        attention.DECODE_MERGE_KERNELS["bf16"].name,
    ):
        device.kernel(name).load()
    with device.capture(stream=s) as cap:
        attention.kv_attention(
            device,
            out,
            dq,
            positions,
            lengths,
            cache.dkey,
            cache.dvalue,
            batch=1,
            seq=1,
            heads=heads,
            kv_heads=kv_heads,
            head_dim=head_dim,
            strides=cache.strides,
            capacity=capacity,
            workspace=workspace,
            plan=plan,
            status=status,
            stream=s,
        )
    assert cap.graph.launches == 1  # at most 8 live splits: merged in the kernel, no reduce
    counters = workspace.view(np.uint32, offset=4 * (plan.workspace_elems - plan.counters))
    for p in (0, 39, 127, 255, 256, 511, 1000, 2047, -1, 40):
        pos = np.array([[p]], np.int64)
        positions.copy_from_host(pos, stream=s)
        device.fill(out.view(np.uint16), 0xFFFF, stream=s)
        cap.graph.launch(stream=s)
        check_faults(device, status, stream=s)
        want = ref.kv_attention_from(
            cache.key,
            cache.value,
            q,
            pos,
            np.array([capacity]),
            cache.geometry,
            kv_heads=kv_heads,
            scale=0.0,
        )
        assert rel_err(out.to_host(stream=s), want) <= TOL[BF16], p
        assert (counters.to_host(stream=s) == 0).all(), p
    cap.graph.close()


def test_decode_tc_faults(device: Device) -> None:
    """A position past the committed length: zeros and KV_POSITION; a block-table page that is
    gone inside the live context: KV_PAGE (that query's output is unspecified)."""
    rng = np.random.default_rng(31)
    s = device.default_stream
    lens = [40, 300]
    cache, lengths, last = filled(
        device, "paged", dtype=BF16, lens=lens, kv_heads=2, head_dim=64, capacity=320, rng=rng
    )
    assert cache.table is not None
    q = rng.standard_normal((2, 1, 14, 64)).astype(BF16)
    plan = attention.attention_plan(
        batch=2, seq=1, heads=14, kv_heads=2, head_dim=64, capacity=320, min_chunk=16, min_share=16
    )

    def run(positions: np.ndarray, table: np.ndarray) -> tuple[np.ndarray, int]:
        """The output and the fault bits the launch flagged."""
        out = poisoned(device, q.shape, BF16)
        status = new_status(device, stream=s)
        attention.kv_attention(
            device,
            out,
            upload(device, q),
            upload(device, positions),
            lengths,
            cache.dkey,
            cache.dvalue,
            batch=2,
            seq=1,
            heads=14,
            kv_heads=2,
            head_dim=64,
            strides=cache.strides,
            capacity=320,
            block_table=upload(device, table),
            table_cols=cache.table_cols,
            workspace=workspace_for(device, plan),
            plan=plan,
            status=status,
            stream=s,
        )
        with pytest.raises(KernelFaultError) as info:
            check_faults(device, status, stream=s)
        return out.to_host(stream=s), info.value.faults

    got, faults = run(np.array([[39], [300]], np.int64), cache.table)  # 300 >= row 1's length
    assert faults == KernelFault.KV_POSITION
    assert (got[1] == 0).all() and np.isfinite(got[0].astype(np.float32)).all()
    want = ref.kv_attention_from(
        cache.key,
        cache.value,
        q[:1],
        last[:1],
        np.array([40]),
        cache.geometry,
        kv_heads=2,
        scale=0.0,
        block_table=cache.table[:1],
    )
    assert rel_err(got[:1], want) <= TOL[BF16]  # the other row is untouched by the fault
    table = cache.table.copy()
    table[1, 5] = -1  # tokens 80..95 of row 1 lose their page
    _, faults = run(last, table)
    assert faults == KernelFault.KV_PAGE


def test_decode_tc_is_chosen_only_where_it_applies(
    device: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = attention.attention_plan(batch=1, seq=1, heads=14, kv_heads=2, head_dim=64, capacity=64)
    q = upload(device, np.zeros((1, 1, 14, 64), BF16))
    ok = attention._decode_tc_ok
    assert ok(plan, 1, 7, 64, True, q, q, 14 * 64, 64)
    assert ok(plan, 1, 8, 128, True, q, q, 16 * 128, 64)
    q32 = upload(device, np.zeros((1, 1, 14, 64), np.float32))
    assert not ok(plan, 1, 7, 64, True, q32, q32, 14 * 64, 64)  # fp32: no tensor-core path
    assert not ok(plan, 1, 7, 96, True, q, q, 14 * 96, 64)  # head_dim 64 or 128 only
    assert not ok(plan, 1, 7, 256, True, q, q, 14 * 256, 64)
    assert not ok(plan, 1, 9, 64, True, q, q, 18 * 64, 64)  # > 8 query heads a KV head
    assert not ok(plan, 1, 7, 64, False, q, q, 14 * 64, 64)  # no 16-byte K/V loads
    assert not ok(plan, 1, 7, 64, True, q, q, 14 * 64 + 4, 64)  # query rows not 16-byte aligned
    shifted = q.view(BF16, (14 * 64 - 8,), offset=2)
    assert not ok(plan, 1, 7, 64, True, q, shifted, 14 * 64, 64)  # unaligned output
    assert not ok(plan, 1, 7, 64, True, q, q, 14 * 64, 2**31)  # int32 token indices
    prefill = attention.attention_plan(
        batch=1, seq=4, heads=14, kv_heads=2, head_dim=64, capacity=64
    )
    assert not ok(prefill, 4, 7, 64, True, q, q, 14 * 64, 64)
    monkeypatch.setenv(attention.ATTENTION_ENV, "v1")
    assert not ok(plan, 1, 7, 64, True, q, q, 14 * 64, 64)
    monkeypatch.setenv(attention.ATTENTION_ENV, "v3")
    with pytest.raises(KernelArgumentError, match="GENAI_EP_ATTENTION='v3' is not an attention"):
        ok(plan, 1, 7, 64, True, q, q, 14 * 64, 64)
