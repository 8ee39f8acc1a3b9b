"""`NativeBackend`: this project's executor runs an ep graph from static per-bucket plans.

Prefill left-pads the prompts (padding gets position -1: neither written nor attended) and runs
the (batch, width) plan eagerly; each decode step runs the (batch, 1) plan through the
`CaptureManager` under key ``(batch, capacity bound, "decode")``. A non-ep model is rewritten
into this project's ops first (`ep.rewrite.rewrite_model`, cached under
``default_cache_dir()/native``). CPU runs the kernels' NumPy twins on the CPU device; CUDA the
kernels themselves: one executor.

Device token loop (``sync_every`` = k, ``decode.sync_every``; k = 1 too, unless
``device_picks=False``): `NativeBackend.steps` runs k decode steps with no host synchronisation
between them: each step's calls (through the
`CaptureManager`), a masked argmax (`ep.kernels.sample.argmax`, after ``native_mask_ids`` while
EOS/stop ids are masked) or, with sampling parameters, a draw on the device
(`ep.kernels.sample.sample`: `ep.sampling`'s semantics and each row's own random numbers) into
the next input ids, and ``native_advance`` (positions + 1, the id into a [k, batch] history);
then one read of the history. The generator applies stops to the k
tokens and drops those past a stop. The KV cache is made ready (grown, paged) step by step exactly
as `step` does, so each step runs at the capacity, and through the graph, that k = 1 would use.
`steps` is `collect` (wait for a run, read its ids) of `launch_steps` (queue a run): with
``run_ahead`` (``decode.run_ahead``, default on) the generator launches the next run, continuing
from the last one's pick on the device, before it waits for the last one, so the device never
idles while the host reads tokens and checks stops; a stop makes that run surplus (up to k steps
of device time), and the next prefill discards it (``discarded_steps``).

Padding (``buckets``): a capture policy with ``pad_to(batch)`` makes prefill and every decode step
run at that size, the real rows first and padding rows (pad id, position -1: nothing written or
attended, length 0) after; only the real rows' logits and tokens are returned.

Fused decode (``fused=``, ``decode.fused``; default ``off``): with ``on`` (or ``auto``, CUDA only)
a batch-1 decode step of a model `ep.native.fused.match_stack` reads as a Llama/Qwen2-style bf16
decoder is one persistent kernel (`ep.kernels.stack`) on the plan's own buffers and the KV cache
(any contiguous layout, through its strides), captured and replayed like the plan's calls but
never under the plan's signature. Other steps (another batch, a paged layout, a position past
the kernel's attention) run the plan, and ``fused_metrics`` says why. The kernel rounds where the
graph rounds but sums in its own order: its logits are not the plan's bits, so batch rows and
solo runs agree bitwise only with it off (DESIGN.md §6), which is why it is opt-in. In a greedy
device loop, the fused step takes the pick itself (the mask's ids set to -inf, up to
`ep.kernels.stack.PICK_MASK` of them, the argmax into the history, the next id and position):
a loop step is one launch.

Weights: by default every initializer is resident (`ResidentWeights`). With ``offload=`` (an
offload policy), ``budget=`` and ``piece=`` (``offload.piece``: weights larger than this are held
in pieces, one kernel call each), the weights go into an `ep.offload.WeightStore` on this
backend's stream: resident ones are bound once, the others fetched by their kernel's call at every
step; each prefill and decode step is bracketed by ``begin_step`` / ``end_step(tokens=batch)``
and captures and replays are reported to the store (`CaptureManager`). `offload_counters` is
``metrics.offload`` of ``genai-ep run --json``.
"""

from __future__ import annotations

import copy
import functools
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ep.config import MIN_PIECE_BYTES, Budget, parse_budget, parse_piece
from ep.device import Device, PinnedBuffer, binding_signature, get_device
from ep.errors import ConfigError, ContractError, GenerationError, OffloadError
from ep.model import DecoderModel, default_cache_dir, load_model
from ep.native import _kernels as nk
from ep.native.capture import CaptureManager, CaptureMetrics
from ep.native.fused import (
    FUSED_MODES,
    FusedDecode,
    StackMatch,
    fused_kernel_refusal,
    fused_refusal,
    match_stack,
)
from ep.native.kv import DeviceKVCache
from ep.native.plan import KVBinding, StepPlan, replay_enabled, split_specs, weight_reads
from ep.native.program import Program, load_program
from ep.native.weights import OffloadedWeights, ResidentWeights, WeightSource
from ep.offload import (
    DEFAULT_PIECE_BYTES,
    AccessTrace,
    WeightStore,
    split_weights,
    weight_infos,
)
from ep.runtime.kv import prompt_lengths
from ep.sampling import SamplingParams
from ep.seams import BindingSignature, CapturePolicy, KVLayout, OffloadPolicy, StepInfo

# Ops whose initializer inputs stay the executor's own (always resident, never in the store):
# Rotary's cos/sin tables are derived constants read two at a time.
_EXECUTOR_TABLES = frozenset({"Rotary"})

__all__ = ["LoopRun", "NativeBackend", "as_ep_model"]


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
        weights: WeightSource | WeightStore | None = None,
        offload: OffloadPolicy | None = None,
        budget: Budget | int | str | None = None,
        piece: int | str | None = None,
        sources: Mapping[str, str] | None = None,
        cache_dir: str | Path | None = None,
        sync_every: int = 1,
        device_picks: bool = True,
        fused: str = "off",
        run_ahead: bool = True,
    ) -> None:
        if fused not in FUSED_MODES:
            raise ConfigError(
                f"fused={fused!r}; expected one of {', '.join(FUSED_MODES)} (decode.fused: the "
                "batch-1 decode step as one persistent kernel where the model allows it)"
            )
        if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
            raise ConfigError(
                f"sync_every={sync_every!r}; expected an integer >= 1 (decode steps between host "
                "synchronisations; set decode.sync_every)"
            )
        if not isinstance(run_ahead, bool):
            raise ConfigError(
                f"run_ahead={run_ahead!r}; expected True (the generator launches the device "
                "loop's next k steps before it reads the last k) or False (set decode.run_ahead)"
            )
        if not isinstance(device_picks, bool):
            raise ConfigError(
                f"device_picks={device_picks!r}; expected True (pick tokens on the device) or "
                "False (on the host, from each step's logits)"
            )
        model = as_ep_model(model, cache_dir)
        self.model = model
        self.device = get_device(device)
        self.stream = self.device.create_stream(name="native")
        import ep.kernels
        from ep.kernels.matmul import matmul_workspace

        self.device.compile_all()  # every kernel before any capture
        self.program = load_program(model.onnx_path, prepack=self.device.kind != "cpu")
        if offload is not None and weights is not None:
            raise OffloadError(
                "NativeBackend got both weights= and offload=: pass an offload policy (and "
                "budget=) for the backend to build the store, or a weight source, not both"
            )
        tables = ResidentWeights(self.device, self.program.arrays)
        self.weights: WeightSource
        if offload is not None:
            store = offload_store(self.program, offload, budget, device=self.device,
                                  stream=self.stream, piece=piece)  # fmt: skip
            self.weights = OffloadedWeights(store, tables)
        elif isinstance(weights, WeightStore):
            self.weights = OffloadedWeights(weights, tables)
        else:
            self.weights = weights or tables
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
        offloaded = self.weights if isinstance(self.weights, OffloadedWeights) else None
        self.offloaded = offloaded
        self.capture = CaptureManager(
            capture, device=self.device, stream=self.stream, weights=offloaded
        )
        self.sources = dict(sources or {})
        self._plans: dict[tuple[int, int], StepPlan] = {}
        self._bound: dict[tuple[int, int, bool], _Bound] = {}
        self._table: Any = None
        self.lens = np.zeros(0, np.int64)  # per row the step runs at (padding rows: 0)
        self._real = 0  # the caller's rows: the first ones
        self._loop: dict[int, _LoopBuffers] = {}
        self._pinned_logits: dict[tuple[int, ...], PinnedBuffer] = {}
        self._last_logits: dict[tuple[int, ...], Any] = {}  # per shape: a prefill's last rows
        self._prefilled: Any = None  # the last prefill's last rows, until the next step
        self.decode_syncs = 0  # host synchronisations of decode steps (a step, or a collect)
        self.sync_every = sync_every
        # The generator picks tokens through `first_tokens` and `steps` (on the device) at any
        # sync_every; False: through `step`'s logits on the host (the reference's own sampler).
        self.device_picks = device_picks
        self.run_ahead = run_ahead  # the generator keeps one run of steps in flight (below)
        self._runs: list[LoopRun] = []  # launched runs not collected yet
        self._continues = False  # the device holds the last launched run's pick as input
        self._landings: list[_Landing] = []  # pinned places runs land in, reused
        self.discarded_steps = 0  # steps of runs a prefill discarded before they were collected
        self.replay = replay_enabled()  # eager calls issue the launches their first run recorded
        self._decoding = False
        self.fused_mode = fused
        self.fused_steps = 0  # decode steps the fused kernel ran
        self.fused_picks = 0  # of them, device-loop steps whose greedy pick it took too
        self.fused_reason = ""  # why the last step that could not be fused was not
        match = self._fused_model()
        # packed once here (about 4 s and 0.7 GB for the 0.5B model), not inside a step
        self._fused = None if match is None else FusedDecode(
            self.device, self.program, match, self.weights, stream=self.stream,
            status=self.status,
        )  # fmt: skip

    # --- the fused decode step (ep.native.fused) ---------------------------------------------

    def _fused_model(self) -> StackMatch | None:
        """The model as the fused kernel's decoder, or None with ``fused_reason`` saying why not
        (``fused="on"``: a `ConfigError` instead)."""
        if self.fused_mode == "off":
            self.fused_reason = "decode.fused = off"
            return None
        why, match = "", None
        if self.fused_mode == "auto" and self.device.kind == "cpu":
            why = ("the CPU device runs the op-per-launch plan (decode.fused = on runs the fused "
                   "kernel's NumPy twin)")  # fmt: skip
        elif self.offloaded is not None and any(
            p != "resident" for p in self.offloaded.store.layout.placements.values()
        ):
            why = (f"the offload plan ({self.offloaded.reason}) streams weights, and the fused "
                   "kernel keeps every layer's weights on the device")  # fmt: skip
        else:
            try:
                match = match_stack(self.program)
                why = fused_kernel_refusal(self.device, match.shape)
            except ValueError as exc:
                why = f"the model is not the fused kernel's decoder: {exc}"
        if why:
            if self.fused_mode == "on":
                raise ConfigError(f"decode.fused = on, but {why}; set decode.fused = auto or off")
            self.fused_reason = why
            return None
        return match

    def _fused_for(self, batch: int, position: int) -> FusedDecode | None:
        """The fused kernel for a decode step at ``batch`` writing ``position``, or None (the
        plan runs it) with ``fused_reason`` saying why."""
        if self._fused is None:
            return None
        geometry = self._kv.geometry
        why = fused_refusal(batch, geometry.strides if geometry is not None else None)
        positions = self._fused.step.positions
        if not why and position >= positions:
            why = (f"position {position}: the fused kernel's attention holds {positions} "
                   "positions; the plan runs later steps")  # fmt: skip
        if why:
            self.fused_reason = why
            return None
        return self._fused

    @property
    def fused_metrics(self) -> dict[str, Any]:
        """``metrics.fused`` of ``genai-ep run --json``: the mode, whether the model is the fused
        kernel's, the decode steps it ran (``picks``: of them, device-loop steps whose greedy pick
        it took), and why the last other one was not fused."""
        return {
            "mode": self.fused_mode,
            "matched": self._fused is not None,
            "steps": self.fused_steps,
            "picks": self.fused_picks,
            "reason": self.fused_reason,
        }

    # --- Backend --------------------------------------------------------------------------------

    @property
    def kv(self) -> DeviceKVCache:
        if self._decoding:
            self._kv.live_lengths = tuple(int(n) for n in self.lens)
        return self._kv

    @property
    def capture_metrics(self) -> CaptureMetrics:
        return self.capture.metrics

    @property
    def offload_counters(self) -> dict[str, int | float] | None:
        """The store's 11 counters (``metrics.offload``); None when no store is in use."""
        return None if self.offloaded is None else self.offloaded.counters().to_dict()

    def close(self) -> None:
        """Give back the offload store's device and pinned memory (the weights' bytes)."""
        if self.offloaded is not None:
            self.offloaded.close()

    def _begin_step(self) -> None:
        if self.offloaded is not None:
            self.offloaded.begin_step()

    def _end_step(self, tokens: int, fixed: AccessTrace | None) -> None:
        if self.offloaded is not None:
            if fixed is not None:  # reads of the weights bound once, which never call get
                self.offloaded.replayed(fixed)
            self.offloaded.end_step(tokens)

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
        found = self._bind(plan)
        return found.calls, found.signature

    def _bind(self, plan: StepPlan, fused: FusedDecode | None = None) -> _Bound:
        """The plan's calls bound to the cache (bound again only when a buffer or the geometry
        they bind changed: a new prompt in the same buffers keeps them, and their graphs); with
        ``fused``, the fused kernel's one call on the plan's buffers instead."""
        key = (plan.batch, plan.seq, fused is not None)
        found = self._bound.get(key)
        if found is not None and found.epoch == self._kv.epoch:
            return found
        binding = self._kv_binding(plan.batch)
        sig = _binding_signature(plan, binding)
        if fused is not None:  # its graphs are never the plan's
            sig = BindingSignature((*sig.bindings, fused.signature()))
        if found is not None and found.signature == sig:
            found.epoch = self._kv.epoch
            return found
        calls: list[Any] = (
            plan.bind(binding) if fused is None else [fused.call(fused.io(plan, binding))]
        )
        fixed = None
        if self.offloaded is not None:  # fetched weights move between calls: never replayed
            if fused is None:  # (the fused kernel's weights are its own, all resident)
                fixed = self.offloaded.fixed_reads(plan.bound_weights)
            # first and last work of the step, so a capture holds the store's copies too
            start = functools.partial(self.offloaded.start, stream=self.stream)
            finish = functools.partial(self.offloaded.finish, stream=self.stream)
            calls = [start, *calls, finish]
        elif self.replay:
            calls = [_Replayed(call, self.device) for call in calls]
        bound = _Bound(self._kv.epoch, calls, sig, fixed)
        self._bound[key] = bound
        return bound

    def _check_faults(self) -> None:
        from ep.kernels import check_faults

        check_faults(self.device, self.status, stream=self.stream)

    def _rows_for(self, batch: int) -> int:
        """The batch a step runs at: ``batch``, or the capture policy's padded size for it.

        A policy with ``pad_to(batch)`` (``buckets``) pads to its nearest larger captured size;
        only when the weights keep their addresses, since otherwise nothing is captured and the
        padding rows would be pure waste.
        """
        pad_to = getattr(self.capture.policy, "pad_to", None)
        if pad_to is None or not getattr(self.weights, "capture_safe", False):
            return batch
        rows = pad_to(batch)
        if isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or rows < batch:
            raise ContractError(
                f"capture policy {self.capture.metrics.policy!r} pad_to({batch}) returned "
                f"{rows!r}; expected an integer >= {batch}"
            )
        return int(rows)

    def prefill(self, prompts: Sequence[np.ndarray], *, reserve: int = 0) -> np.ndarray:
        """Logits [batch, vocab] of each prompt's last token (the cache holds the prompts).

        A batch the capture policy pads (``buckets``) runs with padding rows after the real ones
        from here on: every position -1 (nothing written, nothing attended), length 0.
        """
        batch = len(prompts)
        lens, width = prompt_lengths(prompts, self.model.context_length)
        self._discard_runs()
        rows = self._rows_for(batch)
        self._decoding = False
        self._prefilled = None
        self._table = None
        kv = self._kv
        padded = np.zeros(rows, np.int64)
        padded[:batch] = lens
        kv.allocate(rows, width + 1, reserve=reserve)
        kv.prepare(np.zeros(rows, np.int64), padded)
        pads = width - padded
        ids = np.full((rows, width), self.model.pad_token_id, dtype=np.int64)
        for i, p in enumerate(prompts):
            ids[i, pads[i] :] = p
        positions = np.arange(width, dtype=np.int64)[None, :] - pads[:, None]
        positions[positions < 0] = -1
        plan = self._plan(rows, width)
        plan.input_ids.copy_from_host(ids, stream=self.stream)
        plan.positions.copy_from_host(positions, stream=self.stream)
        bound = self._bind(plan)  # binds (and allocates) the block table first
        self._upload_table()
        self._begin_step()
        for call in bound.calls:
            call()
        self._end_step(batch, bound.fixed)  # the real rows' tokens
        last = self._last_rows(plan.logits)
        logits = self._logits_to_host(last)
        self._check_faults()
        self.lens = padded
        self._real = batch
        self._decoding = True
        self._prefilled = last
        self._growths_seen = kv.growths
        return np.array(logits[:batch], dtype=np.float32)  # a copy: the buffer is reused

    def _last_rows(self, logits: Any) -> Any:
        """A prefill's logits [rows, width, vocab] at each row's last position, [rows, vocab] on
        the device (one strided copy): only those go to the host, and `first_tokens` reads them."""
        rows, width, vocab = logits.shape
        last = self._last_logits.get((rows, vocab))
        if last is None:
            last = self.device.alloc((rows, vocab), logits.dtype, stream=self.stream,
                                     name=f"logits.last:{rows}x{vocab}")  # fmt: skip
            self._last_logits[(rows, vocab)] = last
        row = vocab * logits.dtype.itemsize
        self.device.copy_2d(last, logits, width=row, height=rows, dst_pitch=row,
                            src_pitch=width * row, src_offset=(width - 1) * row,
                            stream=self.stream)  # fmt: skip
        return last

    def first_tokens(
        self, *, mask: Sequence[int] | np.ndarray = (), sampling: SamplingParams | None = None
    ) -> np.ndarray:
        """Each row's first new token, picked on the device from the last prefill's logits as
        `steps` picks the later ones: the ids in ``mask`` set to -inf, then the argmax, or with
        ``sampling`` row b's draw number 0 of ``default_rng([sampling.seed, b])`` (so `steps`
        continues with ``draws=1``). Int64 [batch], after one synchronisation; once a prefill,
        before the first step (the mask is written into the logits)."""
        if self._prefilled is None:
            raise GenerationError(
                "first_tokens() reads the last prefill's logits: call it once after prefill() "
                "and before step() or steps()"
            )
        if sampling is not None and (refusal := self.sampling_refusal(sampling)):
            raise GenerationError(f"first_tokens(sampling=...) with {refusal}")
        self._continues = False
        drawn = None if sampling is None or sampling.greedy else sampling
        masked = self._checked_mask(mask, self.model.vocab_size)
        logits, self._prefilled = self._prefilled, None
        loop = self._loop_for(1, masked, drawn, 0)
        self._pick(loop, logits, masked.size, drawn)
        ids = loop.sampled.to_host(stream=self.stream)
        self._check_faults()
        return np.asarray(ids).reshape(-1)[: self._real].astype(np.int64, copy=True)

    def _decode_once(
        self, plan: StepPlan, ahead: int, pick: bool = False, mask: np.ndarray | None = None
    ) -> bool:
        """One decode step of ``plan`` (its ids and positions already on the device), the
        cache made ready for the token at ``lens + ahead`` of every real row first. With
        ``pick`` (a greedy device loop's step; ``mask``: ids it may not pick, at most
        `ep.kernels.stack.PICK_MASK`), a fused step also takes the pick: the argmax as the next
        input id and into the fused kernel's ``tokens``, the position moved on; True when it
        did (else the caller picks)."""
        kv = self._kv
        rows = plan.batch
        epoch = kv.epoch
        lens = self.lens + ahead
        lens[self._real :] = 0  # padding rows write nothing
        if kv.pool is not None or int(lens.max()) >= kv.capacity:
            stops = lens + 1
            stops[self._real :] = 0
            kv.prepare(lens, stops)
        fused = self._fused_for(rows, int(lens.max()))
        if fused is not None:
            fused.set_picking(pick, () if mask is None else mask)
            self.fused_steps += 1
            self.fused_picks += pick
        bound = self._bind(plan, fused)
        if kv.epoch != epoch:
            self.capture.revalidate(bound.signature, kv.growths, rows)
        self._upload_table()
        weights_stable = bool(getattr(self.weights, "capture_safe", False))
        can, why = True, "every buffer is fixed per (batch, capacity) bucket"
        info = StepInfo(
            phase="decode",
            batch=rows,
            capacity=kv.bound_capacity,
            signature=bound.signature,
            offload_address_stable=weights_stable,
            backend_can_capture=can,
            backend_reason=why,
            sources={
                **self.sources,
                "offload": self.sources.get("offload", "default"),
            },
        )
        self._begin_step()
        self.capture.run(info, bound.calls, growths=kv.growths)
        self._end_step(self._real, bound.fixed)  # the real rows' tokens
        return fused is not None and pick

    def _logits_to_host(self, logits: Any) -> np.ndarray:
        """``logits`` on the host, through a pinned buffer kept per shape: a copy from pageable
        memory runs at a fraction of the bus speed (batch 16 x 151936 fp32 logits are 9.7 MB a
        step). The result is the caller's (the pinned buffer is reused)."""
        pinned = self._pinned_logits.get(logits.shape)
        if pinned is None:
            pinned = self.device.alloc_pinned(
                logits.shape, logits.dtype, stream=self.stream, name=f"logits:{logits.shape}"
            )
            self._pinned_logits[logits.shape] = pinned
        self.device.copy(pinned, logits, stream=self.stream)
        self.stream.sync()
        return pinned.array

    def _upload_step(self, plan: StepPlan, tokens: np.ndarray) -> None:
        """The step's input ids (padding rows: the pad id) and positions (padding rows: -1)."""
        batch = self._real
        ids = np.full((plan.batch, 1), self.model.pad_token_id, dtype=np.int64)
        given = np.asarray(tokens)
        if given.size != batch:
            raise GenerationError(
                f"step got {given.size} tokens for a batch of {batch}; pass one id per row"
            )
        ids[:batch, 0] = given.reshape(-1)
        positions = self.lens.reshape(plan.batch, 1).copy()
        positions[batch:] = -1
        plan.input_ids.copy_from_host(ids, stream=self.stream)
        plan.positions.copy_from_host(positions, stream=self.stream)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        if not self._decoding:
            raise GenerationError("step() before prefill(): run a prefill first")
        self._refuse_runs("step()")
        self._continues = False
        plan = self._plan(self.lens.size, 1)
        self._upload_step(plan, tokens)
        self._prefilled = None
        self._decode_once(plan, 0)
        logits = self._logits_to_host(plan.logits)
        self._check_faults()
        self.decode_syncs += 1
        self.lens[: self._real] += 1
        return np.array(logits[: self._real, 0], dtype=np.float32)  # a copy: reused buffer

    def steps(
        self,
        tokens: np.ndarray,
        count: int,
        *,
        mask: Sequence[int] | np.ndarray = (),
        mask_steps: int = 0,
        sampling: SamplingParams | None = None,
        draws: int = 0,
    ) -> np.ndarray:
        """``count`` decode steps on the device with one host synchronisation.

        Step j feeds the previous token (``tokens`` for j = 0), picks the next from its logits
        with the ids in ``mask`` set to -inf while ``j < mask_steps`` (EOS/stop ids before
        ``min_new_tokens``), and writes it as the next input id; live positions move one forward
        on the device. The pick is the argmax (lowest index on ties, as ``np.argmax``) unless
        ``sampling`` samples: then row b draws its ``draws + j``-th uniform from
        ``default_rng([sampling.seed, b])``, the generator `ep.sampling.make_rngs` gives it, so
        the tokens are those of `ep.sampling.sample` one step at a time (temperature, top-k,
        top-p and min-p; not the repetition penalty, which needs the history on the host).
        Returns the ids [count, batch] (int64), read back once at the end. Stops are the
        caller's business: every row runs all ``count`` steps. ``collect(launch_steps(...))``.
        """
        return self.collect(self.launch_steps(tokens, count, mask=mask, mask_steps=mask_steps,
                                              sampling=sampling, draws=draws))  # fmt: skip

    def launch_steps(
        self,
        tokens: np.ndarray | None,
        count: int,
        *,
        mask: Sequence[int] | np.ndarray = (),
        mask_steps: int = 0,
        sampling: SamplingParams | None = None,
        draws: int = 0,
    ) -> LoopRun:
        """`steps`' ``count`` steps queued on the device, not waited for: `collect` the run for
        its tokens. ``tokens`` None continues from the last launched run's last pick, which is
        on the device already: so the next run goes in before the host reads this one, and the
        device never waits for the host (``run_ahead``; the generator drops what a stop makes
        surplus). The cache's lengths move on at launch."""
        from ep.kernels.stack import PICK_MASK

        if not self._decoding:
            raise GenerationError("steps() before prefill(): run a prefill first")
        if isinstance(count, bool) or not isinstance(count, (int, np.integer)) or count < 1:
            raise GenerationError(f"steps(count={count!r}); expected an integer >= 1")
        count = int(count)
        if tokens is None and not self._continues:
            raise GenerationError(
                "launch_steps(None, ...) continues from the last launched run's last pick, and "
                "no run was launched since the last prefill(), step() or first_tokens(): pass "
                "the last tokens"
            )
        room = self.model.context_length - int(self.lens[: self._real].max())
        if count > room:
            raise GenerationError(
                f"steps(count={count}) would write past the context of "
                f"{self.model.context_length} tokens ({room} left); run at most {room} steps"
            )
        masked = self._checked_mask(mask, self.model.vocab_size)
        if sampling is not None and (refusal := self.sampling_refusal(sampling)):
            raise GenerationError(
                f"steps(sampling=...) with {refusal}; pick on the host from step()'s logits "
                "(the generator does so by itself)"
            )
        drawn = None if sampling is None or sampling.greedy else sampling
        if drawn is not None:
            _check_draws(draws)
        rows = self.lens.size
        plan = self._plan(rows, 1)
        loop = self._loop_for(count, masked, drawn, draws)
        self._prefilled = None
        if tokens is not None:
            self._upload_step(plan, tokens)
        picked: list[int] = []  # the steps the fused kernel picked, a run at a time
        for j in range(count):
            masking = masked.size if j < mask_steps else 0
            pick = drawn is None and masking <= PICK_MASK
            if self._decode_once(plan, j, pick, masked[:masking]):
                picked.append(j)
                continue
            self._picked_to_history(picked, loop)
            self._pick(loop, plan.logits, masking, drawn)
            nk.advance(self.device, plan.input_ids, plan.positions, loop.history, loop.sampled,
                       batch=rows, slot=j, stream=self.stream)  # fmt: skip
        self._picked_to_history(picked, loop)
        landing = self._landing_for(count * rows)
        item = np.dtype(np.int64).itemsize
        self.device.copy(landing.history, loop.history, nbytes=count * rows * item,
                         stream=self.stream)  # fmt: skip
        self.device.copy(landing.status, self.status, stream=self.stream)
        self.stream.record(landing.done)
        self.lens[: self._real] += count
        run = LoopRun(count=count, rows=rows, real=self._real, landing=landing)
        self._runs.append(run)
        self._continues = True
        return run

    def collect(self, run: LoopRun) -> np.ndarray:
        """The ids [count, batch] (int64) of a launched run, after waiting for it (and only it:
        a run launched after it keeps the device busy meanwhile)."""
        if run not in self._runs:
            raise GenerationError(
                "collect(run): this run was collected already, or a prefill() since its launch "
                "discarded it; collect each launched run once, before the next prefill"
            )
        landing = run.landing
        landing.done.sync()
        self._runs.remove(run)  # its landing is free again
        self.decode_syncs += 1
        if int(landing.status.array.reshape(-1)[0]):  # a kernel flagged bad data: say what
            self._discard_runs()
            self._check_faults()
        n = run.count * run.rows
        out = landing.history.array.reshape(-1)[:n].reshape(run.count, run.rows)
        return out[:, : run.real].astype(np.int64, copy=True)

    def _landing_for(self, size: int) -> _Landing:
        """A pinned place for a run's ``size`` ids and the status word that no run in flight
        holds (made or reused)."""
        held = [run.landing for run in self._runs]
        for landing in self._landings:
            if landing.history.size >= size and landing not in held:  # (by identity)
                return landing
        dev, st = self.device, self.stream
        n = len(self._landings)
        landing = _Landing(
            history=dev.alloc_pinned(size, np.int64, stream=st, name=f"loop.landing{n}"),
            status=dev.alloc_pinned(1, np.uint32, stream=st, name=f"loop.status{n}"),
            done=dev.create_event(),
        )
        self._landings.append(landing)
        return landing

    def _discard_runs(self) -> None:
        """Forget the runs not collected (a prefill starts over); their work finishes first."""
        if self._runs:
            self.stream.sync()
            self.discarded_steps += sum(run.count for run in self._runs)
            self._runs.clear()
        self._continues = False

    def _refuse_runs(self, what: str) -> None:
        if self._runs:
            raise GenerationError(
                f"{what} while {len(self._runs)} run(s) of launch_steps() are in flight: collect "
                "them first (their tokens come before this one's), or prefill anew"
            )

    def _picked_to_history(self, picked: list[int], loop: _LoopBuffers) -> None:
        """The tokens of a run of steps the fused kernel picked (``picked``, emptied), from its
        ``tokens`` (by position) into the loop's history (by step): one copy on the device."""
        if not picked or self._fused is None:
            return
        first = int(self.lens[0]) + picked[0] + 1  # the position of the first one's token
        item = np.dtype(np.int64).itemsize
        self.device.copy(loop.history, self._fused.tokens, stream=self.stream,
                         nbytes=len(picked) * item, dst_offset=picked[0] * item,
                         src_offset=first * item)  # fmt: skip
        picked.clear()

    def _pick(
        self, loop: _LoopBuffers, logits: Any, masked: int, sampling: SamplingParams | None
    ) -> None:
        """Each row's next id into ``loop.sampled`` from ``logits`` [rows, vocab] on the device:
        the first ``masked`` ids of ``loop.mask`` set to -inf, then the argmax, or a draw with
        ``sampling`` (each row's key and draw count in ``loop``, the count then advanced)."""
        from ep.kernels import sample

        rows, vocab = self.lens.size, self.model.vocab_size
        if masked:
            nk.mask_ids(self.device, logits, loop.mask, batch=rows, count=masked, vocab=vocab,
                        stream=self.stream)  # fmt: skip
        if sampling is None:
            sample.argmax(self.device, loop.sampled, logits, batch=rows, vocab=vocab,
                          scratch=loop.scratch, stream=self.stream)  # fmt: skip
            return
        sample.sample(self.device, loop.sampled, logits, loop.keys, loop.draws, batch=rows,
                      vocab=vocab, temperature=sampling.temperature, top_k=sampling.top_k,
                      top_p=sampling.top_p, min_p=sampling.min_p, advance_steps=True,
                      scratch=loop.sample_scratch, status=self.status,
                      stream=self.stream)  # fmt: skip

    @staticmethod
    def _checked_mask(mask: Sequence[int] | np.ndarray, vocab: int) -> np.ndarray:
        masked = np.asarray(mask, dtype=np.int64).reshape(-1)
        if masked.size and (masked.min() < 0 or masked.max() >= vocab):
            raise GenerationError(
                f"mask holds id {int(masked[(masked < 0) | (masked >= vocab)][0])}, outside the "
                f"vocabulary [0, {vocab})"
            )
        return masked

    def _loop_for(
        self, count: int, masked: np.ndarray, drawn: SamplingParams | None, draws: int
    ) -> _LoopBuffers:
        """The loop buffers for ``count`` steps, holding the ``masked`` ids and, for a draw,
        row b's generator key (seed, b) and the uniforms it drew so far."""
        rows = self.lens.size
        loop = self._loop_buffers(rows, count, masked.size)
        if masked.size:
            loop.mask.copy_from_host(masked, stream=self.stream)
        if drawn is not None:
            keys = np.stack([np.full(rows, drawn.seed), np.arange(rows)], axis=1)
            loop.keys.copy_from_host(keys.astype(np.int64), stream=self.stream)
            loop.draws.copy_from_host(np.full(rows, draws, np.int64), stream=self.stream)
        return loop

    def sampling_refusal(self, sampling: SamplingParams) -> str:
        """Why `steps` cannot pick tokens with ``sampling`` on the device ("" when it can): the
        repetition penalty needs each row's history on the host, a draw needs a seed the
        device's int64 generator keys hold, and a vocabulary the sampling kernel's integer
        weights hold. The generator asks before it uses the device loop."""
        from ep.kernels.sample import MAX_SAMPLE_VOCAB

        if sampling.uses_history:
            return (
                f"repetition_penalty={sampling.repetition_penalty}: the penalty needs each row's "
                "token history, which the host keeps (no repetition penalty on the device)"
            )
        if sampling.greedy:
            return ""
        if sampling.seed is None or sampling.seed >= 2**63:
            return (
                f"seed={sampling.seed!r}; the device's generators need a seed below 2**63 (their "
                "keys are int64; the generator draws one when none is given)"
            )
        if self.model.vocab_size > MAX_SAMPLE_VOCAB:
            return (
                f"a vocabulary of {self.model.vocab_size} ids; the sampling kernel draws from at "
                f"most {MAX_SAMPLE_VOCAB}"
            )
        return ""

    def _loop_buffers(self, rows: int, count: int, masked: int) -> _LoopBuffers:
        """The device loop's sampled ids, token history, mask ids and the sampling kernels'
        scratch (grown, never shrunk)."""
        from ep.kernels.sample import argmax_scratch, sample_scratch

        have = self._loop.get(rows)
        if have is None or have.steps < count or have.masked < masked:
            steps = max(count, have.steps if have else 0)
            width = max(masked, have.masked if have else 0, 1)
            dev, st = self.device, self.stream
            have = _LoopBuffers(
                steps=steps,
                masked=width,
                sampled=dev.alloc(rows, np.int64, stream=st, name=f"loop.sampled:b{rows}"),
                history=dev.alloc((steps, rows), np.int64, stream=st, name=f"loop.hist:b{rows}"),
                mask=dev.alloc(width, np.int64, stream=st, name=f"loop.mask:b{rows}"),
                scratch=have.scratch if have else argmax_scratch(dev, rows, stream=st),
                sample_scratch=(
                    have.sample_scratch if have else sample_scratch(dev, rows, stream=st)
                ),
                keys=dev.alloc((rows, 2), np.int64, stream=st, name=f"loop.keys:b{rows}"),
                draws=dev.alloc(rows, np.int64, stream=st, name=f"loop.draws:b{rows}"),
            )
            self._loop[rows] = have
        return have


@dataclass(frozen=True, eq=False)
class _Landing:
    """Pinned host memory a run of loop steps lands in: its ids and the status word, then
    ``done`` (recorded after the copies); held by the run until it is collected or discarded."""

    history: PinnedBuffer
    status: PinnedBuffer
    done: Any  # Event


@dataclass(eq=False)
class LoopRun:
    """A run of device-loop steps `NativeBackend.launch_steps` queued: `NativeBackend.collect`
    gives its ids, once, before the next prefill."""

    count: int
    rows: int
    real: int
    landing: _Landing


@dataclass(frozen=True)
class _LoopBuffers:
    """Device buffers of the token loop at one batch: room for ``steps`` steps, ``masked`` ids."""

    steps: int
    masked: int
    sampled: Any
    history: Any
    mask: Any
    scratch: Any  # `ep.kernels.sample.argmax_scratch`
    sample_scratch: Any  # `ep.kernels.sample.sample_scratch`
    keys: Any  # int64 [batch, 2]: each row's generator entropy (seed, row) when sampling
    draws: Any  # int64 [batch]: the uniforms each row drew so far (the kernel counts on)


def _check_draws(draws: int) -> None:
    if isinstance(draws, bool) or not isinstance(draws, (int, np.integer)) or draws < 0:
        raise GenerationError(f"steps(draws={draws!r}); expected an integer >= 0")


def _binding_signature(plan: StepPlan, binding: KVBinding) -> BindingSignature:
    """What ``plan``'s calls bound to ``binding`` bake in: every buffer, the cache geometry."""
    buffers = [plan.arena, plan.input_ids, plan.positions, plan.logits, *binding.keys]
    buffers += list(binding.values)
    if binding.block_table is not None:
        buffers.append(binding.block_table)
    sig = binding_signature(buffers)
    s = binding.strides
    geometry = (s.batch, s.token, s.head, s.dim, s.page, s.page_size, binding.capacity)
    return BindingSignature((*sig.bindings, ("kv.geometry", 0, geometry, "int64")))


class _Replayed:
    """A bound call whose first run records its kernel launches: later runs issue them again as
    they were, without the op's host work (checks, planning, argument conversion: tens of µs a
    launch, most of an eager step's and a prefill's host time). A call stays bound only while
    its signature holds (`_binding_signature`: what it bakes in), as its graph does. One that
    did anything else on the device (a copy, a fill, an allocation, a synchronisation) runs as
    itself every time."""

    __slots__ = ("call", "device", "record")

    def __init__(self, call: Any, device: Any) -> None:
        self.call = call
        self.device = device
        self.record: Any = None  # a LaunchRecord once recorded, False when not replayable

    def __call__(self) -> None:
        record = self.record
        if record:
            record.replay()
        elif record is False:
            self.call()
        else:
            with self.device.record_launches() as record:
                self.call()
            self.record = record if record.replayable else False


class _Bound:
    """A plan's calls bound at one cache epoch, their signature, and the weights bound once."""

    __slots__ = ("calls", "epoch", "fixed", "signature")

    def __init__(
        self, epoch: int, calls: list[Any], signature: BindingSignature, fixed: AccessTrace | None
    ) -> None:
        self.epoch = epoch
        self.calls = calls
        self.signature = signature
        self.fixed = fixed


def offload_store(
    program: Program,
    policy: OffloadPolicy,
    budget: Budget | int | str | None,
    *,
    device: Device,
    stream: Any,
    piece: int | str | None = None,
) -> WeightStore:
    """The `WeightStore` of ``program``'s weights under ``policy`` and ``budget`` (default 100%).

    The weights are the initializers the kernels read (`weight_reads`), less the executor's own
    tables, in the order one step reads them. A weight larger than ``piece`` bytes (default
    `ep.offload.DEFAULT_PIECE_BYTES`; ``offload.piece``) that `split_specs` allows is held in
    pieces along its output axis, in that order piece by piece. The store gets one staging slot
    more than the most weights (or pieces) one kernel reads at once (at least 2), and a policy
    that reserves slots of its own (``slots``, e.g. scan_resistant) must reserve at least as
    many; one whose ``slots`` is None (reserve what the store uses) plans, as a copy, with the
    store's count.
    """
    reads = weight_reads(program)
    tables = {n for r in reads if r.op in _EXECUTOR_TABLES for n in r.weights}
    piece_bytes = _piece_bytes(piece)
    whole: dict[str, np.ndarray] = {}
    for read in reads:
        for name in read.weights:
            if name not in tables and name not in whole:
                whole[name] = np.ascontiguousarray(program.arrays[name])
    arrays, splits = split_weights(whole, split_specs(program, frozenset(tables)), piece_bytes)
    order: list[str] = []
    ops: dict[str, str] = {}
    together = 1
    for read in reads:
        names = [n for n in read.weights if n not in tables]
        together = max(together, len(names))
        count = max((len(splits[n].pieces) for n in names if n in splits), default=1)
        for i in range(count):  # piece i of every split weight of the node, as its call reads
            for name in names:
                stored = splits[name].pieces[i].name if name in splits else name
                if stored not in ops:
                    ops[stored] = read.op
                    order.append(stored)
    slots = together + 1
    reserved = getattr(policy, "slots", False)  # False: the policy has no slots of its own
    if reserved is None:  # the policy reserves whatever the store uses: tell a copy of it
        policy = copy.copy(policy)
        policy.slots = slots  # type: ignore[attr-defined]  # the attribute exists: it is None
    elif isinstance(reserved, int) and not isinstance(reserved, bool):
        if reserved < slots:
            name = getattr(policy, "name", type(policy).__name__)
            raise OffloadError(
                f"offload policy {name!r} reserves {reserved} staging slots, but this model has "
                f"kernels that read {together} streamed weights at once, which needs {slots}; "
                f"set --set offload.{name}.slots={slots}"
            )
        slots = reserved
    if budget is None:
        budget = "100%"
    if isinstance(budget, str):
        budget = parse_budget(budget)
    infos = weight_infos(arrays, order, ops=ops)
    return WeightStore(
        device, arrays, infos, policy, budget, stream=stream, slots=slots, splits=splits
    )


def _piece_bytes(piece: int | str | None) -> int:
    if piece is None:
        return DEFAULT_PIECE_BYTES
    if isinstance(piece, str):
        return parse_piece(piece)
    if isinstance(piece, bool) or not isinstance(piece, int) or piece < MIN_PIECE_BYTES:
        raise ConfigError(
            f"piece={piece!r}: the piece size must be a byte count of at least "
            f"{MIN_PIECE_BYTES} (offload.piece, e.g. '32MiB' or 33554432)"
        )
    return piece
