"""The bits of every decode GEMV variant, saved or compared: proof that a kernel change kept them.

Runs `ep.kernels.matmul.gemm` / `gemm_nbits` / `gemm_mxfp4` on fixed seeded inputs over every
format (dense [N, K] and [K, N], 4-bit with and without zero points, MXFP4), dtype (fp32, fp16,
bf16), a set of shapes (the Qwen2.5-0.5B layer projections and odd ones), M = 1, 3, 16, with and
without a workspace (the K split over blocks) and with and without the SwiGLU epilogue, and
records a SHA-256 of each output's bytes (outputs poisoned with NaN first):

    python3 tools/gemv_bits.py save before.json      # on the GPU, before the change
    python3 tools/gemv_bits.py check before.json     # after it: exit 1 naming what differs

A kernel refactor that should not change any result is proven on the device by one ``save`` on the
old code and one ``check`` on the new (the fifth session's lean GEMV: 1440 outputs, all equal).
``--device cpu`` runs the kernels' NumPy twins (a smoke test of this script); ``--quick`` runs the
small shapes only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "plugins", ROOT / "graphs"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from ep.device import Device, get_device  # noqa: E402
from ep.kernels import matmul  # noqa: E402
from ep.ops.matmul import quantize_mxfp4, quantize_nbits  # noqa: E402

FORMATS = ("nk", "kn", "q4", "q4zp", "mx4")
DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
# (N, K): QKV, O, gate/up, down, the gate/up's transpose; then odd sizes (unaligned K, a K split)
SHAPES = ((1152, 896), (896, 896), (9728, 896), (896, 4864), (72, 1024), (208, 520), (96, 2048))
QUICK = ((72, 1024), (208, 520), (96, 2048))
ROWS = (1, 3, 16)


def _weights(dev: Device, fmt: str, dtype: np.dtype, w: np.ndarray) -> list[Any]:
    s = dev.default_stream
    if fmt == "nk":
        return [dev.to_device(w.astype(dtype), stream=s)]
    if fmt == "kn":
        return [dev.to_device(np.ascontiguousarray(w.T).astype(dtype), stream=s)]
    if fmt.startswith("q4"):
        b, scales, zp = quantize_nbits(w, block_size=32, zero_point=fmt == "q4zp")
        return [
            dev.to_device(b, stream=s),
            dev.to_device(scales.astype(dtype), stream=s),
            dev.to_device(zp, stream=s) if zp is not None else None,
        ]
    return [dev.to_device(a, stream=s) for a in quantize_mxfp4(w)]


def cases(dev: Device, shapes: tuple[tuple[int, int], ...]) -> Iterator[tuple[str, str]]:
    """(case name, SHA-256 of its output bytes) for every variant, in a fixed order."""
    s = dev.default_stream
    workspace = matmul.matmul_workspace(dev, stream=s)
    for dtype in DTYPES:
        for fmt in FORMATS:
            for N, K in shapes:
                if fmt == "mx4" and K % 32:
                    continue
                rng = np.random.default_rng(N * 7 + K)
                w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
                weights = _weights(dev, fmt, dtype, w)
                for M in ROWS:
                    x_host = rng.standard_normal((M, K)).astype(np.float32).astype(dtype)
                    x = dev.to_device(x_host, stream=s)
                    for ws in (None, workspace):
                        epilogues = (None, 0, 1) if fmt != "kn" and N % 16 == 0 else (None,)
                        for swiglu in epilogues:
                            y = dev.alloc((M, N if swiglu is None else N // 2), dtype, stream=s)
                            dev.fill(y, float("nan"), stream=s)
                            common = dict(M=M, N=N, K=K, stream=s, workspace=ws, swiglu=swiglu)
                            if fmt in ("nk", "kn"):
                                matmul.gemm(
                                    dev, y, x, weights[0], transpose_b=int(fmt == "nk"), **common
                                )
                            elif fmt.startswith("q4"):
                                matmul.gemm_nbits(dev, y, x, *weights, block_size=32, **common)
                            else:
                                matmul.gemm_mxfp4(dev, y, x, *weights, **common)
                            digest = hashlib.sha256(y.to_host(stream=s).tobytes()).hexdigest()
                            split = "ws" if ws is not None else "nows"
                            yield f"{dtype}-{fmt}-{N}x{K}-M{M}-{split}-swiglu{swiglu}", digest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("mode", choices=("save", "check"))
    p.add_argument("path", type=Path, help="the JSON of case -> SHA-256 (written or read)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="the small shapes only")
    s = p.parse_args(argv)
    dev = get_device(s.device)
    got = dict(cases(dev, QUICK if s.quick else SHAPES))
    if s.mode == "save":
        s.path.write_text(json.dumps(got, indent=0))
        print(f"saved {len(got)} output digests to {s.path}")
        return 0
    saved = json.loads(s.path.read_text())
    differ = [k for k in got if k in saved and saved[k] != got[k]]
    new = [k for k in got if k not in saved]
    print(f"compared {len(got) - len(new)} outputs with {s.path}: {len(differ)} differ"
          + (f", {len(new)} not in the file" if new else ""))  # fmt: skip
    for key in differ:
        print(f"  differs: {key}")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
