"""Decode kernels on a GPU as fractions of the device's copy bandwidth, measured in the same run.

For each GEMV (the Qwen2.5-0.5B shapes, K x N: 896x896, 896x128, 896x1152 (fused QKV), 896x4864,
896x9728 (fused gate + up), 4864x896, 896x151936;
bf16 activations; dense [N, K], dense [K, N], 4-bit MatMulNBits (block 32, zero points), the same
4-bit weights repacked for ``ep_gemv_q4p`` (``q4p``; ``q4p-d8b2``: a compiled ring), MXFP4 and
the same MXFP4 bytes repacked for ``ep_gemv_mx4p`` (``mx4p``; ``mx4p-d8b2``) and for the FP8
tensor cores' ``ep_gemv_mx4f8`` (``mx4f8``, sm_90a; ``mx4f8-d8b2``), and the 4-bit weights for
the FP8 tensor cores' ``ep_gemv_q4f8`` (``q4f8``, sm_90a; ``q4f8-d6b3``); ``+sym`` after a 4-bit
format (``q4p+sym``, ``q4f8-d6b3+sym``): symmetric weights, no zero points (every one 8, as the
onnxruntime-genai model builder writes them);
M = 1, 4, 16) and for decode attention (bf16, 14 query heads, 2 KV heads, head_dim 64: full
head-major caches of 512, 2k, 8k, 32k tokens, and the native decode graph's case, a seq-major cache
of 2048 slots holding 1, 40, 128, 512, 2048 live tokens), it reports the bytes a launch must move
(weights with their scales, activations in, results out; for attention the live K and V read)
divided by the launch time, and that
figure divided by the device-to-device copy bandwidth (bytes read + written per second) measured
first. The weights rotate through a pool of copies several times the L2 cache, so each launch reads
them from HBM, as a decode step does.

Timing: every launch is captured once into a CUDA graph of R launches over the pool; each of
``--reps`` replays gets fresh random activations and a NaN-poisoned output (outside the timed
span), and is timed with CUDA events. Reported: the median per launch, and min and max over the
replays. Every format is also checked once against the NumPy reference (`ep.ops.matmul`).

When torch is importable, cuBLAS's bf16 matmul (torch.matmul, a captured torch graph) on the same
shapes is measured as a reference line. Nothing here needs torch.

    python tools/bench_kernels.py                 # writes $OUT/bench_kernels.json (or ./bench-out)
    python tools/bench_kernels.py --out results --reps 50 --quick
    python tools/bench_kernels.py --formats q4,mxfp4 --shapes 896x151936 --rows 1,4,16 \
        --no-attention --no-torch          # only those GEMV rows (and only their kernels built)
    python tools/bench_kernels.py --formats bf16,q4,mxfp4 --rows 1,4 --gemv v1,v2 \
        --no-attention --no-torch   # A/B: the bf16-nk, q4 and mxfp4 rows once per GEMV version
    python tools/bench_kernels.py --attention-only --attention v1,v2 \
        --attention-share 128,256   # A/B: the attention rows, kv_decode vs kv_decode_tc

``--gemv v1,v2`` times the dense [N, K] (``bf16``, the alias of ``bf16-nk``), q4 and mxfp4 rows
once with ``GENAI_EP_GEMV=v1`` (the split-K and streaming GEMVs) and once with ``v2`` (the
default: ``ep_gemv_<fmt>_v2_<dt>`` where the plan picks it); their rows are labelled
``bf16-nk/v1``, ``q4/v2``, ... and the table names each row's kernel. ``v2-any`` also runs the
dense v2 past its measured rule (every weight and M it can run: for re-measuring the rule).
Large shapes (no whole reference check) are checked on their first and last 1024 columns.

``--attention v1,v2`` times every attention row once with ``GENAI_EP_ATTENTION=v1`` (``kv_decode``
and its reduce kernel) and once with ``v2`` (the default: ``kv_decode_tc``); ``--attention-share``
repeats the v2 rows for each ``min_share`` given (live tokens a decode split takes at least).
Labels: ``bf16/v1``, ``cap2048/v2/s128``, ...; ``--attention-only`` skips the GEMV and torch rows.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

from ep.device import KERNELS, Buffer, Device, get_device, probe_cuda  # noqa: E402
from ep.device._kernels import nvrtc_version  # noqa: E402
from ep.kernels import matmul as mm  # noqa: E402
from ep.kernels import mx4f8, q4f8, q4p  # noqa: E402
from ep.ops import matmul as ref  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
SHAPES = [
    (896, 896),
    (896, 128),
    (896, 1152),
    (896, 4864),
    (896, 9728),
    (4864, 896),
    (896, 151936),
]  # (K, N)
LARGE = {(896, 4864), (896, 9728), (4864, 896), (896, 151936)}
ROWS = [1, 4, 16]
FORMATS = ["bf16-nk", "bf16-kn", "q4", "q4p", "q4f8", "mxfp4", "mx4p", "mx4f8"]
# kernel-name part of each format; q4p / q4f8 / mx4p / mx4f8: the weights of q4 / mxfp4 repacked
# (`ep.kernels.q4p`, `ep.kernels.q4f8`, `ep.kernels.mx4f8`)
_FAMILY = {
    "bf16-nk": "nk", "bf16-kn": "kn", "q4": "q4", "q4p": "q4p", "mxfp4": "mx4", "mx4p": "mx4p",
    "mx4f8": "mx4f8", "q4f8": "q4f8",
}  # fmt: skip
_ALIASES = {"bf16": "bf16-nk"}  # --formats bf16: the dense [N, K] (decode) orientation
GEMV_CHOICES = ("v1", "v2", "v2-any")  # --gemv: the GEMV versions a row runs under
_GEMV_FORMATS = ("bf16-nk", "q4", "mxfp4")  # the formats with a v2 GEMV (--gemv applies to them)
CONTEXTS = [512, 2048, 8192, 32768]
DECODE_GRAPH_LIVE = [1, 40, 128, 512, 2048]  # live tokens in a 2048-slot seq-major cache
ATTENTION_CHOICES = ("v1", "v2")  # --attention: GENAI_EP_ATTENTION for the attention rows
HEADS, KV_HEADS, HEAD_DIM = 14, 2, 64


@dataclass(frozen=True)
class Timing:
    """Per-launch milliseconds over the replays."""

    median_ms: float
    min_ms: float
    max_ms: float
    replays: int
    launches_per_replay: int


@dataclass(frozen=True)
class Row:
    """One line of the results."""

    kind: str  # gemv | attention | torch
    fmt: str
    K: int
    N: int
    M: int
    bytes: int
    timing: Timing | None
    gbps: float
    ratio: float  # achieved bytes/s over the copy bandwidth
    kernel: str
    note: str = ""


# --- machine ---------------------------------------------------------------------------------


def _version(module: str) -> str:
    try:
        import importlib.metadata as md

        return md.version(module)
    except Exception:
        return "absent"


def machine_info(dev: Device) -> dict[str, Any]:
    probe = probe_cuda()
    info: dict[str, Any] = {
        "gpu": getattr(dev, "gpu_name", dev.name),
        "arch": dev.arch,
        "driver_cuda": f"{probe.driver_version // 1000}.{probe.driver_version % 1000 // 10}",
        "cuda-core": _version("cuda-core"),
        "cuda-bindings": _version("cuda-bindings"),
        "nvrtc": nvrtc_version(),
        "numpy": np.__version__,
        "python": platform.python_version(),
        "host": platform.node(),
    }
    core: Any = getattr(dev, "_core", None)
    for key, prop in (("sms", "multiprocessor_count"), ("l2_bytes", "l2_cache_size")):
        try:
            info[key] = int(getattr(core.properties, prop))
        except Exception:
            info[key] = None
    try:
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version,name,clocks.max.sm,clocks.max.mem",
             "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20, check=False,
        )  # fmt: skip
        info["nvidia-smi"] = smi.stdout.strip() or smi.stderr.strip()
    except Exception as exc:
        info["nvidia-smi"] = f"not run: {exc}"
    try:
        import torch

        info["torch"] = torch.__version__
    except Exception:
        info["torch"] = "absent"
    return info


# --- timing ----------------------------------------------------------------------------------


def time_graph(
    dev: Device,
    record: Callable[[], int],
    prepare: Callable[[], None],
    reps: int,
    warmup: int = 3,
) -> Timing:
    """Capture ``record`` (which queues R launches and returns R) once; time ``reps`` replays."""
    s = dev.default_stream
    with dev.capture(stream=s) as cap:
        launches = record()
    graph = cap.graph
    start, end = dev.create_event(timing=True), dev.create_event(timing=True)
    samples: list[float] = []
    for i in range(warmup + reps):
        prepare()
        s.record(start)
        graph.launch(stream=s)
        s.record(end)
        ms = end.elapsed_ms(start)
        if i >= warmup:
            samples.append(ms / launches)
    graph.close()
    return Timing(statistics.median(samples), min(samples), max(samples), reps, launches)


def copy_bandwidth(dev: Device, nbytes: int, reps: int) -> dict[str, float]:
    """Device-to-device copy: bytes read + written per second (median over ``reps`` copies)."""
    s = dev.default_stream
    src = dev.alloc(nbytes, np.uint8, stream=s, name="copy-src")
    dst = dev.alloc(nbytes, np.uint8, stream=s, name="copy-dst")
    dev.fill(src.view(np.uint32), 0x3F803F80, stream=s)
    start, end = dev.create_event(timing=True), dev.create_event(timing=True)
    samples = []
    for i in range(reps + 3):
        s.record(start)
        dev.copy(dst, src, stream=s)
        s.record(end)
        if i >= 3:
            samples.append(end.elapsed_ms(start))
    med = statistics.median(samples)
    src.free()
    dst.free()
    return {
        "bytes": nbytes,
        "median_ms": med,
        "min_ms": min(samples),
        "max_ms": max(samples),
        "bytes_per_s": 2 * nbytes / (med * 1e-3),
    }


# --- GEMV cases ------------------------------------------------------------------------------


def _bf16(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(BF16)


def _symmetric(fmt: str) -> tuple[str, bool]:
    """(the format without ``+sym``, whether its 4-bit weights have no zero points)."""
    base, _, mod = fmt.partition("+")
    return base, mod == "sym"


def _weights(fmt: str, rng: np.random.Generator, K: int, N: int) -> dict[str, np.ndarray]:
    """Random weights of one format (random bytes for the packed formats: all codes occur)."""
    fmt, sym = _symmetric(fmt)
    if fmt == "bf16-nk":
        return {"w": _bf16(rng, (N, K), K**-0.5)}
    if fmt == "bf16-kn":
        return {"w": _bf16(rng, (K, N), K**-0.5)}
    if fmt == "q4" or fmt.startswith(("q4p", "q4f8")):
        kb = -(-K // 32)
        w = {
            "b": rng.integers(0, 256, (N, kb, 16), dtype=np.uint8),
            "scales": (rng.uniform(0.5, 1.5, N * kb).astype(np.float32) * (0.1 / 8)).astype(BF16),
            "zp": rng.integers(0, 256, N * ((kb + 1) // 2), dtype=np.uint8),
        }
        zp: np.ndarray | None = None if sym else w["zp"]
        del w["zp"]
        if fmt.startswith("q4p"):  # the same bytes in the packed layout (its padding included)
            w["b"], w["scales"], zp = q4p.pack_q4(w["b"], w["scales"], zp, N=N, K=K)
        if fmt.startswith("q4f8"):
            w["b"], w["scales"], zp = q4f8.pack_q4f8(w["b"], w["scales"], zp, N=N, K=K)
        return w if zp is None else {**w, "zp": zp}
    w = {
        "b": rng.integers(0, 256, (N, K // 32, 16), dtype=np.uint8),
        "scales": rng.integers(118, 124, (N, K // 32), dtype=np.uint8),  # no E8M0 0 or 255
    }
    if fmt.startswith("mx4p"):  # the same bytes in the packed layout (its padding included)
        packed = q4p.pack_mx4(w["b"], w["scales"], N=N, K=K, dtype=BF16)
        w = dict(zip(("b", "scales"), packed[:2], strict=True))
    if fmt.startswith("mx4f8"):
        packed = mx4f8.pack_mx4f8(w["b"], w["scales"], N=N, K=K)
        w = dict(zip(("b", "scales"), packed[:2], strict=True))
    return w


# The repacked formats' layouts: (rows a unit, elements a unit takes a 64-k step of its weights,
# scales and zero points), so that `_dense_rows` decodes only the units holding its rows.
_PACKED = {"q4p": (16, (512, 32, 8)), "mx4p": (16, (512, 32)), "q4f8": (64, (2048, 128, 32)),
           "mx4f8": (64, (2048, 128))}  # fmt: skip


def _dense_rows(fmt: str, w: dict[str, np.ndarray], K: int, N: int, r: slice) -> np.ndarray:
    """Rows ``r`` of the weight as the reference multiplies it: float32 [rows, K] (W[r] of
    ``y = x @ W.T``), decoded from those rows' bytes only."""
    fmt, _ = _symmetric(fmt)
    zp = w.get("zp")  # 4-bit: None for symmetric weights
    n = r.stop - r.start
    family = fmt.partition("-")[0]
    if family in _PACKED:
        unit, sizes = _PACKED[family]
        steps = -(-K // 64)
        t0, t1 = r.start // unit, -(-r.stop // unit)
        rows = min(N, t1 * unit) - t0 * unit
        arrays = [w["b"], w["scales"], zp][: len(sizes)]
        b, scales, *z = [
            None if a is None else a[t0 * steps * e : t1 * steps * e]
            for a, e in zip(arrays, sizes, strict=True)
        ]
        assert b is not None and scales is not None
        if family == "q4p":
            dense = q4p.unpack_q4(b, scales, z[0], N=rows, K=K)
        elif family == "q4f8":
            dense = q4f8.unpack_q4f8(b, scales, z[0], N=rows, K=K)
        elif family == "mx4p":
            dense = q4p.unpack_mx4(b, scales, N=rows, K=K, dtype=BF16)
        else:
            dense = mx4f8.unpack_mx4f8(b, scales, N=rows, K=K)
        return dense[r.start - t0 * unit : r.stop - t0 * unit]
    if fmt == "bf16-nk":
        return w["w"][r].astype(np.float32)
    if fmt == "bf16-kn":
        return w["w"][:, r].T.astype(np.float32)
    if fmt == "q4":
        kb, zr = -(-K // 32), (-(-K // 32) + 1) // 2
        zeros = None if zp is None else zp[r.start * zr : r.stop * zr]
        scales = w["scales"][r.start * kb : r.stop * kb]
        return ref.dequantize_nbits(w["b"][r], scales, zeros, K=K, N=n, block_size=32)
    return ref.dequantize_mxfp4(w["b"][r], w["scales"][r]).reshape(n, K)


def _reference(x: np.ndarray, dense: np.ndarray) -> np.ndarray:
    """The reference product of x and `_dense_rows`' rows: float32 sums, rounded to bf16 once."""
    return np.matmul(x.astype(np.float32), dense.T).astype(BF16)


def _launch(
    fmt: str,
    dev: Device,
    out: Buffer,
    x: Buffer,
    w: dict[str, Buffer],
    M: int,
    K: int,
    N: int,
    ws: mm.MatmulWorkspace,
    resident: bool = True,
) -> mm.MatmulPlan:
    s = dev.default_stream
    fmt, _ = _symmetric(fmt)
    zp = w.get("zp")  # 4-bit: None for symmetric weights
    if fmt in ("bf16-nk", "bf16-kn"):
        return mm.gemm(
            dev, out, x, w["w"], M=M, N=N, K=K, transpose_b=int(fmt == "bf16-nk"), stream=s,
            workspace=ws, resident=resident,
        )  # fmt: skip
    if fmt == "q4":
        return mm.gemm_nbits(
            dev, out, x, w["b"], w["scales"], zp, M=M, N=N, K=K, block_size=32, stream=s,
            workspace=ws, resident=resident,
        )  # fmt: skip
    if fmt.startswith("q4p"):  # q4p, or q4p-<ring> (a compiled ring variant: `q4p.RINGS`)
        packed = q4p.PackedQ4(w["b"], w["scales"], zp, N, K)
        ring = fmt.partition("-")[2] or None
        return q4p.gemv_q4_packed(dev, out, x, packed, M=M, stream=s, resident=resident, ring=ring)
    if fmt.startswith("mx4p"):  # mx4p, or mx4p-<ring>; `_weights` draws no E8M0 0 or 255
        mx = q4p.PackedMX4(w["b"], w["scales"], N, K, BF16, exact=False)
        ring = fmt.partition("-")[2] or None
        return q4p.gemv_mx4_packed(dev, out, x, mx, M=M, stream=s, resident=resident, ring=ring)
    if fmt.startswith("q4f8"):  # q4f8, or q4f8-<ring>
        packed4 = q4f8.PackedQ4F8(w["b"], w["scales"], zp, N, K)
        ring = fmt.partition("-")[2] or None
        return q4f8.gemv_q4_f8(dev, out, x, packed4, M=M, stream=s, resident=resident, ring=ring)
    if fmt.startswith("mx4f8"):  # mx4f8, or mx4f8-<ring>
        f8 = mx4f8.PackedMX4F8(w["b"], w["scales"], N, K, exact=False)
        ring = fmt.partition("-")[2] or None
        return mx4f8.gemv_mx4_f8(dev, out, x, f8, M=M, stream=s, resident=resident, ring=ring)
    return mm.gemm_mxfp4(
        dev, out, x, w["b"], w["scales"], M=M, N=N, K=K, stream=s, workspace=ws, resident=resident
    )


def bench_gemv(
    dev: Device,
    fmt: str,
    K: int,
    N: int,
    rows: list[int],
    copy_bps: float,
    pool_bytes: int,
    reps: int,
    rng: np.random.Generator,
    ws: mm.MatmulWorkspace,
    label: str = "",
    resident: bool = True,
) -> list[Row]:
    """Time ``fmt`` at every M of ``rows``; ``label`` names its rows (default: the format).
    ``resident``: the weights are passed as resident (loaded before each GEMV's PDL wait, as the
    native executor runs them)."""
    label = label or fmt
    s = dev.default_stream
    host = _weights(fmt, rng, K, N)
    wbytes = sum(a.nbytes for a in host.values())
    copies = max(1, min(64, -(-pool_bytes // wbytes)))
    first = {k: dev.to_device(v, stream=s, name=f"{fmt}.{k}.0") for k, v in host.items()}
    pool = [first]
    for c in range(1, copies):
        pool.append({})
        for k, b in first.items():
            pool[-1][k] = dev.alloc(b.shape, b.dtype, stream=s, name=f"{fmt}.{k}.{c}")
            dev.copy(pool[-1][k], b, stream=s)
    launches = max(copies, 8)
    out_rows: list[Row] = []
    # A reference check; the NumPy reference of a big one runs on its first and last 1024 output
    # columns only (decoding the whole weight is slow), the same rows for every M.
    parts = [slice(0, N)] if N * K <= 5_000_000 else [slice(0, 1024), slice(N - 1024, N)]
    dense = [_dense_rows(fmt, host, K, N, r) for r in parts]
    for M in rows:
        x = dev.alloc((M, K), BF16, stream=s, name="x")
        out = dev.alloc((M, N), BF16, stream=s, name="y")
        xh = _bf16(rng, (M, K))
        x.copy_from_host(xh, stream=s)
        dev.fill(out, float("nan"), stream=s)
        _launch(fmt, dev, out, x, first, M, K, N, ws)
        got_all = out.to_host(stream=s).astype(np.float64)
        err = 0.0
        for r, d in zip(parts, dense, strict=True):
            want = _reference(xh, d).astype(np.float64)
            err = max(
                err, float(np.abs(got_all[:, r] - want).max() / max(np.abs(want).max(), 1e-30))
            )
        note = f"rel err {err:.1e}" + ("" if err < 1e-2 else " FAILED")
        if len(parts) > 1:
            note += " (2x1024 cols)"
        plan_box: list[mm.MatmulPlan] = []

        def record(
            x: Buffer = x, out: Buffer = out, M: int = M, plans: list[mm.MatmulPlan] = plan_box
        ) -> int:
            for i in range(launches):
                plans.append(_launch(fmt, dev, out, x, pool[i % copies], M, K, N, ws, resident))
            return launches

        def prepare(x: Buffer = x, out: Buffer = out, M: int = M) -> None:
            x.copy_from_host(_bf16(rng, (M, K)), stream=s)
            dev.fill(out, float("nan"), stream=s)

        timing = time_graph(dev, record, prepare, reps)
        if not np.isfinite(out.to_host(stream=s).astype(np.float32)).all():
            note += " NaN in the output"
        moved = wbytes + 2 * M * K + 2 * M * N
        gbps = moved / (timing.median_ms * 1e-3)
        plan = plan_box[0]
        geometry = f"{plan.kernel} grid={plan.grid} kw={plan.kw} gy={plan.gy}"
        if copies * wbytes < pool_bytes:
            note += f" pool {copies * wbytes / 1e6:.0f} MB (L2-resident in part)"
        out_rows.append(
            Row(
                "gemv", label, K, N, M, moved, timing, gbps, gbps / copy_bps, geometry, note.strip()
            )
        )
        print(f"  {label:14s} K={K:5d} N={N:6d} M={M:2d}  {timing.median_ms * 1e3:8.2f} us  "
              f"{gbps / 1e9:7.1f} GB/s  {gbps / copy_bps:5.2f}  {note}", flush=True)  # fmt: skip
    for weights in pool:
        for b in weights.values():
            b.free()
    return out_rows


# --- attention ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionCase:
    """One attention row: a cache of ``capacity`` slots (``layout``) holding ``live`` tokens."""

    capacity: int
    live: int
    layout: str  # head_major | seq_major
    version: str  # GENAI_EP_ATTENTION for the row ("" = the environment's)
    share: int  # attention_plan's min_share (0 = its default)

    @property
    def label(self) -> str:
        name = "bf16" if self.layout == "head_major" else f"cap{self.capacity}"
        if self.version:
            name += f"/{self.version}"
        if self.share:
            name += f"/s{self.share}"
        return name


def attention_cases(versions: list[str], shares: list[int]) -> list[AttentionCase]:
    """Full contexts (head-major, capacity = context, as before) and the native decode graph's
    case: a seq-major cache captured for 2048 slots holding 1..2048 live tokens."""
    cases = []
    for version in versions or [""]:
        for share in shares if version != "v1" and shares else [0]:
            for ctx in CONTEXTS:
                cases.append(AttentionCase(ctx, ctx, "head_major", version, share))
            for live in DECODE_GRAPH_LIVE:
                cases.append(AttentionCase(2048, live, "seq_major", version, share))
    return cases


@contextlib.contextmanager
def _attention_env(version: str) -> Iterator[None]:
    """``GENAI_EP_ATTENTION=version`` while a row is captured (no change when empty)."""
    from ep.kernels import attention as att

    if not version:
        yield
        return
    before = os.environ.get(att.ATTENTION_ENV)
    os.environ[att.ATTENTION_ENV] = version
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(att.ATTENTION_ENV, None)
        else:
            os.environ[att.ATTENTION_ENV] = before


def bench_attention(
    dev: Device,
    copy_bps: float,
    pool_bytes: int,
    reps: int,
    rng: np.random.Generator,
    cases: list[AttentionCase],
) -> list[Row]:
    try:
        from ep.kernels import attention as att
        from ep.kernels import new_status
        from ep.seams import KVStrides
    except Exception as exc:  # the attention kernels are another module; the GEMVs still count
        print(f"  attention skipped: ep.kernels.attention is not importable ({exc})")
        return [
            Row("attention", "absent", 0, 0, 1, 0, None, 0.0, 0.0, "", f"not importable: {exc}")
        ]
    s = dev.default_stream
    rows: list[Row] = []
    status = new_status(dev, stream=s)
    for case in cases:
        cap, live = case.capacity, case.live
        try:
            cache_elems = KV_HEADS * cap * HEAD_DIM  # batch 1
            kv_bytes = 2 * cache_elems * 2
            copies = max(1, min(64, -(-pool_bytes // kv_bytes)))
            if case.layout == "head_major":  # [1, Hkv, C, D]
                strides = KVStrides(cache_elems, HEAD_DIM, cap * HEAD_DIM, 1, 0, 0)
            else:  # [1, C, Hkv, D]
                strides = KVStrides(cache_elems, KV_HEADS * HEAD_DIM, HEAD_DIM, 1, 0, 0)
            caches = []
            for c in range(copies):
                k = dev.to_device(_bf16(rng, (cache_elems,)), stream=s, name=f"k{c}")
                v = dev.to_device(_bf16(rng, (cache_elems,)), stream=s, name=f"v{c}")
                caches.append((k, v))
            q = dev.alloc((1, 1, HEADS, HEAD_DIM), BF16, stream=s, name="q")
            out = dev.alloc((1, 1, HEADS, HEAD_DIM), BF16, stream=s, name="attn-out")
            positions = dev.to_device(np.array([[live - 1]], np.int64), stream=s, name="pos")
            lengths = dev.to_device(np.array([max(live, 1)], np.int64), stream=s, name="len")
            plan = att.attention_plan(
                batch=1, seq=1, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, capacity=cap,
                min_share=case.share or att.DECODE_SHARE,
            )  # fmt: skip
            ws = att.attention_workspace(dev, plan, stream=s, name="attn-ws")
            launches = max(copies, 8)

            def record(
                q: Buffer = q, out: Buffer = out, positions: Buffer = positions,
                lengths: Buffer = lengths, caches: list[Any] = caches, ws: Buffer | None = ws,
                strides: Any = strides, cap: int = cap, plan: Any = plan, copies: int = copies,
                launches: int = launches,
            ) -> int:  # fmt: skip
                for i in range(launches):
                    k, v = caches[i % copies]
                    att.kv_attention(
                        dev, out, q, positions, lengths, k, v, batch=1, seq=1, heads=HEADS,
                        kv_heads=KV_HEADS, head_dim=HEAD_DIM, strides=strides, capacity=cap,
                        workspace=ws, plan=plan, status=status, stream=s,
                    )  # fmt: skip
                return launches

            def prepare(q: Buffer = q, out: Buffer = out) -> None:
                q.copy_from_host(_bf16(rng, (1, 1, HEADS, HEAD_DIM)), stream=s)
                dev.fill(out, float("nan"), stream=s)

            with _attention_env(case.version):
                timing = time_graph(dev, record, prepare, reps)
                tc = att._decode_tc_ok(
                    plan, 1, HEADS // KV_HEADS, HEAD_DIM, True, q, out, HEADS * HEAD_DIM, cap
                )
            finite = np.isfinite(out.to_host(stream=s).astype(np.float32)).all()
            moved = 2 * live * KV_HEADS * HEAD_DIM * 2 + 2 * 2 * HEADS * HEAD_DIM
            gbps = moved / (timing.median_ms * 1e-3)
            kernel = f"kv_decode_tc{HEAD_DIM}_bf16" if tc else "kv_decode_bf16"
            note = f"live={live} splits={plan.splits} share>={plan.share}" + (
                "" if finite else " NaN in the output"
            )
            if copies * kv_bytes < pool_bytes:
                note += f" pool {copies * kv_bytes / 1e6:.0f} MB (L2-resident in part)"
            rows.append(
                Row("attention", case.label, live, HEADS, 1, moved, timing, gbps, gbps / copy_bps,
                    kernel, note)
            )  # fmt: skip
            print(
                f"  attention {case.label:14s} live={live:6d}  {timing.median_ms * 1e3:8.2f} us  "
                f"{gbps / 1e9:7.1f} GB/s  {gbps / copy_bps:5.2f}  {kernel}  {note}",
                flush=True,
            )
            for k, v in caches:
                k.free()
                v.free()
        except Exception as exc:
            traceback.print_exc()
            rows.append(
                Row("attention", case.label, live, HEADS, 1, 0, None, 0.0, 0.0, "", repr(exc))
            )
    return rows


# --- torch / cuBLAS reference --------------------------------------------------------------------


def bench_torch(
    copy_bps: float, pool_bytes: int, reps: int, shapes: list[tuple[int, int]], rows: list[int]
) -> list[Row]:
    try:
        import torch
    except Exception as exc:
        print(f"  torch reference skipped: {exc}")
        return []
    out: list[Row] = []
    for K, N in shapes:
        wbytes = 2 * N * K
        copies = max(1, min(64, -(-pool_bytes // wbytes)))
        weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        launches = max(copies, 8)
        for M in rows:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for w in weights[:2]:  # warm-up outside the capture (cuBLAS workspaces)
                    torch.matmul(x, w.t(), out=y)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(launches):
                    torch.matmul(x, weights[i % copies].t(), out=y)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            samples = []
            for i in range(reps + 3):
                x.copy_(torch.randn(M, K, device="cuda", dtype=torch.bfloat16))
                y.fill_(float("nan"))
                start.record()
                graph.replay()
                end.record()
                end.synchronize()
                if i >= 3:
                    samples.append(start.elapsed_time(end) / launches)
            timing = Timing(statistics.median(samples), min(samples), max(samples), reps, launches)
            moved = wbytes + 2 * M * K + 2 * M * N
            gbps = moved / (timing.median_ms * 1e-3)
            out.append(
                Row("torch", "bf16-nk", K, N, M, moved, timing, gbps, gbps / copy_bps,
                    "torch.matmul (cuBLAS)")
            )  # fmt: skip
            print(f"  torch    K={K:5d} N={N:6d} M={M:2d}  {timing.median_ms * 1e3:8.2f} us  "
                  f"{gbps / 1e9:7.1f} GB/s  {gbps / copy_bps:5.2f}", flush=True)  # fmt: skip
            del graph
        del weights
        torch.cuda.empty_cache()
    return out


# --- main ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def _gemv_env(choice: str) -> Iterator[None]:
    """``GENAI_EP_GEMV=choice`` while a row is planned and captured (no change when empty).

    ``v2-any``: ``v2``, with the dense v2's measured rule (weight size, M) opened to every
    weight and M it can run, so that the rule itself can be re-measured.
    """
    if not choice:
        yield
        return
    before = os.environ.get(mm.GEMV_ENV)
    rule = mm._V2_DENSE_MIN_ELEMENTS
    os.environ[mm.GEMV_ENV] = "v2" if choice == "v2-any" else choice
    if choice == "v2-any":
        mm._V2_DENSE_MIN_ELEMENTS = 0
    try:
        yield
    finally:
        mm._V2_DENSE_MIN_ELEMENTS = rule
        if before is None:
            os.environ.pop(mm.GEMV_ENV, None)
        else:
            os.environ[mm.GEMV_ENV] = before


def table(rows: list[Row], copy: dict[str, float]) -> str:
    lines = [
        f"device copy: {copy['bytes_per_s'] / 1e12:.2f} TB/s (read + written; "
        f"{copy['bytes'] / 2**20:.0f} MiB, median of the copies)",
        f"{'kind':9s} {'format':14s} {'K':>6s} {'N':>7s} {'M':>3s} {'us':>9s} {'min..max us':>17s} "
        f"{'GB/s':>7s} {'ratio':>6s}",
    ]
    for r in rows:
        if r.timing is None:
            lines.append(f"{r.kind:9s} {r.fmt:14s} {r.K:6d} {r.N:7d} {r.M:3d}  -- {r.note}")
            continue
        t = r.timing
        large = "*" if (r.K, r.N) in LARGE and r.kind != "attention" else " "
        lines.append(
            f"{r.kind:9s} {r.fmt:14s} {r.K:6d} {r.N:7d} {r.M:3d} {t.median_ms * 1e3:9.2f} "
            f"{t.min_ms * 1e3:8.2f}..{t.max_ms * 1e3:<8.2f} {r.gbps / 1e9:7.1f} {r.ratio:6.2f}"
            f"{large} {r.kernel.split(' ')[0]}"
        )
    lines.append("ratio = (bytes moved / median launch time) / copy bandwidth; * = target >= 0.8")
    lines.append(
        "attention rows: K = live tokens, N = query heads; bf16 = a full head-major cache of K "
        "slots, cap2048 = a seq-major cache of 2048 slots (the native decode graph's)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "bench-out")
    parser.add_argument("--reps", type=int, default=30, help="timed graph replays per case")
    parser.add_argument("--pool-mib", type=int, default=256, help="weight pool per case (> L2)")
    parser.add_argument("--copy-mib", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="M=1 only, no torch")
    parser.add_argument("--rows", default="", help="M values, e.g. 1,4 (default 1,4,16)")
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--no-attention", action="store_true")
    parser.add_argument(
        "--attention-only", action="store_true", help="only the attention rows (no GEMV, torch)"
    )
    parser.add_argument(
        "--attention",
        default="",
        help="decode attention kernels for the attention rows, e.g. v1,v2 (an A/B in one run: "
        "v1 = kv_decode + reduce, v2 = kv_decode_tc); default: the environment's "
        "GENAI_EP_ATTENTION (v2 when unset)",
    )
    parser.add_argument(
        "--attention-share",
        default="",
        help="min_share values for the v2 attention rows, e.g. 64,128,256 (live tokens a "
        "decode split takes at least; default: the plan's)",
    )
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--shapes", default="", help="KxN,KxN,... instead of the model's")
    parser.add_argument("--device", default="cuda", help="cuda (default); cpu for a smoke run")
    parser.add_argument(
        "--gemv",
        default="",
        help="GEMV versions for the bf16-nk/q4/mxfp4 rows, e.g. v1,v2 (an A/B in one run; "
        "v2-any: the dense v2 past its rule too); default: the environment's GENAI_EP_GEMV (v2 "
        "when unset)",
    )
    parser.add_argument(
        "--early",
        default="on",
        help="on,off: time the GEMVs with resident weights loaded before the PDL wait (on, as the "
        "native executor runs them) and/or after it (off; rows labelled /late); default on",
    )
    args = parser.parse_args(argv)
    early = [e.strip() for e in args.early.split(",") if e.strip()]
    if not early or any(e not in ("on", "off") for e in early):
        parser.error(f"--early {args.early!r}: expected on, off or on,off")
    gemv = [g.strip() for g in args.gemv.split(",") if g.strip()]
    bad = [g for g in gemv if g not in GEMV_CHOICES]
    if bad:
        parser.error(f"--gemv {args.gemv!r}: expected a list of {', '.join(GEMV_CHOICES)}")
    versions = [v.strip() for v in args.attention.split(",") if v.strip()]
    if any(v not in ATTENTION_CHOICES for v in versions):
        parser.error(
            f"--attention {args.attention!r}: expected a list of {', '.join(ATTENTION_CHOICES)}"
        )
    try:
        shares = [int(v) for v in args.attention_share.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--attention-share {args.attention_share!r}: expected integers")
    if any(v <= 0 for v in shares):
        parser.error(f"--attention-share {args.attention_share!r}: expected positive integers")
    if args.attention_only and args.no_attention:
        parser.error("--attention-only and --no-attention exclude each other")
    shapes = SHAPES
    if args.shapes:
        shapes = [(int(k), int(n)) for k, n in (p.split("x") for p in args.shapes.split(","))]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = get_device(args.device)
    info = machine_info(dev)
    print("machine:", json.dumps(info, indent=1), flush=True)
    t0 = time.perf_counter()
    formats = [_ALIASES.get(f, f) for f in args.formats.split(",") if f]
    if args.attention_only:
        formats = []
    # q4p-<ring> / mx4p-<ring>: the q4p / mx4p family (the variant's kernel name holds "_q4p_")
    bases = [_symmetric(f)[0] for f in formats]
    families = tuple(f"_{_FAMILY.get(f, f.partition('-')[0])}_" for f in bases)
    needed = [
        n
        for n in KERNELS.names()
        if (n.startswith(("ep_gemv_", "ep_gemm_")) and any(fam in n for fam in families))
        or (n.startswith(("kv_attention", "kv_decode")) and not args.no_attention)
    ]
    for name in needed:  # before any capture
        dev.kernel(name).load()
    print(f"compiled/loaded {len(needed)} kernels in {time.perf_counter() - t0:.1f} s", flush=True)
    rng = np.random.default_rng(int(time.time()))
    copy = copy_bandwidth(dev, args.copy_mib << 20, reps=20)
    copy_bps = copy["bytes_per_s"]
    print(f"copy: {copy_bps / 1e12:.3f} TB/s", flush=True)
    pool = args.pool_mib << 20
    rows_m = [1] if args.quick else ROWS
    if args.rows:
        rows_m = [int(m) for m in args.rows.split(",")]
    ws = mm.matmul_workspace(dev, stream=dev.default_stream)
    results: list[Row] = []
    for fmt in formats:
        for K, N in shapes:
            for choice, e in itertools.product(
                gemv if fmt in _GEMV_FORMATS and gemv else [""], early
            ):
                label = (f"{fmt}/{choice}" if choice else fmt) + ("/late" if e == "off" else "")
                try:
                    with _gemv_env(choice):
                        results += bench_gemv(
                            dev, fmt, K, N, rows_m, copy_bps, pool, args.reps, rng, ws, label,
                            resident=e == "on",
                        )  # fmt: skip
                except Exception as exc:
                    traceback.print_exc()
                    results.append(Row("gemv", label, K, N, 0, 0, None, 0.0, 0.0, "", repr(exc)))
    if not args.no_attention:
        cases = attention_cases(versions, shares)
        results += bench_attention(dev, copy_bps, pool, args.reps, rng, cases)
    if not (args.no_torch or args.quick or args.attention_only or dev.kind != "cuda"):
        try:
            results += bench_torch(copy_bps, pool, args.reps, shapes, rows_m)
        except Exception as exc:
            traceback.print_exc()
            results.append(Row("torch", "bf16-nk", 0, 0, 0, 0, None, 0.0, 0.0, "", repr(exc)))
    payload = {
        "machine": info,
        "copy": copy,
        "settings": vars(args),
        "rows": [asdict(r) for r in results],
    }
    path = out_dir / "bench_kernels.json"
    path.write_text(json.dumps(payload, indent=1))
    print(f"\nfull results: {path}\n")
    print(table(results, copy))
    return 0


if __name__ == "__main__":
    sys.exit(main())
