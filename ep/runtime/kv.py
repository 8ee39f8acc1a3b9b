"""The KV cache the runtime owns: one NumPy buffer per layer for K and for V.

A `KVLayout` plugin decides the geometry (shape, strides, capacity buckets, growth plans); this
class validates each answer, allocates, applies growth copies and counts bytes. Layout answers that
break the contract raise `ContractError` naming the layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ep.errors import ConfigError, ContractError, GenerationError
from ep.seams import GrowthPlan, KVGeometry, KVLayout

__all__ = ["KVCache", "KVStats"]


@dataclass(frozen=True)
class KVStats:
    """Counters of one cache. Bytes are totals over every layer's K and V buffers."""

    layout: str
    batch: int
    capacity: int  # tokens each sequence can hold now
    kv_bytes: int  # allocated
    live_bytes: int  # holding live tokens (per the layout's live ranges)
    growths: int
    copied_bytes: int  # moved by growth plans


class KVCache:
    """Per-layer K and V buffers for a batch, shaped by ``layout``."""

    def __init__(
        self,
        layout: KVLayout,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: np.dtype[Any],
        context: int,
    ) -> None:
        self.layout = layout
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = np.dtype(dtype)
        self.context = context
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self.geometry: KVGeometry | None = None
        self.live_lengths: tuple[int, ...] = ()
        self.growths = 0
        self.copied_bytes = 0

    # --- layout calls, validated -------------------------------------------------------------

    def _who(self, call: str) -> str:
        return f"KV layout {getattr(self.layout, 'name', type(self.layout).__name__)!r} ({call})"

    def capacity_for(self, needed: int) -> int:
        if needed > self.context:
            raise GenerationError(
                f"{needed} tokens do not fit the context of {self.context} tokens"
            )
        cap = self.layout.capacity_for(needed, context=self.context)
        if not isinstance(cap, int) or not needed <= cap <= self.context:
            raise ContractError(
                f"{self._who('capacity_for')} returned {cap!r} for needed={needed}, "
                f"context={self.context}; expected an int in [{needed}, {self.context}]"
            )
        return cap

    def _geometry(self, batch: int, capacity: int) -> KVGeometry:
        g = self.layout.geometry(
            batch=batch,
            capacity=capacity,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            itemsize=self.dtype.itemsize,
        )
        self._check_geometry(g, batch, capacity, "geometry")
        return g

    def _check_geometry(self, g: KVGeometry, batch: int, capacity: int, call: str) -> None:
        want = (batch, capacity, self.kv_heads, self.head_dim, self.dtype.itemsize)
        got = (g.batch, g.capacity, g.kv_heads, g.head_dim, g.itemsize)
        if got != want:
            raise ContractError(
                f"{self._who(call)} returned a geometry for (batch, capacity, kv_heads, head_dim, "
                f"itemsize) = {got}; expected {want}"
            )
        s = g.strides
        if s.page_size == 0:
            last = (
                (batch - 1) * s.batch
                + (capacity - 1) * s.token
                + (self.kv_heads - 1) * s.head
                + (self.head_dim - 1) * s.dim
            )
            if min(s.batch, s.token, s.head, s.dim) < 0 or last >= g.elements:
                raise ContractError(
                    f"{self._who(call)}: strides {s} reach element {last}, beyond the "
                    f"{g.elements} elements of shape {g.shape}"
                )

    def _check_plan(self, plan: GrowthPlan, old: KVGeometry, capacity: int) -> None:
        self._check_geometry(plan.new, old.batch, capacity, "growth_plan")
        src_limit = plan.new.nbytes if plan.in_place else old.nbytes
        for c in plan.copies:
            if (
                c.nbytes < 0
                or c.src_offset < 0
                or c.dst_offset < 0
                or c.src_offset + c.nbytes > src_limit
                or c.dst_offset + c.nbytes > plan.new.nbytes
            ):
                raise ContractError(
                    f"{self._who('growth_plan')}: copy {c} falls outside the buffers (old "
                    f"{old.nbytes} bytes, new {plan.new.nbytes} bytes, in_place={plan.in_place})"
                )

    # --- the runtime's operations ------------------------------------------------------------

    @property
    def batch(self) -> int:
        return self.geometry.batch if self.geometry else 0

    @property
    def capacity(self) -> int:
        return self.geometry.capacity if self.geometry else 0

    def allocate(self, batch: int, needed: int, *, reserve: int = 0) -> None:
        """Fresh zeroed buffers for ``batch`` sequences, the layout's bucket for ``needed``."""
        capacity = self.capacity_for(max(needed, min(reserve, self.context)))
        g = self._geometry(batch, capacity)
        self.geometry = g
        self.keys = [np.zeros(g.shape, self.dtype) for _ in range(self.num_layers)]
        self.values = [np.zeros(g.shape, self.dtype) for _ in range(self.num_layers)]
        self.live_lengths = (0,) * batch
        self.growths = 0
        self.copied_bytes = 0

    def ensure(self, needed: int, live_lengths: Sequence[int] | np.ndarray) -> bool:
        """Grow (through the layout's plan) so each sequence holds ``needed`` tokens.

        ``live_lengths``: tokens per sequence that must survive. Returns whether buffers changed.
        """
        old = self.geometry
        if old is None:
            raise ConfigError("KVCache.ensure before allocate")
        self.live_lengths = tuple(int(n) for n in live_lengths)
        if needed <= old.capacity:
            return False
        capacity = self.capacity_for(needed)
        plan = self.layout.growth_plan(old, capacity, self.live_lengths)
        self._check_plan(plan, old, capacity)
        self.keys = [self._grow(buf, plan) for buf in self.keys]
        self.values = [self._grow(buf, plan) for buf in self.values]
        self.geometry = plan.new
        self.growths += 1
        self.copied_bytes += sum(c.nbytes for c in plan.copies) * 2 * self.num_layers
        return True

    def _grow(self, old: np.ndarray, plan: GrowthPlan) -> np.ndarray:
        new = np.zeros(plan.new.shape, self.dtype)
        dst = new.reshape(-1).view(np.uint8)
        src_bytes = old.reshape(-1).view(np.uint8)
        if plan.in_place:
            # A CPU array cannot grow behind its address: emulate it (old bytes stay at their
            # offsets), then move within the grown buffer in the plan's order.
            dst[: src_bytes.size] = src_bytes
            src_bytes = dst
        for c in plan.copies:
            dst[c.dst_offset : c.dst_offset + c.nbytes] = src_bytes[
                c.src_offset : c.src_offset + c.nbytes
            ]
        return new

    def token_view(self, buffer: np.ndarray) -> np.ndarray:
        """A writable ``[batch, capacity, kv_heads, head_dim]`` view via the layout's strides."""
        g = self.geometry
        if g is None or g.strides.page_size:
            raise ConfigError(
                f"KV layout {g.layout if g else '?'} is paged; a token view needs a contiguous one"
            )
        s, item = g.strides, self.dtype.itemsize
        return np.lib.stride_tricks.as_strided(
            buffer.reshape(-1),
            shape=(g.batch, g.capacity, g.kv_heads, g.head_dim),
            strides=(s.batch * item, s.token * item, s.head * item, s.dim * item),
            writeable=True,
        )

    def stats(self) -> KVStats:
        g = self.geometry
        if g is None:
            return KVStats(getattr(self.layout, "name", "?"), 0, 0, 0, 0, self.growths, 0)
        live = sum(r.nbytes for r in self.layout.live_ranges(g, self.live_lengths))
        return KVStats(
            layout=g.layout,
            batch=g.batch,
            capacity=g.capacity,
            kv_bytes=g.nbytes * 2 * self.num_layers,
            live_bytes=live * 2 * self.num_layers,
            growths=self.growths,
            copied_bytes=self.copied_bytes,
        )
