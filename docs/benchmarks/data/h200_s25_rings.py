"""Twenty-fifth session: each ring of the registered 4-bit FP8 GEMV kernels (zero points: d8b2,
d4b3, d6b3; symmetric: d6b3, d8b2, d4b3) timed four times in one process, the order reversed
every round, so that no ring always runs first (``tools/bench_kernels.py`` times its formats in
a fixed order). Run from the repository root on the H200, after ``bash tools/gpu_run.sh``:

    python3 docs/benchmarks/data/h200_s25_rings.py          # prints a line a form, M and ring
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import bench_kernels as bk  # noqa: E402

from ep.device import get_device  # noqa: E402
from ep.kernels import q4f8  # noqa: E402

K, N = 896, 151936
FORMS = (("q4f8", ["d8b2", "d4b3", "d6b3"]), ("q4f8+sym", ["d6b3", "d8b2", "d4b3"]))


def main() -> None:
    dev = get_device("cuda")
    s = dev.default_stream
    rng = np.random.default_rng(1)
    copy = bk.copy_bandwidth(dev, 1 << 30, 20)["bytes_per_s"]
    print(f"copy {copy / 1e12:.3f} TB/s")
    for form, rings in FORMS:
        w = bk._weights(form, rng, K, N)
        wbytes = sum(v.nbytes for v in w.values())
        copies = max(1, min(64, -(-(256 << 20) // wbytes)))
        pool = [{k: dev.to_device(v, stream=s) for k, v in w.items()} for _ in range(copies)]
        packs = [q4f8.PackedQ4F8(p["b"], p["scales"], p.get("zp"), N, K) for p in pool]
        for M in (1, 4, 8):
            x = dev.alloc((M, K), bk.BF16, stream=s)
            x.copy_from_host(bk._bf16(rng, (M, K)), stream=s)
            out = dev.alloc((M, N), bk.BF16, stream=s)
            times: dict[str, list[float]] = {r: [] for r in rings}
            for ring in rings:  # compiled and loaded before any capture
                q4f8.gemv_q4_f8(dev, out, x, packs[0], M=M, stream=s, resident=True, ring=ring)
            for rnd in range(4):
                for ring in rings if rnd % 2 == 0 else rings[::-1]:
                    seq = [packs[i % copies] for i in range(max(copies, 8))]

                    def record(ring: str = ring, seq: list = seq, x=x, out=out,
                               M: int = M) -> int:  # fmt: skip
                        for w4 in seq:
                            q4f8.gemv_q4_f8(dev, out, x, w4, M=M, stream=s, resident=True,
                                            ring=ring)  # fmt: skip
                        return len(seq)

                    times[ring].append(bk.time_graph(dev, record, lambda: None, 20).median_ms)
            moved = wbytes + 2 * M * K + 2 * M * N
            for ring in rings:
                med = float(np.median(times[ring])) * 1e3
                print(f"{form:9s} M={M} {ring}: median {med:.2f} us  ratio "
                      f"{moved / (med * 1e-6) / copy:.3f}  all "
                      + " ".join(f"{v * 1e3:.2f}" for v in times[ring]), flush=True)  # fmt: skip
            x.free()
            out.free()
        for p in pool:
            for buf in p.values():
                buf.free()
    print(f"copy after {bk.copy_bandwidth(dev, 1 << 30, 20)['bytes_per_s'] / 1e12:.3f} TB/s")


if __name__ == "__main__":
    main()
