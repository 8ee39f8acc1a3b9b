"""What each built-in KV layout answers: shape, strides, buckets, bytes per token, and growth
plans checked exactly at batch 3 (`verify_growth_plan`: every live element is labelled, the plan
applied, and each must land where the new strides say)."""

from __future__ import annotations

import pytest
from kv_gate_lib import SkippedRelocation, TransposedCopies

from ep.errors import ContractError
from ep.runtime.kv import verify_growth_plan
from ep.seams import KVStrides
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_builtin.kv_paged import PagedLayout
from ep_builtin.kv_seq_major import SeqMajorLayout

H, D, ITEM = 2, 4, 4
RUN = H * D  # elements of one token of one sequence


def _g(layout: object, batch: int, capacity: int):  # type: ignore[no-untyped-def]
    return layout.geometry(  # type: ignore[attr-defined]
        batch=batch, capacity=capacity, kv_heads=H, head_dim=D, itemsize=ITEM
    )


def test_shapes_and_strides() -> None:
    head = _g(HeadMajorLayout(), 3, 16)
    assert head.shape == (3, H, 16, D)
    assert head.strides == KVStrides(batch=H * 16 * D, token=D, head=16 * D, dim=1)
    seq = _g(SeqMajorLayout(), 3, 16)
    assert seq.shape == (3, 16, H, D)
    assert seq.strides == KVStrides(batch=16 * RUN, token=RUN, head=D, dim=1)
    fixed = SeqMajorLayout(fixed_stride=True)
    assert fixed.capacity_for(10, context=256) == 16  # the context is learnt here
    g = _g(fixed, 3, 16)
    assert g.shape == (3, 256, H, D) and g.capacity == 16
    assert g.strides == KVStrides(batch=256 * RUN, token=RUN, head=D, dim=1)
    paged = _g(PagedLayout(page_size=4), 3, 16)
    assert paged.shape == (3 * 4, 4, H, D)  # room for every sequence at the capacity
    assert paged.strides == KVStrides(batch=0, token=RUN, head=D, dim=1, page=4 * RUN, page_size=4)
    for layout in (HeadMajorLayout(), SeqMajorLayout(), PagedLayout()):
        assert layout.bytes_per_token(kv_heads=H, head_dim=D, itemsize=ITEM) == RUN * ITEM


def test_capacity_buckets() -> None:
    for layout in (HeadMajorLayout(min_capacity=8), SeqMajorLayout(min_capacity=8)):
        got = [layout.capacity_for(n, context=100) for n in (1, 8, 9, 17, 33, 65, 100)]
        assert got == [8, 8, 16, 32, 64, 100, 100]  # powers of two from 8, capped by the context
    paged = PagedLayout(page_size=32, min_capacity=8)
    assert paged.capacity_for(1, context=1000) == 32  # never less than one page
    assert paged.capacity_for(33, context=1000) == 64


LIVE_CASES = [(5, 16, 1), (16, 0, 9), (16, 16, 16)]


@pytest.mark.parametrize("live", LIVE_CASES, ids=str)
@pytest.mark.parametrize(
    "layout",
    [HeadMajorLayout(), SeqMajorLayout(), PagedLayout(page_size=4)],
    ids=lambda x: x.name,
)
def test_growth_plans_place_every_live_element_at_batch_3(layout: object, live: tuple) -> None:
    old = _g(layout, 3, 16)
    plan = layout.growth_plan(old, 32, live)  # type: ignore[attr-defined]
    assert plan.new.capacity == 32
    verify_growth_plan(old, plan, live)


def test_seq_major_relocation_moves_every_sequence_after_the_first() -> None:
    layout = SeqMajorLayout()
    old = _g(layout, 3, 16)
    live = (5, 16, 9)
    plan = layout.growth_plan(old, 32, live)
    assert plan.in_place and plan.stable_address
    token = RUN * ITEM
    # Last sequence first; sequence 0 stays; each moves from b*16 to b*32 tokens.
    assert [(c.src_offset, c.dst_offset, c.nbytes) for c in plan.copies] == [
        (2 * 16 * token, 2 * 32 * token, 9 * token),
        (1 * 16 * token, 1 * 32 * token, 16 * token),
    ]
    verify_growth_plan(old, plan, live)


def test_seq_major_relocation_by_less_than_its_length_is_chunked() -> None:
    """Growth capped by the context (16 -> 20) moves sequence b by 4b tokens: the copies are
    chunks no longer than the move, last chunk first, so none overlaps its own source."""
    layout = SeqMajorLayout()
    old = _g(layout, 3, 16)
    live = (16, 16, 16)
    plan = layout.growth_plan(old, 20, live)
    token = RUN * ITEM
    for c in plan.copies:
        assert c.nbytes <= c.dst_offset - c.src_offset  # never overlaps itself
    seq2 = [c for c in plan.copies if c.src_offset >= 2 * 16 * token]
    assert [c.nbytes // token for c in seq2] == [8, 8]  # moves by 8 tokens: two chunks
    assert seq2[0].src_offset > seq2[1].src_offset  # the end first
    verify_growth_plan(old, plan, live)


def test_fixed_stride_growth_moves_nothing() -> None:
    layout = SeqMajorLayout(fixed_stride=True)
    layout.capacity_for(1, context=64)
    old = _g(layout, 3, 16)
    plan = layout.growth_plan(old, 32, (16, 3, 16))
    assert plan.copies == () and plan.in_place and plan.stable_address
    assert plan.new.strides == old.strides and plan.new.shape == old.shape
    verify_growth_plan(old, plan, (16, 3, 16))


def test_paged_growth_keeps_pages_and_adds_pool_room() -> None:
    layout = PagedLayout(page_size=4)
    old = _g(layout, 3, 16)
    plan = layout.growth_plan(old, 32, (16, 5, 9))
    assert plan.copies == () and plan.in_place and plan.stable_address
    assert plan.new.shape[0] == 3 * 8 and plan.new.strides == old.strides


def test_paged_live_ranges_follow_the_block_table() -> None:
    import numpy as np

    layout = PagedLayout(page_size=4)
    g = _g(layout, 2, 8)
    table = np.array([[5, 1], [0, -1]], np.int32)
    page, token = 4 * RUN * ITEM, RUN * ITEM
    got = layout.live_ranges(g, (6, 3), block_table=table)
    assert [(r.offset, r.nbytes) for r in got] == [
        (5 * page, 4 * token),
        (1 * page, 2 * token),
        (0, 3 * token),
    ]


# --- negative oracles: the check must fail on broken plans, and only batch > 1 shows them ----


@pytest.mark.parametrize("broken", [SkippedRelocation(), TransposedCopies()], ids=lambda x: x.name)
def test_broken_plans_are_caught_at_batch_3_not_at_batch_1(broken: object) -> None:
    one = _g(broken, 1, 16)
    if isinstance(broken, SkippedRelocation):
        verify_growth_plan(one, broken.growth_plan(one, 32, (16,)), (16,))  # looks fine
    three = _g(broken, 3, 16)
    plan = broken.growth_plan(three, 32, (16, 7, 9))  # type: ignore[attr-defined]
    with pytest.raises(ContractError, match=r"misplaces \d+ of \d+ live elements; first: seq"):
        verify_growth_plan(three, plan, (16, 7, 9))
