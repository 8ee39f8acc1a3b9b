"""Same-process A/B of the split-K GEMVs (fifth session; kept beside its log, not a tool).

This tree's ep_gemv_nk_bf16 / ep_gemv_q4_bf16 against the previous commit's, registered from
.br/old_matmul_kernels.cu as old_<name> (``git show bdf003e~1:ep/kernels/_matmul_kernels.cu >
.br/old_matmul_kernels.cu``), alternating three times on the layer shapes. Run from the
repository root on the GPU machine: ``python3 docs/benchmarks/data/h200_gemv_ab.py``.
"""

import dataclasses
import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, "tools")
import bench_kernels as bk

from ep.device import get_device, register_kernel
from ep.kernels import matmul as mm
from ep.kernels._common import SILU_MUL

NAMES = ("ep_gemv_nk_bf16", "ep_gemv_q4_bf16")
OLD_NK = (
    "  epk::row_gemv<T, epk::DenseRows<T>, 4>(p, y, x, ws, counters, M, N, K, kw, gy, flags, oc);"
)

old_cu = Path(".br/old_matmul_kernels.cu").read_text()
for name in NAMES:
    new = mm.MATMUL_KERNELS[name]
    entry = new.source[new.source.index("typedef __nv_bfloat16 T;") :]
    if "nk" in name:  # the old dense entry had no FULL/TWO dispatch
        entry = entry[: entry.index("  if ((flags")] + OLD_NK + "\n}\n"
    entry = entry.replace(name, "old_" + name)
    source = SILU_MUL + old_cu + "\n" + entry
    register_kernel(
        dataclasses.replace(new, name="old_" + name, entry="old_" + name, source=source)
    )

dev = get_device("cuda")
ws = mm.matmul_workspace(dev, stream=dev.default_stream)
copy = bk.copy_bandwidth(dev, 1 << 30, 10)["bytes_per_s"]
real_plan = mm.plan_matmul
res: dict[tuple[str, int, int, int, str], list[float]] = {}
for _ in range(3):
    for variant in ("new", "old"):

        def plan(*a: Any, variant: str = variant, **k: Any) -> mm.MatmulPlan:
            p = real_plan(*a, **k)
            if variant == "old" and p.kernel in NAMES:
                return dataclasses.replace(p, kernel="old_" + p.kernel)
            return p

        mm.plan_matmul = plan  # type: ignore[assignment]
        for fmt in ("bf16-nk", "q4"):
            for K, N in ((896, 1152), (896, 896), (896, 9728), (4864, 896)):
                rng = np.random.default_rng(0)
                for r in bk.bench_gemv(dev, fmt, K, N, [1, 16], copy, 256 << 20, 30, rng, ws):
                    res.setdefault((fmt, K, N, r.M, variant), []).append(r.timing.median_ms * 1e3)
        mm.plan_matmul = real_plan  # type: ignore[assignment]
print(f"copy {copy / 1e12:.2f} TB/s")
print(f"{'fmt':8} {'K':>5} {'N':>5} {'M':>3}  old us (3 runs)        new us (3 runs)       new/old")
for (fmt, K, N, M, variant), t in sorted(res.items()):
    if variant == "new":
        o = res[(fmt, K, N, M, "old")]
        olds, news = " ".join(f"{x:5.2f}" for x in o), " ".join(f"{x:5.2f}" for x in t)
        ratio = np.median(t) / np.median(o)
        print(f"{fmt:8} {K:5d} {N:5d} {M:3d}  {olds}   {news}   {ratio:.3f}")
