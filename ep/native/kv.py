"""`DeviceKVCache`: the runtime's `KVCache` with its buffers on the executor's device.

The layout decides geometry, buckets and growth exactly as for the ort backend (the parent class
validates every answer and keeps the counters); only where the bytes live changes. On the CPU
device the parent's host code runs as is (its buffers are host-readable). On CUDA the few places
that touch bytes (zeroing, committing, applying a growth plan) go through the device's ``fill``
and ``copy`` on the stream, and ``keys``/``values`` stay empty: there is no host view.

A fixed-stride layout (its geometry at the full context has the same strides as at the current
capacity) gets the whole reach committed at allocation, so a growth never changes a bound
buffer's address or shape, and kernels are bound with the context as their capacity bound: a
captured graph survives the growth (``growth_keeps``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ep.device import Device, Stream
from ep.errors import GenerationError
from ep.runtime.kv import KVCache
from ep.seams import GrowthPlan, KVGeometry, KVLayout

__all__ = ["DeviceKVCache", "byte_runs"]


class DeviceKVCache(KVCache):
    """A `KVCache` whose K/V buffers are `GrowableBuffer`s of ``device``."""

    def __init__(
        self,
        layout: KVLayout,
        *,
        device: Device,
        stream: Stream,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: np.dtype[Any],
        context: int,
    ) -> None:
        super().__init__(
            layout,
            num_layers=num_layers,
            kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=dtype,
            context=context,
        )
        self._device = device
        self._stream = stream
        self.host_readable = device.kind == "cpu"
        self.bound_capacity = 0  # the capacity kernels are bound with (see module docstring)

    # --- what the executor binds ---------------------------------------------------------------

    @property
    def roots(self) -> list[Any]:
        """Layer i's K buffer is ``roots[i]``, its V buffer ``roots[num_layers + i]``."""
        return list(self._roots)

    def fixed_stride(self) -> bool:
        """Whether growing to the context keeps this geometry's strides (nothing relocates)."""
        g = self.geometry
        if g is None or g.strides.page_size:
            return False
        at_context = self._geometry(g.batch, self.context)
        return at_context.strides == g.strides

    def allocate(self, batch: int, needed: int, *, reserve: int = 0) -> None:
        super().allocate(batch, needed, reserve=reserve)
        g = self.geometry
        assert g is not None
        self.bound_capacity = g.capacity
        if self.fixed_stride():
            self._commit(self._reach(self._geometry(batch, self.context)), zero=False)
            self.bound_capacity = self.context

    def ensure(self, needed: int, live_lengths: Any) -> bool:
        grew = super().ensure(needed, live_lengths)
        if grew and self.bound_capacity < self.capacity:
            self.bound_capacity = self.capacity
        return grew

    # --- byte movers: the parent's on the CPU, the device's elsewhere ---------------------------

    def _commit(self, elements: int, *, zero: bool = True) -> None:
        if self.host_readable:
            super()._commit(elements, zero=zero)
            return
        if elements <= self._committed:
            return
        old = self._committed
        for root in self._roots:
            root.grow((elements,), stream=self._stream)
            if zero:
                self._device.fill(
                    root.view(shape=(elements - old,), offset=old * self.dtype.itemsize),
                    0,
                    stream=self._stream,
                )
        self._committed = elements
        self._refresh()

    def _zero(self, ranges: list[tuple[int, int]]) -> None:
        if self.host_readable:
            super()._zero(ranges)
            return
        # One 2-D fill a run of equal ranges at a constant step (a fixed stride's slots of every
        # sequence): 48 buffers x 16 sequences were 768 launches, about 60 ms of host time.
        for offset, width, height, pitch in byte_runs(ranges):
            for root in self._roots:
                self._device.fill_2d(root, 0, width=width, height=height, pitch=pitch,
                                     offset=offset, stream=self._stream)  # fmt: skip

    def _refresh(self) -> None:
        if self.host_readable:
            super()._refresh()
            return
        self.keys, self.values = [], []
        self.epoch += 1

    def _apply(self, plan: GrowthPlan, old: KVGeometry) -> None:
        if self.host_readable:
            super()._apply(plan, old)
            return
        dev, stream, item = self._device, self._stream, self.dtype.itemsize
        new = plan.new
        ends = [-(-(c.dst_offset + c.nbytes) // item) for c in plan.copies]
        if new.strides.page_size:
            elements = max([self._committed, *ends])
        else:
            elements = max([self._reach(new), *ends])
        if plan.in_place and elements * item <= self._roots[0].reserved_bytes:
            before = self._committed
            after = max(elements, before)
            for root in self._roots:
                root.grow((after,), stream=stream)
                raw = root.view(np.uint8)
                for c in plan.copies:
                    if c.nbytes:
                        dev.copy(
                            raw.view(shape=(c.nbytes,), offset=c.dst_offset),
                            raw.view(shape=(c.nbytes,), offset=c.src_offset),
                            stream=stream,
                        )
            self._committed = after
            self._zero(self._stale(plan, old, before * item))
            return
        self._reserve = max(self._reserve, elements * item)
        fresh = self._new_roots(self._reserve)
        for old_root, root in zip(self._roots, fresh, strict=True):
            root.grow((elements,), stream=stream)
            dev.fill(root, 0, stream=stream)
            dst = root.view(np.uint8)
            src = old_root.view(np.uint8)
            if plan.in_place:
                n = min(src.nbytes, dst.nbytes)
                dev.copy(dst.view(shape=(n,)), src.view(shape=(n,)), stream=stream)
                src = dst
            for c in plan.copies:
                if c.nbytes:
                    dev.copy(
                        dst.view(shape=(c.nbytes,), offset=c.dst_offset),
                        src.view(shape=(c.nbytes,), offset=c.src_offset),
                        stream=stream,
                    )
        self._roots = fresh
        self._committed = elements
        self.moved_growths += 1

    def _map_pages(self, first: np.ndarray, last: np.ndarray) -> None:
        if not self.host_readable and self.pool is not None and self.pool.shared_pages:
            raise GenerationError(
                "the native backend on CUDA does not copy shared KV pages (copy-on-write); "
                "run prompts that do not share pages, or use the CPU device"
            )
        if self.host_readable:
            super()._map_pages(first, last)
            return
        # Same bookkeeping as the parent without the host copies (no shared pages here).
        pool = self.pool
        assert pool is not None and self.geometry is not None
        p = pool.page_size
        want = np.where(last > first, -(-last // p), 0)
        for b in np.flatnonzero(want > pool.mapped):
            for j in range(int(pool.mapped[b]), int(want[b])):
                pool.tables[b, j] = pool.take()
            pool.mapped[b] = want[b]
        self._commit(pool.high_water * self.geometry.strides.page)


def byte_runs(ranges: list[tuple[int, int]]) -> list[tuple[int, int, int, int]]:
    """Byte ranges ``[start, stop)`` (disjoint; empty ones dropped) as ``(offset, width, height,
    pitch)`` runs: ``height`` ranges of ``width`` bytes, each ``pitch`` after the last."""
    runs: list[tuple[int, int, int, int]] = []
    for start, stop in sorted(r for r in ranges if r[1] > r[0]):
        width = stop - start
        if runs and runs[-1][1] == width:
            offset, _, height, pitch = runs[-1]
            if height == 1 and start - offset >= width:
                runs[-1] = (offset, width, 2, start - offset)
                continue
            if height > 1 and start == offset + height * pitch:
                runs[-1] = (offset, width, height + 1, pitch)
                continue
        runs.append((start, width, 1, width))
    return runs
