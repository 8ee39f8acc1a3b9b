"""Where a launch of the FP8 MXFP4 GEMV (``ep_gemv_mx4f8_bf16``) spends its time, on a GPU.

The kernel compiled with ``EPK_TRACE`` (the .cu file, ``f8_run``) has each warpgroup record
the global timer at its start, after the PDL wait, after staging x and at its end, plus its SM
and its steps. A graph of L launches over a pool of weight copies (each launch reads its weights
from HBM, as in ``tools/bench_kernels.py``) is replayed; the last replay's records are
summarised per launch (µs from the launch's first warpgroup start): the spread of the starts, the
PDL wait, the staging, the loop and the ends, and the gap to the previous launch's last end.
``--out DIR`` also writes the raw records (``trace_<ring>_m<M>.npz``: int64 [L, warpgroups, 8]);
``--records FILE`` summarises such a file again, without a GPU.

The timestamps change the code ptxas schedules: the traced M <= 8 loop sinks its ring refills to
the end of a round (nvdisasm), as the untraced kernel did before its refills became volatile
predicated loads, so its loop times there describe that older schedule (22.1 µs a launch
against the production kernel's 21.6 in one run; docs/benchmarks/h200.md, fifteenth session).
The starts, waits, staging and start-order effects it shows hold for both.

    python3 tools/trace_mx4f8.py [--rows 1] [--ring d8b3] [--launches 8] [--out DIR]
    python3 tools/trace_mx4f8.py --records docs/benchmarks/data/h200_s14_trace_d8b3_m1.npz
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ep.device import KernelSource, get_device, register_kernel
from ep.errors import DeviceUnavailableError
from ep.kernels import mx4f8

BF16 = np.dtype(ml_dtypes.bfloat16)
FIELDS = (
    "start",
    "after PDL wait",
    "after staging",
    "end",
    "clock start",
    "clock end",
    "SM",
    "steps",
)


def trace_source(ring: str) -> KernelSource:
    """The ``ring`` variant compiled with EPK_TRACE (a trace pointer as its last argument)."""
    depth, per_sm = (int(v) for v in ring[1:].split("b"))
    return mx4f8.kernel_source(f"ep_gemv_mx4f8_trace_{ring}_bf16", depth, per_sm, trace=True)


def spread(v: np.ndarray) -> str:
    """p50 / p90 / max of µs values."""
    return "/".join(f"{q:.2f}" for q in np.percentile(v, [50, 90, 100]))


def summarise(t: np.ndarray) -> list[str]:
    """Lines describing each launch of the records ``t`` (int64 ns [L, warpgroups, 8])."""
    lines, prev_end = [], None
    for i, r in enumerate(t):
        t0, t1, t2, t3 = (r[:, k].astype(np.float64) / 1000 for k in range(4))
        start, end = t0.min(), t3.max()
        gap = f"{start - prev_end:+.2f}" if prev_end is not None else "-"
        lines.append(
            f"launch {i}: span {end - start:.2f} us, start - previous end {gap} | starts "
            f"{spread(t0 - start)} | PDL wait {spread(t1 - t0)} | staging {spread(t2 - t1)} | "
            f"loop min {np.min(t3 - t2):.2f} p50/p90/max {spread(t3 - t2)} | ends "
            f"p10 {np.percentile(t3 - start, 10):.2f} p50/p90/max {spread(t3 - start)}"
        )
        prev_end = end
    r = t[-1]
    loop = (r[:, 3] - r[:, 2]) / 1000
    for n in np.unique(r[:, 7]):
        sel = loop[r[:, 7] == n]
        lines.append(
            f"  last launch, {sel.size} warpgroups of {n} steps: loop p50/p90/max {spread(sel)}"
        )
    # each SM's warpgroups by the order they started in: the later, the longer their loop
    t0, sm = r[:, 0], r[:, 6]
    rank = np.empty(len(r), np.int64)
    for k in np.unique(sm):
        on = np.flatnonzero(sm == k)
        rank[on[np.argsort(t0[on], kind="stable")]] = np.arange(on.size)
    ends = (r[:, 3] - t0.min()) / 1000
    for k in np.unique(rank):
        sel = rank == k
        lines.append(
            f"  last launch, warpgroups started {k + 1}. on their SM ({sel.sum()}): start p50 "
            f"{np.median((t0[sel] - t0.min()) / 1000):.2f}, loop p50 {np.median(loop[sel]):.2f}, "
            f"end p50 {np.median(ends[sel]):.2f} max {ends[sel].max():.2f}"
        )
    per_sm = np.array([loop[sm == k].mean() for k in np.unique(sm)])
    lines.append(
        f"  last launch, mean loop of an SM's warpgroups: min {per_sm.min():.2f} {spread(per_sm)}"
    )
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=1, help="M, rows of x (1..16)")
    ap.add_argument("--ring", default="d8b3", help="a ring of ep.kernels.mx4f8.RINGS")
    ap.add_argument("--N", type=int, default=151936)
    ap.add_argument("--K", type=int, default=896)
    ap.add_argument("--launches", type=int, default=8, help="launches in the graph")
    ap.add_argument("--out", type=Path, help="a folder for the raw records")
    ap.add_argument("--records", type=Path, help="summarise a saved .npz instead (no GPU)")
    args = ap.parse_args()
    if args.records:
        print("\n".join(summarise(np.load(args.records)["records"])))
        return 0
    rings = [f"d{d}b{b}" for d, b in mx4f8.RINGS]
    if args.ring not in rings:
        ap.error(
            f"--ring {args.ring!r}: expected one of {', '.join(rings)} (ep.kernels.mx4f8.RINGS)"
        )
    if not 1 <= args.rows <= 16:
        ap.error(f"--rows {args.rows}: the GEMV takes 1 to 16 rows")
    try:
        dev = get_device("cuda")
    except DeviceUnavailableError as exc:
        print(f"trace_mx4f8: needs a GPU with wgmma (sm_90a): {exc}", file=sys.stderr)
        return 2
    s = dev.default_stream
    M, N, K, L = args.rows, args.N, args.K, args.launches
    name = register_kernel(trace_source(args.ring)).name
    kernel = dev.kernel(name)
    kernel.load()  # before the capture
    rng = np.random.default_rng(0)
    b = rng.integers(0, 256, (N, K // 32, 16), dtype=np.uint8)
    sc = rng.integers(118, 124, (N, K // 32), dtype=np.uint8)
    pool = [mx4f8.upload_mx4f8(dev, b, sc, N=N, K=K, stream=s, name=f"w{i}") for i in range(4)]
    x = dev.to_device(rng.standard_normal((M, K)).astype(BF16), stream=s, name="x")
    out = dev.alloc((M, N), BF16, stream=s, name="y")
    per_sm = int(args.ring.split("b")[1])
    T, S, blocks, sizes = mx4f8.launch_shape(dev, N, K, per_sm)
    groups = mx4f8.block_warps(per_sm) // 4  # warpgroups a block
    wgs = groups * blocks
    trace = dev.alloc((L, wgs, 8), np.dtype(np.uint64), stream=s, name="trace")
    flags = mx4f8.mx4_arguments(
        "trace", dev, out, x, pool[0].weights, pool[0].scales, M=M, N=N, K=K, sizes=sizes,
        resident=True, exact=False,
    )  # fmt: skip
    shared = mx4f8.shared_bytes(M, K)
    with dev.capture(stream=s) as cap:
        for i in range(L):
            w, rec = pool[i % len(pool)], trace.view(shape=(wgs, 8), offset=i * wgs * 64)
            kernel.launch(blocks, 128 * groups, out, x, w.weights, w.scales, M, N, K, flags, rec,
                          stream=s, shared_mem=shared)  # fmt: skip
    start, end = dev.create_event(timing=True), dev.create_event(timing=True)
    per_launch = []
    for _ in range(6):
        s.record(start)
        cap.graph.launch(stream=s)
        s.record(end)
        per_launch.append(end.elapsed_ms(start) * 1000 / L)
    records = trace.to_host(stream=s).astype(np.int64)
    print(
        f"{name}: M={M} N={N} K={K}, {blocks} blocks, {wgs} warpgroups, {T} tiles of {S} steps; "
        f"events {statistics.median(per_launch):.2f} us a launch "
        f"(replays {', '.join(f'{v:.2f}' for v in per_launch)})"
    )
    print("\n".join(summarise(records)))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(
            args.out / f"trace_{args.ring}_m{M}.npz", records=records, fields=np.array(FIELDS)
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
