"""The split-K GEMVs with a rotary/KV-commit epilogue (``ep_gemv_<fmt>_rope_<dt>``, `gemm(...,
rope=attention.rope_epilogue(...))`): bitwise the plain GEMV of the packed QKV projection
followed by `attention.kv_commit_rotary` on its q, k and v columns: the rotated q, both whole
caches (poisoned first), the lengths and the fault bits. On the CPU device (the NumPy twins) and,
marked ``cuda``, on the GPU; every weight format and dtype, K split over warps only and over
blocks, the layout plugins, decode and a short prefill, cos/sin caches and theta, with and
without the projection's bias, partial and interleaved rotations.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from gemv_case import GemvCase, Upload
from test_rotary_commit_kernels import CAPACITY, MAX_POS, THETA, Shape, geometry_of

from ep.device import Buffer, Device
from ep.errors import KernelArgumentError
from ep.kernels import KernelFault, attention, new_status, rotary
from ep.kernels.matmul import MatmulPlan, gemm, matmul_workspace, plan_matmul
from ep.ops import rotary as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
DTYPE_IDS = ["f32", "f16", "bf16"]
FORMATS = ["nk", "q4", "q4-zp", "mx4"]
SHAPES = {  # head_dim a multiple of 16: a GEMV column group holds whole pairs of one head
    "h14kv2d64r32": Shape(14, 2, 64, 32, 0),  # partial rotation: pass-through pairs
    "h4kv2d32i": Shape(4, 2, 32, 0, 1),  # interleaved
    "h6kv3d16": Shape(6, 3, 16, 0, 0),
    "qwen": Shape(14, 2, 64, 0, 0),  # Qwen2.5-0.5B's attention (the CUDA shape test)
}
# (shape, layout, phase, theta tables, bias)
SCENARIOS = [
    ("h14kv2d64r32", "seq_major", "decode", False, True),
    ("h4kv2d32i", "paged", "prefill", True, False),
    ("h6kv3d16", "head_major", "decode", True, True),
    ("h14kv2d64r32", "seq_major_fixed", "prefill", False, False),
]


def positions_for(phase: str, rng: np.random.Generator) -> np.ndarray:
    """Decode: one token a row, one padding row. Prefill (12 tokens, still a GEMV): left-padded
    rows of 6 and 3 tokens at different starts."""
    if phase == "decode":
        a, b = (int(x) for x in rng.choice(CAPACITY - 1, size=2, replace=False))
        return np.array([[a], [-1], [b]], dtype=np.int64)
    pos = np.full((2, 6), -1, dtype=np.int64)
    for row, n in enumerate((6, 3)):
        pos[row, 6 - n :] = int(rng.integers(0, CAPACITY - n)) + np.arange(n)
    return pos


class Chain:
    """One scenario's inputs: a packed QKV weight, x, positions, bias and rotary tables."""

    def __init__(
        self, dev: Device, rng: np.random.Generator, upload: Upload, fmt: str, dtype: np.dtype,
        scenario: tuple[str, str, str, bool, bool], K: int, positions: np.ndarray | None = None,
    ) -> None:  # fmt: skip
        shape, self.layout, phase, self.theta, bias = scenario
        self.dev, self.dtype, self.sh = dev, dtype, SHAPES[shape]
        self.positions = positions_for(phase, rng) if positions is None else positions
        self.M = self.positions.size
        self.case = GemvCase(dev, rng, upload, fmt, dtype, self.sh.width, K)
        self.x = upload(dev, rng.standard_normal((self.M, K)).astype(np.float32).astype(dtype))
        self.bias = upload(dev, rng.standard_normal(self.sh.width).astype(dtype)) if bias else None
        self.cos, self.sin = ref.rope_cache(
            THETA, self.sh.rotary_dim or self.sh.head_dim, MAX_POS, dtype
        )
        self.table: np.ndarray | None = None
        if self.layout == "paged":
            pages, page_size = geometry_of(self.layout, dtype, self.sh).shape[:2]
            per_row = -(-CAPACITY // page_size)
            rows = self.positions.shape[0]
            self.table = rng.permutation(pages)[: rows * per_row].reshape(rows, per_row)
            self.table = self.table.astype(np.int32)

    def run(self, ws: Any, *, fused: bool) -> tuple[dict[str, np.ndarray], MatmulPlan]:
        """The step, fused or as the GEMV then `kv_commit_rotary`: its outputs and GEMV plan."""
        dev, s, sh, dt = self.dev, self.dev.default_stream, self.sh, self.dtype
        batch, seq = self.positions.shape
        geometry = geometry_of(self.layout, dt, sh)

        def poisoned(count: int, dtype: np.dtype) -> Buffer:
            buf = dev.alloc(count, dtype, stream=s)
            dev.fill(buf.view(np.uint8), 0xA5, stream=s)
            return buf

        keys, values = poisoned(geometry.elements, dt), poisoned(geometry.elements, dt)
        lengths, status = poisoned(batch, np.dtype(np.int64)), new_status(dev, stream=s)
        q_per = sh.heads * sh.head_dim
        q_out = poisoned(self.M * q_per, dt)
        rot = sh.rotary_dim or sh.head_dim
        if self.theta:
            freq = rotary.rotary_inv_freq(dev, THETA, rot, stream=s)
            tables: dict[str, Any] = dict(inv_freq=freq, theta=THETA, rotary_dim=rot)
        else:
            tables = dict(
                cos_cache=dev.to_device(self.cos, stream=s),
                sin_cache=dev.to_device(self.sin, stream=s), max_positions=MAX_POS,
                rotary_dim=rot,
            )  # fmt: skip
        table = None if self.table is None else dev.to_device(self.table, stream=s)
        common: dict[str, Any] = dict(
            batch=batch, seq=seq, heads=sh.heads, kv_heads=sh.kv_heads, head_dim=sh.head_dim,
            strides=geometry.strides, capacity=CAPACITY, interleaved=sh.interleaved,
            bias=self.bias, block_table=table,
            table_cols=0 if self.table is None else self.table.shape[1], status=status, **tables,
        )  # fmt: skip
        pos = dev.to_device(self.positions, stream=s)
        if fused:
            epilogue = attention.rope_epilogue(keys, values, lengths, q_out, pos, **common)
            plan = self.case.run(q_out, self.x, self.M, ws, rope=epilogue)
        else:
            packed = poisoned(self.M * sh.width, dt)
            plan = self.case.run(packed, self.x, self.M, ws)
            item, width = dt.itemsize, sh.width
            q, k, v = (packed.view(dt, offset=o * item) for o in sh.offsets)
            attention.kv_commit_rotary(
                dev, keys, values, lengths, q_out, q, k, v, pos, **common,
                bias_offsets=sh.offsets, q_token_stride=width, k_token_stride=width,
                v_token_stride=width, stream=s,
            )  # fmt: skip
        outputs = {"q_out": q_out, "keys": keys, "values": values, "lengths": lengths}
        got = {name: buf.to_host(stream=s).copy() for name, buf in outputs.items()}
        got["status"] = status.to_host(stream=s).copy()
        return got, plan


def assert_same(fused: dict[str, np.ndarray], unfused: dict[str, np.ndarray]) -> None:
    for name, array in unfused.items():
        assert fused[name].tobytes() == array.tobytes(), f"{name} differs from the unfused chain"


@pytest.mark.parametrize("split", ["gy1", "split-k"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_rope_epilogue_stores_what_the_gemv_then_the_commit_store(
    device: Device, rng: np.random.Generator, upload: Upload, fmt: str, dtype: np.dtype,
    split: str,
) -> None:  # fmt: skip
    K = 2048 if split == "split-k" else 320
    ws = None
    if split == "split-k":
        ws = matmul_workspace(device, stream=device.default_stream, floats=1 << 18, counters=1024)
    for scenario in SCENARIOS:
        chain = Chain(device, rng, upload, fmt, dtype, scenario, K)
        unfused, plain = chain.run(ws, fused=False)
        fused, plan = chain.run(ws, fused=True)
        base = plain.kernel.split("_")[2]  # the format (nk16: dense at 9..16 rows)
        assert plan.kernel == plain.kernel.replace(f"_{base}_", f"_{base}_rope_")
        assert (plan.kw, plan.gy, plan.grid) == (plain.kw, plain.gy, plain.grid)
        assert (plan.gy > 1) == (split == "split-k")
        assert_same(fused, unfused)
        assert int(fused["status"][0]) == 0, scenario
        live = chain.positions >= 0
        want = np.where(live, chain.positions, -1).max(axis=1) + 1
        np.testing.assert_array_equal(fused["lengths"], want)


def test_faults_and_unrotated_tokens_match_the_unfused_chain(
    device: Device, rng: np.random.Generator, upload: Upload
) -> None:
    """Positions past the cos/sin cache (q and k stored unrotated: ROTARY_POSITION), past the KV
    capacity (not committed: KV_POSITION) and out of order (KV_ORDER): same bytes, same bits."""
    positions = np.array([[3, 2], [MAX_POS + 1, -1], [CAPACITY + 5, CAPACITY + 6]], np.int64)
    scenario = ("h14kv2d64r32", "seq_major_fixed", "prefill", False, True)
    chain = Chain(device, rng, upload, "nk", np.dtype(np.float32), scenario, 64, positions)
    unfused, _ = chain.run(None, fused=False)
    fused, _ = chain.run(None, fused=True)
    assert_same(fused, unfused)
    bits = KernelFault(int(fused["status"][0]))
    assert bits == KernelFault.ROTARY_POSITION | KernelFault.KV_POSITION | KernelFault.KV_ORDER


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["nk", "q4-zp"])
def test_rope_epilogue_on_the_qkv_shape_of_qwen_0_5b(
    cuda_device: Device, rng: np.random.Generator, upload: Upload, fmt: str
) -> None:
    """The model's QKV projection (K 896, 14 + 2 x 2 heads of 64, bias, cos/sin caches), bf16, in
    the executor's workspace, at 1 and 16 tokens (the native fusion tests capture it)."""
    dev, s = cuda_device, cuda_device.default_stream
    ws = matmul_workspace(dev, stream=s)
    for batch in (1, 16):
        positions = rng.choice(CAPACITY - 1, size=(batch, 1), replace=False).astype(np.int64)
        scenario = ("qwen", "seq_major", "decode", False, True)
        chain = Chain(dev, rng, upload, fmt, BF16, scenario, 896, positions)
        unfused, _ = chain.run(ws, fused=False)
        fused, _ = chain.run(ws, fused=True)
        assert_same(fused, unfused)


def test_rope_plan_keeps_the_plain_k_split(cpu_device: Device) -> None:
    ws = matmul_workspace(cpu_device, stream=cpu_device.default_stream)
    for fmt, N, K in (("nk", 1152, 896), ("q4", 1152, 896), ("mx4", 4096, 4096)):
        plain = plan_matmul(fmt, BF16, M=1, N=N, K=K, workspace=ws)
        fused = plan_matmul(fmt, BF16, M=1, N=N, K=K, workspace=ws, epilogue="rope")
        assert fused.kernel == f"ep_gemv_{fmt}_rope_bf16"
        assert (fused.kw, fused.gy, fused.grid) == (plain.kw, plain.gy, plain.grid)
        assert "rope epilogue" in fused.reason


def test_rope_epilogue_refuses_what_it_cannot_run(
    cpu_device: Device, rng: np.random.Generator, upload: Upload
) -> None:
    dev, s = cpu_device, cpu_device.default_stream
    scenario = ("h6kv3d16", "seq_major", "decode", False, False)
    chain = Chain(dev, rng, upload, "nk", np.dtype(np.float32), scenario, 64)
    sh, F32 = chain.sh, np.dtype(np.float32)
    geometry = geometry_of("seq_major", F32, sh)
    keys, values = (dev.alloc(geometry.elements, F32, stream=s) for _ in range(2))
    lengths, status = dev.alloc(3, np.int64, stream=s), new_status(dev, stream=s)
    q_out = dev.alloc(3 * sh.heads * sh.head_dim, F32, stream=s)
    pos = dev.to_device(chain.positions, stream=s)
    freq = rotary.rotary_inv_freq(dev, THETA, sh.head_dim, stream=s)
    common: dict[str, Any] = dict(
        batch=3, seq=1, heads=sh.heads, kv_heads=sh.kv_heads, head_dim=sh.head_dim,
        strides=geometry.strides, capacity=CAPACITY, inv_freq=freq, theta=THETA, status=status,
    )  # fmt: skip
    with pytest.raises(KernelArgumentError, match=r"head_dim=40: the GEMV epilogue needs a mult"):
        attention.rope_epilogue(keys, values, lengths, q_out, pos, **{**common, "head_dim": 40})
    with pytest.raises(KernelArgumentError, match="must not overlap the caches"):
        attention.rope_epilogue(keys, values, lengths, keys, pos, **common)
    epilogue = attention.rope_epilogue(keys, values, lengths, q_out, pos, **common)
    w = chain.case.weights[0]
    base = dict(M=3, N=sh.width, K=64, stream=s, rope=epilogue)

    def refused(match: str, **kw: Any) -> None:
        args = {"transpose_b": 1, **base, **kw}
        with pytest.raises(KernelArgumentError, match=match):
            gemm(dev, q_out, chain.x, w, **args)

    refused(r"covers 3 tokens of 192 packed q/k/v columns; this GEMV has M=2, N=192", M=2)
    refused(r"pass swiglu or rope, not both", swiglu=0)
    refused(r"rotary/KV-commit epilogue needs the weight as \[N, K\]", transpose_b=0)
    refused(r"whole QKV weight \(no split_n\)", split_n=384)
    shared = dev.alloc(3 * 64 + q_out.size, F32, stream=s, name="shared")  # x, then q_out after it
    x = shared.view(F32, (3 * 64,))
    inside = attention.rope_epilogue(keys, values, lengths, shared, pos, **common)
    with pytest.raises(KernelArgumentError, match=r"out 'shared' overlaps x"):
        gemm(dev, q_out, x, w, transpose_b=1, **{**base, "rope": inside})
    with pytest.raises(KernelArgumentError, match=r"GEMV only \(M <= 16\); M=17: run the GEMM and "
                       r"the QKVRotaryCommit kernel"):  # fmt: skip
        plan_matmul("nk", BF16, M=17, N=192, K=64, epilogue="rope")
