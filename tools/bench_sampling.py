"""Sampling on the device against greedy on the device and sampling on the host, same run.

For each ``--batch`` and each setting, fresh model-like logits [batch, vocab] (float32; a few
tokens far above the rest, as a trained model's are, or ``--flat`` rows where every token is a
candidate, as a random-weight model's are):

- **sample**: `ep.kernels.sample.sample` (temperature, top-k, top-p, min-p; the row's blocks meet
  in a scratch), a graph of one call replayed ``--reps`` times between two events (device µs a
  call), and the same call launched eagerly (host µs a call: what the device token loop pays);
- **argmax**: the greedy kernel on the same logits, the same way (the floor a sampler can
  approach: one pass over the row);
- **host**: the logits copied to the host and `ep.ops.sample.sample` in NumPy, what
  ``decode.sync_every = 1`` does (wall µs a call, median).

Every call's ids are checked against the NumPy reference first. Ratios are sample ÷ argmax and
host ÷ sample.

    python3 tools/bench_sampling.py --out DIR          # on the H200: DIR/bench_sampling.json
    python3 tools/bench_sampling.py --device cpu --vocab 4099 --batch 1,2 --reps 3   # smoke
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tools"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _bench import captured_us, machine_info  # noqa: E402

SETTINGS = {
    "t0.8-p0.9": dict(temperature=0.8, top_p=0.9),
    "t0.7-k50": dict(temperature=0.7, top_k=50),
    "t0.6-k40-p0.95-min0.02": dict(temperature=0.6, top_k=40, top_p=0.95, min_p=0.02),
    "t1.0": dict(temperature=1.0),
}


def model_like(rng: np.random.Generator, batch: int, vocab: int, flat: bool) -> np.ndarray:
    """float32 logits: N(0, 2) with five hot tokens 4..9 above a row (``flat``: N(0, 0.05))."""
    if flat:
        return (rng.standard_normal((batch, vocab)) * 0.05).astype(np.float32)
    x = rng.standard_normal((batch, vocab)).astype(np.float32) * 2
    for b in range(batch):
        x[b, rng.choice(vocab, 5, replace=False)] += rng.uniform(4, 9, 5).astype(np.float32)
    return x


def _device_us(dev: Any, stream: Any, call: Any, reps: int) -> tuple[float, float]:
    """(device µs of a captured call replayed back to back, host µs of an eager launch)."""
    graph_us = captured_us(dev, stream, [call], reps)
    call()
    stream.sync()
    t0 = time.perf_counter()
    for _ in range(reps):
        call()
    host_us = (time.perf_counter() - t0) * 1e6 / reps
    stream.sync()
    return graph_us, host_us


def bench(dev: Any, batch: int, name: str, settings: dict[str, Any], s: argparse.Namespace) -> dict:
    from ep.kernels import check_faults, new_status, sample
    from ep.ops import sample as ref

    stream = dev.default_stream
    rng = np.random.default_rng(batch)
    values = model_like(rng, batch, s.vocab, s.flat)
    keys = np.stack([np.full(batch, 7), np.arange(batch)], axis=1).astype(np.int64)
    steps = np.zeros(batch, np.int64)
    logits = dev.to_device(values, stream=stream)
    dkeys, dsteps = dev.to_device(keys, stream=stream), dev.to_device(steps, stream=stream)
    ids = dev.alloc(batch, np.int64, stream=stream)
    status = new_status(dev, stream=stream)
    scratch = sample.sample_scratch(dev, batch, stream=stream)
    argmax_scratch = sample.argmax_scratch(dev, batch, stream=stream)
    common = dict(batch=batch, vocab=s.vocab, stream=stream)

    def draw() -> None:
        sample.sample(dev, ids, logits, dkeys, dsteps, status=status, scratch=scratch,
                      **common, **settings)  # fmt: skip

    def greedy() -> None:
        sample.argmax(dev, ids, logits, scratch=argmax_scratch, **common)

    draw()
    want = ref.sample(values, keys, steps, temperature=settings["temperature"],
                      top_k=settings.get("top_k", 0), top_p=settings.get("top_p", 1.0),
                      min_p=settings.get("min_p", 0.0))  # fmt: skip
    same = bool(np.array_equal(ids.to_host(stream=stream), want))
    check_faults(dev, status, stream=stream)
    dev.kernel(sample.SAMPLE_KERNELS["f32"].name).load()
    dev.kernel(sample.ARGMAX_KERNELS["f32"].name).load()
    sample_graph, sample_host = _device_us(dev, stream, draw, s.reps)
    argmax_graph, argmax_host = _device_us(dev, stream, greedy, s.reps)
    walls = []
    for _ in range(max(3, s.reps // 10)):
        t0 = time.perf_counter()
        ref.sample(logits.to_host(stream=stream), keys, steps, temperature=settings["temperature"],
                   top_k=settings.get("top_k", 0), top_p=settings.get("top_p", 1.0),
                   min_p=settings.get("min_p", 0.0))  # fmt: skip
        walls.append((time.perf_counter() - t0) * 1e6)
    host = statistics.median(walls)
    return {
        "batch": batch, "setting": name, "ids_equal_reference": same,
        "sample_graph_us": sample_graph, "sample_launch_host_us": sample_host,
        "argmax_graph_us": argmax_graph, "argmax_launch_host_us": argmax_host,
        "host_numpy_us": host, "host_numpy_us_min": min(walls), "host_numpy_us_max": max(walls),
        "sample_over_argmax": sample_graph / argmax_graph, "host_over_sample": host / sample_graph,
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--batch", default="1,4,16,64")
    p.add_argument("--settings", default=",".join(SETTINGS), help="names from SETTINGS, a,b")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--flat", action="store_true", help="near-equal logits: every token a candidate")
    p.add_argument("--out", default=None)
    s = p.parse_args(argv)
    from ep.device import get_device

    dev = get_device(s.device)
    names = [n for n in SETTINGS if n in s.settings.split(",")]
    unknown = set(s.settings.split(",")) - set(SETTINGS)
    if unknown:
        p.error(f"unknown --settings {sorted(unknown)}; expected names from {list(SETTINGS)}")
    results = []
    print(f"{'batch':>5} {'setting':24} {'sample µs':>10} {'argmax µs':>10} {'ratio':>6} "
          f"{'host µs':>10} {'host/dev':>9} {'launch µs':>10} ids")  # fmt: skip
    for batch in (int(b) for b in s.batch.split(",")):
        for name in names:
            r = bench(dev, batch, name, SETTINGS[name], s)
            results.append(r)
            print(f"{batch:5d} {name:24} {r['sample_graph_us']:10.1f} {r['argmax_graph_us']:10.1f} "
                  f"{r['sample_over_argmax']:6.1f} {r['host_numpy_us']:10.0f} "
                  f"{r['host_over_sample']:9.1f} {r['sample_launch_host_us']:10.1f} "
                  f"{'equal' if r['ids_equal_reference'] else 'DIFFER'}", flush=True)  # fmt: skip
    if s.out:
        out = Path(s.out)
        out.mkdir(parents=True, exist_ok=True)
        payload = {"tool": "bench_sampling", "machine": machine_info(), "device": dev.name,
                   "vocab": s.vocab, "flat": s.flat, "reps": s.reps,
                   "results": results}  # fmt: skip
        (out / "bench_sampling.json").write_text(json.dumps(payload, indent=1))
    return 0 if all(r["ids_equal_reference"] for r in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
