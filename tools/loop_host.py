"""Where the device token loop's time goes, call by call: host, device, and cache growth.

On the benchmark's Qwen2.5-0.5B-shaped bf16 model (`bench_native.py`'s spec and build cache), for
each ``--batch``: one backend is warmed up (a prefill, warm-up steps, one ``steps(k)`` call), then
``--rounds`` rounds each prefill the same prompts again (the cache keeps its buffers, the calls
stay bound, the step's graph stays valid) and time ``--calls`` calls of ``steps(k)``: the host
wall clock, the host's own time (the call minus its one wait for the device, the token download),
the device time between events around the call (all per step), and whether the cache grew in
the call. Also the captured step alone (its graph replayed back to back, no sampling): what
sampling, the step boundary and growth add. The tokens of every round must agree, else the exit
status is 1.

    python3 tools/loop_host.py --batch 1,16 --out DIR     # on the H200: DIR/loop_host.json
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
for _path in (ROOT, ROOT / "plugins", ROOT / "graphs", ROOT / "tools"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _bench import machine_info, replay_ms  # noqa: E402
from bench_native import QWEN_SPEC, make_prompts  # noqa: E402
from profile_native import profiled_backend, profiled_model  # noqa: E402


def _stats(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def time_calls(backend: Any, prompts: list[np.ndarray], k: int, calls: int) -> dict[str, Any]:
    """Prefill ``prompts``, then ``calls`` timed ``steps(k)`` calls; per-step figures."""
    dev, stream = backend.device, backend.stream
    waits: list[float] = []
    download = dev.download

    def timed(*args: Any, **kwargs: Any) -> Any:  # the call's waits for the device
        t0 = time.perf_counter()
        out = download(*args, **kwargs)
        waits.append(time.perf_counter() - t0)
        return out

    start, end = dev.create_event(timing=True), dev.create_event(timing=True)
    token = backend.prefill(prompts).argmax(-1).astype(np.int64)
    wall, host, device, tokens, growths = [], [], [], [], []
    dev.download = timed  # type: ignore[method-assign]
    try:
        for _ in range(calls):
            waits.clear()
            grown = backend.kv.growths
            t0 = time.perf_counter()
            stream.record(start)
            out = backend.steps(token, k)
            stream.record(end)
            seconds = time.perf_counter() - t0
            end.sync()
            wall.append(seconds * 1e3 / k)
            host.append((seconds - sum(waits)) * 1e3 / k)
            device.append(end.elapsed_ms(start) / k)
            growths.append(backend.kv.growths - grown)
            tokens += out.tolist()
            token = out[-1]
    finally:
        del dev.download
    return {"wall": wall, "host": host, "device": device, "growths": growths, "tokens": tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", default="1,16")
    p.add_argument("--k", type=int, default=16, help="steps per steps() call")
    p.add_argument("--calls", type=int, default=4, help="timed calls per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--spec", default=QWEN_SPEC)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--work", default="/tmp/genai-ep-bench")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test with a small --spec")
    s = p.parse_args(argv)

    model = profiled_model(s.spec, s.context, s.work)
    results, agree = [], True
    for batch in (int(b) for b in s.batch.split(",")):
        backend = profiled_backend(model, s.device)
        prompts = make_prompts(batch, s.prompt, model.vocab_size, seed=batch)
        token = backend.prefill(prompts).argmax(-1).astype(np.int64)
        token = backend.steps(backend.steps(token, 3)[-1], s.k)[-1]  # warm-up, the capture
        backend.prefill(prompts)  # the step at the timed calls' first context
        graph = next(iter(backend.capture.graphs.values())).graph
        graph_ms = replay_ms(backend.device, backend.stream, graph, 100)
        runs: dict[str, list[float]] = {}
        seen: list[Any] = []
        for _ in range(s.rounds):
            r = time_calls(backend, prompts, s.k, s.calls)
            seen.append(r.pop("tokens"))
            for name, values in r.items():
                runs.setdefault(name, []).extend(values)
        same = all(t == seen[0] for t in seen)
        agree &= same
        row = {
            "batch": batch,
            "k": s.k,
            "graph_ms": graph_ms,
            "tokens_agree": same,
            "capture": backend.capture_metrics.to_dict(),
            **{n: _stats(x) for n, x in runs.items() if n != "growths"},
            "calls": runs,  # per call, in order: ms a step and the cache's growths in the call
        }
        results.append(row)
        print(f"batch {batch}: the step's graph alone {graph_ms:.3f} ms; rounds agree: {same}")
        line = ", ".join(
            f"{n} {row[n]['median']:.3f} (min {row[n]['min']:.3f})"
            for n in ("wall", "host", "device")
        )
        print(f"  steps({s.k}) ms/step: {line}", flush=True)
        for n in ("wall", "host"):
            print(f"  {n} per call: " + " ".join(f"{x:.3f}" for x in runs[n]))
        print("  growths per call: " + " ".join(str(int(x)) for x in runs["growths"]))
    if s.out:
        Path(s.out).mkdir(parents=True, exist_ok=True)
        payload = {"tool": "loop_host", "machine": machine_info(), "settings": vars(s),
                   "results": results}  # fmt: skip
        (Path(s.out) / "loop_host.json").write_text(json.dumps(payload, indent=1))
    return 0 if agree else 1


if __name__ == "__main__":
    raise SystemExit(main())
