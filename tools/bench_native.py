"""Benchmark: the native executor's decode step, on the CPU against ort, on CUDA against the floor.

``--device cpu`` (default): the tiny model (``--model``, default tests/data/genai-llama-tiny/
genai-fp32) on the ``ort`` backend and on the native executor with capture policy ``never`` and
``warmup``, batch 1 and 4. Every mode's greedy tokens must equal ort's (EOS masked), else the exit
status is 1. Reported: ms per decode step and the ratio native / ort.

``--device cuda``: a Qwen2.5-0.5B-shaped bf16 ep model with random weights (hidden 896, 24
layers, 14 heads, 2 KV heads, head_dim 64, intermediate 4864, vocab 151936, tied embeddings, qkv
bias), built once into ``--work`` (about 10 s; reused when its spec file matches). Modes, at
batch 1, 4 and 16: ``native-capture`` (warmup policy: 2 eager steps, then a CUDA graph replayed),
``native-loop`` (the same, decoding with the device token loop: ``steps(tokens, --loop)``, one
host synchronisation per ``--loop`` greedy steps, the logits never leave the device),
``native-eager`` (policy never) and ``hf-eager`` (Hugging Face transformers' ``Qwen2ForCausalLM``
with the same weights in bf16 on the GPU, a ``DynamicCache``, no compile and no graphs; skipped
with a note when torch or transformers does not import). Also: the device copy bandwidth (bytes
read + written per second, `bench_kernels.copy_bandwidth`), the bandwidth floor = weight bytes
read per step ÷ that bandwidth (convention of DESIGN.md: 0.99 GB at ~4 TB/s ~ 0.25 ms; the
embedding table is counted once, as the tied LM head reads it whole), tokens/s per batch and the
batch-16 ÷ batch-1 tokens/s ratio, against the targets: <= 0.5 ms per step at batch 1 and >= 10x
batch-1 tokens/s at batch 16, for native-capture and for native-loop.

KV layout on CUDA (``--layout``, default ``seq_major_fixed``): seq-major with a fixed
full-context per-sequence stride, so a capacity growth during timing moves nothing and the
captured graph is kept (counted as ``growth_keeps``). ``head_major`` instead reserves prompt +
warm-up + timed steps at prefill, so no growth happens while timing. Each run reports the capture
counters and how many captures happened inside the timed window (should be 0).

Timing: each repeat prefills ``--prompt`` random tokens per row (equal lengths: no padding), runs
``--warmup`` steps, then times ``--steps`` steps; repeats are interleaved across modes (order
rotated). A step's time is host wall-clock from the call to logits (native/ort: logits on the
host; HF: next tokens on the device, synchronised); on CUDA the device time between CUDA events
around the step is recorded beside it. Reported: median, min and max over every timed step.

``--offload POLICY --budget 100%,75%,50%,25% --piece 32MiB``: one ``native-offload@BUDGET`` mode
per budget (``native-offload`` when one budget is given), at every batch (``--batches 1,2,4,8`` or
``--batches 1 2 4 8``); see the end of ``--help``. ``--spec qwen2.5-1.5b`` picks a larger model
(hidden 1536, 28 layers, vocab 151936, tied: 3.1 GB in bf16) whose tied table alone is over a
quarter of it; ``--spec qwen2.5-0.5b`` is the default, any other text is `ModelSpec.parse` input.

Every part (model build, copy bandwidth, each mode at each batch, the HF reference) is guarded:
an error is recorded in the JSON (``errors``) and the rest still runs.

    python tools/bench_native.py                          # CPU, prints a table
    python tools/bench_native.py --device cuda --out DIR  # writes DIR/bench_native.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "plugins", ROOT / "graphs"):  # run from a checkout without installing
    if str(_path) not in sys.path:
        sys.path.append(str(_path))

from _bench import machine_info, spread  # noqa: E402

TINY_MODEL = ROOT / "tests" / "data" / "genai-llama-tiny" / "genai-fp32"
QWEN_SPEC = (
    "hidden=896,layers=24,heads=14,kv_heads=2,head_dim=64,intermediate=4864,vocab=151936,"
    "tie=true,bias=true,theta=1000000,eps=1e-6,dtype=bf16,type=qwen2"
)
QWEN15_SPEC = (
    "hidden=1536,layers=28,heads=12,kv_heads=2,head_dim=128,intermediate=8960,vocab=151936,"
    "tie=true,bias=true,theta=1000000,eps=1e-6,dtype=bf16,type=qwen2"
)
SPEC_PRESETS = {"qwen2.5-0.5b": QWEN_SPEC, "qwen2.5-1.5b": QWEN15_SPEC}
CPU_MODES = ("ort", "native-never", "native-warmup")
CUDA_MODES = ("native-capture", "native-loop", "native-fused", "native-fused-loop", "native-eager",
              "hf-eager")  # fmt: skip
FUSED_MODES = ("native-fused", "native-fused-loop", "native-fused-loop-sync")  # batch 1 only
SYNC_MODES = ("native-loop-sync", "native-fused-loop-sync")  # --loop-sync: run_ahead off
# the modes the targets are read from, and their keys' tags
TARGET_MODES = (("native-capture", ""), ("native-loop", "_loop"), ("native-fused", "_fused"),
                ("native-fused-loop", "_fused_loop"))  # fmt: skip
# the plan mode a fused mode's batch 16 runs as (the fused step takes batch 1 only)
FUSED_PLAN_MODES = {"native-fused": "native-capture", "native-fused-loop": "native-loop"}
TARGET_B1_MS = 0.5
TARGET_SCALING = 10.0
OFFLOAD_NOTE = (
    "adds a mode 'native-offload@BUDGET' per budget (a comma list: 100%%,75%%,50%%,25%%): the "
    "native backend with offload=POLICY (a registered offload policy), budget=BUDGET and "
    "piece=PIECE (weights over PIECE bytes streamed in pieces; warmup capture, which runs eagerly "
    "when the plan is not address-stable). Reported per (budget, batch): the store's counters, "
    "host-to-device bytes per timed step and per token, byte hit rate, ms per step and ms per "
    "step / (bytes streamed per step / pinned host-to-device bandwidth measured in the same run), "
    "target <= 1.2 on CUDA. Without an offload= in NativeBackend the modes are skipped."
)


@dataclass(frozen=True)
class Settings:
    """What one run measures (the parsed command line)."""

    device: str
    model: str
    batches: tuple[int, ...]
    prompt: int
    warmup: int
    steps: int
    repeats: int
    layout: str
    context: int
    work: str
    out: str
    seed: int
    no_hf: bool
    offload: str
    budgets: tuple[str, ...]
    piece: str
    spec: str
    run_on: str
    loop: int = 16
    loop_sync: bool = False


@dataclass
class ModeRun:
    """One mode at one batch: samples pooled over the repeats."""

    mode: str
    batch: int
    wall_ms: list[float] = field(default_factory=list)
    event_ms: list[float] = field(default_factory=list)
    tokens: list[list[list[int]]] = field(default_factory=list)  # per repeat: [B][steps]
    capture: dict[str, Any] = field(default_factory=dict)
    captures_during_timing: int = 0
    offload: dict[str, Any] = field(default_factory=dict)
    fused: dict[str, Any] = field(default_factory=dict)
    error: str = ""
    note: str = ""

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"mode": self.mode, "batch": self.batch}
        if self.wall_ms:
            ms = spread(self.wall_ms)
            out["step_ms"] = ms
            out["tokens_per_s"] = self.batch / (ms["median"] * 1e-3)
            out["samples"] = len(self.wall_ms)
        if self.event_ms:
            out["event_step_ms"] = spread(self.event_ms)
        if self.capture:
            out["capture"] = self.capture
            out["captures_during_timing"] = self.captures_during_timing
        if self.offload:
            out["offload"] = self.offload
        if self.fused:
            out["fused"] = self.fused
        if self.error:
            out["error"] = self.error
        if self.note:
            out["note"] = self.note
        return out


class Errors:
    """Every guarded part's failure, kept for the JSON and printed as it happens."""

    def __init__(self) -> None:
        self.items: list[dict[str, str]] = []

    def add(self, part: str, exc: BaseException) -> str:
        text = f"{type(exc).__name__}: {exc}"
        self.items.append({"part": part, "error": text, "traceback": traceback.format_exc()})
        print(f"[error] {part}: {text}", file=sys.stderr, flush=True)
        return text


# --- decoding ----------------------------------------------------------------------------------


def greedy(logits: np.ndarray, banned: Sequence[int]) -> np.ndarray:
    """Argmax per row with ``banned`` (EOS) masked, so random weights never stop early."""
    masked = np.array(logits, dtype=np.float32, copy=True)
    masked[:, list(banned)] = -np.inf
    return masked.argmax(axis=1).astype(np.int64)


def make_prompts(batch: int, length: int, vocab: int, seed: int) -> list[np.ndarray]:
    """``batch`` random prompts of ``length`` ids (equal lengths: no padding); ids 0..2 avoided."""
    rng = np.random.default_rng(seed + batch)
    return [rng.integers(3, vocab, length, dtype=np.int64) for _ in range(batch)]


def decode_backend(
    backend: Any,
    prompts: list[np.ndarray],
    s: Settings,
    banned: Sequence[int],
    run: ModeRun,
    timer: Callable[[], tuple[Any, Any]] | None = None,
) -> None:
    """Prefill, ``s.warmup`` steps, then ``s.steps`` timed steps of a ``Backend``; into ``run``."""
    reserve = s.prompt + s.warmup + s.steps + 1 if s.layout == "head_major" else 0
    tokens = greedy(backend.prefill(prompts, reserve=reserve), banned)
    seen: list[np.ndarray] = []
    metrics = getattr(backend, "capture_metrics", None)
    captures_before = 0
    htod_before = 0
    events = timer() if timer is not None else None  # one pair, read after every step
    stream = getattr(backend, "stream", None)
    for i in range(s.warmup + s.steps):
        if i == s.warmup and metrics is not None:
            captures_before = metrics.captures
        if i == s.warmup:
            htod_before = _htod_bytes(backend)
        t0 = time.perf_counter()
        if events is not None and stream is not None:
            stream.record(events[0])
        logits = backend.step(tokens)
        if events is not None and stream is not None:
            stream.record(events[1])
        t1 = time.perf_counter()
        if i >= s.warmup:
            run.wall_ms.append((t1 - t0) * 1e3)
            if events is not None and stream is not None:
                run.event_ms.append(events[1].elapsed_ms(events[0]))
        tokens = greedy(logits, banned)
        seen.append(tokens)
    run.tokens.append(np.stack(seen, axis=1).tolist())
    fused_metrics(backend, run)
    if metrics is not None:
        run.capture = metrics.to_dict()
        run.captures_during_timing += metrics.captures - captures_before
    counters = getattr(backend, "offload_counters", None)
    if counters:
        timed = run.offload.get("htod_bytes_timed", 0) + _htod_bytes(backend) - htod_before
        steps = run.offload.get("timed_steps", 0) + s.steps
        run.offload = {
            "counters": counters,
            "htod_bytes_timed": timed,
            "timed_steps": steps,
            "htod_bytes_per_step": timed / steps,
            "htod_bytes_per_token": timed / (steps * len(prompts)),
        }


@dataclass
class LoopRunner:
    """``native-loop``: a native backend decoding with its device token loop in runs of k greedy
    steps (stop ids masked, as `greedy` does), one host synchronisation a run; with ``ahead``
    (the generator's ``decode.run_ahead``, default) the next run is launched before the host
    waits for this one, so the device never waits for the host."""

    backend: Any
    k: int
    ahead: bool = True

    def close(self) -> None:
        self.backend.close()


def decode_loop(
    runner: LoopRunner,
    prompts: list[np.ndarray],
    s: Settings,
    banned: Sequence[int],
    run: ModeRun,
    timer: Callable[[], tuple[Any, Any]] | None = None,
) -> None:
    """Like `decode_backend`, stepping ``runner.k`` steps a run; each timed run's wall clock
    (from the last run's tokens on the host to its own) and the device time between events
    around its launches are spread evenly over its steps."""
    backend = runner.backend
    reserve = s.prompt + s.warmup + s.steps + 1 if s.layout == "head_major" else 0
    metrics = backend.capture_metrics
    tokens = greedy(backend.prefill(prompts, reserve=reserve), banned)
    sizes: list[tuple[str, int]] = []  # (phase, steps) of each run
    for phase, total in (("warmup", s.warmup), ("timed", s.steps)):
        sizes += [(phase, min(runner.k, total - done)) for done in range(0, total, runner.k)]
    stream = backend.stream

    def launch(i: int, ids: np.ndarray | None) -> tuple[Any, Any]:
        events = timer() if timer is not None else None
        if events is not None:
            stream.record(events[0])
        n = sizes[i][1]
        launched = backend.launch_steps(ids, n, mask=banned, mask_steps=n)
        if events is not None:
            stream.record(events[1])
        return launched, events

    seen: list[np.ndarray] = []
    recorded = metrics.captures
    queued = launch(0, tokens)
    last = time.perf_counter()
    for i, (phase, n) in enumerate(sizes):
        if phase == "timed" and sizes[i - 1][0] == "warmup":
            recorded = metrics.captures
        this, events = queued
        if runner.ahead and i + 1 < len(sizes):
            queued = launch(i + 1, None)  # before this run is read: its last pick is the input
        out = backend.collect(this)
        now = time.perf_counter()
        if phase == "timed":
            run.wall_ms.extend([(now - last) * 1e3 / n] * n)
            if events is not None:
                run.event_ms.extend([events[1].elapsed_ms(events[0]) / n] * n)
        last = now
        seen.extend(out)
        if not runner.ahead and i + 1 < len(sizes):
            queued = launch(i + 1, out[-1])
    run.tokens.append(np.stack(seen, axis=1).tolist())
    fused_metrics(backend, run)
    run.capture = metrics.to_dict()
    run.captures_during_timing += metrics.captures - recorded


def fused_metrics(backend: Any, run: ModeRun) -> None:
    """A native backend's ``metrics.fused`` into ``run`` when its fused step is on."""
    fused = getattr(backend, "fused_metrics", None)
    if fused is not None and fused["mode"] != "off":
        run.fused = fused


def _htod_bytes(backend: Any) -> int:
    counters = getattr(backend, "offload_counters", None)
    return int(counters["htod_bytes"]) if counters else 0


def offload_rows(rows: list[dict[str, Any]], htod: dict[str, float] | None) -> None:
    """Per offload row: byte hit rate, and ms/step over the streamed bytes' copy time."""
    for row in rows:
        off = row.get("offload")
        if not off:
            continue
        off["byte_hit_rate"] = off["counters"]["byte_hit_rate"]
        per_step = off.get("htod_bytes_per_step")
        if htod and per_step and "step_ms" in row:
            floor = per_step / htod["bytes_per_s"] * 1e3
            off["stream_floor_ms"] = floor
            off["ms_over_stream_floor"] = row["step_ms"]["median"] / floor


def offload_mode(s: Settings, budget: str) -> str:
    """``native-offload`` for a single budget, else ``native-offload@BUDGET``."""
    return "native-offload" if len(s.budgets) == 1 else f"native-offload@{budget}"


def offload_backends(
    model: Callable[[], Any], s: Settings, device: Any, notes: list[str], errors: Errors
) -> dict[str, Any]:
    """One native backend per ``--budget`` (by mode name), each with a freshly loaded model."""
    out: dict[str, Any] = {}
    for budget in s.budgets:
        mode = offload_mode(s, budget)
        try:
            found = offload_backend(model(), s, device, notes, errors, budget, mode)
        except Exception as exc:
            errors.add(f"build {mode}", exc)
            continue
        if found is not None:
            out[mode] = found
    return out


def offload_backend(
    model: Any,
    s: Settings,
    device: Any,
    notes: list[str],
    errors: Errors,
    budget: str,
    mode: str = "native-offload",
) -> Any | None:
    """The native backend with ``--offload``, ``budget`` and ``--piece`` (None when unsupported)."""
    import inspect

    from ep.config import check_implements
    from ep.native import NativeBackend
    from ep.plugins import get_host
    from ep.registry import option_values
    from ep_builtin.capture_warmup import WarmupCapture

    if "offload" not in inspect.signature(NativeBackend).parameters:
        notes.append(f"--offload {s.offload} skipped: NativeBackend takes no offload= here")
        return None
    try:
        entry = get_host().registry.get("offload", s.offload, where=f"--offload {s.offload}")
        policy = entry.factory(option_values(entry, {}))
        check_implements("offload", policy, entry)
        takes_piece = "piece" in inspect.signature(NativeBackend).parameters
        extra: dict[str, Any] = {"piece": s.piece} if takes_piece else {}
        return NativeBackend(
            model, make_layout(s.layout), device=device, capture=WarmupCapture(steps=2),
            offload=policy, budget=budget, cache_dir=s.work, **extra,
            sources={"offload": "command line --offload", "budget": "command line --budget"},
        )  # fmt: skip
    except Exception as exc:
        errors.add(f"build {mode}", exc)
        return None


def htod_bandwidth(dev: Any, nbytes: int, reps: int) -> dict[str, float]:
    """Pinned host -> device copy: bytes per second (median over ``reps`` copies)."""
    s = dev.default_stream
    src = dev.alloc_pinned(nbytes, np.uint8, stream=s, name="htod-src")
    dst = dev.alloc(nbytes, np.uint8, stream=s, name="htod-dst")
    start, end = dev.create_event(timing=True), dev.create_event(timing=True)
    samples = []
    for i in range(reps + 3):
        s.record(start)
        dev.copy(dst, src, stream=s)
        s.record(end)
        if i >= 3:
            samples.append(end.elapsed_ms(start))
    src.free()
    dst.free()
    med = statistics.median(samples)
    return {
        "bytes": nbytes,
        "median_ms": med,
        "min_ms": min(samples),
        "max_ms": max(samples),
        "bytes_per_s": nbytes / (med * 1e-3),
    }


# --- CPU: native against ort on the tiny model ---------------------------------------------------


def close_all(runners: dict[str, Any], errors: Errors) -> None:
    """Give back what a backend holds beyond garbage collection (an offload store)."""
    for mode, runner in runners.items():
        try:
            close = getattr(runner, "close", None)
            if close is not None:
                close()
        except Exception as exc:
            errors.add(f"close {mode}", exc)


def bench_cpu(s: Settings, errors: Errors, notes: list[str]) -> dict[str, Any]:
    from ep.errors import ConfigError
    from ep.model import load_model
    from ep.native import NativeBackend
    from ep.runtime import create_backend
    from ep_builtin.capture_never import NeverCapture
    from ep_builtin.capture_warmup import WarmupCapture

    model = load_model(s.model)
    need = s.prompt + s.warmup + s.steps + 1
    if need >= model.context_length:
        raise ConfigError(
            f"--prompt {s.prompt} + --warmup {s.warmup} + --steps {s.steps} needs {need} tokens; "
            f"the model's context is {model.context_length}: lower them"
        )
    makers: dict[str, Callable[[], Any]] = {
        "ort": lambda: create_backend("ort", model, make_layout(s.layout)),
        "native-never": lambda: NativeBackend(
            model, make_layout(s.layout), capture=NeverCapture(), cache_dir=s.work
        ),
        "native-warmup": lambda: NativeBackend(
            model, make_layout(s.layout), capture=WarmupCapture(steps=2), cache_dir=s.work
        ),
    }
    backends: dict[str, Any] = {}
    for mode, make in makers.items():
        try:
            backends[mode] = make()
        except Exception as exc:
            errors.add(f"build {mode}", exc)
    modes = list(CPU_MODES)
    htod: dict[str, float] | None = None
    if s.offload:
        modes += [offload_mode(s, b) for b in s.budgets]
        backends |= offload_backends(lambda: model, s, "cpu", notes, errors)
        try:
            from ep.device import get_device

            htod = htod_bandwidth(get_device("cpu"), 16 << 20, reps=5)
        except Exception as exc:
            errors.add("host-to-device bandwidth", exc)
    runs = interleave(s, modes, backends, model.vocab_size, model.eos_token_ids, errors)
    close_all(backends, errors)
    rows = [r.summary() for r in runs]
    offload_rows(rows, htod)
    mismatches = token_mismatches(runs, reference="ort")
    ratios: dict[str, Any] = {}
    for b in s.batches:
        base = next((r for r in runs if r.mode == "ort" and r.batch == b and r.wall_ms), None)
        for r in runs:
            if r.batch == b and r.mode != "ort" and r.wall_ms and base is not None:
                ratios[f"{r.mode}/ort@{b}"] = statistics.median(r.wall_ms) / statistics.median(
                    base.wall_ms
                )
    return {
        "model": {
            "path": str(model.onnx_path),
            "flavour": model.flavour,
            "vocab": model.vocab_size,
        },
        "rows": rows,
        **({"htod": htod} if htod else {}),
        "ratio_native_over_ort": ratios,
        "tokens_match": not mismatches and bool(runs),
        "token_mismatches": mismatches,
    }


def make_layout(name: str) -> Any:
    from ep_builtin.kv_head_major import HeadMajorLayout
    from ep_builtin.kv_seq_major import SeqMajorLayout

    if name == "head_major":
        return HeadMajorLayout(min_capacity=16)
    if name == "seq_major":
        return SeqMajorLayout(min_capacity=16)
    return SeqMajorLayout(min_capacity=16, fixed_stride=True)


def interleave(
    s: Settings,
    modes: Sequence[str],
    runners: dict[str, Any],
    vocab: int,
    banned: Sequence[int],
    errors: Errors,
    timer: Callable[[], tuple[Any, Any]] | None = None,
) -> list[ModeRun]:
    """Every batch, every repeat, every mode (order rotated per repeat); a failing mode at a
    batch is recorded and skipped for the rest of that batch's repeats."""
    runs: list[ModeRun] = []
    for b in s.batches:
        prompts = make_prompts(b, s.prompt, vocab, s.seed)
        modes_b = [m for m in modes if b == 1 or m not in FUSED_MODES]
        by_mode = {m: ModeRun(m, b) for m in modes_b}
        runs += by_mode.values()
        for m in modes_b:
            if m not in runners:
                by_mode[m].error = "not built (see errors)"
        for r in range(s.repeats):
            order = list(modes_b[r % len(modes_b) :]) + list(modes_b[: r % len(modes_b)])
            for m in order:
                run = by_mode[m]
                if run.error or m not in runners:
                    continue
                try:
                    runner = runners[m]
                    if isinstance(runner, HFRunner):
                        runner.decode(prompts, s, banned, run)
                    elif isinstance(runner, LoopRunner):
                        decode_loop(runner, prompts, s, banned, run, timer)
                    else:
                        decode_backend(runner, prompts, s, banned, run, timer)
                except Exception as exc:
                    run.error = errors.add(f"{m} batch {b} repeat {r}", exc)
            done = [f"{m} {statistics.median(by_mode[m].wall_ms):.3f}" for m in modes_b
                    if by_mode[m].wall_ms]  # fmt: skip
            print(f"batch {b} repeat {r + 1}/{s.repeats}: ms/step " + ", ".join(done), flush=True)
    return runs


def token_mismatches(runs: list[ModeRun], reference: str) -> list[str]:
    """Modes whose greedy tokens differ from ``reference``'s (same batch, same repeat)."""
    out: list[str] = []
    for ref in (r for r in runs if r.mode == reference and r.tokens):
        for r in runs:
            if r.batch != ref.batch or r.mode == reference or not r.tokens:
                continue
            for i, toks in enumerate(r.tokens):
                if i < len(ref.tokens) and toks != ref.tokens[i]:
                    out.append(
                        f"{r.mode} batch {r.batch} repeat {i}: tokens differ from {reference}"
                    )
                    break
    return out


# --- CUDA: the Qwen2.5-0.5B shape ----------------------------------------------------------------


def model_spec(text: str, context: int) -> Any:
    """The benchmark model's `ModelSpec` (``text`` as `ModelSpec.parse` reads it) at ``context``."""
    import dataclasses

    from ep_graphs import ModelSpec

    return dataclasses.replace(ModelSpec.parse(text), context_length=context)


def hf_mismatch(spec: Any, device_kind: str) -> str:
    """Why the transformers reference cannot mirror ``spec`` here ("" when it can)."""
    if device_kind != "cuda":
        return f"the transformers reference runs on CUDA only (device {device_kind})"
    if spec.model_type != "qwen2" or not spec.qkv_bias or not spec.tie_embeddings:
        return "the transformers reference is Qwen2ForCausalLM: it needs type=qwen2, bias, tie"
    if spec.head_dim * spec.num_heads != spec.hidden_size:
        return "Qwen2ForCausalLM derives head_dim = hidden / heads; the spec's differs"
    return ""


def weight_bytes(spec: Any) -> int:
    """Bytes of every weight one decode step reads (the tied table once), at the spec's dtype."""
    from ep_graphs import expected_shapes

    item = {"fp32": 4, "fp16": 2, "bf16": 2}[spec.dtype]
    return sum(int(np.prod(shape)) * item for shape in expected_shapes(spec).values())


def build_or_reuse(spec: Any, work: Path, seed: int, weights: dict[str, np.ndarray] | None) -> Path:
    """The ep model folder for ``spec`` under ``work`` (reused when its spec file matches)."""
    import hashlib

    from ep_graphs import build_model, random_weights

    tag = hashlib.sha256(json.dumps(spec.to_dict(), sort_keys=True).encode()).hexdigest()[:8]
    folder = work / f"{spec.model_type}-{spec.hidden_size}x{spec.num_layers}-{spec.dtype}-{tag}"
    marker = work / f"{folder.name}.spec.json"
    wanted = json.dumps({"spec": spec.to_dict(), "seed": seed}, sort_keys=True)
    built = (folder / "genai_config.json").is_file() and marker.is_file()
    if built and marker.read_text() == wanted:
        print(f"model: reusing {folder}", flush=True)
        return folder
    t0 = time.perf_counter()
    build_model(spec, weights or random_weights(spec, seed), flavour="ep", out_dir=folder)
    marker.write_text(wanted)
    print(f"model: built {folder} in {time.perf_counter() - t0:.1f} s", flush=True)
    return folder


class HFRunner:
    """Hugging Face transformers' Qwen2ForCausalLM with the benchmark's weights, bf16, on CUDA."""

    def __init__(self, spec: Any, weights: dict[str, np.ndarray]) -> None:
        import torch
        import transformers
        from transformers import Qwen2Config, Qwen2ForCausalLM

        self.torch = torch
        config = Qwen2Config(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_kv_heads,
            max_position_embeddings=spec.context_length,
            rms_norm_eps=spec.rms_norm_eps,
            rope_theta=spec.rope_theta,
            tie_word_embeddings=True,
            use_cache=True,
        )
        rope = getattr(config, "rope_parameters", None)
        if isinstance(rope, dict):  # transformers 5 keeps theta here
            rope["rope_theta"] = spec.rope_theta
        model = Qwen2ForCausalLM(config)  # initialised on the CPU: the plainest path
        state = {k: torch.from_numpy(np.asarray(v, dtype=np.float32)) for k, v in weights.items()}
        result = model.load_state_dict(state, strict=False)
        del state
        model = model.to(device="cuda", dtype=torch.bfloat16).eval()
        missing = [k for k in result.missing_keys if k != "lm_head.weight"]
        self.load_note = (
            f"weights not loaded (left at random init): missing {missing[:4]}, unexpected "
            f"{list(result.unexpected_keys)[:4]}"
            if missing or result.unexpected_keys
            else "the benchmark's weights"
        )
        if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
            model.lm_head.weight = model.model.embed_tokens.weight  # tied, as the ep model is
        self.model = model
        head, table = model.lm_head.weight, model.model.embed_tokens.weight
        self.info = {
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "attn_implementation": str(getattr(model.config, "_attn_implementation", "")),
            "lm_head_tied": bool(head.data_ptr() == table.data_ptr()),
            "weights": self.load_note,
        }

    def decode(
        self, prompts: list[np.ndarray], s: Settings, banned: Sequence[int], run: ModeRun
    ) -> None:
        torch = self.torch
        ids = torch.from_numpy(np.stack(prompts)).to("cuda")
        ban = torch.tensor(list(banned), device="cuda", dtype=torch.long)
        seen: list[Any] = []

        def pick(logits: Any) -> Any:
            last = logits[:, -1].float()
            last[:, ban] = float("-inf")
            return last.argmax(dim=-1)

        with torch.inference_mode():
            out = self.model(input_ids=ids, use_cache=True)
            past = out.past_key_values
            nxt = pick(out.logits)
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            for i in range(s.warmup + s.steps):
                t0 = time.perf_counter()
                start.record()
                out = self.model(input_ids=nxt[:, None], past_key_values=past, use_cache=True)
                past = out.past_key_values
                nxt = pick(out.logits)
                end.record()
                end.synchronize()
                t1 = time.perf_counter()
                if i >= s.warmup:
                    run.wall_ms.append((t1 - t0) * 1e3)
                    run.event_ms.append(start.elapsed_time(end))
                seen.append(nxt)
        run.tokens.append(torch.stack(seen, dim=1).cpu().tolist())
        run.note = "next tokens stay on the device (argmax there); no compile, no CUDA graphs"


def bench_cuda(s: Settings, errors: Errors, notes: list[str]) -> dict[str, Any]:
    from ep.device import get_device

    result: dict[str, Any] = {}
    dev = get_device(s.run_on)  # no GPU: DeviceUnavailableError says why, in words
    try:
        from bench_kernels import machine_info as gpu_info

        result["gpu"] = gpu_info(dev)
    except Exception as exc:
        errors.add("gpu machine info", exc)
    spec = model_spec(s.spec, s.context)
    hf_unfit = hf_mismatch(spec, dev.kind)
    wbytes = weight_bytes(spec)
    result["model"] = {"spec": spec.to_dict(), "weight_bytes": wbytes, "layout": s.layout}

    weights: dict[str, np.ndarray] | None = None
    if not (s.no_hf or hf_unfit):
        try:
            from ep_graphs import random_weights

            weights = random_weights(spec, s.seed)  # the same weights for HF and the native model
        except Exception as exc:
            errors.add("random weights", exc)
    folder: Path | None = None
    try:
        folder = build_or_reuse(spec, Path(s.work), s.seed, weights)
    except Exception as exc:
        errors.add("build model", exc)

    try:
        from bench_kernels import copy_bandwidth

        copy = copy_bandwidth(dev, 1 << 30, reps=20)
        result["copy"] = copy
        floor = wbytes / copy["bytes_per_s"] * 1e3
        result["floor_ms"] = floor
        result["floor_convention"] = (
            "weight bytes read per step / device-to-device copy bandwidth counted as bytes read "
            "+ written per second (the copy's total HBM traffic)"
        )
        print(f"copy {copy['bytes_per_s'] / 1e12:.2f} TB/s; floor {floor:.3f} ms/step", flush=True)
    except Exception as exc:
        errors.add("copy bandwidth", exc)

    runners: dict[str, Any] = {}
    vocab, banned = spec.vocab_size, list(spec.eos_token_ids)
    if folder is not None:
        from ep.model import load_model
        from ep.native import NativeBackend
        from ep_builtin.capture_never import NeverCapture
        from ep_builtin.capture_warmup import WarmupCapture

        policies = {
            "native-capture": WarmupCapture(steps=2),
            "native-loop": WarmupCapture(steps=2),
            "native-fused": WarmupCapture(steps=2),
            "native-fused-loop": WarmupCapture(steps=2),
            "native-eager": NeverCapture(),
            **({m: WarmupCapture(steps=2) for m in SYNC_MODES} if s.loop_sync else {}),
        }
        for mode, policy in policies.items():
            try:
                model = load_model(folder)
                vocab, banned = model.vocab_size, list(model.eos_token_ids)
                t0 = time.perf_counter()
                backend = NativeBackend(
                    model, make_layout(s.layout), device=dev, capture=policy, cache_dir=s.work,
                    fused="on" if mode in FUSED_MODES else "off",
                )  # fmt: skip
                loop = "-loop" in mode
                ahead = mode not in SYNC_MODES
                runners[mode] = LoopRunner(backend, s.loop, ahead) if loop else backend
                print(f"{mode}: ready in {time.perf_counter() - t0:.1f} s", flush=True)
            except Exception as exc:
                errors.add(f"build {mode}", exc)
        if s.offload:
            try:
                result["htod"] = htod_bandwidth(dev, 256 << 20, reps=20)
            except Exception as exc:
                errors.add("host-to-device bandwidth", exc)
            model_folder = folder
            runners |= offload_backends(lambda: load_model(model_folder), s, dev, notes, errors)
    if s.no_hf:
        result["hf"] = {"skipped": "--no-hf"}
    elif hf_unfit:
        result["hf"] = {"skipped": hf_unfit}
    elif weights is None:
        result["hf"] = {"skipped": "no weights (see errors)"}
    else:
        try:
            hf = HFRunner(spec, weights)
            runners["hf-eager"] = hf
            result["hf"] = hf.info
        except ImportError as exc:
            result["hf"] = {"skipped": f"torch/transformers do not import: {exc}"}
            print(f"hf-eager skipped: {exc}", flush=True)
        except Exception as exc:
            result["hf"] = {"error": errors.add("build hf-eager", exc)}
    weights = None  # the host copy is not needed any more

    def timer() -> tuple[Any, Any]:
        return dev.create_event(timing=True), dev.create_event(timing=True)

    modes = [m for m in CUDA_MODES if m != "hf-eager" or "hf-eager" in runners]
    if s.loop_sync:
        modes[4:4] = SYNC_MODES
    if s.offload:
        modes[3:3] = [offload_mode(s, b) for b in s.budgets]
    runs = interleave(s, modes, runners, vocab, banned, errors, timer)
    close_all(runners, errors)
    result["rows"] = [r.summary() for r in runs]
    offload_rows(result["rows"], result.get("htod"))
    exact = [r for r in runs if r.mode != "hf-eager" and r.mode not in FUSED_MODES]
    mismatches = token_mismatches(exact, "native-eager")
    result["tokens_match"] = not mismatches
    result["token_mismatches"] = mismatches
    result["fused_token_agreement"] = fused_agreement(runs)
    result["hf_token_agreement"] = hf_agreement(runs)
    result["targets"] = targets(runs, result.get("floor_ms"))
    return result


def fused_agreement(runs: list[ModeRun]) -> dict[str, Any]:
    """Per fused mode (batch 1): the share of its greedy tokens equal to native-eager's, and
    the first step where they part, per repeat (None: never). The fused kernel sums in its own
    order, so near-ties may break the other way (random weights give flat logits)."""
    out: dict[str, Any] = {}
    ref = next((r for r in runs if r.mode == "native-eager" and r.batch == 1), None)
    for run in (r for r in runs if r.mode in FUSED_MODES and r.tokens):
        if ref is None or not ref.tokens:
            continue
        pairs = [(np.array(a[0]), np.array(b[0]))
                 for a, b in zip(run.tokens, ref.tokens, strict=False)]  # fmt: skip
        pairs = [(a, b) for a, b in pairs if a.shape == b.shape]
        if not pairs:
            continue
        first = [int(np.argmax(a != b)) if (a != b).any() else None for a, b in pairs]
        same = float(np.mean([float((a == b).mean()) for a, b in pairs]))
        out[run.mode] = {"share_equal": same, "first_difference": first}
    return out


def hf_agreement(runs: list[ModeRun]) -> dict[str, float]:
    """Share of HF's greedy tokens equal to native-eager's (bf16 sums differ: informative only)."""
    out: dict[str, float] = {}
    for hf in (r for r in runs if r.mode == "hf-eager" and r.tokens):
        ref = next((r for r in runs if r.mode == "native-eager" and r.batch == hf.batch), None)
        if ref is None or not ref.tokens:
            continue
        a, b = np.array(hf.tokens[0]), np.array(ref.tokens[0])
        if a.shape == b.shape:
            out[f"batch {hf.batch}"] = float((a == b).mean())
    return out


def targets(runs: list[ModeRun], floor: float | None) -> dict[str, Any]:
    """The DESIGN.md targets, from the capture mode's medians (logits on the host every step)
    and from the device token loop's (``_loop`` keys). A fused mode runs batch 1 only: with
    ``decode.fused`` a batch of 16 runs the plan, so its scaling takes the plan mode's batch 16
    (`FUSED_PLAN_MODES`; the key's ``batch16_mode`` says which), the two targets of one
    configuration."""
    out: dict[str, Any] = {}
    for mode, tag in TARGET_MODES:
        med = {r.batch: statistics.median(r.wall_ms) for r in runs
               if r.mode == mode and r.wall_ms}  # fmt: skip
        mode16 = mode
        if 16 not in med and mode in FUSED_PLAN_MODES:
            mode16 = FUSED_PLAN_MODES[mode]
            med.update({r.batch: statistics.median(r.wall_ms) for r in runs
                        if r.mode == mode16 and r.batch == 16 and r.wall_ms})  # fmt: skip
        if 1 in med:
            b1 = med[1]
            out[f"batch1_ms{tag}"] = {
                "value": b1,
                "target": TARGET_B1_MS,
                "met": b1 <= TARGET_B1_MS,
            }
            if floor:
                out[f"batch1_over_floor{tag}"] = b1 / floor
        if 1 in med and 16 in med:
            scaling = (16 / med[16]) / (1 / med[1])
            out[f"tokens_per_s_16_over_1{tag}"] = {
                "value": scaling, "target": TARGET_SCALING, "met": scaling >= TARGET_SCALING,
                "batch16_mode": mode16,
            }  # fmt: skip
    return out


# --- output ---------------------------------------------------------------------------------


def table(payload: dict[str, Any]) -> str:
    """The short summary printed last."""
    m = payload["machine"]
    gpu = payload.get("gpu", {}).get("gpu", "")
    lines = [
        f"machine: {m.get('cpu')} ({m.get('usable_cores')} cores), python {m.get('python')}"
        + (f", {gpu}" if gpu else ""),
        f"{'mode':19s} {'batch':>5s} {'ms/step':>9s} {'min..max':>17s} {'tok/s':>9s}  note",
    ]
    for row in payload.get("rows", []):
        if "step_ms" not in row:
            lines.append(f"{row['mode']:19s} {row['batch']:5d}  -- {row.get('error', 'no data')}")
            continue
        t = row["step_ms"]
        note = []
        if "captures_during_timing" in row and row["capture"].get("enabled"):
            c = row["capture"]
            note.append(
                f"replays {c['replays']} captures {c['captures']} "
                f"(in timing {row['captures_during_timing']}) keeps {c['growth_keeps']}"
            )
        off = row.get("offload")
        if off:
            note.append(f"htod/token {off['htod_bytes_per_token'] / 1e6:.2f} MB")
            if "ms_over_stream_floor" in off:
                note.append(f"ms/stream floor {off['ms_over_stream_floor']:.2f} (target <= 1.2)")
        lines.append(
            f"{row['mode']:19s} {row['batch']:5d} {t['median']:9.3f} "
            f"{t['min']:8.3f}..{t['max']:<8.3f} {row['tokens_per_s']:9.1f}  {' '.join(note)}"
        )
    offloaded = [r for r in payload.get("rows", []) if r.get("offload") and "step_ms" in r]
    if offloaded:
        lines.append(
            f"{'offload mode':22s} {'batch':>5s} {'htod/token':>12s} {'byte hit':>9s} "
            f"{'ms/step':>9s} {'ms/stream floor':>16s}"
        )
        for row in offloaded:
            off = row["offload"]
            ratio = off.get("ms_over_stream_floor")
            lines.append(
                f"{row['mode']:22s} {row['batch']:5d} {off['htod_bytes_per_token']:12.0f} "
                f"{off['byte_hit_rate']:9.3f} {row['step_ms']['median']:9.3f} "
                + (f"{ratio:16.2f}" if ratio is not None else f"{'-':>16s}")
            )
        if "htod" in payload:
            lines.append(
                f"host-to-device bandwidth {payload['htod']['bytes_per_s'] / 1e9:.2f} GB/s "
                "(pinned, this run); ms/stream floor target <= 1.2 on CUDA"
            )
    for key, value in payload.get("ratio_native_over_ort", {}).items():
        lines.append(f"ratio {key}: {value:.2f}")
    if any("capture" in r for r in payload.get("rows", [])):
        lines.append(
            "capture counters are cumulative per backend (over batches); 'in timing' "
            "counts captures inside timed steps"
        )
    if "floor_ms" in payload:
        c = payload["copy"]
        lines.append(
            f"floor {payload['floor_ms']:.3f} ms = {payload['model']['weight_bytes'] / 1e9:.3f} GB "
            f"/ {c['bytes_per_s'] / 1e12:.2f} TB/s (copy, read + written)"
        )
    t = payload.get("targets", {})
    for mode, tag in TARGET_MODES:
        if f"batch1_ms{tag}" in t:
            b1 = t[f"batch1_ms{tag}"]
            lines.append(
                f"target batch 1 {mode} {b1['value']:.3f} ms <= {b1['target']}: "
                + ("met" if b1["met"] else "NOT met")
            )
        if f"tokens_per_s_16_over_1{tag}" in t:
            sc = t[f"tokens_per_s_16_over_1{tag}"]
            at16 = sc.get("batch16_mode", mode)
            lines.append(
                f"target batch 16 / batch 1 tokens/s ({mode}"
                + (f"; batch 16: {at16}" if at16 != mode else "")
                + f") {sc['value']:.1f} >= {sc['target']}: "
                + ("met" if sc["met"] else "NOT met")
            )
    if "tokens_match" in payload:
        lines.append("greedy tokens: " + ("identical" if payload["tokens_match"] else "DIFFER"))
    for mode, agree in payload.get("fused_token_agreement", {}).items():
        lines.append(f"{mode} tokens equal to native-eager's: {agree['share_equal']:.3f} (first "
                     f"difference per repeat: {agree['first_difference']})")  # fmt: skip
    for e in payload.get("errors", []):
        lines.append(f"error in {e['part']}: {e['error']}")
    for note in payload.get("notes", []):
        lines.append(f"note: {note}")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> Settings:
    parser = argparse.ArgumentParser(
        description=(__doc__ or "").split("\n")[0],
        epilog=f"--offload/--budget: {OFFLOAD_NOTE}",
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--model", default=str(TINY_MODEL), help="CPU mode's model folder")
    parser.add_argument(
        "--batches", "--batch", nargs="+", help="1 2 4 or 1,2,4 (default: cpu 1 4; cuda 1 4 16)"
    )
    parser.add_argument("--prompt", type=int, default=32, help="prompt tokens per row")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps after the prefill")
    parser.add_argument("--steps", type=int, help="timed steps per repeat (cpu 32, cuda 64)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats per mode")
    parser.add_argument(
        "--layout",
        choices=("auto", "seq_major_fixed", "head_major", "seq_major"),
        default="auto",
        help="KV layout (auto: cpu head_major, as ort on a genai model needs; cuda "
        "seq_major_fixed). head_major reserves every timed token at prefill (no growth)",
    )
    parser.add_argument("--context", type=int, default=2048, help="CUDA model's context length")
    parser.add_argument("--work", default="", help="build/cache folder (default: a temp dir)")
    parser.add_argument(
        "--out", default=os.environ.get("OUT", ""), help="writes bench_native.json (default $OUT)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--spec", default="qwen2.5-0.5b", help="CUDA mode's model: qwen2.5-0.5b (default), "
        "qwen2.5-1.5b (does not fit a small budget) or ModelSpec.parse text",
    )  # fmt: skip
    parser.add_argument(
        "--run-on", default="", help="run the --device cuda benchmark on this device instead "
        "(cpu: a smoke test of this script with a small --spec; its times mean nothing)",
    )  # fmt: skip
    parser.add_argument("--no-hf", action="store_true", help="skip the transformers reference")
    parser.add_argument(
        "--loop", type=int, default=16, help="native-loop: greedy steps per host sync (steps(k))"
    )
    parser.add_argument(
        "--loop-sync", action="store_true", help="also native-loop-sync and "
        "native-fused-loop-sync: the loops with decode.run_ahead off (each run launched after "
        "the host read the last)",
    )  # fmt: skip
    parser.add_argument("--offload", default="", help="an offload policy: adds native-offload")
    parser.add_argument(
        "--budget", "--budgets", default="50%",
        help="offload budget(s), comma-separated, e.g. 100%%,75%%,50%%,25%% or 2GiB",
    )  # fmt: skip
    parser.add_argument(
        "--piece", default="32MiB", help="offload.piece: weights over this are streamed in pieces"
    )
    a = parser.parse_args(argv)
    batches: list[int] = []
    for item in a.batches or []:
        for part in str(item).split(","):
            if not part.strip().isdigit():
                parser.error(f"--batches {item!r}: expected integers, e.g. 1,2,4,8 or 1 2 4 8")
            batches.append(int(part))
    a.batches = batches or None
    budgets = tuple(b.strip() for b in a.budget.split(",") if b.strip())
    for name in ("prompt", "steps", "repeats"):
        value = getattr(a, name)
        if value is not None and value < 1:
            parser.error(f"--{name} {value}: expected a positive integer")
    if a.warmup < 0 or any(b < 1 for b in a.batches or [1]):
        parser.error("--warmup must be >= 0 and every --batches value >= 1")
    if a.offload:
        from ep.config import parse_budget, parse_piece
        from ep.errors import ConfigError

        try:
            if not budgets:
                raise ConfigError(f"--budget {a.budget!r}: give at least one budget, e.g. 50%")
            for budget in budgets:
                parse_budget(budget)
            parse_piece(a.piece)
        except ConfigError as exc:
            parser.error(str(exc))
    cuda = a.device == "cuda"
    layout = a.layout if a.layout != "auto" else ("seq_major_fixed" if cuda else "head_major")
    return Settings(
        device=a.device,
        model=a.model,
        batches=tuple(a.batches or ((1, 4, 16) if cuda else (1, 4))),
        prompt=a.prompt,
        warmup=a.warmup,
        steps=a.steps or (64 if cuda else 32),
        repeats=a.repeats,
        layout=layout,
        context=a.context,
        work=a.work or tempfile.mkdtemp(prefix="bench_native-"),
        out=a.out,
        seed=a.seed,
        no_hf=a.no_hf,
        offload=a.offload,
        budgets=budgets,
        piece=a.piece,
        spec=SPEC_PRESETS.get(a.spec.strip().lower(), a.spec),
        run_on=a.run_on or a.device,
        loop=a.loop,
        loop_sync=a.loop_sync,
    )


def main(argv: list[str] | None = None) -> int:
    s = parse_args(argv)
    Path(s.work).mkdir(parents=True, exist_ok=True)
    errors = Errors()
    payload: dict[str, Any] = {
        "tool": "bench_native",
        "machine": machine_info("onnxruntime", "onnxruntime-extensions", "cuda-core", "ml_dtypes"),
        "settings": vars(s) | {"batches": list(s.batches), "budgets": list(s.budgets)},
        "notes": [],
    }
    print("machine:", json.dumps(payload["machine"]), flush=True)
    if s.warmup < 3:
        payload["notes"].append(
            f"--warmup {s.warmup} < 3: the warmup policy captures at step 3, inside the timing"
        )
    if s.offload:
        payload["offload"] = {"policy": s.offload, "budgets": list(s.budgets), "piece": s.piece}
    t0 = time.perf_counter()
    try:
        bench = bench_cuda if s.device == "cuda" else bench_cpu
        payload |= bench(s, errors, payload["notes"])
    except Exception as exc:  # still write what there is
        errors.add(f"{s.device} benchmark", exc)
    payload["seconds"] = time.perf_counter() - t0
    payload["errors"] = errors.items
    if s.out:
        out = Path(s.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "bench_native.json"
        path.write_text(json.dumps(payload, indent=1, default=str))
        print(f"\nfull results: {path}", flush=True)
    print()
    print(table(payload))
    failed = not payload.get("tokens_match", False) or not payload.get("rows")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
