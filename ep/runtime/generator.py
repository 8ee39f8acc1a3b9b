"""`Generator`: prefill, then token-by-token decode of a batch, with sampling and stopping.

The hot loop does per step: mask stop ids (until ``min_new_tokens``), pick tokens (argmax or
`ep.sampling.sample`), check stops, and call the backend's `step`. A backend with ``steps`` (the
native one, unless built with ``device_picks=False``) instead gives k = ``sync_every`` tokens per
call (k = 1 included), picked on the device (argmax, or a draw from each row's own generator, the
very numbers `ep.sampling.make_rngs` gives it: a seed is drawn when none is set), the first one
by its ``first_tokens``; they are consumed one per loop turn the same way, so stops and
``min_new_tokens`` act as with k = 1. What the device cannot pick (the repetition penalty needs
the history on the host) is picked here, one step a call, with a note when k > 1 was asked.
With the backend's ``run_ahead`` (``launch_steps``/``collect``), the next k steps are launched
before the host waits for this k, so the device never waits for the host; a stop makes them
surplus, and they are dropped (the next prefill discards them).
Nothing large is allocated and no plugin hook is called per token; the KV layout object is called
only when the cache grows.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator, Sequence
from collections.abc import Generator as PyGenerator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ep.errors import GenerationError, ModelError
from ep.model import DecoderModel
from ep.runtime.backend import Backend, create_backend
from ep.runtime.metrics import GenerationMetrics, summarize
from ep.sampling import SamplingParams, make_rngs, sample, seen_mask
from ep.seams import KVLayout
from ep.tokenizer import INSTALL_HINT, Tokenizer, TokenStream

__all__ = [
    "GenerationOptions",
    "GenerationResult",
    "GenerationStream",
    "Generator",
    "Prompts",
    "StepTokens",
]

# One prompt (text or token ids) or a batch of them.
# One prompt (text or ids) or a batch of them; a batch may mix text and ids.
Prompts = str | Sequence[int] | np.ndarray | Sequence[str | Sequence[int]]


@dataclass(frozen=True)
class GenerationOptions:
    """When to stop, and how much KV room to start with.

    ``max_new_tokens`` >= 1 (clipped to the context, with a note in the result);
    ``min_new_tokens``: EOS and stop ids are masked to -inf until this many tokens exist;
    ``stop_token_ids``: extra ids that end a row (besides the model's EOS when
    ``stop_on_eos``); ``kv_capacity``: initial KV capacity in tokens (0: the layout's bucket for
    the prompt; the cache grows when needed either way); ``add_special_tokens``: for text prompts;
    ``decode_text``: decode the result's text (and streamed text) when a tokenizer exists.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_on_eos: bool = True
    kv_capacity: int = 0
    add_special_tokens: bool = True
    decode_text: bool = True

    def __post_init__(self) -> None:
        for name, low in (("max_new_tokens", 1), ("min_new_tokens", 0), ("kv_capacity", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
                raise GenerationError(f"{name}={value!r}; expected an integer >= {low}")
        if self.min_new_tokens > self.max_new_tokens:
            raise GenerationError(
                f"min_new_tokens={self.min_new_tokens} exceeds max_new_tokens="
                f"{self.max_new_tokens}; raise max_new_tokens or lower min_new_tokens"
            )
        ids = tuple(self.stop_token_ids)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or i < 0:
                raise GenerationError(f"stop token id {i!r}; expected integers >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(i) for i in ids))


@dataclass(frozen=True)
class StepTokens:
    """One decode step of a stream: the new token of each row.

    ``tokens[b]`` is None once row b has finished (at an earlier step). ``text[b]`` is the text
    that token completed ("" while a character is incomplete), when the model has a tokenizer.
    ``finished[b]``: row b is done after this step.
    """

    step: int
    tokens: tuple[int | None, ...]
    text: tuple[str, ...] | None
    finished: tuple[bool, ...]


@dataclass(frozen=True)
class GenerationResult:
    """What `Generator.generate` returns.

    ``tokens[b]``: the generated ids of row b only (a stopping EOS/stop id included, as
    transformers does); ``text[b]``: their decoded text without the stopping id (None without a
    tokenizer); ``finish_reasons[b]``: "eos", "stop" or "length"; ``notes``: adjustments made
    (e.g. max_new_tokens clipped by the context).
    """

    tokens: tuple[tuple[int, ...], ...]
    text: tuple[str, ...] | None
    finish_reasons: tuple[str, ...]
    prompt_lengths: tuple[int, ...]
    notes: tuple[str, ...]
    metrics: GenerationMetrics

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens": [list(t) for t in self.tokens],
            "text": list(self.text) if self.text is not None else None,
            "finish_reasons": list(self.finish_reasons),
            "prompt_lengths": list(self.prompt_lengths),
            "notes": list(self.notes),
            "metrics": self.metrics.to_dict(),
        }


class GenerationStream:
    """Iterate for `StepTokens`; once exhausted, `result` holds the `GenerationResult`."""

    def __init__(self, steps: Iterator[StepTokens | None]) -> None:
        self._steps = steps
        self._result: GenerationResult | None = None

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> StepTokens:
        try:
            item = next(self._steps)
        except StopIteration as stop:
            self._result = stop.value
            raise
        assert item is not None
        return item

    @property
    def result(self) -> GenerationResult:
        if self._result is None:
            raise GenerationError(
                "the stream has not finished yet; iterate it to the end before reading .result"
            )
        return self._result


@dataclass
class _Plan:
    """A validated request: what `_run` needs, computed before any work."""

    prompts: list[np.ndarray]
    max_new: int
    min_new: int
    stops: np.ndarray
    kv_capacity: int
    decode_text: bool
    notes: list[str] = field(default_factory=list)


class Generator:
    """Generates tokens from a loaded `DecoderModel` with one backend and one KV layout.

    ``backend``: a name ("ort") or a ready `Backend`. ``sampling`` and ``options`` are the
    defaults of every call; `generate` and `stream` may override them per call. ``device``,
    ``threads`` and ``session_options_hook`` go to the backend (ONNX Runtime: the EP, intra-op
    threads, a callable that registers custom ops into the SessionOptions).
    """

    def __init__(
        self,
        model: DecoderModel,
        *,
        layout: KVLayout,
        backend: str | Backend = "ort",
        sampling: SamplingParams | None = None,
        options: GenerationOptions | None = None,
        device: str = "cpu",
        threads: int = 0,
        session_options_hook: Callable[[Any], None] | None = None,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.model = model
        self.layout = layout
        self.sampling = sampling or SamplingParams()
        self.options = options or GenerationOptions()
        if isinstance(backend, str):
            self.backend: Backend = create_backend(
                backend,
                model,
                layout,
                device=device,
                threads=threads,
                session_options_hook=session_options_hook,
            )
        else:
            self.backend = backend
        self._tokenizer = tokenizer
        self._tokenizer_problem = ""

    # --- public API ---------------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer | None:
        """The model folder's tokenizer, loaded on first use (None when there is none)."""
        if self._tokenizer is None and not self._tokenizer_problem:
            if self.model.tokenizer_dir is None:
                self._tokenizer_problem = f"no tokenizer.json in {self.model.folder}"
            else:
                try:
                    self._tokenizer = Tokenizer(self.model.tokenizer_dir)
                except ModelError as exc:
                    self._tokenizer_problem = str(exc)
        return self._tokenizer

    def generate(
        self,
        prompts: Prompts,
        *,
        options: GenerationOptions | None = None,
        sampling: SamplingParams | None = None,
    ) -> GenerationResult:
        """Generate for one prompt or a batch (text or token ids); see `GenerationResult`."""
        steps = self._run(prompts, options or self.options, sampling or self.sampling, False)
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                result: GenerationResult = stop.value
                return result

    def stream(
        self,
        prompts: Prompts,
        *,
        options: GenerationOptions | None = None,
        sampling: SamplingParams | None = None,
    ) -> GenerationStream:
        """Like `generate`, yielding each step's new tokens; ``.result`` at the end.

        The request is validated here, before the first ``next()``.
        """
        plan = self._plan(prompts, options or self.options)
        steps = self._loop(plan, sampling or self.sampling, True)
        return GenerationStream(steps)

    # --- request validation -------------------------------------------------------------------

    def _as_ids(self, item: Any, index: int, options: GenerationOptions) -> np.ndarray:
        if isinstance(item, str):
            tok = self.tokenizer
            if tok is None:
                raise ModelError(
                    f"prompt {index} is text but the model has no usable tokenizer "
                    f"({self._tokenizer_problem}); pass token ids instead"
                )
            ids = np.asarray(tok.encode(item, add_special_tokens=options.add_special_tokens))
        else:
            try:
                ids = np.asarray(item)
            except (TypeError, ValueError) as exc:
                raise GenerationError(
                    f"prompt {index} is not a sequence of token ids: {exc}"
                ) from None
        if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
            raise GenerationError(
                f"prompt {index} has dtype {ids.dtype} and shape {ids.shape}; expected a flat "
                "sequence of integer token ids (or a string)"
            )
        if ids.size == 0:
            raise GenerationError(f"prompt {index} is empty; give at least one token")
        vocab = self.model.vocab_size
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.size:
            raise GenerationError(
                f"prompt {index} holds token id {int(bad[0])}, outside the model's vocabulary "
                f"[0, {vocab}) (vocab size {vocab})"
            )
        return ids.astype(np.int64, copy=False)

    def _plan(self, prompts: Prompts, options: GenerationOptions) -> _Plan:
        if isinstance(prompts, str):
            items: list[Any] = [prompts]
        elif isinstance(prompts, np.ndarray):
            items = [prompts] if prompts.ndim == 1 else list(prompts)
        elif isinstance(prompts, Sequence):
            if len(prompts) == 0:
                raise GenerationError("no prompts given; pass a prompt or a list of prompts")
            flat = all(
                isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in prompts
            )
            items = [prompts] if flat else list(prompts)
        else:
            raise GenerationError(
                f"prompts of type {type(prompts).__name__}; expected a string, a list of token "
                "ids, or a list of either"
            )
        ids = [self._as_ids(item, i, options) for i, item in enumerate(items)]
        ctx = self.model.context_length
        longest = max(len(p) for p in ids)
        if longest >= ctx:
            which = next(i for i, p in enumerate(ids) if len(p) == longest)
            raise GenerationError(
                f"prompt {which} has {longest} tokens; the model's context is {ctx} tokens, "
                f"which leaves no room for a new token. Shorten it to at most {ctx - 1} tokens"
            )
        notes = []
        max_new = options.max_new_tokens
        if max_new > ctx - longest:
            notes.append(
                f"max_new_tokens clipped from {max_new} to {ctx - longest}: the longest prompt "
                f"has {longest} tokens and the context holds {ctx}"
            )
            max_new = ctx - longest
        vocab = self.model.vocab_size
        for i in options.stop_token_ids:
            if i >= vocab:
                raise GenerationError(
                    f"stop token id {i} is outside the model's vocabulary [0, {vocab}) "
                    f"(vocab size {vocab})"
                )
        stops = set(options.stop_token_ids)
        if options.stop_on_eos:
            stops |= set(self.model.eos_token_ids)
        return _Plan(
            prompts=ids,
            max_new=max_new,
            min_new=min(options.min_new_tokens, max_new),
            stops=np.array(sorted(stops), dtype=np.int64),
            kv_capacity=options.kv_capacity,
            decode_text=options.decode_text,
            notes=notes,
        )

    # --- the loop -----------------------------------------------------------------------------

    def _run(
        self,
        prompts: Prompts,
        options: GenerationOptions,
        sampling: SamplingParams,
        emit: bool,
    ) -> PyGenerator[StepTokens | None, None, GenerationResult]:
        plan = self._plan(prompts, options)
        return self._loop(plan, sampling, emit)

    def _loop(
        self, plan: _Plan, sampling: SamplingParams, emit: bool
    ) -> PyGenerator[StepTokens | None, None, GenerationResult]:
        prompts, max_new, min_new, stops = plan.prompts, plan.max_new, plan.min_new, plan.stops
        batch, vocab = len(prompts), self.model.vocab_size
        notes = list(plan.notes)
        wants_text = plan.decode_text and self.model.tokenizer_dir is not None
        tokenizer = self.tokenizer if wants_text else None
        if wants_text and tokenizer is None:
            notes.append(f"text not decoded: {self._tokenizer_problem or INSTALL_HINT}")
        streams: list[TokenStream] | None = (
            [tokenizer.stream(context=[int(t) for t in p]) for p in prompts]
            if emit and tokenizer
            else None
        )
        greedy_fast = sampling.greedy and not sampling.uses_history
        # The device token loop (native backend, decode.sync_every = k, k = 1 included): k steps
        # on the device per host synchronisation, the tokens picked there; they are consumed
        # below one at a time, as if picked here, so stops apply per token and tokens past a
        # stop or the end are dropped.
        every = int(getattr(self.backend, "sync_every", 1))
        device_loop = hasattr(self.backend, "steps") and getattr(self.backend, "device_picks", True)
        if device_loop and not sampling.greedy and sampling.seed is None:
            # the device's generators are seeded: draw one here (the host's rngs use it too)
            fresh = np.random.SeedSequence().generate_state(1, np.uint64)[0] >> np.uint64(1)
            sampling = dataclasses.replace(sampling, seed=int(fresh))
        refusal = self.backend.sampling_refusal(sampling) if device_loop else ""  # type: ignore[attr-defined]
        if refusal:  # picked on the host from each step's logits; said when k > 1 was asked
            if every > 1:
                notes.append(
                    f"decode.sync_every={every} cannot pick tokens on the device with {refusal}; "
                    "ran with sync_every=1, picking them on the host"
                )
            device_loop = False
        rngs = None if sampling.greedy else make_rngs(sampling.seed, batch)
        seen = seen_mask(prompts, batch, vocab) if sampling.uses_history else None
        rows = np.arange(batch)
        pad = self.model.pad_token_id
        single_stop = int(stops[0]) if stops.size == 1 else None

        out = np.empty((batch, max_new), dtype=np.int64)
        lengths = np.full(batch, max_new, dtype=np.int64)
        finished = np.zeros(batch, dtype=np.bool_)
        reasons = ["length"] * batch
        any_finished = False
        step_s: list[float] = []

        t0 = time.perf_counter()
        logits = self.backend.prefill(prompts, reserve=plan.kv_capacity)
        prefill_s = time.perf_counter() - t0

        block: np.ndarray | None = None
        used = 0
        ahead = (
            device_loop
            and bool(getattr(self.backend, "run_ahead", False))
            and hasattr(self.backend, "launch_steps")
        )
        pending: Any = None  # the run launched ahead, when ``ahead``

        def run_from(first: int) -> dict[str, Any]:
            """The device loop's run for the tokens from step ``first`` on (k, or to the end);
            each row drew one uniform a step before it."""
            return {"count": min(every, max_new - first), "mask": stops, "sampling": sampling,
                    "mask_steps": max(0, min_new - first), "draws": first}  # fmt: skip

        step = 0
        while True:
            top = time.perf_counter()
            if emit:
                done_before = finished.copy()
            if block is not None:
                ids = block[used].copy()
                used += 1
            elif device_loop:  # the first token, on the device as the loop picks the rest
                ids = self.backend.first_tokens(  # type: ignore[attr-defined]
                    mask=stops if step < min_new else (), sampling=sampling
                )
            else:
                if step < min_new and stops.size:
                    logits[:, stops if single_stop is None else single_stop] = -np.inf
                ids = logits.argmax(axis=1) if greedy_fast else sample(logits, sampling, rngs, seen)
            if any_finished:
                ids[finished] = pad
            out[:, step] = ids
            if seen is not None:
                seen[rows, ids] = True
            hit = None
            if stops.size and step >= min_new:
                hit = (ids == single_stop) if single_stop is not None else np.isin(ids, stops)
                hit &= ~finished
                if hit.any():
                    for b in np.flatnonzero(hit):
                        token = int(ids[b])
                        reasons[b] = "eos" if token in self.model.eos_token_ids else "stop"
                        lengths[b] = step + 1
                    finished |= hit
                    any_finished = True
                else:
                    hit = None
            last = step + 1 >= max_new or (any_finished and bool(finished.all()))
            if emit:
                paused = time.perf_counter()
                yield self._step_tokens(step, ids, done_before, finished, hit, last, streams)
                top += time.perf_counter() - paused  # the consumer's time is not decode time
            if last:
                break
            if device_loop:
                if block is None or used == len(block):
                    backend: Any = self.backend
                    if not ahead:
                        block = backend.steps(ids, **run_from(step + 1))
                    else:
                        run = pending or backend.launch_steps(ids, **run_from(step + 1))
                        # the next run goes in before this one is read, its input this one's
                        # last pick (on the device): the device has it queued meanwhile
                        first = step + 1 + run.count  # the step the next run starts at
                        more = first < max_new
                        pending = backend.launch_steps(None, **run_from(first)) if more else None
                        block = backend.collect(run)
                    used = 0
            else:
                logits = self.backend.step(ids)
            step += 1
            step_s.append(time.perf_counter() - top)

        tokens = tuple(tuple(out[b, : lengths[b]].tolist()) for b in range(batch))
        text = None
        if tokenizer is not None:
            text = tuple(
                tokenizer.decode(t[:-1] if reasons[b] in ("eos", "stop") else t)
                for b, t in enumerate(tokens)
            )
        metrics = summarize(
            batch=batch,
            prompt_tokens=sum(len(p) for p in prompts),
            new_tokens=int(lengths.sum()),
            prefill_s=prefill_s,
            step_s=step_s,
            kv=self.backend.kv.stats(),
        )
        return GenerationResult(
            tokens=tokens,
            text=text,
            finish_reasons=tuple(reasons),
            prompt_lengths=tuple(len(p) for p in prompts),
            notes=tuple(notes),
            metrics=metrics,
        )

    def _step_tokens(
        self,
        step: int,
        ids: np.ndarray,
        done_before: np.ndarray,
        finished: np.ndarray,
        hit: np.ndarray | None,
        last: bool,
        streams: list[TokenStream] | None,
    ) -> StepTokens:
        tokens = tuple(None if done_before[b] else int(ids[b]) for b in range(len(ids)))
        text = None
        if streams is not None:
            pieces = []
            for b, stream in enumerate(streams):
                piece = ""
                if not done_before[b]:
                    stopped = hit is not None and bool(hit[b])
                    if not stopped:  # a stopping id is not part of the text
                        piece = stream.push(int(ids[b]))
                    if stopped or last:
                        piece += stream.flush()
                pieces.append(piece)
            text = tuple(pieces)
        return StepTokens(step=step, tokens=tokens, text=text, finished=tuple(finished.tolist()))
