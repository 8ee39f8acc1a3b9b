"""The split-K GEMVs with a SwiGLU epilogue (``ep_gemv_<fmt>_swiglu_<dt>``, `gemm(...,
swiglu=)`): bitwise the plain GEMV followed by `ep.kernels.mlp.swiglu_packed`, on the CPU device
(the NumPy twins) and, marked ``cuda``, on the GPU. Outputs are poisoned with NaN first.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
from gemv_case import GemvCase

from ep.device import Buffer, Device
from ep.errors import KernelArgumentError
from ep.kernels import matmul
from ep.kernels.matmul import MatmulPlan, MatmulWorkspace, gemm, matmul_workspace, plan_matmul
from ep.kernels.mlp import swiglu_packed
from ep.ops import mlp as mlp_ref

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
DTYPE_IDS = ["f32", "f16", "bf16"]
FORMATS = ["nk", "q4", "q4-zp", "mx4"]

Upload = Callable[..., Buffer]
Poison = Callable[[Buffer], None]


def _fused_and_chain(
    case: GemvCase, x: np.ndarray, ws: MatmulWorkspace | None, interleaved: int, poison: Poison,
    upload: Upload,
) -> tuple[np.ndarray, np.ndarray, MatmulPlan, MatmulPlan]:  # fmt: skip
    """(fused output, GEMV-then-SwiGLUPacked output, fused plan, plain plan) for rows ``x``."""
    dev, s, M = case.dev, case.dev.default_stream, x.shape[0]
    xb = upload(dev, x)
    fused = dev.alloc((M, case.N // 2), case.dtype, stream=s, name="fused")
    packed = dev.alloc((M, case.N), case.dtype, stream=s, name="packed")
    chain = dev.alloc((M, case.N // 2), case.dtype, stream=s, name="chain")
    for buf in (fused, packed, chain):
        poison(buf)
    fused_plan = case.run(fused, xb, M, ws, swiglu=interleaved)
    plain_plan = case.run(packed, xb, M, ws)
    swiglu_packed(dev, chain, packed, rows=M, inter=case.N // 2, interleaved=interleaved, stream=s)
    return fused.to_host(stream=s), chain.to_host(stream=s), fused_plan, plain_plan


@pytest.mark.parametrize("interleaved", [0, 1], ids=["halves", "interleaved"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("split", ["gy1", "split-k"])
def test_swiglu_epilogue_is_bitwise_the_gemv_then_swiglu_packed(
    device: Device,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    dtype: np.dtype,
    fmt: str,
    interleaved: int,
    split: str,
) -> None:
    """Every batch size of the GEMV (1, 5, 16), with the K split over warps only (no workspace)
    and over blocks (a workspace: gy > 1, the last block finishes the pairs)."""
    K, N = (2048, 96) if split == "split-k" else (320, 208)
    case = GemvCase(device, rng, upload, fmt, dtype, N, K)
    ws = None
    if split == "split-k":
        ws = matmul_workspace(device, stream=device.default_stream, floats=1 << 18, counters=1024)
    for M in (1, 5, 16):
        x = rng.standard_normal((M, K)).astype(np.float32).astype(dtype)
        got, want, fused, plain = _fused_and_chain(case, x, ws, interleaved, poison, upload)
        base = plain.kernel.split("_")[2]  # the format (nk16: dense at 9..16 rows)
        assert fused.kernel == plain.kernel.replace(f"_{base}_", f"_{base}_swiglu_")
        assert (fused.kw, fused.gy, fused.grid) == (plain.kw, plain.gy, plain.grid)
        assert (fused.gy > 1) == (split == "split-k")
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
        # and it is SwiGLU of the product: the reference within the dtype's bounds
        y = x.astype(np.float32) @ case.dense.astype(dtype).astype(np.float32).T
        inter = N // 2
        gate, up = (y[:, 0::2], y[:, 1::2]) if interleaved else (y[:, :inter], y[:, inter:])
        ref = mlp_ref.swiglu(gate, up)
        tol = 1e-5 if dtype == np.float32 else 3e-2
        err = np.abs(got.astype(np.float64) - ref).max() / np.abs(ref).max()
        assert err < tol, (M, err)


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["nk", "q4-zp"])
def test_swiglu_epilogue_on_the_mlp_shape_of_qwen_0_5b(
    cuda_device: Device, rng: np.random.Generator, poison: Poison, upload: Upload, fmt: str
) -> None:
    """The model's gate/up projection (K 896, N 2 x 4864), bf16, in the workspace the native
    executor gives it; a captured graph replays the fused call to the same bits."""
    dev, s = cuda_device, cuda_device.default_stream
    case = GemvCase(dev, rng, upload, fmt, BF16, 9728, 896)
    ws = matmul_workspace(dev, stream=s)
    for M in (1, 16):
        x = rng.standard_normal((M, 896)).astype(np.float32).astype(BF16)
        got, want, _, _ = _fused_and_chain(case, x, ws, 0, poison, upload)
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
    xb = upload(dev, x)
    out = dev.alloc((16, 4864), BF16, stream=s, name="captured")
    dev.compile_all()
    with dev.capture(stream=s) as cap:
        case.run(out, xb, 16, ws, swiglu=0)
    for _ in range(2):
        poison(out)
        cap.graph.launch(stream=s)
        np.testing.assert_array_equal(out.to_host(stream=s).view(np.uint16), want.view(np.uint16))


def test_swiglu_plan_keeps_the_plain_k_split_and_never_takes_v2(cpu_device: Device) -> None:
    ws = matmul_workspace(cpu_device, stream=cpu_device.default_stream)
    for fmt, N, K in (("nk", 9728, 896), ("q4", 9728, 896), ("mx4", 1152, 896)):
        plain = plan_matmul(fmt, BF16, M=1, N=N, K=K, workspace=ws)
        fused = plan_matmul(fmt, BF16, M=1, N=N, K=K, workspace=ws, epilogue="swiglu")
        assert matmul.split_k_gemv(plain) and not matmul.split_k_gemv(fused)
        assert fused.kernel == f"ep_gemv_{fmt}_swiglu_bf16"
        assert (fused.kw, fused.gy, fused.grid) == (plain.kw, plain.gy, plain.grid)
        assert "SwiGLU epilogue" in fused.reason
    # The vocabulary-sized 4-bit weight plans v2 alone; its epilogue form is the split-K GEMV.
    v2 = plan_matmul("q4", BF16, M=1, N=151936, K=896, workspace=ws)
    fused = plan_matmul("q4", BF16, M=1, N=151936, K=896, workspace=ws, epilogue="swiglu")
    assert "_v2_" in v2.kernel and fused.kernel == "ep_gemv_q4_swiglu_bf16"
    assert not matmul.split_k_gemv(v2)


def test_swiglu_epilogue_refuses_what_it_cannot_run(
    cpu_device: Device, rng: np.random.Generator, upload: Upload
) -> None:
    dev, s = cpu_device, cpu_device.default_stream
    N, K = 64, 64
    x = upload(dev, np.ones((17, K), np.float32))
    w = upload(dev, np.ones((N, K), np.float32))
    out = dev.alloc((17, N), np.float32, stream=s)
    base = dict(M=1, N=N, K=K, transpose_b=1, stream=s)

    def refused(match: str, **kw: object) -> None:
        args = {**base, **kw}
        with pytest.raises(KernelArgumentError, match=match):
            gemm(dev, args.pop("out", out), x, w, **args)  # type: ignore[arg-type]

    refused(r"swiglu=2; expected None \(no epilogue\), 0", swiglu=2)
    refused(r"swiglu=True; expected None", swiglu=True)
    refused(r"needs the weight as \[N, K\] \(transpose_b=1\)", swiglu=0, transpose_b=0)
    refused(r"GEMV only \(M <= 16\); M=17", swiglu=0, M=17)
    refused(r"N \(gate and up outputs\) a multiple of 16; got N=40", swiglu=0, N=40)
    refused(r"whole gate/up weight \(no split_n\)", swiglu=0, split_n=128)
    small = dev.alloc((1, N // 2 - 1), np.float32, stream=s, name="small")
    refused(r"out 'small' holds 31 elements; these sizes need 32", swiglu=0, out=small)
    with pytest.raises(KernelArgumentError, match=r"matmul: a SwiGLU epilogue runs in the GEMV"):
        plan_matmul("nk", np.dtype(np.float32), M=20, N=N, K=K, epilogue="swiglu")
