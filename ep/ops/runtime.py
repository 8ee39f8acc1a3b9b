"""State the runtime owns and ops reach by name or handle: named weights and KV-cache buffers.

Inside an ONNX Runtime session a Python custom op gets *copies* of its inputs, so a weight or a KV
cache passed as an input would be copied on every call and a write to it would never reach the
caller. Instead the runtime keeps the arrays and the ops look them up:

- ``MatMul`` names its weight in an attribute and asks the process-wide weight resolver (set by
  the runtime with `set_weight_resolver`; later the offload policy decides where it lives);
- ``KVCommit`` / ``KVAttention`` receive an int64 handle input that `KV_CACHES` maps to the
  runtime's per-layer key/value buffers, written and read in place.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

from ep.errors import OpError

__all__ = [
    "KV_CACHES",
    "DictWeights",
    "KVCacheTable",
    "KVLayerBuffers",
    "WeightResolver",
    "get_weight_resolver",
    "resolve_weight",
    "set_weight_resolver",
    "use_weights",
]


# --- named weights ---------------------------------------------------------------------------


@runtime_checkable
class WeightResolver(Protocol):
    """The array for a weight name (the runtime implements it; the offload policy places it)."""

    def weight(self, name: str) -> np.ndarray:
        """The weight called ``name``; raise KeyError when there is none."""
        ...


class DictWeights:
    """A `WeightResolver` over a plain mapping of names to arrays."""

    def __init__(self, weights: Mapping[str, np.ndarray]) -> None:
        self._weights = dict(weights)

    def weight(self, name: str) -> np.ndarray:
        return self._weights[name]

    def names(self) -> list[str]:
        return sorted(self._weights)


_resolver: WeightResolver | None = None


def set_weight_resolver(resolver: WeightResolver | None) -> WeightResolver | None:
    """Install the process-wide weight resolver; returns the previous one (None clears it)."""
    global _resolver
    if resolver is not None and not isinstance(resolver, WeightResolver):
        raise OpError(
            f"weight resolver {resolver!r} has no weight(name) method; pass an object with "
            "weight(name) -> numpy array, for example ep.ops.DictWeights({...})"
        )
    previous, _resolver = _resolver, resolver
    return previous


def get_weight_resolver() -> WeightResolver | None:
    return _resolver


@contextmanager
def use_weights(resolver: WeightResolver) -> Iterator[WeightResolver]:
    """Install ``resolver`` for the duration of a ``with`` block, then restore the previous one."""
    previous = set_weight_resolver(resolver)
    try:
        yield resolver
    finally:
        set_weight_resolver(previous)


def resolve_weight(name: str) -> np.ndarray:
    """The array the current resolver gives for ``name``; an OpError that says how to fix it."""
    resolver = _resolver
    if resolver is None:
        raise OpError(
            f"MatMul asks for weight {name!r} but no weight resolver is set; the runtime sets one "
            "with ep.ops.set_weight_resolver(...) before running a graph with named weights"
        )
    try:
        found = resolver.weight(name)
    except KeyError:
        known = getattr(resolver, "names", None)
        hint = f"; it knows {', '.join(known()[:8])}" if callable(known) else ""
        raise OpError(
            f"MatMul asks for weight {name!r}, which the weight resolver {type(resolver).__name__}"
            f" does not have{hint}. Check the node's weight attribute"
        ) from None
    if not isinstance(found, np.ndarray):
        raise OpError(
            f"the weight resolver {type(resolver).__name__} returned a {type(found).__name__} "
            f"for {name!r}; it must return a numpy array"
        )
    return found


# --- KV caches -------------------------------------------------------------------------------


@dataclass(frozen=True)
class KVLayerBuffers:
    """One layer's key and value buffers, as flat element views of the runtime's allocations."""

    key: np.ndarray
    value: np.ndarray


class KVCacheTable:
    """Handles (int64 > 0) for sets of per-layer KV buffers the runtime owns.

    The table holds views, never copies: ops write through them into the runtime's memory. A
    runtime binds its buffers once, rebinds after a growth that moved them, and releases them at
    the end. Lookups are lock-free (a dict read); changes take a lock.
    """

    def __init__(self) -> None:
        self._sets: dict[int, tuple[KVLayerBuffers, ...]] = {}
        self._next = 1
        self._lock = threading.Lock()

    def bind(self, layers: Sequence[tuple[np.ndarray, np.ndarray]]) -> int:
        """Register per-layer ``(key, value)`` buffers; returns the handle to feed the graph."""
        views = _views(layers)
        with self._lock:
            handle = self._next
            self._next += 1
            self._sets[handle] = views
        return handle

    def rebind(self, handle: int, layers: Sequence[tuple[np.ndarray, np.ndarray]]) -> None:
        """Point ``handle`` at new buffers (after a growth that moved them)."""
        views = _views(layers)
        with self._lock:
            self._known(handle)
            self._sets[handle] = views

    def release(self, handle: int) -> None:
        with self._lock:
            self._known(handle)
            del self._sets[handle]

    def layer(self, handle: int, layer: int) -> KVLayerBuffers:
        """The buffers of ``layer`` under ``handle``."""
        layers = self._sets.get(handle)
        if layers is None:
            self._known(handle)
            raise AssertionError  # pragma: no cover - _known raised
        if not 0 <= layer < len(layers):
            raise OpError(
                f"KV cache handle {handle} holds {len(layers)} layer(s); a node asks for layer "
                f"{layer}. Check the node's layer attribute"
            )
        return layers[layer]

    def __len__(self) -> int:
        return len(self._sets)

    def _known(self, handle: int) -> None:
        if handle not in self._sets:
            live = ", ".join(map(str, sorted(self._sets))) or "none"
            raise OpError(
                f"KV cache handle {handle} is not bound (live handles: {live}); bind the "
                "runtime's buffers with ep.ops.KV_CACHES.bind(...) and feed that handle"
            )


def _views(layers: Sequence[tuple[np.ndarray, np.ndarray]]) -> tuple[KVLayerBuffers, ...]:
    out = []
    for i, pair in enumerate(layers):
        if len(pair) != 2:
            raise OpError(f"KV layer {i}: expected a (key, value) pair, got {len(pair)} items")
        key, value = pair
        for kind, buf in (("key", key), ("value", value)):
            if not isinstance(buf, np.ndarray) or not buf.flags.c_contiguous:
                raise OpError(
                    f"KV layer {i} {kind}: expected a C-contiguous numpy array (ops write through "
                    f"a flat view of it), got {type(buf).__name__}"
                    + ("" if not isinstance(buf, np.ndarray) else " that is not contiguous")
                )
            if not buf.flags.writeable:
                raise OpError(f"KV layer {i} {kind}: the buffer is read-only; KVCommit writes it")
        if key.dtype != value.dtype:
            raise OpError(f"KV layer {i}: key is {key.dtype} but value is {value.dtype}")
        out.append(KVLayerBuffers(key.reshape(-1), value.reshape(-1)))
    return tuple(out)


# The process-wide table the KV ops read (one per process, like the registered op set).
KV_CACHES = KVCacheTable()
