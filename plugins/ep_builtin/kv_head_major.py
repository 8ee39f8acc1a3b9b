"""The ``head_major`` KV layout: each layer's cache is [batch, kv_heads, capacity, head_dim].

This is the layout of onnxruntime-genai models' past/present tensors, so graphs with head-major
I/O bind it directly. Growing the capacity changes the per-head stride, so growth allocates a new
buffer and copies every (sequence, head) run of live tokens: addresses are not stable.

Graph flavours: every one. onnxruntime-genai ("contrib") graphs bind this cache itself as their
shared past/present (it is the only layout they can: GroupQueryAttention reads and writes its
cache head-major); "standard" graphs commit each new token into it; ep graphs read its strides.
The other layouts (``seq_major``, ``paged``) run on ep graphs — ``genai-ep rewrite MODEL -o OUT``
turns an onnxruntime-genai model into one, and the ort backend says so when asked for another
layout on a contrib graph (see `ep.ort.backend`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ep.hookspecs import hookimpl
from ep.registry import Option, Register
from ep.seams import ByteRange, CopyRange, GrowthPlan, KVGeometry, KVStrides

__all__ = ["HeadMajorLayout", "capacity_bucket", "power_of_two"]


def capacity_bucket(needed: int, *, minimum: int, context: int) -> int:
    """The smallest power of two times ``minimum`` that holds ``needed``, capped at ``context``."""
    if needed > context:
        raise ValueError(f"{needed} tokens do not fit the context of {context}")
    capacity = minimum
    while capacity < needed:
        capacity *= 2
    return min(capacity, context)


class HeadMajorLayout:
    """[B, Hkv, C, D]: one contiguous run of C tokens per (sequence, head)."""

    name = "head_major"

    def __init__(self, min_capacity: int = 16) -> None:
        self.min_capacity = min_capacity

    def geometry(
        self, *, batch: int, capacity: int, kv_heads: int, head_dim: int, itemsize: int
    ) -> KVGeometry:
        d = head_dim
        strides = KVStrides(batch=kv_heads * capacity * d, token=d, head=capacity * d, dim=1)
        shape = (batch, kv_heads, capacity, head_dim)
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
        copies = []
        for b, live in enumerate(live_lengths):
            nbytes = min(live, old.capacity) * old.head_dim * old.itemsize
            if nbytes == 0:
                continue
            for h in range(old.kv_heads):
                src = (b * old.strides.batch + h * old.strides.head) * old.itemsize
                dst = (b * new.strides.batch + h * new.strides.head) * new.itemsize
                copies.append(CopyRange(src, dst, nbytes))
        return GrowthPlan(
            new=new,
            copies=tuple(copies),
            stable_address=False,
            in_place=False,
            reason=(
                f"head-major per-head stride is the capacity ({old.capacity} -> {new_capacity}): "
                "copy each (sequence, head) run into a new buffer"
            ),
        )

    def live_ranges(
        self, geometry: KVGeometry, live_lengths: Sequence[int]
    ) -> tuple[ByteRange, ...]:
        g = geometry
        ranges = []
        for b, live in enumerate(live_lengths):
            for h in range(g.kv_heads):
                offset = (b * g.strides.batch + h * g.strides.head) * g.itemsize
                ranges.append(ByteRange(offset, min(live, g.capacity) * g.head_dim * g.itemsize))
        return tuple(ranges)

    def bytes_per_token(self, *, kv_heads: int, head_dim: int, itemsize: int) -> int:
        return kv_heads * head_dim * itemsize


def _make(options: Mapping[str, Any]) -> HeadMajorLayout:
    return HeadMajorLayout(min_capacity=options["min_capacity"])


def power_of_two(value: int) -> str:
    """Option check shared by the layouts' capacity and page-size options."""
    return "" if value > 0 and value & (value - 1) == 0 else "must be a power of two >= 1"


@hookimpl(trylast=True)
def ep_register_kv_layouts(register: Register) -> None:
    register.add(
        "head_major",
        _make,
        options=[
            Option("min_capacity", int, 16, "smallest capacity bucket (tokens)", check=power_of_two)
        ],
        description="[B, Hkv, C, D]; the past/present layout of onnxruntime-genai models",
    )
