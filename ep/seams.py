"""The contracts of the three seams: KV layout, capture policy, offload policy.

Plugins *decide*; the core *acts* (DESIGN.md §3). Each seam is a `typing.Protocol` so that a plugin
is any plain object with the right methods (no base class to inherit), and each decision is a frozen
dataclass that carries a human-readable `reason`. The core validates every decision and owns every
allocation, pointer, stream and byte count.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

__all__ = [
    "AccessDecision",
    "BindingSignature",
    "ByteRange",
    "CaptureAction",
    "CaptureDecision",
    "CapturePolicy",
    "CopyRange",
    "GrowthPlan",
    "KVGeometry",
    "KVLayout",
    "KVStrides",
    "OffloadPlan",
    "OffloadPolicy",
    "Placement",
    "StepInfo",
    "WeightInfo",
]


# --- KV layout -------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVStrides:
    """Element strides of one layer's K (or V) cache along its logical axes.

    Kernels take their index math from here, so a layout never needs kernel changes: element
    (b, t, h, d) lives at ``b*batch + t*token + h*head + d*dim`` for contiguous layouts. For a
    paged layout, ``page_size > 0``: token t of sequence b lives in physical page
    ``p = table[b, t // page_size]`` at ``p*page + (t % page_size)*token + h*head + d*dim``, and
    ``batch`` is unused (0).
    """

    batch: int
    token: int
    head: int
    dim: int
    page: int = 0
    page_size: int = 0


@dataclass(frozen=True)
class KVGeometry:
    """The physical shape of one layer's K (or V) buffer for a batch at a capacity."""

    layout: str
    batch: int
    capacity: int  # tokens each sequence can hold
    kv_heads: int
    head_dim: int
    itemsize: int
    shape: tuple[int, ...]  # physical shape of the allocation
    strides: KVStrides

    @property
    def elements(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def nbytes(self) -> int:
        return self.elements * self.itemsize


@dataclass(frozen=True)
class ByteRange:
    """``nbytes`` bytes starting at ``offset`` within one layer's buffer."""

    offset: int
    nbytes: int


@dataclass(frozen=True)
class CopyRange:
    """Copy ``nbytes`` from ``src_offset`` (old buffer) to ``dst_offset`` (new buffer)."""

    src_offset: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True)
class GrowthPlan:
    """How to go from one capacity to a larger one, for one layer's buffer.

    ``stable_address``: the buffer keeps its address (memory is only committed behind it), so a
    captured graph bound to it stays valid. ``in_place``: ``copies`` move bytes within the same
    buffer (after it grew), otherwise from the old buffer into a fresh one. Copies are applied in
    order; a layout that relocates in place lists them so that no source is overwritten first.
    """

    new: KVGeometry
    copies: tuple[CopyRange, ...]
    stable_address: bool
    in_place: bool
    reason: str


@runtime_checkable
class KVLayout(Protocol):
    """How each layer's K/V lives in memory. Pure geometry: the core allocates and copies."""

    name: str

    def geometry(
        self, *, batch: int, capacity: int, kv_heads: int, head_dim: int, itemsize: int
    ) -> KVGeometry:
        """Physical shape and strides of one layer's buffer."""
        ...

    def capacity_for(self, needed: int, *, context: int) -> int:
        """The capacity bucket (>= needed, <= context) to allocate for ``needed`` tokens."""
        ...

    def growth_plan(
        self, old: KVGeometry, new_capacity: int, live_lengths: Sequence[int]
    ) -> GrowthPlan:
        """The exact byte ranges to copy when growing ``old`` to ``new_capacity``."""
        ...

    def live_ranges(
        self, geometry: KVGeometry, live_lengths: Sequence[int]
    ) -> tuple[ByteRange, ...]:
        """Byte ranges holding the first ``live_lengths[b]`` tokens of each sequence."""
        ...

    def bytes_per_token(self, *, kv_heads: int, head_dim: int, itemsize: int) -> int:
        """Bytes one token occupies in one layer's K (or V) buffer."""
        ...


# --- capture policy --------------------------------------------------------------------------


CaptureAction = Literal["eager", "capture", "replay"]


@dataclass(frozen=True)
class BindingSignature:
    """What a captured graph baked in: each bound buffer's address, shape and dtype."""

    bindings: tuple[tuple[str, int, tuple[int, ...], str], ...]  # (name, address, shape, dtype)

    def differences(self, other: BindingSignature) -> list[str]:
        """Human-readable list of what changed between two signatures (empty: identical)."""
        mine = {b[0]: b[1:] for b in self.bindings}
        theirs = {b[0]: b[1:] for b in other.bindings}
        out = []
        for name in sorted(mine.keys() | theirs.keys()):
            if mine.get(name) != theirs.get(name):
                out.append(f"{name}: {mine.get(name)} -> {theirs.get(name)}")
        return out


@dataclass(frozen=True)
class StepInfo:
    """Everything a capture policy may look at for one step, and where each input came from."""

    phase: Literal["prefill", "decode"]
    batch: int
    capacity: int
    signature: BindingSignature
    offload_address_stable: bool
    backend_can_capture: bool
    backend_reason: str
    sources: Mapping[str, str] = field(default_factory=dict)  # input name -> "config file", ...


@dataclass(frozen=True)
class CaptureDecision:
    """Run this step eagerly, capture it under ``key``, or replay the graph kept under ``key``.

    A decline (``eager``) names the predicate that failed and its inputs, for example
    ``predicate="offload plan is address-stable"``,
    ``inputs={"offload": "lru (from config file)"}``.
    """

    action: CaptureAction
    reason: str
    key: Hashable | None = None
    predicate: str = ""
    inputs: Mapping[str, str] = field(default_factory=dict)

    def __bool__(self) -> bool:  # truthy when the step runs from a graph
        return self.action != "eager"


@runtime_checkable
class CapturePolicy(Protocol):
    """When a decode step is captured as a graph, replayed, recaptured or run eagerly."""

    name: str

    def decide(self, step: StepInfo) -> CaptureDecision:
        """Called by the core before every step of the native backend."""
        ...

    def captured(self, key: Hashable, ok: bool, error: str = "") -> None:
        """Told by the core whether a capture it asked for worked (policies count failures)."""
        ...

    def invalidated(self, key: Hashable, why: str) -> None:
        """Told by the core that the graph under ``key`` no longer matches its bindings."""
        ...


# --- offload policy --------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightInfo:
    """One weight as an offload policy sees it."""

    name: str
    nbytes: int
    layer: int  # -1 for weights outside the decoder layers (embedding, final norm, head)
    op: str  # the op that reads it, e.g. "MatMul", "MatMulNBits", "Gather"
    order: int  # position in the order of use within one step


@dataclass(frozen=True)
class Placement:
    """Where one weight lives: on the device for good, streamed at each use, or cached."""

    where: Literal["resident", "stream", "cache"]
    reason: str


@dataclass(frozen=True)
class OffloadPlan:
    """A placement per weight. ``capture_safe``: no weight address ever changes during decode."""

    placements: Mapping[str, Placement]
    capture_safe: bool
    dynamic: bool  # the policy answers `access` per use (e.g. an LRU cache)
    reason: str


@dataclass(frozen=True)
class AccessDecision:
    """A dynamic policy's answer to one weight access: evict these, then page the weight in."""

    evict: tuple[str, ...]
    reason: str


@runtime_checkable
class OffloadPolicy(Protocol):
    """Where each weight lives, under a device byte budget."""

    name: str

    def plan(self, weights: Sequence[WeightInfo], budget_bytes: int) -> OffloadPlan:
        """Called once per model load, before the first step."""
        ...

    def access(self, weight: WeightInfo, cached: Sequence[str], free_bytes: int) -> AccessDecision:
        """Dynamic policies only: called on a miss of a ``cache`` weight."""
        ...
