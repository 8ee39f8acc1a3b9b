"""ep.runtime.kv.KVCache with the built-in layouts: growth on stable-address buffers, committed
memory, the in-place plan checks, and the paged pool (pages on demand, fork, copy-on-write,
release)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
from kv_gate_lib import BatchOneStride

from ep.errors import ConfigError, ContractError, GenerationError
from ep.native.kv import byte_runs
from ep.runtime.kv import KVCache
from ep.seams import CopyRange, GrowthPlan, KVGeometry
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_builtin.kv_paged import PagedLayout
from ep_builtin.kv_seq_major import SeqMajorLayout

LAYERS, H, D = 2, 2, 4
TOKEN = H * D * 4  # bytes of one token in one buffer (fp32)


def _cache(layout: object, context: int = 64) -> KVCache:
    return KVCache(
        layout,  # type: ignore[arg-type]
        num_layers=LAYERS,
        kv_heads=H,
        head_dim=D,
        dtype=np.dtype(np.float32),
        context=context,
    )


def _fill(cache: KVCache, lengths: Sequence[int], seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    written = []
    for buf in cache.keys + cache.values:
        view = cache.token_view(buf)
        logical = np.zeros(view.shape, np.float32)
        for b, n in enumerate(lengths):
            logical[b, :n] = rng.normal(size=(n, H, D))
            view[b, :n] = logical[b, :n]
        written.append(logical)
    return written


def _same_tokens(cache: KVCache, written: list[np.ndarray], lengths: Sequence[int]) -> None:
    for buf, logical in zip(cache.keys + cache.values, written, strict=True):
        view = cache.token_view(buf)
        for b, n in enumerate(lengths):
            np.testing.assert_array_equal(view[b, :n], logical[b, :n])


def test_seq_major_grows_in_place_and_clears_what_it_vacated() -> None:
    cache = _cache(SeqMajorLayout(min_capacity=8))
    lengths = [5, 8, 3]
    cache.allocate(3, 8)
    written = _fill(cache, lengths)
    address = cache.keys[0].ctypes.data
    assert cache.ensure(9, lengths) and cache.ensure(17, lengths)  # 8 -> 16 -> 32
    assert cache.keys[0].ctypes.data == address  # the buffer grew behind its address
    _same_tokens(cache, written, lengths)
    stats = cache.stats()
    assert (stats.growths, stats.moved_growths) == (2, 0)
    assert stats.relocated_bytes == 2 * (8 + 3) * TOKEN * 2 * LAYERS  # b > 0, twice
    # Every byte that holds no live token is zero (nothing stale left where a sequence was).
    for buf in cache.keys + cache.values:
        view = cache.token_view(buf)
        for b, n in enumerate(lengths):
            assert not view[b, n:].any()


def test_head_major_growth_moves_to_a_new_buffer() -> None:
    cache = _cache(HeadMajorLayout(min_capacity=8))
    cache.allocate(3, 8)
    written = _fill(cache, [5, 8, 3])
    address = cache.keys[0].ctypes.data
    cache.ensure(9, [5, 8, 3])
    assert cache.keys[0].ctypes.data != address and cache.stats().moved_growths == 1
    _same_tokens(cache, written, [5, 8, 3])


def test_fixed_stride_commits_as_it_grows_and_never_moves() -> None:
    cache = _cache(SeqMajorLayout(min_capacity=8, fixed_stride=True), context=64)
    cache.allocate(3, 8)
    per_buffer = lambda cap: ((3 - 1) * 64 + cap) * TOKEN  # noqa: E731
    assert cache.committed_bytes == per_buffer(8) * 2 * LAYERS
    assert cache.stats().kv_bytes == 3 * 64 * TOKEN * 2 * LAYERS  # the full reservation
    written = _fill(cache, [8, 8, 8])
    # The gaps between sequences are committed but not addressed at capacity 8: never zeroed
    # (untouched pages cost nothing on the CPU). Poison them: a growth must clear what it opens.
    run = 64 * H * D
    for buf in cache.keys + cache.values:
        for b in range(2):
            buf[b * run + 8 * H * D : (b + 1) * run] = np.nan
    address = cache.keys[0].ctypes.data
    cache.ensure(30, [8, 8, 8])
    assert cache.keys[0].ctypes.data == address
    assert cache.committed_bytes == per_buffer(32) * 2 * LAYERS
    assert cache.relocated_bytes == 0
    _same_tokens(cache, written, [8, 8, 8])
    for buf in cache.keys + cache.values:
        assert not cache.token_view(buf)[:, 8:].any()  # the new slots: zero, not NaN


@pytest.mark.parametrize(
    "layout",
    [SeqMajorLayout(min_capacity=8), SeqMajorLayout(min_capacity=8, fixed_stride=True),
     HeadMajorLayout(min_capacity=8)],
    ids=["seq_major", "seq_major_fixed", "head_major"],
)  # fmt: skip
def test_a_new_batch_keeps_buffers_that_hold_it_and_zeroes_what_it_addresses(layout) -> None:
    # Same addresses from one prompt to the next (a captured decode graph stays valid), and
    # no byte of the previous batch where the new one can read: as fresh memory.
    cache = _cache(layout)
    cache.allocate(3, 8)
    cache.ensure(20, [8, 8, 8])
    address = cache.keys[0].ctypes.data
    for buf in cache.keys + cache.values:
        buf.reshape(-1).view(np.uint8)[:] = 0xFF  # NaN everywhere
    roots = list(cache._roots)
    cache.allocate(2, 8)
    assert cache.keys[0].ctypes.data == address
    assert all(a is b for a, b in zip(roots, cache._roots, strict=True))
    for buf in cache.keys + cache.values:
        assert not cache.token_view(buf).any()
    written = _fill(cache, [3, 8])
    cache.ensure(30, [3, 8])
    _same_tokens(cache, written, [3, 8])
    for buf in cache.keys + cache.values:
        view = cache.token_view(buf)
        assert not view[0, 3:].any() and not view[1, 8:].any()  # the grown slots: zero


def test_a_batch_the_reservation_cannot_hold_and_a_paged_pool_get_fresh_buffers() -> None:
    # one sequence of 32k tokens reserves 1 MiB (2 MiB: a granule); three need 3 MiB
    cache = _cache(SeqMajorLayout(min_capacity=8, fixed_stride=True), context=32768)
    cache.allocate(1, 8)
    roots = list(cache._roots)
    cache.allocate(3, 8)
    assert all(a is not b for a, b in zip(roots, cache._roots, strict=True))
    paged = _cache(PagedLayout(page_size=4))
    paged.allocate(2, 8)
    roots = list(paged._roots)
    paged.allocate(2, 8)  # a new pool of pages: fresh, zeroed pages
    assert all(a is not b for a, b in zip(roots, paged._roots, strict=True))


def test_a_stride_that_only_works_at_batch_one_is_refused() -> None:
    cache = _cache(BatchOneStride(min_capacity=8))
    cache.allocate(1, 8)  # one sequence: nothing can alias
    with pytest.raises(ContractError, match=r"'seq_major_batch_one_stride'.*strides .* alias"):
        cache.allocate(3, 8)


class _FirstFirst(SeqMajorLayout):
    """Relocates sequence 1 before sequence 2: overwrites 2's tokens before they move."""

    name = "first_first"

    def growth_plan(self, old: KVGeometry, new: int, live: Sequence[int]) -> GrowthPlan:
        plan = super().growth_plan(old, new, live)
        return GrowthPlan(plan.new, plan.copies[::-1], True, True, "wrong order")


class _Overlapping(SeqMajorLayout):
    name = "overlapping"

    def growth_plan(self, old: KVGeometry, new: int, live: Sequence[int]) -> GrowthPlan:
        plan = super().growth_plan(old, new, live)
        c = plan.copies[-1]  # sequence 1, moved by 8 tokens in one copy of 12: overlaps
        whole = CopyRange(c.src_offset, c.dst_offset, 12 * TOKEN)
        return GrowthPlan(plan.new, (whole,), True, True, "one overlapping copy")


class _StableButNew(HeadMajorLayout):
    name = "stable_but_new"

    def growth_plan(self, old: KVGeometry, new: int, live: Sequence[int]) -> GrowthPlan:
        plan = super().growth_plan(old, new, live)
        return GrowthPlan(plan.new, plan.copies, True, False, "claims a stable address")


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (_FirstFirst(min_capacity=8), r"overwrites live bytes .* before any copy moved them"),
        (_Overlapping(min_capacity=8), r"overlaps its own source"),
        (_StableButNew(min_capacity=8), r"stable_address=True with in_place=False"),
    ],
    ids=lambda x: getattr(x, "name", ""),
)
def test_unsafe_growth_plans_are_refused_before_any_byte_moves(
    layout: object, message: str
) -> None:
    cache = _cache(layout)
    cache.allocate(3, 8)
    written = _fill(cache, [8, 8, 8])
    with pytest.raises(ContractError, match=message):
        cache.ensure(9, [8, 8, 8])
    assert cache.capacity == 8
    _same_tokens(cache, written, [8, 8, 8])  # nothing corrupted


# --- the paged pool ------------------------------------------------------------------------------


def _paged(context: int = 64) -> KVCache:
    cache = _cache(PagedLayout(page_size=4, min_capacity=8), context=context)
    cache.allocate(3, 8)
    return cache


def test_pages_are_taken_on_demand_lowest_first() -> None:
    cache = _paged()
    assert cache.committed_bytes == 0 and cache.stats().pages_in_use == 0
    cache.prepare([0, 0, 0], [5, 1, 0])  # row 0: 2 pages, row 1: 1 page, row 2: none
    table = cache.block_table
    assert table is not None
    assert table[:, :2].tolist() == [[0, 1], [2, -1], [-1, -1]]
    assert cache.committed_bytes == 3 * 4 * TOKEN * 2 * LAYERS
    assert cache.prepare([5, 1, 0], [6, 2, 0]) is False  # inside pages taken: nothing to rebind
    assert cache.stats().pages_in_use == 3
    # Row 0 crosses into its third page at 9 tokens: the capacity grows 8 -> 16, so the table
    # gets more columns (a new array: rebind) and the pages keep their ids.
    assert cache.prepare([6, 2, 0], [9, 3, 0]) is True
    wider = cache.block_table
    assert wider is not None and wider.shape == (3, 4) and cache.capacity == 16
    assert wider[:, :3].tolist() == [[0, 1, 3], [2, -1, -1], [-1, -1, -1]]


def test_fork_shares_pages_and_a_write_copies_the_shared_page() -> None:
    cache = _paged()
    cache.prepare([0, 0, 0], [6, 0, 0])  # row 0 holds 6 tokens: pages 0 (full) and 1 (half)
    cache.keys[0][:2] = np.arange(2 * 4 * H * D, dtype=np.float32).reshape(2, 4, H, D)
    before = cache.keys[0][:2].copy()
    cache.fork(0, 1)
    table = cache.block_table
    assert table is not None
    assert table[1, :2].tolist() == [0, 1]
    assert cache.stats().shared_pages == 2 and cache.stats().pages_in_use == 2
    # Row 1 writes token 6, in shared page 1: the page is copied first, row 0's stays put.
    cache.prepare([6, 6, 0], [6, 7, 0])
    mine = int(table[1, 1])
    assert mine not in (0, 1) and int(table[1, 0]) == 0  # the full page stays shared
    np.testing.assert_array_equal(cache.keys[0][mine], before[1])  # the copy holds the prefix
    cache.keys[0][mine, 2] = -1.0  # row 1's new token lands in its own page
    np.testing.assert_array_equal(cache.keys[0][:2], before)
    stats = cache.stats()
    assert stats.shared_pages == 1 and stats.cow_bytes == 4 * TOKEN * 2 * LAYERS
    # Negative oracle: had row 1 written through the shared page, row 0 would have changed.
    cache.fork(0, 2)
    cache.keys[0][int(table[2, 1]), 2] = -1.0
    assert not np.array_equal(cache.keys[0][:2], before)


def test_released_pages_go_back_to_the_pool_cleared() -> None:
    cache = _paged()
    cache.prepare([0, 0, 0], [8, 4, 0])  # pages 0, 1 (row 0) and 2 (row 1)
    cache.keys[0][:3] = 1.0
    cache.fork(1, 2)  # page 2 shared by rows 1 and 2
    assert cache.release(0) == 2 and cache.stats().pages_in_use == 1
    assert not cache.keys[0][:2].any()  # given back cleared
    assert cache.release(1) == 0  # row 2 still holds page 2
    assert cache.release(2) == 1 and cache.stats().pages_in_use == 0
    cache.prepare([0, 0, 0], [1, 0, 0])
    table = cache.block_table
    assert table is not None and int(table[0, 0]) == 0  # reused, lowest first
    assert cache.committed_bytes == 3 * 4 * TOKEN * 2 * LAYERS  # no new memory


def test_an_exhausted_pool_is_a_clear_error() -> None:
    class Tiny(PagedLayout):
        def geometry(self, **kw: int) -> KVGeometry:  # type: ignore[override]
            g = super().geometry(**kw)
            pages = -(-g.capacity // self.page_size)  # room for one sequence only
            return KVGeometry(g.layout, g.batch, g.capacity, g.kv_heads, g.head_dim,
                              g.itemsize, (pages, *g.shape[1:]), g.strides)  # fmt: skip

    cache = _cache(Tiny(page_size=4, min_capacity=8), context=8)
    cache.allocate(2, 8)
    cache.prepare([0, 0], [8, 0])
    with pytest.raises(GenerationError, match=r"KV page pool is exhausted: all 2 pages"):
        cache.prepare([0, 0], [0, 1])


def test_paged_calls_on_a_contiguous_cache_are_config_errors() -> None:
    cache = _cache(HeadMajorLayout())
    cache.allocate(2, 8)
    with pytest.raises(ConfigError, match=r"fork needs a paged layout.*'head_major'"):
        cache.fork(0, 1)
    paged = _paged()
    with pytest.raises(ConfigError, match=r"fork\(1, 1\): expected two different sequences"):
        paged.fork(1, 1)


def test_byte_ranges_become_runs_of_equal_ranges_at_one_step() -> None:
    # a fixed stride's slots of 4 sequences, then two odd ranges; empty ranges dropped
    ranges = [(b * 100 + 10, b * 100 + 30) for b in range(4)] + [(500, 505), (600, 610), (7, 7)]
    assert byte_runs(ranges) == [(10, 20, 4, 100), (500, 5, 1, 5), (600, 10, 1, 10)]
    assert byte_runs([(40, 50), (0, 10)]) == [(0, 10, 2, 40)]  # sorted first
    assert byte_runs([(0, 10), (10, 20), (25, 35)]) == [(0, 10, 2, 10), (25, 10, 1, 10)]
