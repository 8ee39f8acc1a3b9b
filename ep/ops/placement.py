"""Which kernel of each op ONNX Runtime sessions run: the switch the invocation hook reads.

By default sessions run every op's ``"cpu"`` kernel (its NumPy reference). `use_device` switches
the process to another kernel set for a ``with`` block (`set_device` without one):

    with ep.ops.use_device("cuda"):           # the ops' CUDA kernels, a host round trip each
        outputs = ep.ops.run(session, None, feeds)

``use_device("cpu", kernels="cuda")`` runs the very same CUDA kernel functions on the CPU device,
whose kernels are the NumPy twins of the CUDA ones: every line of the round trip (uploads, wrapper
arguments, fault checks, KV-cache regions) runs in CI, without a GPU.

An op that has no kernel for the chosen set is an `OpError` naming the op, the set and the fix;
with ``fallback=True`` it runs its NumPy reference instead (a RuntimeWarning names it once).

The choice is process-wide, like the weight resolver (`ep.ops.use_weights`): ONNX Runtime may run
nodes on its own threads. The hook reads one attribute per call; the CPU path costs a string
comparison and nothing else.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ep.errors import ConfigError

if TYPE_CHECKING:
    from ep.device import Device

__all__ = [
    "OpPlacement",
    "current_placement",
    "placement_for",
    "set_device",
    "set_placement",
    "use_device",
    "use_placement",
]

_DEVICE_NAME = re.compile(r"^(cpu|cuda)(?::(\d+))?$")
_KERNEL_KEY = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class OpPlacement:
    """Where the ops of ONNX Runtime sessions run.

    ``kernels``: the key of `ep.ops.OpDef.kernels` each op runs ("cpu": the NumPy references;
    "cuda": the CUDA kernels of `ep.ops.cuda`). ``device``: the `ep.device` device those device
    kernels launch on ("cuda", "cuda:1"; "cpu" runs them on the CPU device's NumPy twins).
    ``fallback``: an op without a ``kernels`` kernel runs its reference instead of failing.
    """

    kernels: str = "cpu"
    device: str = "cpu"
    fallback: bool = False

    def describe(self) -> str:
        if self.kernels == "cpu":
            return "the ops' NumPy references"
        where = f"the {self.kernels!r} kernels on device {self.device!r}"
        return where + (" (reference fallback on)" if self.fallback else "")


class _Active:
    """The current placement, flattened into attributes the invocation hook reads directly."""

    def __init__(self) -> None:
        self.placement = OpPlacement()
        self.kernels = "cpu"
        self.device = "cpu"
        self.fallback = False
        self.warned: set[tuple[str, str]] = set()  # (op name, kernels) fallbacks warned about
        self.lock = threading.Lock()

    def install(self, placement: OpPlacement) -> OpPlacement:
        with self.lock:
            previous = self.placement
            self.placement = placement
            self.device = placement.device
            self.fallback = placement.fallback
            # Last: the hook tests ``kernels`` first, so it never sees a new set with an old device.
            self.kernels = placement.kernels
        return previous


ACTIVE = _Active()


def current_placement() -> OpPlacement:
    """The placement ONNX Runtime sessions use now."""
    return ACTIVE.placement


def placement_for(
    device: str | Device, *, kernels: str | None = None, fallback: bool = False
) -> OpPlacement:
    """The placement for ``device`` ("cpu", "cuda", "cuda:N" or an `ep.device.Device`), checked.

    ``kernels`` defaults to the device's kind ("cuda:1" -> "cuda"). A CUDA device is opened here,
    so a machine without one fails now, with the device layer's reason in words
    (`ep.errors.DeviceUnavailableError`), not at the first op.
    """
    name = device if isinstance(device, str) else getattr(device, "name", None)
    if not isinstance(name, str):
        raise ConfigError(f"device {device!r} is neither a device name nor an ep.device.Device")
    text = name.strip().lower()
    found = _DEVICE_NAME.match(text)
    if found is None or (found.group(1) == "cpu" and found.group(2) is not None):
        raise ConfigError(
            f"ops device {device!r} is not a device name: expected 'cpu', 'cuda' or 'cuda:N'"
        )
    key = found.group(1) if kernels is None else kernels
    if not isinstance(key, str) or not _KERNEL_KEY.match(key):
        raise ConfigError(
            f"kernels={kernels!r} is not a kernel set name: expected a lower-case key of "
            "OpDef.kernels such as 'cpu' or 'cuda'"
        )
    if not isinstance(fallback, bool):
        raise ConfigError(f"fallback={fallback!r} must be True or False")
    if found.group(1) == "cuda":
        from ep.device import get_device  # loaded here: the CPU path never needs the device layer

        text = get_device(text).name  # raises DeviceUnavailableError when CUDA is not here
    return OpPlacement(kernels=key, device=text, fallback=fallback)


def set_placement(placement: OpPlacement) -> OpPlacement:
    """Install an already checked placement (from `placement_for`); returns the previous one."""
    if not isinstance(placement, OpPlacement):
        raise ConfigError(
            f"expected an ep.ops.OpPlacement (from ep.ops.placement_for), got "
            f"{type(placement).__name__}"
        )
    return ACTIVE.install(placement)


def set_device(
    device: str | Device, *, kernels: str | None = None, fallback: bool = False
) -> OpPlacement:
    """Make ONNX Runtime sessions run the ops' ``kernels`` on ``device`` from now on (see
    `placement_for`); returns the previous placement. ``set_device("cpu")`` restores the default."""
    return set_placement(placement_for(device, kernels=kernels, fallback=fallback))


@contextmanager
def use_placement(placement: OpPlacement) -> Iterator[OpPlacement]:
    """Install ``placement`` for a ``with`` block, then restore the previous one."""
    previous = set_placement(placement)
    try:
        yield placement
    finally:
        ACTIVE.install(previous)


@contextmanager
def use_device(
    device: str | Device, *, kernels: str | None = None, fallback: bool = False
) -> Iterator[OpPlacement]:
    """`set_device` for a ``with`` block, then restore the previous placement."""
    with use_placement(placement_for(device, kernels=kernels, fallback=fallback)) as placement:
        yield placement
