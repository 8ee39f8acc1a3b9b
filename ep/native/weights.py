"""Where the executor gets each weight's device buffer: ``weights.get(name, stream=...)``.

`WeightSource` is the small interface the offload work (`ep.offload`'s ``WeightStore``) plugs
into later; `ResidentWeights` uploads every initializer once and keeps it (capture-safe: no
address ever changes).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

import numpy as np

from ep.device import Buffer, Device, Stream
from ep.errors import ModelError

__all__ = ["ResidentWeights", "WeightSource"]


@runtime_checkable
class WeightSource(Protocol):
    """Gives the device buffer of a weight by name; ``capture_safe``: addresses never change."""

    capture_safe: bool
    reason: str

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

    @property
    def resident_bytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())
