"""Per-call overhead of this project's ops inside ONNX Runtime, against built-in ops.

Runs one-node models on the CPU: our RMSNorm (a Python custom op through onnxruntime-extensions and
the genai-ep hook) against ONNX Runtime's SimplifiedLayerNormalization on the same tensors, and an
Identity model as the floor of a ``session.run`` call. Reports microseconds per ``run`` (median and
spread over repeats of timed blocks), the NumPy kernel alone, and ours ÷ built-in in the same run.

    python tools/bench_op_overhead.py                 # small shapes, a few seconds
    python tools/bench_op_overhead.py --shapes 1x64,8x4096 --repeats 30 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import onnxruntime_extensions
from onnx import TensorProto, helper

import ep.ops as eo
from ep.ops.norm import rms_norm


def _model(nodes: list[Any]) -> bytes:
    graph = helper.make_graph(
        nodes,
        "bench",
        [
            helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("w", TensorProto.FLOAT, None),
        ],
        [helper.make_empty_tensor_value_info("y")],
    )
    return eo.make_model(graph).SerializeToString()


def _session(nodes: list[Any]) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1  # overhead, not parallel speed
    so.log_severity_level = 3
    eo.register_session_options(so)
    return ort.InferenceSession(_model(nodes), so, providers=["CPUExecutionProvider"])


def _time(calls: dict[str, Callable[[], object]], inner: int, repeats: int) -> dict[str, list]:
    """Microseconds per call, one figure per timed block of ``inner`` calls. The candidates take
    turns block by block, so a noisy neighbour slows all of them alike."""
    for call in calls.values():
        for _ in range(max(inner // 4, 10)):
            call()
    out: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(repeats):
        for name, call in calls.items():
            start = time.perf_counter_ns()
            for _ in range(inner):
                call()
            out[name].append((time.perf_counter_ns() - start) / inner / 1e3)
    return out


def _summary(samples: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(samples, n=10) if len(samples) >= 2 else samples * 9
    return {
        "median_us": statistics.median(samples),
        "p10_us": qs[0],
        "p90_us": qs[-1],
        "min_us": min(samples),
        "samples": len(samples),
    }


def machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "onnxruntime": ort.__version__,
        "onnxruntime_extensions": onnxruntime_extensions.__version__,
    }


def bench(shape: tuple[int, ...], inner: int, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    feeds = {
        "x": rng.standard_normal(shape).astype(np.float32),
        "w": rng.standard_normal(shape[-1]).astype(np.float32),
    }
    ours = _session(eo.make_nodes("RMSNorm", ["x", "w"], ["y"], name="rms", epsilon=1e-6))
    builtin = _session(
        [helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["y"], epsilon=1e-6)]
    )
    floor = _session([helper.make_node("Identity", ["x"], ["y"])])
    np.testing.assert_allclose(
        ours.run(None, feeds)[0], builtin.run(None, feeds)[0], rtol=1e-5, atol=1e-6
    )
    calls: dict[str, Callable[[], object]] = {
        "identity_run": lambda: floor.run(None, feeds),
        "builtin_run": lambda: builtin.run(None, feeds),
        "ours_run": lambda: ours.run(None, feeds),
        "ours_checked_run": lambda: eo.run(ours, None, feeds),
        "numpy_kernel": lambda: rms_norm(feeds["x"], feeds["w"], epsilon=1e-6),
    }
    rows = _time(calls, inner, repeats)
    stats = {name: _summary(samples) for name, samples in rows.items()}
    ours_med = stats["ours_run"]["median_us"]
    builtin_med = stats["builtin_run"]["median_us"]
    floor_med = stats["identity_run"]["median_us"]
    return {
        "shape": list(shape),
        "bytes": int(feeds["x"].nbytes),
        "stats": stats,
        "ours_over_builtin": ours_med / builtin_med,
        "ours_op_overhead_us": ours_med - floor_med,
        "builtin_op_overhead_us": builtin_med - floor_med,
    }


def _shape(text: str) -> tuple[int, ...]:
    return tuple(int(d) for d in text.lower().split("x"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--shapes",
        default="1x64,1x4096,16x4096",
        help="comma-separated shapes, e.g. 1x64,8x4096 (default %(default)s)",
    )
    parser.add_argument("--inner", type=int, default=200, help="calls per timed block")
    parser.add_argument("--repeats", type=int, default=15, help="timed blocks per measurement")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    info = machine()
    results = [bench(_shape(s), args.inner, args.repeats) for s in args.shapes.split(",")]
    print(" ".join(f"{k}={v}" for k, v in info.items()))
    print(f"{'shape':>10} {'what':>17} {'median µs':>10} {'p10':>8} {'p90':>8}")
    for res in results:
        shape = "x".join(map(str, res["shape"]))
        for name, st in res["stats"].items():
            print(
                f"{shape:>10} {name:>17} {st['median_us']:10.2f} {st['p10_us']:8.2f} "
                f"{st['p90_us']:8.2f}"
            )
        print(
            f"{shape:>10} {'ours/builtin':>17} {res['ours_over_builtin']:10.2f}   "
            f"op overhead over Identity: ours {res['ours_op_overhead_us']:.2f} µs, "
            f"built-in {res['builtin_op_overhead_us']:.2f} µs"
        )
    if args.json:
        payload = {
            "machine": info,
            "inner": args.inner,
            "repeats": args.repeats,
            "results": results,
        }
        args.json.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
