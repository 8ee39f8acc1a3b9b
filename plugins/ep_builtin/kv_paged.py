"""The ``paged`` KV layout: each layer's cache is a pool of pages of ``page_size`` tokens.

Physical shape ``[pages, page_size, kv_heads, head_dim]``; token t of sequence b lives in page
``table[b, t // page_size]`` at slot ``t % page_size`` (`ep.seams.KVStrides` with ``page_size``
> 0). For a batch at a capacity the pool holds ``batch * ceil(capacity / page_size)`` pages: room
for every sequence at the capacity without sharing.

What the layout decides and what the runtime does (`ep.runtime.kv.KVCache` and its `PagePool`):

* **block tables**: one row per sequence, ``ceil(capacity / page_size)`` int32 columns, -1 for
  a page not taken yet. KVCommitPaged / KVAttentionPaged read them (the ort backend feeds the
  table as a graph input, see `ep.ort.backend`).
* **pages on demand**: a page is taken (lowest free id first, so the committed prefix of the pool
  stays dense) when a sequence first writes a token in it, and returned to the pool when the
  sequence ends (`KVCache.release`) or the batch is replaced.
* **copy-on-write fork**: `KVCache.fork(src, dst)` gives dst src's block table and counts a
  reference per page; a write into a shared page first copies that page to a fresh one. A batch
  that repeats one prompt (or parallel sampling) runs the prompt once and shares its pages.
* **growth** never moves a token: pages keep their ids, the pool grows behind them and the block
  tables get more columns. The plan has no copies and keeps the address (the runtime grows the
  pool in place on the device layer's stable-address buffer).

Graph flavours: only this project's ``ep`` graphs (their KV ops, swapped for the paged ones by the
ort backend) read pages; onnxruntime-genai and standard graphs are refused with the command that
rewrites them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ep.hookspecs import hookimpl
from ep.registry import Option, Register
from ep.seams import ByteRange, GrowthPlan, KVGeometry, KVStrides
from ep_builtin.kv_head_major import capacity_bucket, power_of_two

__all__ = ["PagedLayout"]


class PagedLayout:
    """Pages of ``page_size`` tokens, [pages, P, Hkv, D], addressed through block tables."""

    name = "paged"

    def __init__(self, page_size: int = 16, min_capacity: int = 16) -> None:
        self.page_size = page_size
        self.min_capacity = min_capacity

    def pages_for(self, tokens: int) -> int:
        """Pages that hold ``tokens`` tokens of one sequence."""
        return -(-tokens // self.page_size)

    def geometry(
        self, *, batch: int, capacity: int, kv_heads: int, head_dim: int, itemsize: int
    ) -> KVGeometry:
        p = self.page_size
        run = kv_heads * head_dim
        strides = KVStrides(batch=0, token=run, head=head_dim, dim=1, page=p * run, page_size=p)
        shape = (batch * self.pages_for(capacity), p, kv_heads, head_dim)
        return KVGeometry(self.name, batch, capacity, kv_heads, head_dim, itemsize, shape, strides)

    def capacity_for(self, needed: int, *, context: int) -> int:
        # Buckets start at a whole page at least, so a table column is never half used.
        minimum = max(self.min_capacity, self.page_size)
        return capacity_bucket(needed, minimum=minimum, context=context)

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
        return GrowthPlan(
            new=new,
            copies=(),
            stable_address=True,
            in_place=True,
            reason=(
                f"pages keep their ids: the pool grows from {old.shape[0]} to {new.shape[0]} "
                f"pages behind them and block tables get {self.pages_for(new_capacity)} columns"
            ),
        )

    def live_ranges(
        self,
        geometry: KVGeometry,
        live_lengths: Sequence[int],
        *,
        block_table: np.ndarray | None = None,
    ) -> tuple[ByteRange, ...]:
        """One range per (sequence, page) in use. Without ``block_table``: the identity table
        (sequence b's j-th page is ``b * ceil(capacity / page_size) + j``)."""
        g, p = geometry, self.page_size
        token_bytes = g.kv_heads * g.head_dim * g.itemsize
        page_bytes = g.strides.page * g.itemsize
        per_seq = self.pages_for(g.capacity)
        ranges = []
        for b, n in enumerate(live_lengths):
            live = min(n, g.capacity)
            for j in range(self.pages_for(live)):
                page = int(block_table[b, j]) if block_table is not None else b * per_seq + j
                tokens = min(p, live - j * p)
                ranges.append(ByteRange(page * page_bytes, tokens * token_bytes))
        return tuple(ranges)

    def bytes_per_token(self, *, kv_heads: int, head_dim: int, itemsize: int) -> int:
        return kv_heads * head_dim * itemsize


def _make(options: Mapping[str, Any]) -> PagedLayout:
    return PagedLayout(page_size=options["page_size"], min_capacity=options["min_capacity"])


@hookimpl(trylast=True)
def ep_register_kv_layouts(register: Register) -> None:
    register.add(
        "paged",
        _make,
        options=[
            Option("page_size", int, 16, "tokens per page", check=power_of_two),
            Option(
                "min_capacity",
                int,
                16,
                "smallest capacity bucket (tokens; at least one page)",
                check=power_of_two,
            ),
        ],
        description="pages of page_size tokens [P, page_size, Hkv, D] + a block table per "
        "sequence; on-demand pages, copy-on-write prefix sharing; read by ep graphs",
    )
