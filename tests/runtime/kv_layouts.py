"""KV layouts for tests: real implementations of the KVLayout Protocol besides head_major.

`SeqMajorPacked` is [B, C, Hkv, D] packed by capacity: growing it moves every sequence b > 0
within the grown buffer (an in-place plan, copies ordered last sequence first), which is the case
DESIGN.md warns about. `BrokenLayout` breaks one rule of the contract on demand.
"""

from __future__ import annotations

from collections.abc import Sequence

from ep.seams import ByteRange, CopyRange, GrowthPlan, KVGeometry, KVStrides
from ep_builtin.kv_head_major import HeadMajorLayout, capacity_bucket


class SeqMajorPacked:
    name = "seq_major_packed"

    def __init__(self, min_capacity: int = 8) -> None:
        self.min_capacity = min_capacity

    def geometry(
        self, *, batch: int, capacity: int, kv_heads: int, head_dim: int, itemsize: int
    ) -> KVGeometry:
        strides = KVStrides(
            batch=capacity * kv_heads * head_dim, token=kv_heads * head_dim, head=head_dim, dim=1
        )
        shape = (batch, capacity, kv_heads, head_dim)
        return KVGeometry(self.name, batch, capacity, kv_heads, head_dim, itemsize, shape, strides)

    def capacity_for(self, needed: int, *, context: int) -> int:
        return capacity_bucket(needed, minimum=self.min_capacity, context=context)

    def growth_plan(
        self, old: KVGeometry, new_capacity: int, live_lengths: Sequence[int]
    ) -> GrowthPlan:
        new = self.geometry(
            batch=old.batch,
            capacity=new_capacity,
            kv_heads=old.kv_heads,
            head_dim=old.head_dim,
            itemsize=old.itemsize,
        )
        token_bytes = old.kv_heads * old.head_dim * old.itemsize
        copies = tuple(
            CopyRange(
                b * old.strides.batch * old.itemsize,
                b * new.strides.batch * new.itemsize,
                min(live_lengths[b], old.capacity) * token_bytes,
            )
            for b in range(old.batch - 1, 0, -1)  # last first: no source is overwritten early
        )
        return GrowthPlan(new, copies, stable_address=True, in_place=True, reason="relocate b>0")

    def live_ranges(
        self, geometry: KVGeometry, live_lengths: Sequence[int]
    ) -> tuple[ByteRange, ...]:
        g = geometry
        token_bytes = g.kv_heads * g.head_dim * g.itemsize
        return tuple(
            ByteRange(b * g.strides.batch * g.itemsize, n * token_bytes)
            for b, n in enumerate(live_lengths)
        )

    def bytes_per_token(self, *, kv_heads: int, head_dim: int, itemsize: int) -> int:
        return kv_heads * head_dim * itemsize


class BrokenLayout(HeadMajorLayout):
    """head_major with one contract violation: "capacity", "geometry" or "copies"."""

    name = "broken"

    def __init__(self, fault: str) -> None:
        super().__init__(min_capacity=16)
        self.fault = fault

    def capacity_for(self, needed: int, *, context: int) -> int:
        if self.fault == "capacity":
            return needed - 1
        return super().capacity_for(needed, context=context)

    def geometry(
        self, *, batch: int, capacity: int, kv_heads: int, head_dim: int, itemsize: int
    ) -> KVGeometry:
        g = super().geometry(
            batch=batch, capacity=capacity, kv_heads=kv_heads, head_dim=head_dim, itemsize=itemsize
        )
        if self.fault == "geometry":
            strides = KVStrides(
                batch=g.strides.batch * 2, token=g.strides.token, head=g.strides.head, dim=1
            )
            return KVGeometry(
                g.layout, batch, capacity, kv_heads, head_dim, itemsize, g.shape, strides
            )
        return g

    def growth_plan(
        self, old: KVGeometry, new_capacity: int, live_lengths: Sequence[int]
    ) -> GrowthPlan:
        plan = super().growth_plan(old, new_capacity, live_lengths)
        if self.fault == "copies":
            bad = CopyRange(0, plan.new.nbytes - 4, 64)
            return GrowthPlan(plan.new, (*plan.copies, bad), False, False, "overruns")
        return plan
