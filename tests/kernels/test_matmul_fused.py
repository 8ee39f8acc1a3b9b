"""The GEMVs fused with the op that makes their activations (`ep.kernels.matmul.gemv_norm`,
``gemv_swiglu``): bitwise the op's own kernel followed by the plain GEMV.

Each case runs the chain (RMSNorm / SkipRMSNorm / packed SwiGLU into a buffer, then `gemm`) and
the fused call on fresh seeded inputs with every output poisoned first, and compares the bits:
on the CPU device (the NumPy twins) and, marked ``cuda``, on the GPU, where the fused kernel must
repeat the norm kernel's reduction order and the SwiGLU kernel's roundings exactly. Sizes cover
odd N, K not a multiple of a warp's step, a hidden size whose norm block is 7 warps, M = 1..16,
the K split over blocks (a workspace) and resident weights loaded before the PDL wait.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest

from ep.device import Buffer, Device
from ep.errors import KernelArgumentError
from ep.kernels import matmul, mlp, norm
from ep.kernels.matmul import GEMV_MAX_ROWS, fused_gemv_ok, fused_gemv_plan, gemm, matmul_workspace

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
DTYPE_IDS = ["f32", "f16", "bf16"]
# (M, N, K): K = 896 (the 0.5B hidden; 112 bf16 units: a norm block of 4 warps), 224 (fp32: 56
# units), 1000 (125 units: 4 warps, one partial), 4864 (SwiGLU's intermediate: split over blocks)
NORM_CASES = [(1, 200, 896), (3, 77, 224), (9, 1152, 1000), (16, 128, 896)]
SWIGLU_CASES = [(1, 96, 4864), (5, 200, 488), (16, 72, 1000)]

Upload = Callable[..., Buffer]
Poison = Callable[[Buffer], None]


def _array(rng: np.random.Generator, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32).astype(dtype)


def _weights(rng: np.random.Generator, N: int, K: int, dtype: np.dtype) -> np.ndarray:
    return (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32).astype(dtype)


def _same_bits(got: Buffer, want: Buffer) -> None:
    g, w = (
        got.to_host(stream=got.device.default_stream),
        want.to_host(stream=want.device.default_stream),
    )
    bits = np.dtype(f"u{g.dtype.itemsize}")
    assert np.isfinite(g.astype(np.float32)).all()
    np.testing.assert_array_equal(g.view(bits), w.view(bits))


@pytest.mark.parametrize("resident", [False, True], ids=["late", "early"])
@pytest.mark.parametrize("skip", [False, True], ids=["rms", "skip"])
@pytest.mark.parametrize("case", NORM_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gemv_norm_is_the_norm_then_the_gemv_bitwise(
    device: Device, rng: np.random.Generator, upload: Upload, poison: Poison,
    dtype: np.dtype, case: tuple[int, int, int], skip: bool, resident: bool,
) -> None:  # fmt: skip
    M, N, K = case
    s = device.default_stream
    x = upload(device, _array(rng, (M, K), dtype), "x")
    res = upload(device, _array(rng, (M, K), dtype), "residual")
    gamma = upload(device, (1.0 + 0.1 * rng.standard_normal(K)).astype(dtype), "gamma")
    w = upload(device, _weights(rng, N, K, dtype), "w")
    ws = matmul_workspace(device, stream=s)
    outs = {}
    for name in ("normed", "sum", "want", "got", "got_sum"):
        rows = N if name in ("want", "got") else K
        outs[name] = device.alloc((M, rows), dtype, stream=s, name=name)
        poison(outs[name])
    if skip:
        norm.skip_rms_norm(device, outs["normed"], outs["sum"], x, res, gamma, rows=M, hidden=K,
                           epsilon=1e-6, stream=s)  # fmt: skip
    else:
        norm.rms_norm(device, outs["normed"], x, gamma, rows=M, hidden=K, epsilon=1e-6, stream=s)
    gemm(device, outs["want"], outs["normed"], w, M=M, N=N, K=K, transpose_b=1, stream=s,
         workspace=ws)  # fmt: skip
    plan = matmul.gemv_norm(
        device, outs["got"], x, gamma, w, M=M, N=N, K=K, epsilon=1e-6, stream=s, workspace=ws,
        skip=res if skip else None, sum_out=outs["got_sum"] if skip else None, resident=resident,
    )  # fmt: skip
    assert plan.kernel == f"ep_gemv_nk_norm_{matmul._DTYPES[dtype][0]}"
    _same_bits(outs["got"], outs["want"])
    if skip:
        _same_bits(outs["got_sum"], outs["sum"])


@pytest.mark.parametrize("resident", [False, True], ids=["late", "early"])
@pytest.mark.parametrize("case", SWIGLU_CASES, ids=lambda c: "x".join(map(str, c)))
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_gemv_swiglu_is_the_swiglu_then_the_gemv_bitwise(
    device: Device, rng: np.random.Generator, upload: Upload, poison: Poison,
    dtype: np.dtype, case: tuple[int, int, int], resident: bool,
) -> None:  # fmt: skip
    M, N, K = case
    s = device.default_stream
    gu = upload(device, (2.0 * _array(rng, (M, 2 * K), np.dtype(np.float32))).astype(dtype), "gu")
    w = upload(device, _weights(rng, N, K, dtype), "w")
    ws = matmul_workspace(device, stream=s)
    act = device.alloc((M, K), dtype, stream=s, name="act")
    want = device.alloc((M, N), dtype, stream=s, name="want")
    got = device.alloc((M, N), dtype, stream=s, name="got")
    for b in (act, want, got):
        poison(b)
    mlp.swiglu_packed(device, act, gu, rows=M, inter=K, interleaved=0, stream=s)
    gemm(device, want, act, w, M=M, N=N, K=K, transpose_b=1, stream=s, workspace=ws)
    plan = matmul.gemv_swiglu(
        device, got, gu, w, M=M, N=N, K=K, stream=s, workspace=ws, resident=resident
    )
    assert plan.gy >= 1 and plan.kernel.startswith("ep_gemv_nk_swiglu_")
    _same_bits(got, want)


def test_the_large_k_case_splits_over_blocks(cpu_device: Device) -> None:
    """SWIGLU_CASES' K = 4864 takes the K split over blocks (the workspace's last-block sum)."""
    ws = matmul_workspace(cpu_device, stream=cpu_device.default_stream)
    plan = fused_gemv_plan(cpu_device, BF16, M=1, N=96, K=4864, workspace=ws)
    assert plan is not None and plan.gy > 1


# --- what the fused GEMVs refuse ---------------------------------------------------------------


def test_only_gemv_sizes_and_aligned_activations_fuse(cpu_device: Device, upload: Upload) -> None:
    x = upload(cpu_device, np.zeros((2, 64), np.float32))
    assert fused_gemv_ok(np.float32, M=2, K=64, activations=(x,))
    assert not fused_gemv_ok(np.float32, M=GEMV_MAX_ROWS + 1, K=64, activations=(x,))
    assert not fused_gemv_ok(np.float32, M=2, K=66, activations=(x,))  # K % 4
    assert not fused_gemv_ok(np.float32, M=2, K=60, activations=(x.view(np.float32, offset=4),))
    assert fused_gemv_plan(cpu_device, BF16, M=17, N=8, K=64, workspace=None) is None


def _norm_args(dev: Device, upload: Upload, M: int = 2, K: int = 64) -> dict[str, Buffer]:
    return {
        "out": dev.alloc((M, 8), np.float32, stream=dev.default_stream, name="out"),
        "x": upload(dev, np.ones((M, K), np.float32), "x"),
        "gamma": upload(dev, np.ones(K, np.float32), "gamma"),
        "w": upload(dev, np.ones((8, K), np.float32), "w"),
    }


def test_skip_needs_its_sum_and_the_sum_its_own_bytes(cpu_device: Device, upload: Upload) -> None:
    a = _norm_args(cpu_device, upload)
    s = cpu_device.default_stream
    call = dict(M=2, N=8, K=64, epsilon=1e-6, stream=s)
    with pytest.raises(KernelArgumentError, match="skip and sum_out come together"):
        matmul.gemv_norm(cpu_device, a["out"], a["x"], a["gamma"], a["w"], skip=a["x"], **call)
    skip = upload(cpu_device, np.ones((2, 64), np.float32), "skip")
    with pytest.raises(KernelArgumentError, match=r"gemv_norm: out 'x' overlaps x"):
        matmul.gemv_norm(cpu_device, a["out"], a["x"], a["gamma"], a["w"], skip=skip,
                         sum_out=a["x"], **call)  # fmt: skip


def test_unaligned_or_too_many_rows_are_refused_with_the_fix(
    cpu_device: Device, upload: Upload
) -> None:
    a = _norm_args(cpu_device, upload, M=17)
    s = cpu_device.default_stream
    with pytest.raises(KernelArgumentError, match=r"M=17.*run the op and gemm apart"):
        matmul.gemv_norm(cpu_device, a["out"].view(np.float32, (17 * 8,)), a["x"], a["gamma"],
                         a["w"], M=17, N=8, K=64, epsilon=1e-6, stream=s)  # fmt: skip
    gu = upload(cpu_device, np.ones(2 * 2 * 64 + 1, np.float32), "gu").view(np.float32, offset=4)
    out = cpu_device.alloc((2, 8), np.float32, stream=s, name="out")
    w = upload(cpu_device, np.ones((8, 64), np.float32), "w")
    with pytest.raises(KernelArgumentError, match="16-byte aligned activations"):
        matmul.gemv_swiglu(cpu_device, out, gu, w, M=2, N=8, K=64, stream=s)
