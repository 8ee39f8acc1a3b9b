"""ep.native.kv.DeviceKVCache on each device: a new batch keeps the buffers that hold it, and
every slot it (or a growth) can address and no live token holds reads zero; the live tokens
survive growth. On CUDA the zeroing is one 2-D fill a run of strided slots."""

from __future__ import annotations

import numpy as np
import pytest
from _devices import device_or_skip

from ep.device import Device
from ep.native.kv import DeviceKVCache
from ep.runtime.kv import _subtract
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_builtin.kv_seq_major import SeqMajorLayout

LAYERS, H, D = 2, 2, 8


def _bytes(cache: DeviceKVCache, dev: Device) -> list[np.ndarray]:
    return [r.view(np.uint8).to_host(stream=cache._stream) for r in cache.roots]


def _idle_is_zero(cache: DeviceKVCache, dev: Device, live: list[int]) -> None:
    g = cache.geometry
    assert g is not None
    idle = _subtract(cache._addressable(g), cache._live(g, live))
    for raw in _bytes(cache, dev):
        for start, stop in idle:
            assert not raw[start:stop].any(), (start, stop)


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize(
    "layout",
    [SeqMajorLayout(min_capacity=8, fixed_stride=True), HeadMajorLayout(min_capacity=8)],
    ids=["seq_major_fixed", "head_major"],
)
def test_a_new_batch_keeps_the_buffers_and_reads_zero_where_no_token_is(kind, layout) -> None:
    dev = device_or_skip(kind)
    stream = dev.create_stream(name="kv")
    cache = DeviceKVCache(layout, device=dev, stream=stream, num_layers=LAYERS, kv_heads=H,
                          head_dim=D, dtype=np.dtype(np.float32), context=64)  # fmt: skip
    cache.allocate(4, 8)
    cache.ensure(20, [8, 8, 8, 8])
    roots = [r.ptr for r in cache.roots]
    for root in cache.roots:
        dev.fill(root.view(np.uint8), 0xFF, stream=stream)  # NaN everywhere
    cache.allocate(3, 8)
    assert [r.ptr for r in cache.roots] == roots
    _idle_is_zero(cache, dev, [0, 0, 0])
    # live tokens: random bytes written through the geometry, found again after a growth
    live = [3, 8, 5]
    rng = np.random.default_rng(0)
    tokens = [rng.integers(1, 255, (len(live), 8, H, D * 4), dtype=np.uint8) for _ in roots]
    for root, want in zip(cache.roots, tokens, strict=True):
        raw = root.view(np.uint8).to_host(stream=stream)
        for b, t, h, at in _slots(cache, live):
            raw[at : at + D * 4] = want[b, t, h]
        root.view(np.uint8).copy_from_host(raw, stream=stream)
    cache.ensure(30, live)
    _idle_is_zero(cache, dev, live)
    for raw, want in zip(_bytes(cache, dev), tokens, strict=True):
        for b, t, h, at in _slots(cache, live):
            assert np.array_equal(raw[at : at + D * 4], want[b, t, h])


def _slots(cache: DeviceKVCache, live: list[int]):
    """(sequence, token, head, byte offset) of every live token's head vector."""
    g = cache.geometry
    assert g is not None
    s, item = g.strides, 4
    for b, n in enumerate(live):
        for t in range(n):
            for h in range(H):
                yield b, t, h, (b * s.batch + t * s.token + h * s.head) * item
