"""The dense decode GEMVs as a decode step runs them: chains over distinct weights, with epilogues.

For each shape of the Qwen2.5-0.5B layers (bf16) and each row count, a CUDA graph of 24 GEMVs
(``--layers``), each over its own weight (24 layers' worth: more than the L2 holds, so every
weight comes from HBM), with resident weights loaded before the PDL wait as the native executor
runs them; the gate/up shape also through its SwiGLU twin (``swiglu`` 1: interleaved gate/up
rows). Prints µs a GEMV (median of 5 replays of 30, min..max), the kernel the plan picked and
the ratio to the device copy bandwidth measured in the same run (weight bytes only: x and y are
a few KB). `tools/bench_kernels.py` times the formats and versions; this script is the A/B for
the kernels of one step, epilogue twins included (the twenty-second session's SwiGLU twin).

    python3 tools/bench_gemv_chain.py [--rows 1,16] [--out DIR]     # on the GPU
    python3 tools/bench_gemv_chain.py --device cpu --layers 2 --reps 1 --rows 1   # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "tools"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _bench import captured_us, machine_info  # noqa: E402
from bench_kernels import copy_bandwidth  # noqa: E402

from ep.device import get_device  # noqa: E402
from ep.kernels import matmul as mm  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
# (K, N, SwiGLU twin too): gate/up, down, O, packed QKV of the 0.5B shape
SHAPES = ((896, 9728, True), (4864, 896, False), (896, 896, False), (896, 1152, False))


def chain(
    dev: Any, ws: Any, K: int, N: int, M: int, swiglu: int | None, layers: int, reps: int
) -> dict[str, Any]:
    stream, rng = dev.default_stream, np.random.default_rng(0)
    host = (rng.standard_normal((N, K)) * 0.02).astype(BF16)
    weights = [dev.to_device(host, stream=stream, name=f"w{i}") for i in range(layers)]
    x = dev.to_device(rng.standard_normal((M, K)).astype(BF16), stream=stream, name="x")
    y = dev.alloc((M, N // 2 if swiglu is not None else N), BF16, stream=stream, name="y")

    def call(w: Any) -> Any:
        return mm.gemm(
            dev, y, x, w, M=M, N=N, K=K, transpose_b=1, stream=stream, workspace=ws,
            resident=True, swiglu=swiglu,
        )  # fmt: skip

    plan = call(weights[0])
    calls = [lambda w=w: call(w) for w in weights]
    us = [captured_us(dev, stream, calls, reps) / layers for _ in range(5)]
    for buf in (*weights, x, y):
        buf.free()
    return {"K": K, "N": N, "M": M, "swiglu": swiglu, "kernel": plan.kernel,
            "us": statistics.median(us), "min": min(us), "max": max(us)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    p.add_argument("--rows", default="1,16", help="row counts, e.g. 1,4,16")
    p.add_argument("--layers", type=int, default=24, help="GEMVs (distinct weights) a chain")
    p.add_argument("--reps", type=int, default=30, help="replays of a chain a sample (5 samples)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu: a smoke run")
    p.add_argument("--out", help="folder for gemv_chain.json")
    args = p.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",") if r.strip()]
    except ValueError:
        rows = []
    if not rows or any(not 1 <= r <= mm.GEMV_MAX_ROWS for r in rows):
        p.error(f"--rows {args.rows!r}: expected row counts in 1..{mm.GEMV_MAX_ROWS}")
    if args.layers < 1 or args.reps < 1:
        p.error("--layers and --reps must be at least 1")
    dev = get_device(args.device)
    ws = mm.matmul_workspace(dev, stream=dev.default_stream)
    bandwidth = copy_bandwidth(dev, 1 << 30, reps=20)["bytes_per_s"]
    print(f"machine: {machine_info('numpy')['cpu']}; copy {bandwidth / 1e12:.2f} TB/s")
    results = []
    for K, N, twin in SHAPES:
        for M in rows:
            for swiglu in (None, 1) if twin else (None,):
                r = chain(dev, ws, K, N, M, swiglu, args.layers, args.reps)
                r["ratio"] = K * N * 2 / (r["us"] * 1e-6) / bandwidth
                results.append(r)
                tag = "swiglu" if swiglu is not None else "plain"
                spread = f"({r['min']:.2f}..{r['max']:.2f})"
                print(f"K={K:5d} N={N:5d} M={M:2d} {tag:6s} {r['kernel']:26s} {r['us']:7.2f} us "
                      f"{spread}  {r['ratio']:.2f}", flush=True)  # fmt: skip
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        payload = {"machine": machine_info("numpy"), "copy_bytes_per_s": bandwidth,
                   "results": results}  # fmt: skip
        (out / "gemv_chain.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
