"""Twenty-fifth session: time variants of the 4-bit FP8 GEMV's ring (steps in flight at M <= 4,
8 and 16, blocks an SM) in one process, each against the copy bandwidth of the same run, every
variant's output checked bit for bit against the first one of its form. Run from the repository
root on the H200, after ``bash tools/gpu_run.sh`` (its PYTHONPATH):

    python3 docs/benchmarks/data/h200_s25_sweep.py - "zp:8,8,6,2;zp:4,4,2,3;sym:6,4,2,3"
    python3 docs/benchmarks/data/h200_s25_sweep.py EPK_X "zp:4,4,2,3" --rows 1,4,8

DEFINES (``-`` for none) are prepended to the .cu source: the session's runs switched
temporary source edits with them (``EPK_ZP_U32``: zero points with the u32 scale slot, now
``F8_Q4_ZP_U32``; ``EPK_REFILL_CLAMP``, ``EPK_NOZERO``: refills without zeroing, not kept). A
variant is ``form:D4,D8,D16,blocks`` with form ``zp`` (zero points; its scale slot as the
registered kernels', `ep.kernels.q4f8._entry`) or ``sym``. ``--device cpu`` runs the NumPy twin of
the zero-point kernel for a smoke test (its timings mean nothing).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[3]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import bench_kernels as bk  # noqa: E402

from ep.device import KERNELS, get_device  # noqa: E402
from ep.kernels import matmul, mx4f8, q4f8  # noqa: E402
from ep.kernels.matmul import _FLAG_EARLY, _x16  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("defines")
    p.add_argument("variants")
    p.add_argument("--rows", default="1,4")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tag", default="")
    p.add_argument("--device", default="cuda")
    p.add_argument("--shape", default="896x151936")
    a = p.parse_args()
    defines = [d for d in a.defines.split(",") if d and d != "-"]
    body = "".join(f"#define {d}\n" for d in defines) + matmul._cuda_source()
    base = q4f8.Q4F8_KERNELS["ep_gemv_q4f8_bf16"]
    dev = get_device(a.device)
    s = dev.default_stream
    K, N = map(int, a.shape.split("x"))
    rng = np.random.default_rng(0)
    variants = []
    for v in a.variants.split(";"):
        form, nums = v.split(":")
        d4, d8, d16, b = map(int, nums.split(","))
        name = f"ep_gemv_q4f8x_{form}_d{d4}_{d8}_{d16}b{b}_bf16"
        entry = q4f8._entry(name, form == "zp", (d4, d8, d16), b)
        source = f"{body}\ntypedef __nv_bfloat16 T;\n{entry}"
        KERNELS._kernels[name] = replace(base, name=name, entry=name, source=source)
        variants.append((form, name, b))
    big = a.device == "cuda"
    copy = bk.copy_bandwidth(dev, (1 << 30) if big else 1 << 20, 20)["bytes_per_s"]
    print(f"copy {copy / 1e12:.3f} TB/s defines={defines}", flush=True)
    for form in ("zp", "sym"):
        runs = [v for v in variants if v[0] == form]
        if not runs:
            continue
        w = bk._weights("q4f8" + ("+sym" if form == "sym" else ""), rng, K, N)
        wbytes = sum(x.nbytes for x in w.values())
        copies = max(1, min(64, -(-(256 << 20) // wbytes))) if big else 2
        pool = [{k: dev.to_device(v, stream=s) for k, v in w.items()} for _ in range(copies)]
        for M in map(int, a.rows.split(",")):
            x = dev.alloc((M, K), bk.BF16, stream=s)
            x.copy_from_host(bk._bf16(rng, (M, K)), stream=s)
            out = dev.alloc((M, N), bk.BF16, stream=s)
            ref = None
            for _, name, b in runs:
                shape = mx4f8.launch_shape(dev, N, K, b)[:3]
                shared = mx4f8.shared_bytes(M, K, block_sums=True)

                def launch(wt: dict, name: str = name, b: int = b, shape: tuple = shape,
                           shared: int = shared, x=x, out=out, M: int = M) -> None:  # fmt: skip
                    args = [out, x, wt["b"], wt["scales"], wt.get("zp", wt["b"]), M, N, K,
                            _x16(x, K) | _FLAG_EARLY]  # fmt: skip
                    mx4f8.f8_launch(dev, name, "4-bit", b, shape, shared, args, stream=s)

                dev.fill(out, float("nan"), stream=s)
                launch(pool[0])
                got = out.to_host(stream=s).view(np.uint16).copy()
                same = "ref" if ref is None else ("bits=" if np.array_equal(got, ref) else "DIFFER")
                ref = got if ref is None else ref
                seq = [pool[i % copies] for i in range(max(copies, 8))]

                def record(launch=launch, seq: list = seq) -> int:
                    for wt in seq:
                        launch(wt)
                    return len(seq)

                t = bk.time_graph(dev, record, lambda: None, a.reps)
                ratio = (wbytes + 2 * M * K + 2 * M * N) / (t.median_ms * 1e-3) / copy
                print(f"{a.tag} {form} M={M} {name:40s} {t.median_ms * 1e3:7.2f} us "
                      f"[{t.min_ms * 1e3:.2f}-{t.max_ms * 1e3:.2f}] {ratio:.3f} {same}",
                      flush=True)  # fmt: skip
            x.free()
            out.free()
        for wt in pool:
            for buf in wt.values():
                buf.free()
    after = bk.copy_bandwidth(dev, (1 << 30) if big else 1 << 20, 20)["bytes_per_s"]
    print(f"copy after {after / 1e12:.3f} TB/s")


if __name__ == "__main__":
    main()
