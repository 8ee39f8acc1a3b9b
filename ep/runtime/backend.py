"""The `Backend` Protocol the generator drives, and `create_backend` by name.

A backend runs the decoder: a prefill over a batch of prompts, then one step per token. It owns
the session (or executor) and the runtime's `KVCache`; the generator owns sampling, stopping and
timing. Kept small so the native backend can slot in beside ``ort``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from ep.errors import ConfigError
from ep.model import DecoderModel
from ep.runtime.kv import KVCache
from ep.seams import KVLayout

__all__ = ["BACKENDS", "Backend", "create_backend"]

BACKENDS: tuple[str, ...] = ("ort",)


@runtime_checkable
class Backend(Protocol):
    """Runs one decoder over a batch. Logits returned are views the caller may modify in place;
    they stay valid until the next `prefill` or `step` call."""

    name: str

    def prefill(self, prompts: Sequence[np.ndarray], *, reserve: int = 0) -> np.ndarray:
        """Run the prompts (int64 arrays of different lengths); return the last real position's
        logits per row as float32 ``[B, V]``. ``reserve``: KV capacity (tokens) to allocate at
        least; 0 lets the layout choose the bucket for the prompt."""
        ...

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """Feed one token per row (int64 ``[B]``); return the next logits, float32 ``[B, V]``."""
        ...

    @property
    def kv(self) -> KVCache:
        """The runtime-owned KV cache (geometry, buffers, counters)."""
        ...


def create_backend(
    name: str,
    model: DecoderModel,
    layout: KVLayout,
    *,
    device: str = "cpu",
    threads: int = 0,
    session_options_hook: Callable[[Any], None] | None = None,
) -> Backend:
    """The backend called ``name`` for ``model``, its KV cache shaped by ``layout``."""
    if name == "ort":
        from ep.ort.backend import OrtBackend
        from ep.ort.session import SessionConfig

        return OrtBackend(
            model,
            layout,
            session=SessionConfig(device=device, intra_op_threads=threads),
            session_options_hook=session_options_hook,
        )
    raise ConfigError(
        f"unknown backend {name!r}; available: {', '.join(BACKENDS)} (the native backend is not "
        "built yet)"
    )
