"""Where the executor gets each weight's device buffer: ``weights.get(name, stream=...)``.

`WeightSource` is what `ep.native.plan.StepPlan` calls. `ResidentWeights` uploads every
initializer once and keeps it (capture-safe: no address ever changes). `OffloadedWeights` puts an
offload policy's `ep.offload.WeightStore` behind the same interface: a resident weight is bound
once (``fixed``), every other one is fetched by its call at each step; the step and capture hooks
(`begin_step`, `end_step`, `begin_capture`, `end_capture`, `replayed`) keep the store's slots and
ledger in step with what the executor ran. A weight the store holds in pieces (``split(name)``
returns its `ep.offload.SplitWeight`) is never fetched whole: its node runs one call per piece.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol, runtime_checkable

import numpy as np

from ep.device import Buffer, Device, Stream
from ep.errors import ModelError, OffloadError
from ep.offload import AccessTrace, OffloadCounters, SplitWeight, WeightStore

__all__ = ["OffloadedWeights", "ResidentWeights", "WeightSource"]


@runtime_checkable
class WeightSource(Protocol):
    """Gives the device buffer of a weight by name; ``capture_safe``: addresses never change.

    Optional: ``fixed(name, *, stream) -> Buffer | None`` (a buffer whose address never changes,
    bound once by the plan; without it every weight is fetched by its call at each step), and
    ``split(name) -> SplitWeight | None`` (a weight held in pieces, each fetched by its name).
    """

    @property
    def capture_safe(self) -> bool: ...

    def get(self, name: str, *, stream: Stream) -> Buffer:
        """The weight's device buffer, ready for kernels queued on ``stream`` after this call."""
        ...


class ResidentWeights:
    """Every weight uploaded once, on first use, and kept on the device."""

    capture_safe = True
    reason = "offload policy resident: every weight stays at one address"

    def __init__(self, device: Device, arrays: Mapping[str, np.ndarray]) -> None:
        self.device = device
        self._arrays = arrays
        self._buffers: dict[str, Buffer] = {}

    def get(self, name: str, *, stream: Stream) -> Buffer:
        found = self._buffers.get(name)
        if found is not None:
            return found
        array = self._arrays.get(name)
        if array is None:
            raise ModelError(
                f"the graph reads weight {name!r}, which the model does not hold; the model "
                "file is incomplete (rebuild or re-export it)"
            )
        buf = self.device.to_device(np.ascontiguousarray(array), stream=stream, name=f"w:{name}")
        self._buffers[name] = buf
        return buf

    def fixed(self, name: str, *, stream: Stream) -> Buffer | None:
        """Every weight here has a fixed address: bind it once."""
        return self.get(name, stream=stream)

    @property
    def resident_bytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())


class OffloadedWeights:
    """The weights of ``store`` placed by its offload policy; ``tables`` are the executor's own.

    ``tables`` serves the few initializers the store does not hold (the rotary cos/sin tables:
    derived constants of the position encoding that one kernel reads two at a time), always
    resident. Every method the executor calls per step is forwarded to the store.
    """

    def __init__(self, store: WeightStore, tables: ResidentWeights) -> None:
        self.store = store
        self.tables = tables
        self._names = frozenset(store.layout.placements)
        self._splits = store.splits

    @property
    def capture_safe(self) -> bool:
        return self.store.capture_safe

    @property
    def reason(self) -> str:
        return f"{self.store.layout.policy}: {self.store.plan.reason}"

    def split(self, name: str) -> SplitWeight | None:
        """The pieces of a weight the store holds in pieces; None for a whole weight."""
        return self._splits.get(name)

    def streamed(self, name: str) -> bool:
        """Whether the store streams or caches ``name`` (fetched by its call at every step; a
        call holds at most ``slots - 1`` such weights at once)."""
        return name in self._names and self.store.layout.placements[name] != "resident"

    def _whole(self, name: str) -> None:
        split = self._splits.get(name)
        if split is not None:
            raise OffloadError(
                f"weight {name!r} is stored in {len(split.pieces)} pieces (offload.piece), so it "
                f"has no buffer of its own; fetch its pieces ({split.pieces[0].name!r}, ...) one "
                "call each"
            )

    def get(self, name: str, *, stream: Stream) -> Buffer:
        if name in self._names:
            return self.store.get(name, stream=stream)
        self._whole(name)
        return self.tables.get(name, stream=stream)

    def fixed(self, name: str, *, stream: Stream) -> Buffer | None:
        """A resident weight's buffer (bound once); None for a streamed or cached one."""
        if name in self._names:
            return self.store.resident_buffer(name)
        self._whole(name)
        return self.tables.get(name, stream=stream)

    def fixed_reads(self, names: Sequence[str]) -> AccessTrace:
        """The store's reads among ``names`` (weights bound once), to count with `replayed`."""
        return self.store.fixed_reads([n for n in names if n in self._names])

    def begin_step(self) -> None:
        self.store.begin_step()

    def start(self, *, stream: Stream) -> None:
        """The step's first call (captured with it): predicted streamed copies start."""
        self.store.start(stream)

    def finish(self, *, stream: Stream) -> None:
        """The step's last call (captured with it): every copy is waited for."""
        self.store.finish(stream)

    def end_step(self, tokens: int) -> None:
        self.store.end_step(tokens)

    def begin_capture(self) -> None:
        self.store.begin_capture()

    def end_capture(self) -> AccessTrace:
        return self.store.end_capture()

    def replayed(self, trace: AccessTrace) -> None:
        self.store.replayed(trace)

    def counters(self) -> OffloadCounters:
        return self.store.counters()

    def close(self) -> None:
        self.store.close()
