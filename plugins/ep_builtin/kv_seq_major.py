"""The ``seq_major`` KV layout: each layer's cache is [batch, capacity, kv_heads, head_dim].

One token of one sequence is one contiguous run of ``kv_heads * head_dim`` elements, so a decode
step writes one run per sequence. Two modes (option ``fixed_stride``):

* **packed** (default): the per-sequence stride *is* the capacity. Growing from capacity C to C'
  moves every sequence b > 0 from ``b*C`` to ``b*C'`` tokens. The plan moves them inside the
  grown buffer (``in_place``, address stable): last sequence first, and each sequence's run in
  chunks of at most the distance it moves, last chunk first, so no copy overlaps itself or
  overwrites a source that a later copy still reads. Sequence 0 never moves.
* **fixed_stride**: the per-sequence stride is the full context, whatever the capacity, so
  growth never moves a byte: the runtime only commits more of the buffer (on the device layer's
  stable-address `GrowableBuffer`; on the CPU a reserved array). The stride needs the context,
  which only ``capacity_for`` is told: the layout keeps the largest one it has seen, and a plan
  keeps the stride of the geometry it grows.

Graph flavours: only this project's ``ep`` graphs (KVCommit/KVAttention read the strides) read
this layout. onnxruntime-genai ("contrib") graphs bind their past/present — head-major — to the
cache itself, so the ort backend refuses them with the ``genai-ep rewrite`` command to run;
"standard" graphs keep head-major staging tensors and commit each new token into this layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ep.hookspecs import hookimpl
from ep.registry import Option, Register
from ep.seams import ByteRange, CopyRange, GrowthPlan, KVGeometry, KVStrides
from ep_builtin.kv_head_major import capacity_bucket, power_of_two

__all__ = ["SeqMajorLayout", "relocation_copies"]


def relocation_copies(
    old: KVGeometry, new: KVGeometry, live_lengths: Sequence[int]
) -> tuple[CopyRange, ...]:
    """In-place moves of sequences b > 0 from ``old``'s batch stride to ``new``'s (larger).

    Last sequence first, each in chunks of at most the distance it moves, last chunk first: no
    copy overlaps itself and none overwrites bytes a later copy reads.
    """
    token_bytes = old.kv_heads * old.head_dim * old.itemsize
    copies: list[CopyRange] = []
    for b in range(old.batch - 1, 0, -1):
        src = b * old.strides.batch * old.itemsize
        dst = b * new.strides.batch * new.itemsize
        nbytes = min(live_lengths[b], old.capacity) * token_bytes
        shift = dst - src
        if nbytes == 0 or shift == 0:
            continue
        end = nbytes
        while end > 0:
            start = max(0, end - shift)
            copies.append(CopyRange(src + start, dst + start, end - start))
            end = start
    return tuple(copies)


class SeqMajorLayout:
    """[B, C, Hkv, D], per-sequence stride C (packed) or the context (``fixed_stride``)."""

    name = "seq_major"

    def __init__(self, min_capacity: int = 16, fixed_stride: bool = False) -> None:
        self.min_capacity = min_capacity
        self.fixed_stride = fixed_stride
        self._context = 0  # the largest context capacity_for was asked about (fixed_stride)

    def _stride_tokens(self, capacity: int) -> int:
        return max(capacity, self._context) if self.fixed_stride else capacity

    def _make(
        self, batch: int, capacity: int, stride_tokens: int, kv_heads: int, head_dim: int, item: int
    ) -> KVGeometry:
        run = kv_heads * head_dim
        strides = KVStrides(batch=stride_tokens * run, token=run, head=head_dim, dim=1)
        shape = (batch, stride_tokens, kv_heads, head_dim)
        return KVGeometry(self.name, batch, capacity, kv_heads, head_dim, item, shape, strides)

    def geometry(
        self, *, batch: int, capacity: int, kv_heads: int, head_dim: int, itemsize: int
    ) -> KVGeometry:
        stride = self._stride_tokens(capacity)
        return self._make(batch, capacity, stride, kv_heads, head_dim, itemsize)

    def capacity_for(self, needed: int, *, context: int) -> int:
        self._context = max(self._context, context)
        return capacity_bucket(needed, minimum=self.min_capacity, context=context)

    def growth_plan(
        self, old: KVGeometry, new_capacity: int, live_lengths: Sequence[int]
    ) -> GrowthPlan:
        run = old.kv_heads * old.head_dim
        old_stride = old.strides.batch // run if run else old.capacity
        if self.fixed_stride and new_capacity <= old_stride:
            new = self._make(
                old.batch, new_capacity, old_stride, old.kv_heads, old.head_dim, old.itemsize
            )
            return GrowthPlan(
                new=new,
                copies=(),
                stable_address=True,
                in_place=True,
                reason=(
                    f"fixed per-sequence stride of {old_stride} tokens: capacity "
                    f"{old.capacity} -> {new_capacity} moves nothing, only commits memory"
                ),
            )
        new = self.geometry(
            batch=old.batch,
            capacity=new_capacity,
            kv_heads=old.kv_heads,
            head_dim=old.head_dim,
            itemsize=old.itemsize,
        )
        copies = relocation_copies(old, new, live_lengths)
        return GrowthPlan(
            new=new,
            copies=copies,
            stable_address=True,
            in_place=True,
            reason=(
                f"seq-major per-sequence stride is the capacity ({old_stride} -> "
                f"{new.strides.batch // run if run else new_capacity} tokens): move sequences "
                f"1..{old.batch - 1} within the grown buffer, last first ({len(copies)} copies)"
            ),
        )

    def live_ranges(
        self, geometry: KVGeometry, live_lengths: Sequence[int]
    ) -> tuple[ByteRange, ...]:
        g = geometry
        token_bytes = g.kv_heads * g.head_dim * g.itemsize
        return tuple(
            ByteRange(b * g.strides.batch * g.itemsize, min(n, g.capacity) * token_bytes)
            for b, n in enumerate(live_lengths)
        )

    def bytes_per_token(self, *, kv_heads: int, head_dim: int, itemsize: int) -> int:
        return kv_heads * head_dim * itemsize


def _make(options: Mapping[str, Any]) -> SeqMajorLayout:
    return SeqMajorLayout(
        min_capacity=options["min_capacity"], fixed_stride=options["fixed_stride"]
    )


@hookimpl(trylast=True)
def ep_register_kv_layouts(register: Register) -> None:
    register.add(
        "seq_major",
        _make,
        options=[
            Option(
                "min_capacity", int, 16, "smallest capacity bucket (tokens)", check=power_of_two
            ),
            Option(
                "fixed_stride",
                bool,
                False,
                "per-sequence stride = the context: growth never relocates, only commits memory",
            ),
        ],
        description="[B, C, Hkv, D]; growth relocates sequences b > 0 in place (or a fixed "
        "full-context stride); read by ep graphs",
    )
