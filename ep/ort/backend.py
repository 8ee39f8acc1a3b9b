"""The ``ort`` backend: an ONNX Runtime session stepped through IOBinding.

The KV cache belongs to the runtime (`ep.runtime.kv.KVCache`, shaped by the KV layout). How it is
bound depends on the graph (measured on onnxruntime 1.32, see tests/ort/test_gqa_semantics.py):

* **shared** (GroupQueryAttention graphs): past and present are bound to the *same* buffer of the
  full capacity ``[B, Hkv, C, D]``. GQA then runs as a "static cache": it writes each row's new
  K/V at that row's position ``seqlens_k = sum(attention_mask) - 1`` (a prefill writes only each
  row's real tokens) and reads only positions up to it, and requires ``total_sequence_length``
  (the mask width) to be at most the capacity. GQA
  derives positions (rotary) and lengths from the mask *sum*, so it cannot skip left padding: a
  batch is **right-padded** (each row's tokens first, then pad). The prefill mask is ``[B, S]``;
  decode uses one fixed ``[B, C]`` mask buffer where each step sets one more 1 per row.
* **concat** (standard graphs): present = concat(past, new). Prompts are left-padded (the mask
  hides the pads, ``position_ids`` count real tokens). Past and present are bound to two staging
  buffers that swap roles every step (present of step t is past of step t+1: no copy), and each
  step's new tokens are committed into the layout's buffer, which stays the authoritative cache.

Per step nothing large is allocated: token, mask, position and logits buffers are bound once and
rewritten in place; only a growth (rare) rebinds.

* **runtime KV** (``ep`` graphs, `_RuntimeKVSteps`): the graph has no past/present. Its KVCommit /
  KVAttention ops reach the layout's buffers through a `ep.ops.KV_CACHES` handle (input
  ``kv_cache``) and read the layout's strides and capacity from ``kv_geometry``, so every layout
  works. ``positions`` gives each token's cache slot; padding is negative, so a batch is
  **left-padded** and each row's tokens still occupy slots 0..n-1. Growth goes through the layout,
  then the handle is rebound and the geometry rewritten. For a **paged** layout the session is
  built from the graph with its KV ops swapped for KVCommitPaged / KVAttentionPaged
  (`paged_graph`), which read the pool's block table from one more input, `PAGED_TABLE_INPUT`;
  the model file stays layout-neutral. Named-weight MatMuls resolve through a resolver over the
  model's initializers, installed for the duration of each run.

Which KV layouts run on which graphs (the policy, and why):

* ``ep`` graphs: every layout, natively (the ops read the layout's strides and block table).
* ``contrib`` (GroupQueryAttention) graphs: dense ``head_major`` only. GQA reads and writes its
  past/present itself, head-major; honouring another layout "at the boundary" would mean keeping
  the head-major cache GQA actually uses plus a second copy in the chosen layout that nothing
  reads — twice the memory and a transposing copy per step, while the layout's strides and
  growth would never be exercised. Any other layout is refused with the command that turns the
  model into an ep graph (`ep_graph_hint`: ``genai-ep rewrite MODEL -o OUT``, or the ep flavour
  for a checkpoint or spec), which runs that layout for real.
* ``standard`` (concatenating) graphs: any contiguous layout, converted at the boundary: such a
  graph needs head-major staging tensors anyway (present is a new tensor every step), so each
  step commits its one new token into the layout's buffer, which stays the authoritative cache.
  Paged layouts are refused with the same hint (the commit writes through a strided view).

Every graph with this project's ops gets them registered into its session options, and after each
run an op's stored error is raised (`ep.ops.raise_op_errors`): otherwise a failing op's outputs are
zeros and the run "succeeds" with logits that are finite, plausible and wrong.
"""

from __future__ import annotations

import contextlib
import re
import shlex
import tempfile
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ep.errors import ConfigError, GenerationError, ModelError, OpError
from ep.model import DecoderModel
from ep.ops.runtime import (
    KV_CACHES,
    DictWeights,
    WeightResolver,
    get_weight_resolver,
    set_weight_resolver,
)
from ep.ort.session import SessionConfig, SessionOptionsHook, create_session
from ep.runtime.kv import KVCache, prompt_lengths
from ep.seams import KVGeometry, KVLayout

__all__ = [
    "PAGED_TABLE_INPUT",
    "OrtBackend",
    "ep_graph_hint",
    "gqa_can_bind",
    "is_dense_head_major",
    "layout_page_size",
    "load_named_weights",
    "paged_graph",
]


class OrtBackend:
    """Prefill and decode steps of ``model`` in an ONNX Runtime session (CPU, or CUDA EP)."""

    name = "ort"

    def __init__(
        self,
        model: DecoderModel,
        layout: KVLayout,
        *,
        session: SessionConfig | None = None,
        session_options_hook: SessionOptionsHook | None = None,
        weights: WeightResolver | None = None,
    ) -> None:
        """``weights``: the resolver for named-weight MatMuls of an ep graph (default: the
        model's own initializers, loaded from its folder)."""
        if model.kv_dtype == "bfloat16":
            raise ConfigError(
                f"{model.onnx_path}: the ort backend binds NumPy KV buffers, and NumPy has no "
                "bfloat16 ONNX Runtime accepts; use an fp32/fp16 model or the native backend"
            )
        self.model = model
        self.page_size = layout_page_size(layout, model)
        if model.flavour == "ep":
            session_options_hook = _with_ops(session_options_hook)
        if model.io.runtime_kv and self.page_size:
            self.session = _paged_session(model, session, session_options_hook)
        else:
            self.session = create_session(
                model.onnx_path, session, session_options_hook=session_options_hook
            )
        self._kv = KVCache(
            layout,
            num_layers=model.num_layers,
            kv_heads=model.kv_heads,
            head_dim=model.head_dim,
            dtype=model.kv_numpy_dtype,
            context=model.context_length,
        )
        io = model.io
        self._ids_dtype = np.dtype(io.input_ids_dtype)
        self._mask_dtype = np.dtype(io.attention_mask_dtype)
        self._pos_dtype = np.dtype(io.position_ids_dtype)
        self._logits_dtype = np.dtype(io.logits_dtype)
        self._kv_names = [
            (io.past_keys[i], io.present_keys[i], io.past_values[i], io.present_values[i])
            for i in range(len(io.past_keys))  # none for a runtime-KV graph
        ]
        self._run = self._runner()
        self.weights: WeightResolver | None = None
        if model.flavour == "ep":
            self.weights = weights if weights is not None else load_named_weights(model.onnx_path)
            self._run = _with_op_state(self._run, self.weights)
        self._ep = _RuntimeKVSteps(self) if model.io.runtime_kv else None
        # Per-generation state, set by prefill.
        self._capacity = 0  # the cache's, mirrored: read every step
        self._batch = 0
        self._binding: Any = None
        self._rows = np.arange(0)
        self._lens = np.zeros(0, dtype=np.int64)
        self._total = 0
        self._tok = np.zeros((0, 1), dtype=self._ids_dtype)
        self._pos = np.zeros((0, 1), dtype=self._pos_dtype)
        self._logits = np.zeros((0, 1, model.vocab_size), dtype=self._logits_dtype)
        self._logits32 = np.zeros((0, model.vocab_size), dtype=np.float32)
        self._convert_logits = False
        self._mask = np.zeros((0, 0), dtype=self._mask_dtype)
        # concat graphs only
        self._stages: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
        self._views: list[tuple[np.ndarray, np.ndarray]] = []
        self._pads = np.zeros((0, 1), dtype=np.int64)
        self._mask_flat = np.zeros(0, dtype=self._mask_dtype)
        self._arange = np.arange(0)

    @property
    def kv(self) -> KVCache:
        """The cache, its live lengths brought up to date (not done per step: nobody reads them)."""
        if self._ep is not None:
            if self._ep.binding is not None:
                self._kv.live_lengths = tuple(int(n) for n in self._ep.lens)
        elif self._binding is not None:
            self._kv.live_lengths = tuple(int(n) for n in self.lengths)
        return self._kv

    @property
    def lengths(self) -> np.ndarray:
        """Tokens held per row (for concat graphs: the common padded length)."""
        if self._ep is not None:
            return self._ep.lens.copy()
        return self._lens.copy() if self.model.share_buffer else np.full(self._batch, self._total)

    def end_sequences(self, rows: Sequence[int]) -> None:
        """Tell the backend that rows' sequences are over (at EOS, say).

        An ep graph stops computing them (they run as padding: not written, not attended) and a
        paged cache takes their pages back into its pool. Other graphs keep computing them:
        their cache is one dense block either way.
        """
        if self._ep is not None:
            self._ep.end(rows)

    def close(self) -> None:
        """Release what outlives a step (the KV cache handle of an ep graph); idempotent."""
        if self._ep is not None:
            self._ep.release()

    def _runner(self) -> Callable[[Any], None]:
        """``run(binding)``: the session's pybind call when it is there.

        The public ``InferenceSession.run_with_iobinding`` wraps it with checks for graph capture
        on other providers that cost about 7 µs per call, a tenth of a tiny model's CPU step. The
        inner object is semi-private API: fall back to the public method when it is missing.
        """
        inner = getattr(self.session, "_sess", None)
        if inner is not None and hasattr(inner, "run_with_iobinding"):
            raw = inner.run_with_iobinding

            def run(binding: Any) -> None:
                raw(binding._iobinding, None)

            return run
        return self.session.run_with_iobinding

    def _failed(self, phase: str, exc: Exception) -> ModelError:
        self._binding = None  # the decode state is unknown now: the next call must prefill
        return ModelError(
            f"ONNX Runtime failed in the {phase} of {self.model.onnx_path} "
            f"({type(exc).__name__}: {str(exc).strip()}); the graph does not run as its I/O "
            f"suggests (flavour {self.model.flavour}, batch {self._batch})"
        )

    # --- binding helpers -----------------------------------------------------------------------

    def _bind_in(self, io: Any, name: str, array: np.ndarray, shape: Sequence[int]) -> None:
        io.bind_input(name, "cpu", 0, array.dtype, list(shape), array.ctypes.data)

    def _bind_out(self, io: Any, name: str, array: np.ndarray, shape: Sequence[int]) -> None:
        io.bind_output(name, "cpu", 0, array.dtype, list(shape), array.ctypes.data)

    def _check_bindable(self, g: KVGeometry) -> None:
        """Shared graphs read the layout's buffer directly: it must be head-major and dense."""
        if not is_dense_head_major(g):
            want = (g.batch, g.kv_heads, g.capacity, g.head_dim)
            raise ConfigError(
                f"KV layout {g.layout!r} gives shape {g.shape} with strides {g.strides}; the ort "
                f"backend binds a GroupQueryAttention graph's past/present to the cache itself, "
                f"which must be head-major [batch, kv_heads, capacity, head_dim] = {want}. Use the "
                f"head_major layout with this model, or {ep_graph_hint(self.model, g.layout)}"
            )

    # --- prefill -------------------------------------------------------------------------------

    def prefill(self, prompts: Sequence[np.ndarray], *, reserve: int = 0) -> np.ndarray:
        if self._ep is not None:
            return self._ep.prefill(prompts, reserve=reserve)
        model = self.model
        batch = len(prompts)
        lens, width = prompt_lengths(prompts, model.context_length)
        self._kv.allocate(batch, width + 1, reserve=reserve)
        g = self._kv.geometry
        assert g is not None
        self._capacity = g.capacity
        if model.share_buffer:
            self._check_bindable(g)
        elif g.strides.page_size:
            raise ConfigError(
                f"KV layout {g.layout!r} is paged (page_size {g.strides.page_size}); a standard "
                "graph's past/present are dense head-major tensors, committed into a contiguous "
                f"layout only. Use a contiguous layout with this model, or "
                f"{ep_graph_hint(self.model, g.layout)}"
            )

        ids = np.full((batch, width), model.pad_token_id, dtype=self._ids_dtype)
        mask = np.zeros((batch, width), dtype=self._mask_dtype)
        right = model.padding == "right"
        for b, p in enumerate(prompts):
            n = len(p)
            if right:
                ids[b, :n], mask[b, :n] = p, 1
            else:
                ids[b, width - n :], mask[b, width - n :] = p, 1
        if right:
            positions = np.broadcast_to(np.arange(width), (batch, width))
        else:
            positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)

        self._batch = batch
        self._rows = np.arange(batch)
        io = self.session.io_binding()
        io.bind_output(model.io.logits, "cpu")  # first: ORT allocates [B, S, V] once
        io.bind_cpu_input(model.io.input_ids, ids)
        io.bind_cpu_input(model.io.attention_mask, mask)
        if model.io.position_ids:
            io.bind_cpu_input(
                model.io.position_ids, np.ascontiguousarray(positions, dtype=self._pos_dtype)
            )
        if model.share_buffer:
            self._bind_shared_kv(io, g.capacity)
        else:
            self._alloc_stages(g.capacity)
            empty = (batch, model.kv_heads, 0, model.head_dim)
            full = (batch, model.kv_heads, width, model.head_dim)
            cur, nxt = self._stages
            for layer, (pk, qk, pv, qv) in enumerate(self._kv_names):
                for j, (past, present) in enumerate(((pk, qk), (pv, qv))):
                    self._bind_in(io, past, cur[2 * layer + j], empty)
                    self._bind_out(io, present, nxt[2 * layer + j], full)
        try:
            self._run(io)
        except Exception as exc:  # ORT raises RuntimeError/Fail/InvalidArgument...
            raise self._failed("prefill", exc) from None
        all_logits = io.get_outputs()[0].numpy()
        # A copy now: rebinding the logits output below releases ORT's buffer.
        last = np.array(all_logits[self._rows, lens - 1] if right else all_logits[:, -1])

        # Decode state: the same binding (the cache stays bound), small buffers bound once and
        # rewritten in place every step.
        self._lens = lens.copy()
        self._total = width
        self._tok = np.zeros((batch, 1), dtype=self._ids_dtype)
        self._pos = np.zeros((batch, 1), dtype=self._pos_dtype)
        self._logits = np.empty((batch, 1, model.vocab_size), dtype=self._logits_dtype)
        self._convert_logits = self._logits_dtype != np.float32
        self._logits32 = (
            np.empty((batch, model.vocab_size), dtype=np.float32)
            if self._convert_logits
            else self._logits[:, 0]
        )
        self._binding = io
        self._bind_in(io, model.io.input_ids, self._tok, self._tok.shape)
        self._bind_out(io, model.io.logits, self._logits, self._logits.shape)
        if model.io.position_ids:
            self._bind_in(io, model.io.position_ids, self._pos, self._pos.shape)
        if model.share_buffer:
            self._mask = np.zeros((batch, g.capacity), dtype=self._mask_dtype)
            self._mask[:, :width] = mask
            self._bind_in(io, model.io.attention_mask, self._mask, self._mask.shape)
        else:
            self._pads = (width - lens)[:, None]
            self._mask_flat = np.zeros(batch * g.capacity, dtype=self._mask_dtype)
            self._arange = np.arange(g.capacity)
            self._stages = (self._stages[1], self._stages[0])
            self._commit(0, width)
        return np.ascontiguousarray(last, dtype=np.float32)

    # --- decode --------------------------------------------------------------------------------

    def step(self, tokens: np.ndarray) -> np.ndarray:
        if self._ep is not None:
            return self._ep.step(tokens)
        if self._binding is None:
            raise GenerationError("step() before prefill(): run a prefill first")
        if self.model.share_buffer:
            lens = self._lens
            if self._total >= self._capacity:
                self._grow_shared(self._total + 1)
            self._tok[:, 0] = tokens
            self._mask[self._rows, lens] = 1
            if self.model.io.position_ids:
                self._pos[:, 0] = lens
            lens += 1
            self._total += 1
            try:
                self._run(self._binding)
            except Exception as exc:
                raise self._failed("decode step", exc) from None
        else:
            self._step_concat(tokens)
        if self._convert_logits:
            np.copyto(self._logits32, self._logits[:, 0], casting="unsafe")
        return self._logits32

    # --- shared buffer (GroupQueryAttention) ----------------------------------------------------

    def _bind_shared_kv(self, io: Any, capacity: int) -> None:
        """Bind each layer's buffer as both past and present (GQA updates it in place)."""
        model = self.model
        shape = (self._batch, model.kv_heads, capacity, model.head_dim)
        for layer, (pk, qk, pv, qv) in enumerate(self._kv_names):
            for past, present, buf in (
                (pk, qk, self._kv.keys[layer]),
                (pv, qv, self._kv.values[layer]),
            ):
                self._bind_in(io, past, buf, shape)
                self._bind_out(io, present, buf, shape)

    def _grow_shared(self, needed: int) -> None:
        self._kv.ensure(needed, self._lens)
        g = self._kv.geometry
        assert g is not None
        self._capacity = g.capacity
        self._check_bindable(g)
        mask = np.zeros((self._batch, g.capacity), dtype=self._mask_dtype)
        mask[:, : self._mask.shape[1]] = self._mask
        self._mask = mask
        self._bind_shared_kv(self._binding, g.capacity)
        self._bind_in(self._binding, self.model.io.attention_mask, mask, mask.shape)

    # --- concatenating graphs (standard) ----------------------------------------------------------

    def _alloc_stages(self, capacity: int) -> None:
        m = self.model
        size = self._batch * m.kv_heads * capacity * m.head_dim
        dtype = self._kv.dtype
        self._stages = (
            [np.zeros(size, dtype) for _ in range(2 * m.num_layers)],
            [np.zeros(size, dtype) for _ in range(2 * m.num_layers)],
        )
        self._views = [
            (self._kv.token_view(self._kv.keys[i]), self._kv.token_view(self._kv.values[i]))
            for i in range(m.num_layers)
        ]

    def _commit(self, start: int, stop: int) -> None:
        """Copy tokens [start, stop) of the current stage (packed [B, H, T, D]) into the cache."""
        m = self.model
        shape = (self._batch, m.kv_heads, stop, m.head_dim)
        cur = self._stages[0]
        n = self._batch * m.kv_heads * stop * m.head_dim
        for layer, (kview, vview) in enumerate(self._views):
            for j, view in enumerate((kview, vview)):
                packed = cur[2 * layer + j][:n].reshape(shape)
                view[:, start:stop] = packed[:, :, start:stop].transpose(0, 2, 1, 3)
        self._kv.live_lengths = (stop,) * self._batch

    def _grow_concat(self, needed: int) -> None:
        self._kv.ensure(needed, (self._total,) * self._batch)
        g = self._kv.geometry
        assert g is not None
        self._capacity = g.capacity
        old_cur = self._stages[0]
        n = self._batch * self.model.kv_heads * self._total * self.model.head_dim
        self._alloc_stages(g.capacity)
        for old, new in zip(old_cur, self._stages[0], strict=True):
            new[:n] = old[:n]
        self._mask_flat = np.zeros(self._batch * g.capacity, dtype=self._mask_dtype)
        self._arange = np.arange(g.capacity)

    def _step_concat(self, tokens: np.ndarray) -> None:
        m, dec = self.model, self._binding
        total = self._total
        if total >= self._capacity:
            self._grow_concat(total + 1)
        self._tok[:, 0] = tokens
        if m.io.position_ids:
            self._pos[:, 0] = total - self._pads[:, 0]
        width = total + 1
        mask = self._mask_flat[: self._batch * width].reshape(self._batch, width)
        np.greater_equal(self._arange[:width], self._pads, out=mask, casting="unsafe")
        self._bind_in(dec, m.io.attention_mask, mask, mask.shape)
        cur, nxt = self._stages
        past_shape = (self._batch, m.kv_heads, total, m.head_dim)
        present_shape = (self._batch, m.kv_heads, width, m.head_dim)
        for layer, (pk, qk, pv, qv) in enumerate(self._kv_names):
            for j, (past, present) in enumerate(((pk, qk), (pv, qv))):
                self._bind_in(dec, past, cur[2 * layer + j], past_shape)
                self._bind_out(dec, present, nxt[2 * layer + j], present_shape)
        try:
            self._run(dec)
        except Exception as exc:
            raise self._failed("decode step", exc) from None
        self._stages = (nxt, cur)
        self._total = width
        self._commit(total, width)


# --- graphs with this project's ops -------------------------------------------------------------


def _with_ops(hook: SessionOptionsHook | None) -> SessionOptionsHook:
    """A session options hook that registers this project's ops, then runs ``hook``."""

    def register(options: ort.SessionOptions) -> None:
        # Loaded here: only graphs with this project's ops need onnxruntime-extensions.
        from ep.ops.ort_bridge import register_session_options

        register_session_options(options)
        if hook is not None:
            hook(options)

    return register


def _with_op_state(
    run: Callable[[Any], None], weights: WeightResolver | None
) -> Callable[[Any], None]:
    """``run(binding)`` with this backend's weight resolver installed for the run, raising an
    op's stored error as an OpError afterwards.

    A Python op's exception never crosses into ONNX Runtime (it would abort the process): the op
    returns zeros and the error waits for the caller. Without the check a failed op is a run that
    "succeeds" with zero outputs. The resolver is process-wide state, so it is set per run: two
    backends with different weights can take turns.
    """
    from ep.ops.ort_bridge import raise_op_errors, take_op_errors

    def checked(binding: Any) -> None:
        take_op_errors()  # a stale error of an earlier, unchecked run is not this run's
        previous = get_weight_resolver()
        if weights is not None:
            set_weight_resolver(weights)
        try:
            run(binding)
        except Exception:
            raise_op_errors()  # an op's error explains ONNX Runtime's failure: it wins
            raise
        finally:
            if weights is not None:
                set_weight_resolver(previous)
        raise_op_errors()

    return checked


def load_named_weights(onnx_path: str | Path) -> DictWeights | None:
    """A resolver over the initializers that MatMul nodes of ``ai.genai_ep`` name, read from the
    model file and its external data; None when the graph has no named-weight MatMul."""
    import onnx
    from onnx import numpy_helper

    from ep.ops import DOMAIN, op_types

    path = Path(onnx_path)
    graph = onnx.load(str(path), load_external_data=False).graph
    known = op_types()
    wanted: dict[str, str] = {}  # weight name -> the first node naming it
    for node in graph.node:
        found = known.get(node.op_type) if node.domain == DOMAIN else None
        if found is None or found[0].name != "MatMul":
            continue
        for attr in node.attribute:
            if attr.name == "weight":
                wanted.setdefault(attr.s.decode(), node.name)
    if not wanted:
        return None
    arrays: dict[str, np.ndarray] = {}
    for init in graph.initializer:
        if init.name in wanted:
            try:
                arrays[init.name] = numpy_helper.to_array(init, str(path.parent))
            except Exception as exc:  # onnx raises OSError, ValueError, ... for bad data
                raise ModelError(
                    f"{path}: cannot read weight {init.name!r} ({type(exc).__name__}: {exc}); "
                    "copy the model's external data file beside it"
                ) from None
    missing = sorted(set(wanted) - set(arrays))
    if missing:
        name = missing[0]
        raise ModelError(
            f"{path}: MatMul node {wanted[name]!r} names weight {name!r}, which is not an "
            f"initializer of the model ({len(missing)} such weight(s)); the weight attribute "
            "must name an initializer the runtime can load"
        )
    return DictWeights(arrays)


def _release_handle(handle: int) -> None:
    with contextlib.suppress(OpError):  # already released elsewhere: nothing left to do
        KV_CACHES.release(handle)


class _RuntimeKVSteps:
    """Prefill and decode of an ep graph: the cache is the runtime's, reached by handle.

    Per step the cache makes room for the step's tokens (`KVCache.prepare`: a growth through the
    layout when the capacity is reached; for a paged pool, the pages the tokens land in, with
    copy-on-write of a shared page), the token and position buffers (bound once) are rewritten
    and the session runs (with the backend's weight resolver, raising op errors:
    `_with_op_state`). When the cache replaced anything that is bound (a new `KVCache.epoch`),
    the handle is rebound, the geometry input rewritten in place (it is bound by address) and
    the block table rebound.

    Paged layouts: the backend loaded the graph with its KV ops swapped for the paged ones
    (`paged_graph`), which read the pool's block table from the graph input
    `PAGED_TABLE_INPUT`. Rows that repeat an earlier row's prompt are not prefilled: they fork
    that row's pages (shared, copied only when one of them writes a shared page). `end` gives a
    finished row's pages back; the row then runs as padding (position -1: not written, not
    attended).
    """

    def __init__(self, backend: OrtBackend) -> None:
        model = backend.model
        self.backend = backend
        self.model = model
        self.io = model.io
        self.paged = backend.page_size > 0
        self.handle = 0
        self._finalizer: weakref.finalize | None = None
        self.handle_input = np.zeros(1, dtype=np.int64)
        self.geometry = np.zeros(7, dtype=np.int64)
        self.capacity = 0
        self.epoch = -1  # the cache epoch the bindings reflect
        self.binding: Any = None
        self.lens = np.zeros(0, dtype=np.int64)
        self.ended = np.zeros(0, dtype=np.bool_)
        self.any_ended = False
        self.tok = np.zeros((0, 1), dtype=np.dtype(model.io.input_ids_dtype))
        self.pos = np.zeros((0, 1), dtype=np.int64)
        self.logits = np.zeros((0, 1, model.vocab_size), dtype=np.dtype(model.io.logits_dtype))
        self.logits32: np.ndarray = np.zeros((0, model.vocab_size), dtype=np.float32)
        self.convert_logits = self.logits.dtype != np.float32

    # --- the cache handle ------------------------------------------------------------------

    def _buffers(self) -> list[tuple[np.ndarray, np.ndarray]]:
        kv = self.backend._kv
        return list(zip(kv.keys, kv.values, strict=True))

    def _bind_cache(self, binding: Any) -> None:
        """Point the handle, the geometry input and (paged) the block table at the cache."""
        kv = self.backend._kv
        g = kv.geometry
        assert g is not None
        from ep.ops.kv import kv_geometry

        if self.handle:
            KV_CACHES.rebind(self.handle, self._buffers())
        else:
            self.handle = KV_CACHES.bind(self._buffers())
            # Garbage collection releases the handle (and so the buffers) if close() is not called.
            self._finalizer = weakref.finalize(self, _release_handle, self.handle)
        self.handle_input[0] = self.handle
        self.geometry[:] = kv_geometry(g)
        self.capacity = g.capacity
        if binding is not None and self.paged:
            assert kv.block_table is not None
            self._bind(binding, PAGED_TABLE_INPUT, kv.block_table)
        self.epoch = kv.epoch

    def release(self) -> None:
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
        self.handle = 0
        self.binding = None

    # --- running ---------------------------------------------------------------------------

    def _run(self, binding: Any, phase: str) -> None:
        try:
            self.backend._run(binding)
        except OpError:
            self.binding = None  # the cache may hold half a step: the next call must prefill
            raise
        except Exception as exc:  # ORT raises RuntimeError/Fail/InvalidArgument...
            self.binding = None
            raise self.backend._failed(phase, exc) from None

    def _bind(self, io: Any, name: str, array: np.ndarray) -> None:
        io.bind_input(name, "cpu", 0, array.dtype, list(array.shape), array.ctypes.data)

    def prefill(self, prompts: Sequence[np.ndarray], *, reserve: int) -> np.ndarray:
        model, io_names = self.model, self.io
        batch = len(prompts)
        lens, width = prompt_lengths(prompts, model.context_length)
        kv = self.backend._kv
        self.binding = None
        kv.allocate(batch, width + 1, reserve=reserve)

        # A paged pool shares a repeated prompt: only its first row is prefilled.
        rows = np.arange(batch)
        source = rows.copy()
        if self.paged:
            first: dict[bytes, int] = {}
            for b, p in enumerate(prompts):
                source[b] = first.setdefault(np.asarray(p, dtype=np.int64).tobytes(), b)
        run = np.flatnonzero(source == rows)
        kv.prepare(np.zeros(batch, np.int64), np.where(source == rows, lens, 0))
        self._bind_cache(None)

        # Left padding: row b's tokens sit at the end, at positions 0..n-1 (cache slots 0..n-1);
        # pads get -1, which the ops neither write nor attend.
        run_lens = lens[run]
        pads = width - run_lens
        ids = np.full((run.size, width), model.pad_token_id, dtype=self.tok.dtype)
        for i, row in enumerate(run):
            ids[i, pads[i] :] = prompts[int(row)]
        positions = np.arange(width, dtype=np.int64)[None, :] - pads[:, None]
        positions[positions < 0] = -1

        io = self.backend.session.io_binding()
        io.bind_output(io_names.logits, "cpu")  # ORT allocates [B, S, V] once
        io.bind_cpu_input(io_names.input_ids, ids)
        assert io_names.positions and io_names.kv_cache and io_names.kv_geometry
        io.bind_cpu_input(io_names.positions, positions)
        self._bind(io, io_names.kv_cache, self.handle_input)
        self._bind(io, io_names.kv_geometry, self.geometry)
        if self.paged:
            assert kv.block_table is not None
            io.bind_cpu_input(PAGED_TABLE_INPUT, np.ascontiguousarray(kv.block_table[run]))
        self._run(io, "prefill")
        # A copy now: rebinding the logits output below releases ORT's buffer. Row b gets the
        # logits of the row it repeats.
        last_run = np.array(io.get_outputs()[0].numpy()[:, -1], dtype=np.float32)
        last = last_run[np.searchsorted(run, source)] if run.size < batch else last_run
        for row in np.flatnonzero(source != rows):
            kv.fork(int(source[row]), int(row))

        # Decode state: small buffers bound once, rewritten in place every step.
        self.lens = lens.copy()
        self.ended = np.zeros(batch, dtype=np.bool_)
        self.any_ended = False
        self.tok = np.zeros((batch, 1), dtype=self.tok.dtype)
        self.pos = np.zeros((batch, 1), dtype=np.int64)
        self.logits = np.empty((batch, 1, model.vocab_size), dtype=self.logits.dtype)
        self.logits32 = (
            np.empty((batch, model.vocab_size), dtype=np.float32)
            if self.convert_logits
            else self.logits[:, 0]
        )
        self._bind(io, io_names.input_ids, self.tok)
        self._bind(io, io_names.positions, self.pos)
        io.bind_output(
            io_names.logits, "cpu", 0, self.logits.dtype, list(self.logits.shape),
            self.logits.ctypes.data,
        )  # fmt: skip
        self._bind_cache(io)
        self.binding = io
        return last

    def step(self, tokens: np.ndarray) -> np.ndarray:
        if self.binding is None:
            raise GenerationError("step() before prefill(): run a prefill first")
        kv = self.backend._kv
        if self.paged or self.any_ended or int(self.lens.max()) >= self.capacity:
            stops = self.lens + ~self.ended  # ended rows write nothing
            kv.prepare(self.lens, stops)
        if kv.epoch != self.epoch:
            self._bind_cache(self.binding)
        self.tok[:, 0] = tokens
        if self.any_ended:
            self.pos[:, 0] = np.where(self.ended, -1, self.lens)
        else:
            self.pos[:, 0] = self.lens
        self._run(self.binding, "decode step")
        self.lens += ~self.ended if self.any_ended else 1
        if self.convert_logits:
            np.copyto(self.logits32, self.logits[:, 0], casting="unsafe")
        return self.logits32

    def end(self, rows: Sequence[int]) -> None:
        """Rows whose sequence is over: their pages go back (paged); they run as padding."""
        if self.binding is None:
            raise GenerationError("end_sequences() before prefill(): run a prefill first")
        kv = self.backend._kv
        for row in rows:
            b = int(row)
            if not 0 <= b < self.ended.size:
                raise GenerationError(
                    f"end_sequences: row {b} is not in the batch of {self.ended.size}"
                )
            if self.ended[b]:
                continue
            self.ended[b] = True
            self.any_ended = True
            if self.paged:
                kv.release(b)
                self.lens[b] = 0  # it holds no tokens now


# --- paged layouts on ep graphs ----------------------------------------------------------------

#: the graph input the paged KV ops read the block table from (int32 [batch, pages])
PAGED_TABLE_INPUT = "kv_block_table"
# Tells ONNX Runtime where a graph loaded from elsewhere finds its external data (ORT >= 1.19).
_EXTERNAL_DATA_FOLDER = "session.model_external_initializers_file_folder_path"


def layout_page_size(layout: KVLayout, model: DecoderModel) -> int:
    """The page size of ``layout``'s geometry for ``model`` (0: a contiguous layout)."""
    g = layout.geometry(
        batch=1,
        capacity=min(16, model.context_length),
        kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        itemsize=model.kv_itemsize,
    )
    return int(g.strides.page_size)


def is_dense_head_major(g: KVGeometry) -> bool:
    """Whether ``g`` is [batch, kv_heads, capacity, head_dim], dense: what GQA graphs bind."""
    s = g.strides
    dense = (g.kv_heads * g.capacity * g.head_dim, g.head_dim, g.capacity * g.head_dim, 1)
    want = (g.batch, g.kv_heads, g.capacity, g.head_dim)
    return g.shape == want and (s.batch, s.token, s.head, s.dim) == dense and not s.page_size


def gqa_can_bind(layout: KVLayout) -> bool:
    """Whether a GroupQueryAttention (contrib) graph can bind ``layout``'s buffers as its
    past/present: dense head-major, probed at batch 2, capacity 16, 2 KV heads of 4."""
    return is_dense_head_major(
        layout.geometry(batch=2, capacity=16, kv_heads=2, head_dim=4, itemsize=4)
    )


def ep_graph_hint(model: DecoderModel, layout: str) -> str:
    """What to run to get ``model`` as an ep graph, whose KV ops read any layout."""
    run = f"genai-ep run --model OUT --kv-layout {layout}"
    if model.kind == "spec":
        spec = re.sub(r",\s*flavou?r\s*=\s*\w+", "", model.source)
        return (
            "load it as an ep graph, whose KV ops read any layout: "
            f"genai-ep run --model {shlex.quote(spec + ',flavour=ep')} --kv-layout {layout}"
        )
    if model.kind == "hf":
        out = shlex.quote(f"{Path(model.source).expanduser()}-ep")
        return (
            "build it as an ep graph, whose KV ops read any layout: "
            f"genai-ep build --hf {shlex.quote(model.source)} --flavour ep -o {out}, then "
            + run.replace("OUT", out)
        )
    src = model.folder if model.kind == "genai" else model.onnx_path
    out = shlex.quote(f"{src.with_suffix('') if src.is_file() else src}-ep")
    return (
        "rewrite it into this project's ops, whose KV ops read any layout: "
        f"genai-ep rewrite {shlex.quote(str(src))} -o {out}, then " + run.replace("OUT", out)
    )


def paged_graph(onnx_path: str | Path) -> Any:
    """The ep graph at ``onnx_path`` with every KVCommit / KVAttention swapped for its paged
    variant, which reads one more input: the block table `PAGED_TABLE_INPUT` (int32 [batch,
    pages]), inserted before the cache handle. External data stays where it is (not loaded).

    Why at load time: one ep model file then serves every layout (model loading accepts only
    the four ep inputs, and a paged op refuses a contiguous geometry), and the swap is exact:
    the paged ops take the same attributes and compute the same numbers.
    """
    import onnx
    from onnx import TensorProto, helper

    from ep.ops import DOMAIN, op_types
    from ep.ops.kv import KV_ATTENTION_PAGED, KV_COMMIT_PAGED

    path = Path(onnx_path)
    model = onnx.load(str(path), load_external_data=False)
    known = op_types()
    paged = {"KVCommit": KV_COMMIT_PAGED, "KVAttention": KV_ATTENTION_PAGED}
    swapped = 0
    for node in model.graph.node:
        found = known.get(node.op_type) if node.domain == DOMAIN else None
        if found is None or found[0].name not in paged:
            continue
        op, signature = found
        node.op_type = paged[op.name].schema.op_type(signature)
        node.input.insert(len(node.input) - 1, PAGED_TABLE_INPUT)
        swapped += 1
    if not swapped:
        raise ModelError(
            f"{path}: no KVCommit/KVAttention nodes to swap for their paged variants; a paged "
            "KV layout needs an ep graph whose KV ops read the runtime's cache"
        )
    model.graph.input.append(
        helper.make_tensor_value_info(PAGED_TABLE_INPUT, TensorProto.INT32, ["batch", "pages"])
    )
    return model


def _paged_session(
    model: DecoderModel, config: SessionConfig | None, hook: SessionOptionsHook | None
) -> ort.InferenceSession:
    """A session of `paged_graph` (written to a temporary folder for ONNX Runtime to load; its
    external data is read from the model's own folder)."""
    import onnx

    graph = paged_graph(model.onnx_path)
    folder = str(model.onnx_path.parent.resolve())

    def with_data(options: ort.SessionOptions) -> None:
        if hook is not None:
            hook(options)
        options.add_session_config_entry(_EXTERNAL_DATA_FOLDER, folder)

    with tempfile.TemporaryDirectory(prefix="genai-ep-paged-") as tmp:
        path = Path(tmp) / model.onnx_path.name
        onnx.save_model(graph, str(path))
        return create_session(path, config, session_options_hook=with_data)
