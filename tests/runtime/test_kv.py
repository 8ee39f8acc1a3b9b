"""ep.runtime.kv.KVCache: allocation by the layout, growth that keeps live tokens, ledgers, and
the contract checks addressed to layout authors."""

from __future__ import annotations

import numpy as np
import pytest
from kv_layouts import BrokenLayout, SeqMajorPacked

from ep.errors import ContractError, GenerationError
from ep.runtime.kv import KVCache
from ep.seams import KVLayout
from ep_builtin.kv_head_major import HeadMajorLayout

LAYERS, HEADS, DIM = 2, 2, 4


def _cache(layout: KVLayout, context: int = 256) -> KVCache:
    return KVCache(
        layout,
        num_layers=LAYERS,
        kv_heads=HEADS,
        head_dim=DIM,
        dtype=np.dtype(np.float32),
        context=context,
    )


def _fill(cache: KVCache, lengths: list[int], rng: np.random.Generator) -> list[np.ndarray]:
    """Random live tokens in every buffer; returns their logical [B, T, H, D] copies."""
    written = []
    for buf in cache.keys + cache.values:
        view = cache.token_view(buf)
        logical = np.zeros(view.shape, np.float32)
        for b, n in enumerate(lengths):
            logical[b, :n] = rng.normal(size=(n, HEADS, DIM))
            view[b, :n] = logical[b, :n]
        written.append(logical)
    return written


@pytest.mark.parametrize("layout", [HeadMajorLayout(), SeqMajorPacked()], ids=lambda x: x.name)
def test_growth_keeps_every_live_token(layout: KVLayout) -> None:
    rng = np.random.default_rng(0)
    cache = _cache(layout)
    lengths = [5, 16, 1]
    cache.allocate(3, 16)
    assert cache.capacity == 16 and cache.batch == 3
    written = _fill(cache, lengths, rng)
    assert cache.ensure(16, lengths) is False  # fits: nothing changes
    assert cache.ensure(17, lengths) is True
    assert cache.capacity == 32 and cache.growths == 1
    for buf, logical in zip(cache.keys + cache.values, written, strict=True):
        view = cache.token_view(buf)
        for b, n in enumerate(lengths):
            np.testing.assert_array_equal(view[b, :n], logical[b, :n])
    stats = cache.stats()
    token_bytes = HEADS * DIM * 4
    # seq-major grows in place: sequence 0 stays where it is, the others move
    moved = lengths[1:] if layout.name == "seq_major_packed" else lengths
    assert stats.copied_bytes == sum(moved) * token_bytes * 2 * LAYERS
    assert stats.live_bytes == sum(lengths) * token_bytes * 2 * LAYERS
    assert stats.kv_bytes == 3 * 32 * token_bytes * 2 * LAYERS


def test_growth_without_the_copies_would_lose_tokens() -> None:
    """Negative oracle for the test above: a plan with no copies loses the live tokens."""

    class NoCopies(HeadMajorLayout):
        def growth_plan(self, old, new_capacity, live_lengths):  # type: ignore[no-untyped-def]
            plan = super().growth_plan(old, new_capacity, live_lengths)
            return type(plan)(plan.new, (), False, False, "forgets the copies")

    cache = _cache(NoCopies())
    cache.allocate(1, 16)
    written = _fill(cache, [10], np.random.default_rng(1))
    cache.ensure(17, [10])
    assert not np.array_equal(cache.token_view(cache.keys[0])[0, :10], written[0][0, :10])


def test_reserve_and_context_bound_the_capacity() -> None:
    cache = _cache(HeadMajorLayout(), context=100)
    cache.allocate(2, 3, reserve=40)
    assert cache.capacity == 64
    cache.allocate(2, 3, reserve=1000)
    assert cache.capacity == 100
    with pytest.raises(GenerationError, match="101 tokens do not fit the context of 100"):
        cache.ensure(101, [100, 100])


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ("capacity", r"returned 16 for needed=17.*expected an int in \[17, 256\]"),
        ("geometry", r"strides .* beyond the .* elements"),
        ("copies", r"copy .* falls outside the buffers"),
    ],
)
def test_contract_violations_name_the_layout(fault: str, message: str) -> None:
    cache = _cache(BrokenLayout(fault))
    with pytest.raises(ContractError, match=message) as info:
        cache.allocate(2, 17 if fault == "capacity" else 3)
        cache.ensure(40, [3, 3])
    assert "KV layout 'broken'" in str(info.value)
