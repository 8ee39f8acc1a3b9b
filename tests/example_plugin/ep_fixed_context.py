"""A complete genai-ep plugin: the ``fixed_context`` KV layout.

Head-major [B, Hkv, C, D] with C = the whole context from the first step: more memory, but the
buffer never grows, so nothing is ever copied and every address stays put.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ep
from ep.seams import ByteRange, CopyRange, GrowthPlan, KVGeometry, KVStrides


class FixedContextLayout:
    name = "fixed_context"

    def __init__(self, reserve: int) -> None:
        self.reserve = reserve  # tokens to allocate; 0 means the model's whole context

    def geometry(
        self, *, batch: int, capacity: int, kv_heads: int, head_dim: int, itemsize: int
    ) -> KVGeometry:
        strides = KVStrides(
            batch=kv_heads * capacity * head_dim, token=head_dim, head=capacity * head_dim, dim=1
        )
        return KVGeometry(
            self.name,
            batch,
            capacity,
            kv_heads,
            head_dim,
            itemsize,
            (batch, kv_heads, capacity, head_dim),
            strides,
        )

    def capacity_for(self, needed: int, *, context: int) -> int:
        if needed > context:
            raise ValueError(f"{needed} tokens do not fit the context of {context}")
        return max(needed, min(self.reserve or context, context))

    def growth_plan(
        self, old: KVGeometry, new_capacity: int, live_lengths: Sequence[int]
    ) -> GrowthPlan:
        # Only reached when `reserve` was smaller than the context: copy each (sequence, head) run.
        new = self.geometry(
            batch=old.batch,
            capacity=new_capacity,
            kv_heads=old.kv_heads,
            head_dim=old.head_dim,
            itemsize=old.itemsize,
        )
        copies = []
        for b, live in enumerate(live_lengths):
            for h in range(old.kv_heads):
                src = (b * old.strides.batch + h * old.strides.head) * old.itemsize
                dst = (b * new.strides.batch + h * new.strides.head) * new.itemsize
                copies.append(CopyRange(src, dst, live * old.head_dim * old.itemsize))
        return GrowthPlan(
            new,
            tuple(copies),
            stable_address=False,
            in_place=False,
            reason="reserve was below the context; grown like head_major",
        )

    def live_ranges(
        self, geometry: KVGeometry, live_lengths: Sequence[int]
    ) -> tuple[ByteRange, ...]:
        g = geometry
        return tuple(
            ByteRange(
                (b * g.strides.batch + h * g.strides.head) * g.itemsize,
                live * g.head_dim * g.itemsize,
            )
            for b, live in enumerate(live_lengths)
            for h in range(g.kv_heads)
        )

    def bytes_per_token(self, *, kv_heads: int, head_dim: int, itemsize: int) -> int:
        return kv_heads * head_dim * itemsize


def _make(options: Mapping[str, Any]) -> FixedContextLayout:
    return FixedContextLayout(reserve=options["reserve"])


@ep.hookimpl
def ep_register_kv_layouts(register: ep.Register) -> None:
    register.add(
        "fixed_context",
        _make,
        options=[
            ep.Option(
                "reserve",
                int,
                0,
                "tokens to allocate (0: the whole context)",
                check=lambda v: "" if v >= 0 else "must be >= 0",
            )
        ],
        description="head-major, allocated for the whole context once; never grows",
    )
