"""The host sampler (`ep.sampling.sample`, what the `ort` backend and host picks run) against the
greedy pick (`np.argmax` on the same logits), same run.

For each setting: ms a call over ``--batch`` rows of ``--vocab`` model-like logits (median, min
and max of ``--rounds`` rounds of ``--reps`` calls), the argmax's, and their ratio; the machine
and NumPy's version. A fixed seed, so every round draws the same tokens.

    python tools/bench_host_sampling.py                      # vocab 151936, batch 1
    python tools/bench_host_sampling.py --vocab 32000 --batch 4 --out results
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for path in (ROOT, ROOT / "tools"):
    if str(path) not in sys.path:  # run from a checkout without installing
        sys.path.insert(0, str(path))

from _bench import machine_info, spread  # noqa: E402

from ep.sampling import SamplingParams, make_rngs, sample  # noqa: E402

SETTINGS: dict[str, SamplingParams] = {
    "t0.8-p0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "t0.7-k50": SamplingParams(temperature=0.7, top_k=50),
    "t0.6-k40-p0.95-m0.02": SamplingParams(temperature=0.6, top_k=40, top_p=0.95, min_p=0.02),
    "t0.6-m0.02": SamplingParams(temperature=0.6, min_p=0.02),
    "t1.0": SamplingParams(temperature=1.0),
}


def _ms(call: Any, reps: int, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        out.append((time.perf_counter() - t0) * 1e3 / reps)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--reps", type=int, default=10, help="calls a round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--settings", default=",".join(SETTINGS))
    parser.add_argument("--out", default=os.environ.get("OUT") or "bench-out")
    args = parser.parse_args(argv)
    names = [n for n in args.settings.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        parser.error(f"--settings: unknown {unknown}; expected some of {', '.join(SETTINGS)}")
    rng = np.random.default_rng(0)
    # model-like: a few large logits above a broad bulk
    logits = (rng.standard_normal((args.batch, args.vocab)) * 2).astype(np.float32)
    logits[:, rng.integers(0, args.vocab, 8)] += 12.0
    greedy = _ms(lambda: np.argmax(logits, axis=-1), args.reps, args.rounds)
    results = []
    print(f"vocab {args.vocab}, batch {args.batch}: ms a call (median, min..max of "
          f"{args.rounds} rounds of {args.reps})")  # fmt: skip
    print(f"  {'argmax':24s} {spread(greedy)['median']:8.3f}")
    for name in names:
        params = SETTINGS[name]
        rngs = make_rngs(7, args.batch)
        times = _ms(lambda p=params, r=rngs: sample(logits, p, r), args.reps, args.rounds)
        s = spread(times)
        results.append({"setting": name, "ms": s, "over_argmax": s["median"] /
                        spread(greedy)["median"]})  # fmt: skip
        print(f"  {name:24s} {s['median']:8.3f}  ({s['min']:.3f}..{s['max']:.3f})  "
              f"{results[-1]['over_argmax']:7.1f}x argmax")  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    payload = {
        "machine": machine_info(),
        "settings": vars(args),
        "argmax_ms": spread(greedy),
        "results": results,
    }
    (out / "bench_host_sampling.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
