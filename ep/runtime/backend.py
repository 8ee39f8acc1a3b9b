"""The `Backend` Protocol the generator drives, and `create_backend` by name.

A backend runs the decoder: a prefill over a batch of prompts, then one step per token. It owns
the session (or executor) and the runtime's `KVCache`; the generator owns sampling, stopping and
timing. Kept small so the native backend can slot in beside ``ort``.

``device="cuda"`` with an ``ep`` graph (this project's ops) runs the ops' CUDA kernels inside the
ONNX Runtime session (`ep.ops.cuda`, a host round trip per op): the session itself stays on the
CPU execution provider, because onnxruntime-extensions' Python ops run on the CPU provider only,
and every prefill and step runs under ``ep.ops.use_placement``. Other graphs take ``device`` to
ONNX Runtime (the CUDA execution provider, from onnxruntime-gpu).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np

from ep.errors import ConfigError
from ep.model import DecoderModel
from ep.runtime.kv import KVCache
from ep.seams import KVLayout

if TYPE_CHECKING:
    from ep.ops.placement import OpPlacement

__all__ = ["BACKENDS", "Backend", "OpsOnDevice", "create_backend"]

BACKENDS: tuple[str, ...] = ("ort", "native")


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
    """The backend called ``name`` for ``model``, its KV cache shaped by ``layout``.

    ``device="cuda"`` needs a CUDA device: without one this raises the device layer's
    `ep.errors.DeviceUnavailableError`, which says why in words.
    """
    if name == "ort":
        from ep.ort.backend import OrtBackend
        from ep.ort.session import SessionConfig

        placement = _ops_placement(model, device)
        backend = OrtBackend(
            model,
            layout,
            session=SessionConfig(
                device="cpu" if placement is not None else device, intra_op_threads=threads
            ),
            session_options_hook=session_options_hook,
        )
        return backend if placement is None else OpsOnDevice(backend, placement)
    if name == "native":
        from ep.native import NativeBackend

        return NativeBackend(model, layout, device=device)
    raise ConfigError(f"unknown backend {name!r}; available: {', '.join(BACKENDS)}")


def _ops_placement(model: DecoderModel, device: str) -> OpPlacement | None:
    """Where an ep graph's ops run for ``device`` (None: leave the choice to ONNX Runtime)."""
    if device != "cuda":
        return None
    from ep.device import probe_cuda

    if model.flavour != "ep":
        # ONNX Runtime's CUDA provider runs these graphs; cuda-python is not needed, but a
        # machine without a GPU is told so plainly rather than to install onnxruntime-gpu.
        probe = probe_cuda()
        if probe.absent:
            from ep.errors import DeviceUnavailableError

            raise DeviceUnavailableError(probe.reason)
        return None
    from ep.ops.placement import placement_for

    return placement_for("cuda")  # opens the GPU: no CUDA device is an error here, in words


class OpsOnDevice:
    """A backend whose session runs this project's ops with the kernels of ``placement``.

    The placement is process-wide state (`ep.ops.placement`), so it is installed for each prefill
    and step and restored after: two backends on different devices can take turns. Everything
    else is the wrapped backend's.
    """

    def __init__(self, backend: Backend, placement: OpPlacement) -> None:
        self.backend = backend
        self.placement = placement
        self.name: str = backend.name

    def prefill(self, prompts: Sequence[np.ndarray], *, reserve: int = 0) -> np.ndarray:
        from ep.ops.placement import use_placement

        with use_placement(self.placement):
            return self.backend.prefill(prompts, reserve=reserve)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        from ep.ops.placement import use_placement

        with use_placement(self.placement):
            return self.backend.step(tokens)

    @property
    def kv(self) -> KVCache:
        return self.backend.kv

    def __getattr__(self, name: str) -> Any:
        # Only reached for what this class does not define: the wrapped backend's own API.
        if name == "backend":  # not set yet (a copy being built): never recurse
            raise AttributeError(name)
        return getattr(self.backend, name)
