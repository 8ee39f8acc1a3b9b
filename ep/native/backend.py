"""`NativeBackend`: this project's executor runs an ep graph from static per-bucket plans.

Prefill left-pads the prompts (padding gets position -1: neither written nor attended) and runs
the (batch, width) plan eagerly; each decode step runs the (batch, 1) plan through the
`CaptureManager` under key ``(batch, capacity bound, "decode")``. A non-ep model is rewritten
into this project's ops first (`ep.rewrite.rewrite_model`, cached under
``default_cache_dir()/native``). CPU runs the kernels' NumPy twins on the CPU device; CUDA the
kernels themselves: one executor.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ep.device import Device, binding_signature, get_device
from ep.errors import GenerationError
from ep.model import DecoderModel, default_cache_dir, load_model
from ep.native.capture import CaptureManager, CaptureMetrics
from ep.native.kv import DeviceKVCache
from ep.native.plan import KVBinding, StepPlan
from ep.native.program import load_program
from ep.native.weights import ResidentWeights, WeightSource
from ep.seams import BindingSignature, CapturePolicy, KVLayout, StepInfo

__all__ = ["NativeBackend", "as_ep_model"]


def as_ep_model(model: DecoderModel, cache_dir: str | Path | None = None) -> DecoderModel:
    """``model`` itself when it is an ep graph, else its rewrite (made once, then cached)."""
    if model.io.runtime_kv:
        return model
    from ep.rewrite import rewrite_model

    digest = hashlib.sha256()
    digest.update(str(model.onnx_path.resolve()).encode())
    digest.update(str(model.onnx_path.stat().st_mtime_ns).encode())
    out = Path(cache_dir or default_cache_dir()) / "native" / digest.hexdigest()[:16]
    if not (out / "genai_config.json").is_file():
        source = model.folder if model.kind == "genai" else model.onnx_path
        rewrite_model(source, out, force=True)
    return load_model(out, context_length=model.context_length)


class NativeBackend:
    """Prefill and decode of an ep graph by the native executor on ``device``."""

    name = "native"

    def __init__(
        self,
        model: DecoderModel,
        layout: KVLayout,
        *,
        device: str | Device = "cpu",
        capture: CapturePolicy | None = None,
        weights: WeightSource | None = None,
        sources: Mapping[str, str] | None = None,
        cache_dir: str | Path | None = None,
    ) -> None:
        model = as_ep_model(model, cache_dir)
        self.model = model
        self.device = get_device(device)
        self.stream = self.device.create_stream(name="native")
        import ep.kernels
        from ep.kernels.matmul import matmul_workspace

        self.device.compile_all()  # every kernel before any capture
        self.program = load_program(model.onnx_path)
        self.weights: WeightSource = weights or ResidentWeights(self.device, self.program.arrays)
        self.status = ep.kernels.new_status(self.device, stream=self.stream)
        self.workspace = matmul_workspace(self.device, stream=self.stream)
        self._inv_freq: dict[tuple[float, int], Any] = {}
        self._kv = DeviceKVCache(
            layout,
            device=self.device,
            stream=self.stream,
            num_layers=model.num_layers,
            kv_heads=model.kv_heads,
            head_dim=model.head_dim,
            dtype=model.kv_numpy_dtype,
            context=model.context_length,
        )
        if capture is None:
            from ep_builtin.capture_never import NeverCapture

            capture = NeverCapture()
        self.capture = CaptureManager(capture, device=self.device, stream=self.stream)
        self.sources = dict(sources or {})
        self._plans: dict[tuple[int, int], StepPlan] = {}
        self._bound: dict[tuple[int, int], tuple[int, list[Any], BindingSignature]] = {}
        self._table: Any = None
        self.lens = np.zeros(0, np.int64)
        self._decoding = False

    # --- Backend --------------------------------------------------------------------------------

    @property
    def kv(self) -> DeviceKVCache:
        if self._decoding:
            self._kv.live_lengths = tuple(int(n) for n in self.lens)
        return self._kv

    @property
    def capture_metrics(self) -> CaptureMetrics:
        return self.capture.metrics

    def _plan(self, batch: int, seq: int) -> StepPlan:
        plan = self._plans.get((batch, seq))
        if plan is None:
            plan = StepPlan(
                self.program,
                device=self.device,
                stream=self.stream,
                weights=self.weights,
                batch=batch,
                seq=seq,
                kv_heads=self.model.kv_heads,
                status=self.status,
                matmul_workspace=self.workspace,
                inv_freq=self._inv_freq,
                split_attention=self.device.kind != "cpu",
                max_context=self.model.context_length,
            )
            self._plans[(batch, seq)] = plan
        return plan

    def _kv_binding(self, batch: int) -> KVBinding:
        kv = self._kv
        g = kv.geometry
        assert g is not None
        roots = kv.roots
        n = kv.num_layers
        table = None
        cols = 0
        if g.strides.page_size:
            cols = -(-kv.context // g.strides.page_size)
            if self._table is None or self._table.shape != (batch, cols):
                self._table = self.device.alloc(
                    (batch, cols), np.int32, stream=self.stream, name="kv.block_table"
                )
            table = self._table
        return KVBinding(
            keys=tuple(roots[:n]),
            values=tuple(roots[n:]),
            strides=g.strides,
            capacity=kv.bound_capacity,
            block_table=table,
            table_cols=cols,
        )

    def _upload_table(self) -> None:
        kv = self._kv
        if kv.block_table is None or self._table is None:
            return
        full = np.full(self._table.shape, -1, np.int32)
        full[:, : kv.block_table.shape[1]] = kv.block_table
        self._table.copy_from_host(full, stream=self.stream)

    def _calls(self, plan: StepPlan) -> tuple[list[Any], BindingSignature]:
        """The plan's calls bound to the cache now (rebound only when the cache changed)."""
        key = (plan.batch, plan.seq)
        found = self._bound.get(key)
        if found is not None and found[0] == self._kv.epoch:
            return found[1], found[2]
        binding = self._kv_binding(plan.batch)
        calls = plan.bind(binding)
        buffers = [plan.arena, plan.input_ids, plan.positions, plan.logits, *binding.keys]
        buffers += list(binding.values)
        if binding.block_table is not None:
            buffers.append(binding.block_table)
        sig = binding_signature(buffers)
        s = binding.strides
        geometry = (s.batch, s.token, s.head, s.dim, s.page, s.page_size, binding.capacity)
        sig = BindingSignature((*sig.bindings, ("kv.geometry", 0, geometry, "int64")))
        self._bound[key] = (self._kv.epoch, calls, sig)
        return calls, sig

    def _check_faults(self) -> None:
        from ep.kernels import check_faults

        check_faults(self.device, self.status, stream=self.stream)

    def prefill(self, prompts: Sequence[np.ndarray], *, reserve: int = 0) -> np.ndarray:
        batch = len(prompts)
        lens = np.array([len(p) for p in prompts], dtype=np.int64)
        if batch == 0 or lens.min() == 0:
            raise GenerationError("prefill needs at least one prompt and no empty prompt")
        width = int(lens.max())
        if width >= self.model.context_length:
            raise GenerationError(
                f"a prompt of {width} tokens leaves no room in the context of "
                f"{self.model.context_length} tokens"
            )
        self._decoding = False
        self._bound.clear()
        self._table = None
        kv = self._kv
        kv.allocate(batch, width + 1, reserve=reserve)
        kv.prepare(np.zeros(batch, np.int64), lens)
        pads = width - lens
        ids = np.full((batch, width), self.model.pad_token_id, dtype=np.int64)
        for i, p in enumerate(prompts):
            ids[i, pads[i] :] = p
        positions = np.arange(width, dtype=np.int64)[None, :] - pads[:, None]
        positions[positions < 0] = -1
        plan = self._plan(batch, width)
        plan.input_ids.copy_from_host(ids, stream=self.stream)
        plan.positions.copy_from_host(positions, stream=self.stream)
        calls, _ = self._calls(plan)  # binds (and allocates) the block table first
        self._upload_table()
        for call in calls:
            call()
        logits = plan.logits.to_host(stream=self.stream)
        self._check_faults()
        self.lens = lens.copy()
        self._decoding = True
        self._growths_seen = kv.growths
        return np.ascontiguousarray(logits[:, -1], dtype=np.float32)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        if not self._decoding:
            raise GenerationError("step() before prefill(): run a prefill first")
        kv = self._kv
        batch = self.lens.size
        epoch = kv.epoch
        if kv.pool is not None or int(self.lens.max()) >= kv.capacity:
            kv.prepare(self.lens, self.lens + 1)
        plan = self._plan(batch, 1)
        calls, sig = self._calls(plan)
        if kv.epoch != epoch:
            self.capture.revalidate(sig, kv.growths, batch)
        plan.input_ids.copy_from_host(
            np.asarray(tokens, dtype=np.int64).reshape(batch, 1), stream=self.stream
        )
        plan.positions.copy_from_host(self.lens.reshape(batch, 1), stream=self.stream)
        self._upload_table()
        weights_stable = bool(getattr(self.weights, "capture_safe", False))
        can, why = True, "every buffer is fixed per (batch, capacity) bucket"
        info = StepInfo(
            phase="decode",
            batch=batch,
            capacity=kv.bound_capacity,
            signature=sig,
            offload_address_stable=weights_stable,
            backend_can_capture=can,
            backend_reason=why,
            sources={
                **self.sources,
                "offload": self.sources.get("offload", "default"),
            },
        )
        self.capture.run(info, calls, growths=kv.growths)
        logits = plan.logits.to_host(stream=self.stream)
        self._check_faults()
        self.lens += 1
        return np.ascontiguousarray(logits[:, 0], dtype=np.float32)
