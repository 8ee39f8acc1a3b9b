"""The matmul kernels (`ep.kernels.matmul`) against the NumPy references of `ep.ops.matmul`.

Every test runs on the CPU device (the kernels' NumPy twins: the wrappers, the checks and the
plans) and, marked ``cuda``, on the GPU. Inputs are seeded random, outputs poisoned with NaN first.
Bounds: fp32 1e-5 (the same dequantized weights, only the summation order differs), fp16/bf16
1e-2 (one rounding of the output; 4-bit/MXFP4 also round the dequantized weight to fp16/bf16).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ep.device import Buffer, Device, KernelCache, compile_kernel
from ep.errors import KernelArgumentError
from ep.kernels import matmul
from ep.kernels.matmul import (
    GEMV_MAX_ROWS,
    MATMUL_KERNELS,
    Format,
    MatmulPlan,
    gemm,
    gemm_mxfp4,
    gemm_nbits,
    matmul_workspace,
    plan_matmul,
)
from ep.ops import DictWeights, use_weights
from ep.ops import norm as norm_ref
from ep.ops.matmul import (
    dequantize_nbits,
    matmul_mxfp4,
    matmul_nbits,
    matmul_nbits_zp,
    matmul_weight,
    quantize_mxfp4,
    quantize_nbits,
)

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
DTYPE_IDS = ["f32", "f16", "bf16"]
ROWS = [1, 3, 16, 67]  # GEMV at 1, 3, 16; the tiled GEMM at 67

Upload = Callable[..., Buffer]
Poison = Callable[[Buffer], None]
RelError = Callable[[np.ndarray, np.ndarray], float]


def _tol(dtype: np.dtype) -> float:
    return 1e-5 if dtype == np.float32 else 1e-2


def _acts(rng: np.random.Generator, dtype: np.dtype, M: int, K: int) -> np.ndarray:
    return rng.standard_normal((M, K)).astype(np.float32).astype(dtype)


def _weights(rng: np.random.Generator, shape: tuple[int, int], K: int) -> np.ndarray:
    return (rng.standard_normal(shape) / np.sqrt(K)).astype(np.float32)


def _out(dev: Device, dtype: np.dtype, M: int, N: int, poison: Poison) -> Buffer:
    out = dev.alloc((M, N), dtype, stream=dev.default_stream, name="y")
    poison(out)
    return out


def _dense_ref(x: np.ndarray, w: np.ndarray, N: int, transpose_b: int) -> np.ndarray:
    with use_weights(DictWeights({"w": w})):
        return matmul_weight(x, weight="w", N=N, transpose_b=transpose_b)


def _q4_case(
    rng: np.random.Generator, dtype: np.dtype, N: int, K: int, block: int, zero_point: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    b, scales, zp = quantize_nbits(
        _weights(rng, (N, K), K), block_size=block, zero_point=zero_point
    )
    return b, scales.astype(dtype), zp


def _q4_ref(
    x: np.ndarray, b: np.ndarray, scales: np.ndarray, zp: np.ndarray | None, N: int, K: int, bs: int
) -> np.ndarray:
    """MatMulNBits with the dequantized weights rounded once to x's dtype, as the kernels compute
    them ((q - z) * s in fp16/bf16 registers) before the fp32 sums. The fp32 reference alone
    would show that rounding as a large relative error on a single output whose sum cancels."""
    if x.dtype == np.float32:
        if zp is None:
            return matmul_nbits(x, b, scales, K=K, N=N, bits=4, block_size=bs)
        return matmul_nbits_zp(x, b, scales, zp, K=K, N=N, bits=4, block_size=bs)
    w = dequantize_nbits(b, scales, zp, K=K, N=N, block_size=bs).astype(x.dtype)
    return (x.astype(np.float32) @ w.astype(np.float32).T).astype(x.dtype)


def _mx4_case(rng: np.random.Generator, N: int, K: int) -> tuple[np.ndarray, np.ndarray]:
    # Block magnitudes spread over 2^-6 .. 2^3, all inside fp16's range once decoded.
    spread = np.exp2(rng.integers(-6, 4, size=(N, K // 32, 1))).astype(np.float32)
    w = (rng.standard_normal((N, K // 32, 32)).astype(np.float32) * spread).reshape(N, K)
    return quantize_mxfp4(w)


# --- compile: every kernel builds for the H200 without a GPU -----------------------------------


def test_every_matmul_kernel_compiles_to_sm90_cubin(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path)
    for name, source in MATMUL_KERNELS.items():
        report = compile_kernel(source, "sm_90", cache=cache).report
        assert report.cubin_bytes > 0, name
    # {gemv, gemm} x {nk, kn, q4, mx4} x {f32, f16, bf16}, the streaming and v2 q4/mx4 GEMVs,
    # the dense v2 GEMV (fp16/bf16), the SwiGLU-epilogue GEMVs ({nk, q4, mx4} x every dtype) and
    # the dense 9..16-row GEMV, plain and with SwiGLU (fp16/bf16)
    assert len(MATMUL_KERNELS) == 24 + 4 + 4 + 2 + 9 + 4
    assert {n for n in MATMUL_KERNELS if "_v2_" in n} == {
        f"ep_gemv_{fmt}_v2_{dt}" for fmt in ("nk", "q4", "mx4") for dt in ("f16", "bf16")
    }
    assert {n for n in MATMUL_KERNELS if "_swiglu_" in n} == {
        f"ep_gemv_{fmt}_swiglu_{dt}" for fmt in ("nk", "q4", "mx4") for dt in ("f32", "f16", "bf16")
    } | {f"ep_gemv_nk16_swiglu_{dt}" for dt in ("f16", "bf16")}
    assert {n for n in MATMUL_KERNELS if "_nk16_" in n} == {
        f"ep_gemv_nk16_{kind}{dt}" for kind in ("", "swiglu_") for dt in ("f16", "bf16")
    }


# --- dense -------------------------------------------------------------------------------------


@pytest.mark.parametrize("transpose_b", [1, 0], ids=["nk", "kn"])
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_dense_matches_matmul_weight(
    device: Device,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    rel_error: RelError,
    dtype: np.dtype,
    M: int,
    transpose_b: int,
) -> None:
    K, N = 93, 45  # odd: partial 16-byte chunks, element-wise edges
    x = _acts(rng, dtype, M, K)
    w = _weights(rng, (N, K) if transpose_b else (K, N), K).astype(dtype)
    out = _out(device, dtype, M, N, poison)
    plan = gemm(
        device,
        out,
        upload(device, x),
        upload(device, w),
        M=M,
        N=N,
        K=K,
        transpose_b=transpose_b,
        stream=device.default_stream,
    )
    assert plan.kind == ("gemv" if M <= GEMV_MAX_ROWS else "gemm")
    got = out.to_host(stream=device.default_stream)
    assert rel_error(got, _dense_ref(x, w, N, transpose_b)) < _tol(dtype)


@pytest.mark.parametrize("captured", [False, True], ids=["eager", "captured"])
@pytest.mark.parametrize("fmt", ["nk", "q4", "mx4"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=["f32", "bf16"])
def test_resident_weights_load_early_yet_x_is_read_after_its_writer(
    device: Device, rng: np.random.Generator, poison: Poison, upload: Upload,
    rel_error: RelError, dtype: np.dtype, fmt: str, captured: bool,
) -> None:  # fmt: skip
    """``resident=True``: the GEMV loads its weights before its PDL wait. x is written by the
    kernel right before it (RMSNorm of a buffer), over x poisoned with NaN: a GEMV that read x
    before the wait would see NaN or stale values. Eager and inside a captured graph, with the
    workspace's K split over blocks (its counters too must wait). Checked on the H200: with the
    early path's wait removed every captured case fails (NaN outputs); eager launches are far
    enough apart on the host that they still pass."""
    from ep.kernels import norm

    M, N, K = 3, 200, 4864
    s = device.default_stream
    src = _acts(rng, dtype, M, K)
    gamma = np.ones(K, dtype)
    x_host = norm_ref.rms_norm(src, gamma, epsilon=1e-6)
    if fmt == "nk":
        w = _weights(rng, (N, K), K).astype(dtype)
        weights, want = [upload(device, w)], _dense_ref(x_host, w, N, 1)
    elif fmt == "q4":
        b, scales, zp = _q4_case(rng, dtype, N, K, 32, True)
        weights = [upload(device, b), upload(device, scales), upload(device, zp)]
        want = _q4_ref(x_host, b, scales, zp, N, K, 32)
    else:
        b, scales = _mx4_case(rng, N, K)
        weights = [upload(device, b), upload(device, scales)]
        want = matmul_mxfp4(x_host, b, scales, K=K, N=N)
    src_b, gamma_b = upload(device, src), upload(device, gamma)
    x = device.alloc((M, K), dtype, stream=s, name="x")
    out = _out(device, dtype, M, N, poison)
    ws = matmul_workspace(device, stream=s)
    common = dict(M=M, N=N, K=K, stream=s, workspace=ws, resident=True)

    def step() -> MatmulPlan:
        norm.rms_norm(device, x, src_b, gamma_b, rows=M, hidden=K, epsilon=1e-6, stream=s)
        if fmt == "nk":
            return gemm(device, out, x, weights[0], transpose_b=1, **common)
        if fmt == "q4":
            return gemm_nbits(device, out, x, *weights, block_size=32, **common)
        return gemm_mxfp4(device, out, x, *weights, **common)

    poison(x)
    if captured:
        with device.capture(stream=s) as cap:
            plan = step()
        poison(x)
        poison(out)
        cap.graph.launch(stream=s)
    else:
        plan = step()
    assert plan.kernel == f"ep_gemv_{fmt}_{matmul._DTYPES[dtype][0]}" and plan.gy > 1
    assert rel_error(out.to_host(stream=s), want) < _tol(dtype)


@pytest.mark.parametrize("transpose_b", [1, 0], ids=["nk", "kn"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("M", "N", "K"), [(1, 896, 4864), (16, 4864, 896), (67, 200, 136)])
def test_dense_model_shapes_with_workspace(
    device: Device,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    rel_error: RelError,
    monkeypatch: pytest.MonkeyPatch,
    M: int,
    N: int,
    K: int,
    dtype: np.dtype,
    transpose_b: int,
) -> None:
    monkeypatch.setenv(matmul.GEMV_ENV, "v1")  # the split-K path (the v2 GEMVs have no workspace)
    s = device.default_stream
    ws = matmul_workspace(device, stream=s, floats=1 << 20, counters=1 << 12)
    x = _acts(rng, dtype, M, K)
    w = _weights(rng, (N, K) if transpose_b else (K, N), K).astype(dtype)
    xb, wb = upload(device, x), upload(device, w)
    want = _dense_ref(x, w, N, transpose_b)
    for _ in range(2):  # the second launch needs the counters the first one reset
        out = _out(device, dtype, M, N, poison)
        plan = gemm(
            device, out, xb, wb, M=M, N=N, K=K, transpose_b=transpose_b, stream=s, workspace=ws
        )
        assert rel_error(out.to_host(stream=s), want) < _tol(dtype)
    if M <= GEMV_MAX_ROWS and K > N:
        assert plan.gy > 1  # this shape does split over blocks: the workspace path is tested
    assert not ws.counters.to_host(stream=s).any()


# --- MatMulNBits ---------------------------------------------------------------------------------


@pytest.mark.parametrize("zero_point", [False, True], ids=["zp8", "zp"])
@pytest.mark.parametrize("block", [16, 32, 128])
@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nbits_matches_matmul_nbits(
    device: Device,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    rel_error: RelError,
    dtype: np.dtype,
    M: int,
    block: int,
    zero_point: bool,
) -> None:
    K, N = 100, 37  # K not a multiple of the block: padded blocks; block 16: a half chunk
    x = _acts(rng, dtype, M, K)
    b, scales, zp = _q4_case(rng, dtype, N, K, block, zero_point)
    out = _out(device, dtype, M, N, poison)
    gemm_nbits(
        device,
        out,
        upload(device, x),
        upload(device, b),
        upload(device, scales),
        upload(device, zp) if zp is not None else None,
        M=M,
        N=N,
        K=K,
        block_size=block,
        stream=device.default_stream,
    )
    got = out.to_host(stream=device.default_stream)
    assert rel_error(got, _q4_ref(x, b, scales, zp, N, K, block)) < _tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("M", "N", "K"), [(1, 4864, 896), (4, 896, 4864), (33, 300, 896)])
def test_nbits_model_shapes_with_workspace(
    device: Device,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    rel_error: RelError,
    M: int,
    N: int,
    K: int,
    dtype: np.dtype,
) -> None:
    s = device.default_stream
    ws = matmul_workspace(device, stream=s, floats=1 << 20, counters=1 << 12)
    x = _acts(rng, dtype, M, K)
    b, scales, zp = _q4_case(rng, dtype, N, K, 32, True)
    out = _out(device, dtype, M, N, poison)
    gemm_nbits(
        device,
        out,
        upload(device, x),
        upload(device, b),
        upload(device, scales),
        upload(device, zp),
        M=M,
        N=N,
        K=K,
        block_size=32,
        stream=s,
        workspace=ws,
    )
    assert rel_error(out.to_host(stream=s), _q4_ref(x, b, scales, zp, N, K, 32)) < _tol(dtype)


# --- MXFP4 ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("M", ROWS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_mxfp4_matches_matmul_mxfp4(
    device: Device,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    rel_error: RelError,
    dtype: np.dtype,
    M: int,
) -> None:
    K, N = 96, 37  # 3 MX blocks a row: the last step has lanes with no block
    x = _acts(rng, dtype, M, K)
    b, scales = _mx4_case(rng, N, K)
    out = _out(device, dtype, M, N, poison)
    gemm_mxfp4(
        device,
        out,
        upload(device, x),
        upload(device, b),
        upload(device, scales),
        M=M,
        N=N,
        K=K,
        stream=device.default_stream,
    )
    want = matmul_mxfp4(x, b, scales, K=K, N=N)
    assert rel_error(out.to_host(stream=device.default_stream), want) < _tol(dtype)


@pytest.mark.parametrize("M", [16, 40])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_mxfp4_every_code_and_the_nan_scale(
    device: Device, upload: Upload, poison: Poison, dtype: np.dtype, M: int
) -> None:
    """Row m picks weight column m: all 16 E2M1 codes come out exactly; scale 255 is NaN."""
    N, K = 3, 64
    codes = np.tile(np.arange(16, dtype=np.uint8), (N, K // 16))  # W[n, k] has code k % 16
    b = (codes[:, 0::2] | (codes[:, 1::2] << 4)).reshape(N, K // 32, 16)
    scales = np.array([[127, 130], [120, 127], [255, 127]], dtype=np.uint8)
    x = np.eye(M, K, dtype=np.float32).astype(dtype)
    out = _out(device, dtype, M, N, poison)
    gemm_mxfp4(
        device,
        out,
        upload(device, x),
        upload(device, b),
        upload(device, scales),
        M=M,
        N=N,
        K=K,
        stream=device.default_stream,
    )
    got = out.to_host(stream=device.default_stream).astype(np.float32)
    want = matmul_mxfp4(x, b, scales, K=K, N=N).astype(np.float32)
    np.testing.assert_array_equal(got, want)  # NaN where want is NaN, exact elsewhere
    e2m1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float32)
    decoded = np.concatenate([e2m1, -e2m1])[np.arange(M) % 16]
    block_scale = np.where(np.arange(M) < 32, 1.0, 8.0)
    np.testing.assert_array_equal(got[:, 0], decoded * block_scale)
    assert np.isnan(got[: min(M, 32), 2]).all()


# --- alignment fallbacks, aliasing of rows, capture -----------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("M", [2, 20])
def test_unaligned_views_take_the_elementwise_path(
    device: Device,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    rel_error: RelError,
    dtype: np.dtype,
    M: int,
) -> None:
    """x and W one element past an aligned address (and q4 bytes one byte past): same results."""
    s = device.default_stream
    K, N, block = 128, 24, 32
    x = _acts(rng, dtype, M, K)
    w = _weights(rng, (N, K), K).astype(dtype)
    xs = upload(device, np.concatenate([np.zeros(1, dtype), x.reshape(-1)]))
    ws = upload(device, np.concatenate([np.zeros(1, dtype), w.reshape(-1)]))
    xv = xs.view(dtype, (M, K), offset=dtype.itemsize)
    wv = ws.view(dtype, (N, K), offset=dtype.itemsize)
    out = _out(device, dtype, M, N, poison)
    gemm(device, out, xv, wv, M=M, N=N, K=K, transpose_b=1, stream=s)
    assert rel_error(out.to_host(stream=s), _dense_ref(x, w, N, 1)) < _tol(dtype)
    b, scales, zp = _q4_case(rng, dtype, N, K, block, True)
    bs = upload(device, np.concatenate([np.zeros(1, np.uint8), b.reshape(-1)]))
    out = _out(device, dtype, M, N, poison)
    gemm_nbits(
        device,
        out,
        xv,
        bs.view(np.uint8, b.size, offset=1),
        upload(device, scales),
        upload(device, zp),
        M=M,
        N=N,
        K=K,
        block_size=block,
        stream=s,
    )
    assert rel_error(out.to_host(stream=s), _q4_ref(x, b, scales, zp, N, K, block)) < _tol(dtype)


@pytest.mark.parametrize("fmt", ["nk", "kn", "q4", "mx4"])
@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=["f32", "bf16"])
def test_a_row_is_bitwise_the_same_at_every_batch_size(
    device: Device,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    dtype: np.dtype,
    fmt: str,
) -> None:
    """Rows of a batch-16 GEMV equal the same rows run alone (the K split ignores M)."""
    s = device.default_stream
    ws = matmul_workspace(device, stream=s, floats=1 << 18, counters=1 << 10)
    K, N = 1024, 72
    x = _acts(rng, dtype, GEMV_MAX_ROWS, K)
    w = _weights(rng, (N, K), K)
    if fmt in ("nk", "kn"):
        weights = [upload(device, (w if fmt == "nk" else w.T).astype(dtype))]
    elif fmt == "q4":
        b, scales, zp = _q4_case(rng, dtype, N, K, 64, True)
        weights = [upload(device, b), upload(device, scales), upload(device, zp)]
    else:
        weights = [upload(device, a) for a in quantize_mxfp4(w)]

    def run(rows: np.ndarray) -> np.ndarray:
        M = rows.shape[0]
        out = _out(device, dtype, M, N, poison)
        xb = upload(device, rows)
        if fmt in ("nk", "kn"):
            gemm(
                device,
                out,
                xb,
                weights[0],
                M=M,
                N=N,
                K=K,
                transpose_b=int(fmt == "nk"),
                stream=s,
                workspace=ws,
            )
        elif fmt == "q4":
            gemm_nbits(
                device, out, xb, *weights, M=M, N=N, K=K, block_size=64, stream=s, workspace=ws
            )
        else:
            gemm_mxfp4(device, out, xb, *weights, M=M, N=N, K=K, stream=s, workspace=ws)
        return out.to_host(stream=s)

    batch = run(x)
    for i in (0, 5, 15):
        np.testing.assert_array_equal(run(x[i : i + 1]), batch[i : i + 1])
    np.testing.assert_array_equal(run(x[3:6]), batch[3:6])


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=["f32", "bf16"])
def test_a_captured_gemv_replays_with_new_inputs(
    device: Device,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    rel_error: RelError,
    monkeypatch: pytest.MonkeyPatch,
    dtype: np.dtype,
) -> None:
    """Split over blocks inside a graph: every replay sees zeroed counters and is right."""
    monkeypatch.setenv(matmul.GEMV_ENV, "v1")  # the split-K GEMV (v2 does not split over blocks)
    s = device.default_stream
    M, N, K = 2, 64, 2048
    ws = matmul_workspace(device, stream=s, floats=1 << 18, counters=1 << 10)
    w = _weights(rng, (N, K), K).astype(dtype)
    wb = upload(device, w)
    xb = device.alloc((M, K), dtype, stream=s, name="x")
    out = _out(device, dtype, M, N, poison)
    device.compile_all()
    with device.capture(stream=s) as cap:
        plan = gemm(device, out, xb, wb, M=M, N=N, K=K, transpose_b=1, stream=s, workspace=ws)
    assert plan.gy > 1
    for _ in range(3):
        x = _acts(rng, dtype, M, K)
        xb.copy_from_host(x, stream=s)
        poison(out)
        cap.graph.launch(stream=s)
        assert rel_error(out.to_host(stream=s), _dense_ref(x, w, N, 1)) < _tol(dtype)


# --- plans ---------------------------------------------------------------------------------------


def test_plan_picks_gemv_up_to_16_rows_and_never_looks_at_m_otherwise(
    cpu_device: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(matmul.GEMV_ENV, "v1")  # the split-K GEMVs (v2: see the tests below)
    ws = matmul_workspace(cpu_device, stream=cpu_device.default_stream)
    for fmt in ("nk", "kn", "q4", "mx4"):
        plans = [plan_matmul(fmt, BF16, M=m, N=896, K=4864, workspace=ws) for m in range(1, 17)]
        geometry = {(p.kernel, p.kind, p.grid, p.block, p.kw, p.gy) for p in plans}
        assert len(geometry) == 1, geometry
        (kernel, kind, _, block, kw, gy) = geometry.pop()
        assert (kernel, kind, block) == (f"ep_gemv_{fmt}_bf16", "gemv", 256)
        assert kw in (1, 2, 4, 8)
        assert gy > 1  # a long K over few columns splits over blocks when it may
        big = plan_matmul(fmt, BF16, M=17, N=896, K=4864, workspace=ws)
        assert big.kind == "gemm" and big.kernel == f"ep_gemm_{fmt}_bf16"
        assert big.grid == (14, 1, 1) and big.block == 128
    lone = plan_matmul("nk", BF16, M=1, N=896, K=4864)
    assert lone.gy == 1 and "no workspace" in lone.reason
    assert plan_matmul("nk", np.dtype(np.float32), M=100, N=10, K=10).block == 256
    wide = plan_matmul("nk", BF16, M=1, N=151936, K=896, workspace=ws)
    assert (wide.kw, wide.gy) == (1, 1) and wide.grid == (151936 // 64, 1, 1)  # 8 groups a block
    with pytest.raises(KernelArgumentError, match="dtype int8 has no kernel"):
        plan_matmul("nk", np.dtype(np.int8), M=1, N=8, K=8)


# --- argument checks (each one guards a kernel from reading or writing out of bounds) -------------


def test_bad_arguments_are_refused_with_a_sentence(cpu_device: Device) -> None:
    dev, s = cpu_device, cpu_device.default_stream
    f32, u8 = np.float32, np.uint8
    x = dev.alloc((2, 64), f32, stream=s, name="x")
    w = dev.alloc((8, 64), f32, stream=s, name="w")
    out = dev.alloc((2, 8), f32, stream=s, name="y")
    dev.fill(x, 1.0, stream=s)
    dev.fill(w, 0.5, stream=s)

    def dense(out: Buffer = out, x: Buffer = x, w: Buffer = w, **sizes: object) -> None:
        args: dict[str, object] = {"M": 2, "N": 8, "K": 64, "transpose_b": 1, **sizes}
        gemm(dev, out, x, w, stream=s, **args)  # type: ignore[arg-type]

    dense()  # the baseline is fine
    before = out.to_host(stream=s)
    np.testing.assert_array_equal(before, np.full((2, 8), 32.0))
    cases: list[tuple[dict[str, object], str]] = [
        ({"out": dev.alloc((2, 8), np.float16, stream=s)}, "float16; expected float32"),
        ({"w": dev.alloc((7, 64), f32, stream=s, name="small")}, "holds 448 elements"),
        ({"x": dev.alloc((2, 64), np.int32, stream=s)}, "float32, float16 or bfloat16"),
        ({"M": 0}, r"M=0 must be an integer in \[1, 2\^31\)"),
        ({"K": True}, "K=True"),
        ({"transpose_b": 2}, "transpose_b=2 must be 0 or 1"),
        ({"out": x.view(f32, 16)}, "overlaps x"),
        ({"workspace": object()}, "workspace must be a MatmulWorkspace"),
    ]
    for change, message in cases:
        with pytest.raises(KernelArgumentError, match=message):
            dense(**change)  # type: ignore[arg-type]

    b = dev.alloc(8 * 2 * 16, u8, stream=s, name="b")
    sc = dev.alloc(16, f32, stream=s, name="scales")
    with pytest.raises(KernelArgumentError, match="block_size=24 must be a power of two"):
        gemm_nbits(dev, out, x, b, sc, M=2, N=8, K=64, block_size=24, stream=s)
    with pytest.raises(KernelArgumentError, match="bits=8"):
        gemm_nbits(dev, out, x, b, sc, M=2, N=8, K=64, block_size=32, stream=s, bits=8)
    with pytest.raises(KernelArgumentError, match=r"zero_points .* holds 3 elements"):
        gemm_nbits(
            dev,
            out,
            x,
            b,
            sc,
            dev.alloc(3, u8, stream=s, name="zero_points"),
            M=2,
            N=8,
            K=64,
            block_size=32,
            stream=s,
        )
    with pytest.raises(KernelArgumentError, match="scales 'scales' is float32; expected float16"):
        gemm_nbits(
            dev,
            dev.alloc((2, 8), np.float16, stream=s),
            x.view(np.float16, (2, 64)),
            b,
            sc,
            M=2,
            N=8,
            K=64,
            block_size=32,
            stream=s,
        )
    with pytest.raises(KernelArgumentError, match="K=48 must be a multiple of 32"):
        gemm_mxfp4(dev, out, x, b, b, M=2, N=8, K=48, stream=s)
    with pytest.raises(KernelArgumentError, match="scales 'b' is uint8; expected"):
        gemm_nbits(dev, out, x, b, b, M=2, N=8, K=64, block_size=32, stream=s)
    # A refused call launched nothing: the output still holds the baseline's result.
    np.testing.assert_array_equal(out.to_host(stream=s), before)


def test_workspace_starts_with_zero_counters(device: Device) -> None:
    ws = matmul_workspace(device, stream=device.default_stream, floats=64, counters=32)
    assert ws.floats == 64 and ws.slots == 32
    assert not ws.counters.to_host(stream=device.default_stream).any()
    with pytest.raises(KernelArgumentError, match="must be positive"):
        matmul_workspace(device, stream=device.default_stream, floats=0)


# --- the streaming q4/mx4 GEMV (many output columns: the vocabulary projection) -----------------
#
# plan_matmul picks it when ceil(N / 16) >= 20 warps x the SM count; the tests below plan for one
# SM (monkeypatched `sm_count`) so that N = 1000 takes it: 5 blocks x 4 warps, about 3 groups of
# 16 rows a warp, so each warp's cp.async ring runs across group boundaries as on the H200.

F16 = np.dtype(np.float16)
STREAM_N = 1000  # 62 full groups of 16 rows and a half one


@pytest.fixture
def one_sm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan for one SM, and stream MXFP4 too (its kernel is built and must be right); v1 GEMVs
    only (the v2 ones would take these shapes)."""
    monkeypatch.setattr(matmul, "sm_count", lambda dev: 1)
    monkeypatch.setattr(matmul, "_STREAM_FORMATS", ("q4", "mx4"))
    monkeypatch.setenv(matmul.GEMV_ENV, "v1")


def _random_q4(
    rng: np.random.Generator, dtype: np.dtype, N: int, K: int, block: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random packed bytes (every code), scales around 1/64 and zero points (quick at any N)."""
    kb = -(-K // block)
    b = rng.integers(0, 256, (N, kb, block // 2), dtype=np.uint8)
    scales = (rng.uniform(0.5, 1.5, N * kb) / 64).astype(np.float32).astype(dtype)
    zp = rng.integers(0, 256, N * ((kb + 1) // 2), dtype=np.uint8)
    return b, scales, zp


def _stream_q4(
    dev: Device,
    out: Buffer,
    x: Buffer,
    b: Buffer,
    scales: Buffer,
    zp: Buffer | None,
    M: int,
    N: int,
    K: int,
    block: int,
) -> str:
    plan = gemm_nbits(
        dev, out, x, b, scales, zp, M=M, N=N, K=K, block_size=block, stream=dev.default_stream
    )
    return plan.kernel


@pytest.mark.parametrize("zero_point", [False, True], ids=["zp8", "zp"])
@pytest.mark.parametrize(
    ("K", "block"),
    [(896, 32), (100, 16), (160, 16), (200, 64), (384, 256)],
    ids=["k896-b32", "k100-b16-odd-blocks", "k160-b16", "k200-b64-padded", "k384-b256"],
)
@pytest.mark.parametrize("M", [1, 4, 13])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_stream_nbits_matches_matmul_nbits(
    device: Device,
    one_sm: None,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    rel_error: RelError,
    dtype: np.dtype,
    M: int,
    K: int,
    block: int,
    zero_point: bool,
) -> None:
    """Block sizes 16..256, zero points or 8, K not a multiple of the block or of a 128-k step,
    kb odd (row bytes not a multiple of 16: the byte-wise path), N not a multiple of 16."""
    N = STREAM_N
    x = _acts(rng, dtype, M, K)
    b, scales, zp = _q4_case(rng, dtype, N, K, block, zero_point)
    s = device.default_stream
    out = device.alloc(M * N + 40, dtype, stream=s, name="y")  # 40 spare elements stay NaN
    poison(out)
    kernel = _stream_q4(
        device,
        out,
        upload(device, x),
        upload(device, b),
        upload(device, scales),
        upload(device, zp) if zp is not None else None,
        M,
        N,
        K,
        block,
    )
    assert kernel == f"ep_gemv_q4_stream_{DTYPE_IDS[DTYPES.index(dtype)]}"
    got = out.to_host(stream=s)
    assert np.isnan(got[M * N :].astype(np.float32)).all()  # nothing written past y
    want = _q4_ref(x, b, scales, zp, N, K, block)
    assert rel_error(got[: M * N].reshape(M, N), want) < _tol(dtype)


@pytest.mark.parametrize("K", [96, 320, 896])
@pytest.mark.parametrize("M", [1, 4, 13])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_stream_mxfp4_matches_matmul_mxfp4(
    device: Device,
    one_sm: None,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    rel_error: RelError,
    dtype: np.dtype,
    M: int,
    K: int,
) -> None:
    N = STREAM_N
    s = device.default_stream
    x = _acts(rng, dtype, M, K)
    b, scales = _mx4_case(rng, N, K)
    out = device.alloc(M * N + 40, dtype, stream=s, name="y")
    poison(out)
    plan = gemm_mxfp4(
        device, out, upload(device, x), upload(device, b), upload(device, scales),
        M=M, N=N, K=K, stream=s,
    )  # fmt: skip
    assert plan.kernel.startswith("ep_gemv_mx4_stream_") and plan.block == 128
    got = out.to_host(stream=s)
    assert np.isnan(got[M * N :].astype(np.float32)).all()
    want = matmul_mxfp4(x, b, scales, K=K, N=N)
    assert rel_error(got[: M * N].reshape(M, N), want) < _tol(dtype)


def _assert_rows_bitwise(
    run: Callable[[np.ndarray], np.ndarray], x: np.ndarray, spans: tuple[tuple[int, int], ...]
) -> None:
    """``run(rows)`` gives the GEMV's output for those rows of x: the batch of all 16 is finite
    and the same on a second run, and each of its rows equals that row run alone and inside the
    batches ``x[lo:hi]`` of ``spans``."""
    batch = run(x)
    assert np.isfinite(batch.astype(np.float32)).all()
    np.testing.assert_array_equal(run(x), batch)
    for i in range(GEMV_MAX_ROWS):
        np.testing.assert_array_equal(run(x[i : i + 1]), batch[i : i + 1])
    for lo, hi in spans:
        np.testing.assert_array_equal(run(x[lo:hi]), batch[lo:hi])


@pytest.mark.parametrize("fmt", ["q4", "mx4"])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_stream_rows_are_bitwise_the_same_at_every_batch_size(
    device: Device,
    one_sm: None,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    dtype: np.dtype,
    fmt: str,
) -> None:
    """Every row of a batch of 16 equals that row alone, and inside batches of 8 and 9 (one MMA
    column block or two), and a second run of the batch is bitwise the first."""
    s = device.default_stream
    K, N = 896, STREAM_N
    x = _acts(rng, dtype, GEMV_MAX_ROWS, K)
    if fmt == "q4":
        b, scales, zp = _random_q4(rng, dtype, N, K, 32)
        weights = [upload(device, b), upload(device, scales), upload(device, zp)]
    else:
        weights = [upload(device, a) for a in _mx4_case(rng, N, K)]

    def run(rows: np.ndarray) -> np.ndarray:
        M = rows.shape[0]
        out = _out(device, dtype, M, N, poison)
        xb = upload(device, rows)
        if fmt == "q4":
            plan = gemm_nbits(device, out, xb, *weights, M=M, N=N, K=K, block_size=32, stream=s)
        else:
            plan = gemm_mxfp4(device, out, xb, *weights, M=M, N=N, K=K, stream=s)
        assert "_stream_" in plan.kernel
        return out.to_host(stream=s)

    _assert_rows_bitwise(run, x, ((3, 11), (7, 16)))


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
@pytest.mark.parametrize("M", [2, 11])
def test_stream_unaligned_arrays_take_the_plain_load_path(
    device: Device,
    one_sm: None,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    rel_error: RelError,
    dtype: np.dtype,
    M: int,
) -> None:
    """Weights one byte past an aligned address, scales one element past (not 4-byte aligned),
    zero points one byte past, MXFP4 scales one byte past: the results of the aligned run."""
    s = device.default_stream
    K, N, block = 256, STREAM_N, 32
    x = _acts(rng, dtype, M, K)
    xb = upload(device, x)

    def shifted(a: np.ndarray) -> Buffer:
        flat = a.reshape(-1)
        buf = upload(device, np.concatenate([np.zeros(1, flat.dtype), flat]))
        return buf.view(flat.dtype, flat.size, offset=flat.dtype.itemsize)

    b, scales, zp = _q4_case(rng, dtype, N, K, block, True)
    assert zp is not None
    want = _q4_ref(x, b, scales, zp, N, K, block)
    for arrays in (
        (shifted(b), upload(device, scales), upload(device, zp)),  # byte-wise weights
        (upload(device, b), shifted(scales), upload(device, zp)),  # plain scale loads
        (upload(device, b), upload(device, scales), shifted(zp)),  # plain zero-point loads
    ):
        out = _out(device, dtype, M, N, poison)
        assert "_stream_" in _stream_q4(device, out, xb, *arrays, M, N, K, block)
        assert rel_error(out.to_host(stream=s), want) < _tol(dtype)
    mb, ms = _mx4_case(rng, N, K)
    out = _out(device, dtype, M, N, poison)
    gemm_mxfp4(device, out, xb, shifted(mb), shifted(ms), M=M, N=N, K=K, stream=s)
    assert rel_error(out.to_host(stream=s), matmul_mxfp4(x, mb, ms, K=K, N=N)) < _tol(dtype)


def test_plan_streams_the_vocabulary_projection_and_splits_k_otherwise(
    cpu_device: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(matmul.GEMV_ENV, "v1")  # the v2 GEMVs take these shapes by default
    ws = matmul_workspace(cpu_device, stream=cpu_device.default_stream)
    # MXFP4 streams only when asked (it measured slower than split-K at M <= 4)
    assert plan_matmul("mx4", BF16, M=1, N=151936, K=896).kernel == "ep_gemv_mx4_bf16"
    monkeypatch.setattr(matmul, "_STREAM_FORMATS", ("q4", "mx4"))
    for fmt in ("q4", "mx4"):
        for dtype, suffix in ((BF16, "bf16"), (F16, "f16")):
            plans = {
                plan_matmul(fmt, dtype, M=m, N=151936, K=896, workspace=w)
                for m in range(1, GEMV_MAX_ROWS + 1)
                for w in (ws, None)
            }
            assert len(plans) == 1, plans  # neither M nor the workspace changes it
            plan = plans.pop()
            assert plan.kernel == f"ep_gemv_{fmt}_stream_{suffix}"
            assert (plan.grid, plan.block, plan.kw, plan.gy) == ((132 * 5, 1, 1), 128, 1, 1)
            # 20 warps an SM, 16 rows a warp: the smallest N that streams on 132 SMs
            edge = plan_matmul(fmt, dtype, M=1, N=132 * 20 * 16, K=896, workspace=ws)
            assert edge.kernel == plan.kernel
            below = plan_matmul(fmt, dtype, M=1, N=132 * 20 * 16 - 16, K=896, workspace=ws)
            assert below.kernel == f"ep_gemv_{fmt}_{suffix}" and below.block == 256
        # fp32 activations keep the SIMT GEMV; the model's narrow shapes keep the K split
        assert plan_matmul(fmt, np.dtype(np.float32), M=1, N=151936, K=896).kernel.endswith(
            f"{fmt}_f32"
        )
        for N, K in ((4864, 896), (896, 4864), (896, 896)):
            assert "_stream_" not in plan_matmul(fmt, BF16, M=1, N=N, K=K, workspace=ws).kernel


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["q4", "mx4"])
def test_stream_vocabulary_projection_on_the_gpu(
    cuda_device: Device,
    rng: np.random.Generator,
    poison: Poison,
    rel_error: RelError,
    monkeypatch: pytest.MonkeyPatch,
    fmt: str,
) -> None:
    """The real shape (K=896, N=151936, bf16, M=4) on the GPU's own SM count: the first and last
    2048 columns against the reference on those rows, and no NaN anywhere."""
    monkeypatch.setattr(matmul, "_STREAM_FORMATS", ("q4", "mx4"))
    monkeypatch.setenv(matmul.GEMV_ENV, "v1")
    dev, s = cuda_device, cuda_device.default_stream
    M, K, N = 4, 896, 151936
    x = _acts(rng, BF16, M, K)
    out = _out(dev, BF16, M, N, poison)
    xb = dev.to_device(x, stream=s)
    if fmt == "q4":
        b, scales, zp = _random_q4(rng, BF16, N, K, 32)
        plan = gemm_nbits(
            dev, out, xb, dev.to_device(b, stream=s), dev.to_device(scales, stream=s),
            dev.to_device(zp, stream=s), M=M, N=N, K=K, block_size=32, stream=s,
        )  # fmt: skip
        kb, zr = K // 32, (K // 32 + 1) // 2

        def ref(r: slice) -> np.ndarray:
            n = r.stop - r.start
            return matmul_nbits_zp(x, b[r], scales[r.start * kb : r.stop * kb],
                                   zp[r.start * zr : r.stop * zr], K=K, N=n, bits=4,
                                   block_size=32)  # fmt: skip
    else:
        mb, ms = _mx4_case(rng, N, K)
        plan = gemm_mxfp4(
            dev, out, xb, dev.to_device(mb, stream=s), dev.to_device(ms, stream=s),
            M=M, N=N, K=K, stream=s,
        )  # fmt: skip

        def ref(r: slice) -> np.ndarray:
            return matmul_mxfp4(x, mb[r], ms[r], K=K, N=r.stop - r.start)

    assert "_stream_" in plan.kernel
    got = out.to_host(stream=s)
    assert np.isfinite(got.astype(np.float32)).all()
    for r in (slice(0, 2048), slice(N - 2048, N)):
        assert rel_error(got[:, r], ref(r)) < 1e-2


def test_layer_sized_dense_gemvs_split_k_over_every_warp(
    cpu_device: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Timed on the H200 over every (kw, gy): all 8 warps on K, blocks only past 4 steps a warp,
    # and a grid of at most one wave of 4 blocks an SM (528 here): the 896 x 9728 gate/up
    # projection takes 4 column groups a block (304 blocks, kw 2), 896 x 4864 2 (304, kw 4), not
    # 1216 / 608 blocks of one group; fp32 (106 registers) keeps all 8 warps on K.
    monkeypatch.setenv(matmul.GEMV_ENV, "v1")
    ws = matmul.matmul_workspace(cpu_device, stream=cpu_device.default_stream)
    cases = {
        (896, 1152): (8, 1, 144),
        (896, 896): (8, 1, 112),
        (896, 9728): (2, 1, 304),
        (896, 4864): (4, 1, 304),
        (4864, 896): (8, 4, 112),
    }
    for (K, N), (kw, gy, blocks) in cases.items():
        plan = plan_matmul("nk", BF16, M=1, N=N, K=K, workspace=ws, sm_count=132)
        assert (plan.kw, plan.gy, plan.grid[0]) == (kw, gy, blocks), (K, N, plan.reason)
        batch = plan_matmul("nk", BF16, M=16, N=N, K=K, workspace=ws, sm_count=132)
        assert (batch.kernel, batch.kw, batch.gy, batch.grid) == (plan.kernel, kw, gy, plan.grid)
    fp32 = plan_matmul("nk", np.float32, M=1, N=9728, K=896, workspace=ws, sm_count=132)
    assert (fp32.kw, fp32.gy, fp32.grid[0]) == (8, 1, 1216)
    head = plan_matmul("nk", BF16, M=1, N=151936, K=896, workspace=ws, sm_count=132)
    assert (head.kw, head.gy) == (1, 1)  # past a few waves: the one-wave rule, unchanged
    # 4-bit weights keep the one-wave rule (38 steps over 8 warps x 4 blocks, not 8 x 1)
    q4 = plan_matmul("q4", BF16, M=1, N=1152, K=4864, workspace=ws, sm_count=132)
    assert (q4.kw, q4.gy) == (8, 4)


# --- the v2 q4/mx4 GEMVs (`ep_gemv_<fmt>_v2_<dt>`) ------------------------------------------------
#
# plan_matmul picks them when the whole weight has a 16-row group for every warp of the GPU
# (16 warps an SM). The GPU tests reach small N through ``split_n`` (a piece of a 151936-row
# weight: the piece takes the whole weight's kernel), so every N runs the v2 kernel itself.

VOCAB = 151936
V2_ROWS = [16, 1, 3, 4]  # 16 first: the other batches must equal its rows bitwise


def _v2_kernel(fmt: str, dtype: np.dtype) -> str:
    return f"ep_gemv_{fmt}_v2_{'f16' if dtype == F16 else 'bf16'}"


def _check_rows(got: np.ndarray, want: Callable[[slice], np.ndarray], N: int, dtype: np.dtype,
                rel_error: RelError) -> None:  # fmt: skip
    """got [M, N] against the reference: all rows when N is small, else the first and last 2048
    (a NumPy reference of a whole 151936-row weight takes too long)."""
    assert np.isfinite(got.astype(np.float32)).all()
    parts = [slice(0, N)] if N <= 4096 else [slice(0, 2048), slice(N - 2048, N)]
    for r in parts:
        assert rel_error(got[:, r], want(r)) < _tol(dtype), r


def _check_v2_batches(
    dev: Device, poison: Poison, rel_error: RelError, dtype: np.dtype, x: np.ndarray, N: int,
    launch: Callable[[Buffer, Buffer, int], MatmulPlan], want: Callable[[int], np.ndarray],
    kernel: str, v2: bool,
) -> None:  # fmt: skip
    """M = 16, 1, 3, 4 (`V2_ROWS`): ``launch(out, x[:M], M)`` runs ``kernel`` exactly when
    ``v2``, matches ``want(M)`` (`_check_rows`), writes nothing past y, and each row of the
    smaller batches is bitwise the same as in the batch of 16."""
    s = dev.default_stream
    batch: np.ndarray | None = None
    for M in V2_ROWS:
        out = dev.alloc(M * N + 40, dtype, stream=s, name="y")  # 40 spare elements stay NaN
        poison(out)
        plan = launch(out, dev.to_device(x[:M], stream=s), M)
        assert (plan.kernel == kernel) == v2, plan.kernel
        got = out.to_host(stream=s)
        assert np.isnan(got[M * N :].astype(np.float32)).all()  # nothing written past y
        got = got[: M * N].reshape(M, N)
        full = want(M)

        def ref(r: slice, full: np.ndarray = full) -> np.ndarray:
            return full[:, r]

        _check_rows(got, ref, N, dtype, rel_error)
        if batch is None:
            batch = got
        else:
            np.testing.assert_array_equal(got, batch[:M])


@pytest.mark.cuda
@pytest.mark.parametrize("zero_point", [False, True], ids=["zp8", "zp"])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
@pytest.mark.parametrize("K", [32, 96, 896, 4864])
@pytest.mark.parametrize("N", [1, 15, 16, 1000])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_v2_nbits_matches_matmul_nbits_at_every_batch_size(
    cuda_device: Device,
    rng: np.random.Generator,
    poison: Poison,
    rel_error: RelError,
    dtype: np.dtype,
    N: int,
    K: int,
    block: int,
    zero_point: bool,
) -> None:
    """Every N (odd tails), K (padded blocks, K < one 128-k step, steps ending mid-row), block
    size (16 falls back) and zero points: M = 16, 1, 3, 4 against the reference, and each row of
    the smaller batches bitwise the same as in the batch of 16."""
    dev, s = cuda_device, cuda_device.default_stream
    x = _acts(rng, dtype, GEMV_MAX_ROWS, K)
    b, scales, zp = _q4_case(rng, dtype, N, K, block, zero_point)
    weights = [dev.to_device(b, stream=s), dev.to_device(scales, stream=s)]
    zb = dev.to_device(zp, stream=s) if zp is not None else None

    def launch(out: Buffer, xb: Buffer, M: int) -> MatmulPlan:
        return gemm_nbits(dev, out, xb, weights[0], weights[1], zb, M=M, N=N, K=K,
                          block_size=block, stream=s, split_n=VOCAB)  # fmt: skip

    _check_v2_batches(
        dev, poison, rel_error, dtype, x, N, launch,
        lambda M: _q4_ref(x[:M], b, scales, zp, N, K, block), _v2_kernel("q4", dtype), block >= 32,
    )  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("K", [32, 96, 896, 4864])
@pytest.mark.parametrize("N", [1, 15, 16, 1000])
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_v2_mxfp4_matches_matmul_mxfp4_at_every_batch_size(
    cuda_device: Device,
    rng: np.random.Generator,
    poison: Poison,
    rel_error: RelError,
    dtype: np.dtype,
    N: int,
    K: int,
) -> None:
    dev, s = cuda_device, cuda_device.default_stream
    x = _acts(rng, dtype, GEMV_MAX_ROWS, K)
    mb, ms = _mx4_case(rng, N, K)
    weights = [dev.to_device(mb, stream=s), dev.to_device(ms, stream=s)]

    def launch(out: Buffer, xb: Buffer, M: int) -> MatmulPlan:
        return gemm_mxfp4(dev, out, xb, *weights, M=M, N=N, K=K, stream=s, split_n=VOCAB)

    _check_v2_batches(
        dev, poison, rel_error, dtype, x, N, launch,
        lambda M: matmul_mxfp4(x[:M], mb, ms, K=K, N=N), _v2_kernel("mx4", dtype), True,
    )  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("fmt", ["q4", "q4-zp8", "mx4"])
@pytest.mark.parametrize("K", [896, 4864])
def test_v2_vocabulary_projection_on_the_gpu(
    cuda_device: Device,
    rng: np.random.Generator,
    poison: Poison,
    rel_error: RelError,
    fmt: str,
    K: int,
) -> None:
    """N = 151936 without split_n on the GPU's own SM count (the plan picks v2 by itself): M = 16,
    1, 4 against the reference on the first and last 2048 columns, rows bitwise equal across M,
    and a second launch bitwise the first."""
    dev, s = cuda_device, cuda_device.default_stream
    N, dtype = VOCAB, BF16
    x = _acts(rng, dtype, GEMV_MAX_ROWS, K)
    if fmt.startswith("q4"):
        b, scales, zps = _random_q4(rng, dtype, N, K, 32)
        zp = zps if fmt == "q4" else None
        kb, zr = K // 32, (K // 32 + 1) // 2
        arrays = [dev.to_device(b, stream=s), dev.to_device(scales, stream=s)]
        zb = dev.to_device(zp, stream=s) if zp is not None else None

        def ref(r: slice, M: int) -> np.ndarray:
            n = r.stop - r.start
            sc = scales[r.start * kb : r.stop * kb]
            if zp is None:
                return matmul_nbits(x[:M], b[r], sc, K=K, N=n, bits=4, block_size=32)
            return matmul_nbits_zp(x[:M], b[r], sc, zp[r.start * zr : r.stop * zr], K=K, N=n,
                                   bits=4, block_size=32)  # fmt: skip
    else:
        mb, ms = _mx4_case(rng, N, K)
        arrays = [dev.to_device(mb, stream=s), dev.to_device(ms, stream=s)]
        zb = None

        def ref(r: slice, M: int) -> np.ndarray:
            return matmul_mxfp4(x[:M], mb[r], ms[r], K=K, N=r.stop - r.start)

    def run(M: int) -> np.ndarray:
        out = _out(dev, dtype, M, N, poison)
        xb = dev.to_device(x[:M], stream=s)
        if fmt.startswith("q4"):
            plan = gemm_nbits(dev, out, xb, arrays[0], arrays[1], zb, M=M, N=N, K=K,
                              block_size=32, stream=s)  # fmt: skip
        else:
            plan = gemm_mxfp4(dev, out, xb, arrays[0], arrays[1], M=M, N=N, K=K, stream=s)
        assert "_v2_" in plan.kernel and plan.block == 512
        return out.to_host(stream=s)

    batch = run(GEMV_MAX_ROWS)
    np.testing.assert_array_equal(run(GEMV_MAX_ROWS), batch)
    for M in (1, 4):
        got = run(M)
        np.testing.assert_array_equal(got, batch[:M])
        for r in (slice(0, 2048), slice(N - 2048, N)):
            assert rel_error(got[:, r], ref(r, M)) < 1e-2


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [F16, BF16], ids=["f16", "bf16"])
def test_v2_unaligned_weights_fall_back_and_unaligned_x_stays_v2(
    cuda_device: Device,
    rng: np.random.Generator,
    poison: Poison,
    rel_error: RelError,
    dtype: np.dtype,
) -> None:
    """Weights one byte past an aligned address take the v1 kernel (same results within
    tolerance); x one element past an aligned address is staged element-wise by v2."""
    dev, s = cuda_device, cuda_device.default_stream
    M, N, K, block = 3, 1000, 256, 32
    x = _acts(rng, dtype, M, K)

    def shifted(a: np.ndarray) -> Buffer:
        flat = a.reshape(-1)
        buf = dev.to_device(np.concatenate([np.zeros(1, flat.dtype), flat]), stream=s)
        return buf.view(flat.dtype, flat.size, offset=flat.dtype.itemsize)

    b, scales, zp = _q4_case(rng, dtype, N, K, block, True)
    assert zp is not None
    want = _q4_ref(x, b, scales, zp, N, K, block)
    sc, zb = dev.to_device(scales, stream=s), dev.to_device(zp, stream=s)
    for xb, wb, v2 in ((shifted(x), dev.to_device(b, stream=s), True),
                       (dev.to_device(x, stream=s), shifted(b), False)):  # fmt: skip
        out = _out(dev, dtype, M, N, poison)
        plan = gemm_nbits(dev, out, xb, wb, sc, zb, M=M, N=N, K=K, block_size=block, stream=s,
                          split_n=VOCAB)  # fmt: skip
        assert ("_v2_" in plan.kernel) == v2, plan.kernel
        assert rel_error(out.to_host(stream=s), want) < _tol(dtype)
    mb, ms = _mx4_case(rng, N, K)
    out = _out(dev, dtype, M, N, poison)
    plan = gemm_mxfp4(dev, out, dev.to_device(x, stream=s), shifted(mb),
                      dev.to_device(ms, stream=s), M=M, N=N, K=K, stream=s,
                      split_n=VOCAB)  # fmt: skip
    assert "_v2_" not in plan.kernel
    assert rel_error(out.to_host(stream=s), matmul_mxfp4(x, mb, ms, K=K, N=N)) < _tol(dtype)


@pytest.mark.cuda
def test_v1_switch_runs_the_earlier_kernels_on_the_gpu(
    cuda_device: Device,
    rng: np.random.Generator,
    poison: Poison,
    rel_error: RelError,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dev, s = cuda_device, cuda_device.default_stream
    M, N, K = 4, 1000, 896
    x = _acts(rng, BF16, M, K)
    b, scales, zp = _q4_case(rng, BF16, N, K, 32, True)
    assert zp is not None
    arrays = [dev.to_device(a, stream=s) for a in (x, b, scales, zp)]
    kernels = []
    for version in ("v2", "v1"):
        monkeypatch.setenv(matmul.GEMV_ENV, version)
        out = _out(dev, BF16, M, N, poison)
        plan = gemm_nbits(dev, out, *arrays, M=M, N=N, K=K, block_size=32, stream=s,
                          split_n=VOCAB)  # fmt: skip
        kernels.append(plan.kernel)
        assert rel_error(out.to_host(stream=s), _q4_ref(x, b, scales, zp, N, K, 32)) < 1e-2
    assert kernels == ["ep_gemv_q4_v2_bf16", "ep_gemv_q4_stream_bf16"]


def test_v2_plan_takes_the_vocabulary_projection_whatever_m(cpu_device: Device) -> None:
    ws = matmul_workspace(cpu_device, stream=cpu_device.default_stream)
    for fmt in ("q4", "mx4"):
        for dtype, suffix in ((BF16, "bf16"), (F16, "f16")):
            for block in (32, 64, 128) if fmt == "q4" else (32,):
                plans = {
                    plan_matmul(fmt, dtype, M=m, N=VOCAB, K=896, block_size=block, workspace=w)
                    for m in range(1, GEMV_MAX_ROWS + 1)
                    for w in (ws, None)
                }
                assert len(plans) == 1, plans  # neither M nor the workspace changes it
                plan = plans.pop()
                assert plan.kernel == f"ep_gemv_{fmt}_v2_{suffix}"
                assert (plan.grid, plan.block, plan.kw, plan.gy) == ((132, 1, 1), 512, 1, 1)
                # x for 16 rows: 7 steps of 256 bytes and 64 bytes of padding a row
                assert plan.shared == matmul.v2_shared_bytes(fmt, 896, block) == 16 * (7 * 256 + 64)
            # one 16-row group for every warp (16 an SM) is the smallest N that takes it
            edge = plan_matmul(fmt, dtype, M=1, N=132 * 16 * 16, K=896)
            assert edge.kernel == f"ep_gemv_{fmt}_v2_{suffix}" and edge.grid == (132, 1, 1)
            below = plan_matmul(fmt, dtype, M=1, N=132 * 16 * 16 - 16, K=896)
            assert "_v2_" not in below.kernel
            # a piece of the vocabulary takes the whole weight's kernel, with its own grid
            piece = plan_matmul(fmt, dtype, M=1, N=1000, K=896, split_n=VOCAB, workspace=ws)
            assert piece.kernel == plan.kernel and piece.grid == (4, 1, 1)  # 63 groups
            assert plan_matmul(fmt, dtype, M=1, N=1, K=896, split_n=VOCAB).grid == (1, 1, 1)
            # M > 16 is the GEMM; fp32, unaligned weights and a too long K are not v2
            assert plan_matmul(fmt, dtype, M=17, N=VOCAB, K=896).kind == "gemm"
            assert "_v2_" not in plan_matmul(fmt, dtype, M=1, N=VOCAB, K=896, aligned=False).kernel
            assert "_v2_" not in plan_matmul(fmt, dtype, M=1, N=VOCAB, K=8192).kernel
            assert "_v2_" in plan_matmul(fmt, dtype, M=1, N=VOCAB, K=4864).kernel
        assert "_v2_" not in plan_matmul(fmt, np.dtype(np.float32), M=1, N=VOCAB, K=896).kernel
    # 4-bit blocks of 16 (two scales a 16-byte chunk) keep the streaming kernel
    assert plan_matmul("q4", BF16, M=1, N=VOCAB, K=896, block_size=16).kernel == (
        "ep_gemv_q4_stream_bf16"
    )
    # the model's narrow shapes keep the K split
    for N, K in ((4864, 896), (896, 4864), (1152, 896)):
        assert "_v2_" not in plan_matmul("q4", BF16, M=1, N=N, K=K, workspace=ws).kernel


def test_v1_switch_and_a_bad_value(cpu_device: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    assert matmul.gemv_version() == "v2"
    monkeypatch.setenv(matmul.GEMV_ENV, "v1")
    assert matmul.gemv_version() == "v1"
    assert plan_matmul("q4", BF16, M=1, N=VOCAB, K=896).kernel == "ep_gemv_q4_stream_bf16"
    assert plan_matmul("mx4", BF16, M=1, N=VOCAB, K=896).kernel == "ep_gemv_mx4_bf16"
    monkeypatch.setenv(matmul.GEMV_ENV, "v3")
    with pytest.raises(KernelArgumentError, match="GENAI_EP_GEMV='v3' is not a GEMV version"):
        plan_matmul("q4", BF16, M=1, N=VOCAB, K=896)
    monkeypatch.setenv(matmul.GEMV_ENV, "V2")
    assert plan_matmul("q4", BF16, M=1, N=VOCAB, K=896).kernel == "ep_gemv_q4_v2_bf16"


def test_v2_4bit_says_why_not_and_keeps_to_the_device_shared_memory(cpu_device: Device) -> None:
    """The fallback's reason names the v2 rule that failed; a device whose blocks hold less shared
    memory than the staged x gets the earlier kernel instead of a launch error."""
    assert plan_matmul("q4", BF16, M=1, N=VOCAB, K=896).kernel == "ep_gemv_q4_v2_bf16"
    cases: list[tuple[Format, dict[str, object], str, str]] = [
        ("q4", {"max_shared": 16 * 1024}, "ep_gemv_q4_stream_bf16",
         "needs 29696 bytes of shared memory a block; at most 16384 here"),
        ("mx4", {"max_shared": 16 * 1024}, "ep_gemv_mx4_bf16",
         "needs 29696 bytes of shared memory a block; at most 16384 here"),
        ("q4", {"K": 8192}, "ep_gemv_q4_stream_bf16",
         "needs 263168 bytes of shared memory a block; at most 163840 here"),
        ("q4", {"N": 4864}, "ep_gemv_q4_bf16",
         "N=4864: 304 groups of 16 rows, fewer than the GPU's 2112 warps"),
        ("q4", {"block_size": 16}, "ep_gemv_q4_stream_bf16", "block_size=16 < 32"),
        ("mx4", {"aligned": False}, "ep_gemv_mx4_bf16",
         "the weight address is not 16-byte aligned"),
    ]  # fmt: skip
    for fmt, change, kernel, why in cases:
        args: dict[str, object] = {"M": 1, "N": VOCAB, "K": 896, "sm_count": 132, **change}
        plan = plan_matmul(fmt, BF16, **args)  # type: ignore[arg-type]
        assert plan.kernel == kernel and f"v2 not taken: {why}" in plan.reason, plan.reason


@pytest.mark.parametrize("fmt", ["q4", "mx4"])
def test_v2_runs_its_numpy_twin_on_the_cpu(
    cpu_device: Device,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    rel_error: RelError,
    fmt: str,
) -> None:
    """The CPU device launches the v2 plan (its twin: the reference's arithmetic)."""
    dev, s = cpu_device, cpu_device.default_stream
    M, N, K = 3, 37, 128
    x = _acts(rng, BF16, M, K)
    out = _out(dev, BF16, M, N, poison)
    if fmt == "q4":
        b, scales, zp = _q4_case(rng, BF16, N, K, 32, True)
        assert zp is not None
        plan = gemm_nbits(dev, out, upload(dev, x), upload(dev, b), upload(dev, scales),
                          upload(dev, zp), M=M, N=N, K=K, block_size=32, stream=s,
                          split_n=VOCAB)  # fmt: skip
        want = _q4_ref(x, b, scales, zp, N, K, 32)
    else:
        mb, ms = _mx4_case(rng, N, K)
        plan = gemm_mxfp4(dev, out, upload(dev, x), upload(dev, mb), upload(dev, ms), M=M, N=N,
                          K=K, stream=s, split_n=VOCAB)  # fmt: skip
        want = matmul_mxfp4(x, mb, ms, K=K, N=N)
    assert plan.kernel == f"ep_gemv_{fmt}_v2_bf16"
    assert rel_error(out.to_host(stream=s), want) < 1e-2


# --- the dense GEMV v2 (ep_gemv_nk_v2_<dt>: fp16/bf16 W [N, K]) ---------------------------------
#
# The plan picks it only where the H200 measured it faster (weights of >= 4 Mi elements at M = 1;
# matmul._V2_DENSE_MIN_ELEMENTS has the timings). Its K split (kw warps of a block, R rounds of
# 8 steps) is a function of K alone, so a row's result must be bitwise the same at every M, for
# every N and every grid (pieces with split_n, one SM walking every tile): the kernel tests open
# the rule (`dense_v2_anywhere`) to run it on every shape and M it supports. GENAI_EP_GEMV=v1
# forces the split-K ep_gemv_nk.

HALF = [F16, BF16]
HALF_IDS = ["f16", "bf16"]
LAYER = {  # (K, N) -> (warps a block, blocks on 132 SMs)
    (896, 1152): (4, 144),  # QKV
    (896, 896): (4, 112),  # o
    (896, 9728): (4, 406),  # gate + up: 1216 tiles, 3 a block
    (4864, 896): (16, 112),  # down: 2 rounds of 8 steps a warp
}
# (K, N) -> v2 planned once the size rule is 4 Mi elements (it was measured faster at M = 1 there)
H200_DENSE_V2_WINS = {
    (896, 128): False,
    (896, 896): False,
    (896, 1152): False,
    (896, 4864): True,
    (4864, 896): True,
    (896, 9728): True,
    (896, 151936): False,  # N > 16384: v2 does not take the vocabulary projection
}


@pytest.fixture
def dense_v2_anywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The dense v2 wherever it can run: its measured rule (weight size, M) opened, so that the
    kernel is checked on every shape and batch size, not only where the plan picks it today."""
    monkeypatch.setattr(matmul, "_V2_DENSE_MIN_ELEMENTS", 0)


def _suffix(dtype: np.dtype) -> str:
    return DTYPE_IDS[DTYPES.index(dtype)]


def test_dense_v2_is_planned_nowhere_by_default_and_by_weight_size_when_opened(
    cpu_device: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    ws = matmul_workspace(cpu_device, stream=cpu_device.default_stream)
    for dtype in HALF:  # the default: no shape, no batch size (it loses at 16 rows)
        for K, N in H200_DENSE_V2_WINS:
            for M in range(1, GEMV_MAX_ROWS + 1):
                plan = plan_matmul("nk", dtype, M=M, N=N, K=K, workspace=ws, sm_count=132)
                fmts = ("nk", "nk16") if M > 8 else ("nk",)  # 9..16 rows: test_matmul_rows16
                assert plan.kernel in [f"ep_gemv_{f}_{_suffix(dtype)}" for f in fmts], (K, N, M)
                assert "v2 not taken: " in plan.reason
    assert "planned nowhere" in plan_matmul("nk", BF16, M=1, N=9728, K=896).reason
    monkeypatch.setattr(matmul, "_V2_DENSE_MIN_ELEMENTS", 4 << 20)
    for dtype in HALF:
        for (K, N), wins in H200_DENSE_V2_WINS.items():
            for M in range(1, GEMV_MAX_ROWS + 1):
                plan = plan_matmul("nk", dtype, M=M, N=N, K=K, workspace=ws, sm_count=132)
                v2 = plan.kernel == f"ep_gemv_nk_v2_{_suffix(dtype)}"
                assert v2 == wins, (K, N, M, plan.reason)  # at every M: batch row identity
    # the boundary is the rule's elements of the whole weight, whatever its shape
    assert "_v2_" in plan_matmul("nk", BF16, M=1, N=4096, K=1024).kernel
    below = plan_matmul("nk", BF16, M=1, N=4088, K=1024)
    assert "_v2_" not in below.kernel
    assert "N x K = 4088 x 1024 < 4194304 elements" in below.reason
    assert "_v2_" in plan_matmul("nk", BF16, M=GEMV_MAX_ROWS, N=4096, K=1024).kernel
    # a piece takes the whole weight's kernel: v2 for a piece of gate + up, not of QKV
    assert "_v2_" in plan_matmul("nk", BF16, M=1, N=1024, K=896, split_n=9728).kernel
    assert "_v2_" not in plan_matmul("nk", BF16, M=1, N=128, K=896, split_n=1152).kernel
    # fp32 and [K, N] weights have no v2; GENAI_EP_GEMV=v1 plans none
    assert plan_matmul("nk", np.dtype(np.float32), M=1, N=9728, K=896).kernel == "ep_gemv_nk_f32"
    assert plan_matmul("kn", BF16, M=1, N=9728, K=896).kernel == "ep_gemv_kn_bf16"
    monkeypatch.setenv(matmul.GEMV_ENV, "v1")
    assert plan_matmul("nk", BF16, M=1, N=9728, K=896).kernel == "ep_gemv_nk_bf16"


@pytest.mark.usefixtures("dense_v2_anywhere")
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_dense_v2_rule_through_the_wrapper(
    device: Device,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    rel_error: RelError,
    dtype: np.dtype,
) -> None:
    """With the rule opened, gate/up runs v2 at M = 1 and 2 (never a batch-dependent choice);
    both match the reference."""
    s = device.default_stream
    N, K = 4864, 896
    w = _weights(rng, (N, K), K).astype(dtype)
    wb = upload(device, w)
    ws = matmul_workspace(device, stream=s)
    for M, kernel in (
        (1, f"ep_gemv_nk_v2_{_suffix(dtype)}"),
        (2, f"ep_gemv_nk_v2_{_suffix(dtype)}"),
    ):
        x = _acts(rng, dtype, M, K)
        out = _out(device, dtype, M, N, poison)
        plan = gemm(device, out, upload(device, x), wb, M=M, N=N, K=K, transpose_b=1, stream=s,
                    workspace=ws)  # fmt: skip
        assert plan.kernel == kernel, plan.reason
        assert rel_error(out.to_host(stream=s), _dense_ref(x, w, N, 1)) < _tol(dtype)


@pytest.mark.usefixtures("dense_v2_anywhere")
def test_v2_plans_the_layer_shapes_the_same_at_every_m(cpu_device: Device) -> None:
    ws = matmul_workspace(cpu_device, stream=cpu_device.default_stream)
    for dtype in HALF:
        for (K, N), (kw, blocks) in LAYER.items():
            plans = {
                plan_matmul("nk", dtype, M=m, N=N, K=K, workspace=w, sm_count=132)
                for m in range(1, GEMV_MAX_ROWS + 1)
                for w in (ws, None)
            }
            assert len(plans) == 1, plans  # neither M nor the workspace changes the geometry
            plan = plans.pop()
            assert plan.kernel == f"ep_gemv_nk_v2_{_suffix(dtype)}", plan.reason
            assert (plan.grid, plan.block, plan.kw, plan.gy) == ((blocks, 1, 1), 32 * kw, kw, 1)
            ldx = -(-K // 64) * 64 + 32
            assert plan.shared == matmul.v2_shared_bytes("nk", K) == kw * 1024 + 16 * ldx * 2
            assert matmul.v2_geometry(K)[0] == kw
    assert matmul.v2_geometry(4864) == (16, 2) and matmul.v2_geometry(896) == (4, 1)
    assert matmul.v2_geometry(8) == (1, 1)
    # prefill is still the tiled GEMM
    assert plan_matmul("nk", BF16, M=17, N=896, K=896).kind == "gemm"


def test_v2_falls_back_to_the_split_k_gemv_with_a_reason(
    cpu_device: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(matmul, "_V2_DENSE_MIN_ELEMENTS", 4 << 20)  # the size rule, opened

    def plan(**kw: object) -> matmul.MatmulPlan:
        args: dict[str, object] = {"M": 1, "N": 4864, "K": 896, **kw}
        dtype = args.pop("dtype", BF16)
        return plan_matmul("nk", dtype, **args)  # type: ignore[arg-type]

    assert plan().kernel == "ep_gemv_nk_v2_bf16"  # the baseline (gate, M = 1) takes v2
    cases: list[tuple[dict[str, object], str]] = [
        ({"aligned": False}, "the weight address is not 16-byte aligned"),
        ({"K": 900}, "K=900 is not a multiple of 8"),  # rows of 1800 bytes
        ({"K": 6152}, "K=6152 > 6144"),
        ({"N": 151936}, "N=151936 > 16384"),
        ({"N": 2048, "split_n": 151936}, "N=151936 > 16384"),  # a piece of the vocabulary
        ({"K": 4864, "max_shared": 99 * 1024}, "needs 173056 bytes of shared memory a block"),
        ({"N": 896}, "N x K = 896 x 896 < 4194304 elements"),
    ]
    for change, why in cases:
        p = plan(**change)
        assert p.kernel == "ep_gemv_nk_bf16" and f"v2 not taken: {why}" in p.reason, p.reason
    assert plan(dtype=np.dtype(np.float32)).kernel == "ep_gemv_nk_f32"
    assert plan(K=6144).kernel == "ep_gemv_nk_v2_bf16"  # the largest K that fits
    # a piece of a layer weight takes v2 like the whole, with the whole's arithmetic (kw)
    piece = plan(N=2048, K=4864, split_n=9728)
    assert piece.kernel == "ep_gemv_nk_v2_bf16" and piece.kw == plan(N=9728, K=4864).kw
    monkeypatch.setenv(matmul.GEMV_ENV, "v1")
    forced = plan()
    assert forced.kernel == "ep_gemv_nk_bf16" and "GENAI_EP_GEMV=v1" in forced.reason
    monkeypatch.setenv(matmul.GEMV_ENV, "V2")
    assert plan().kernel == "ep_gemv_nk_v2_bf16"
    monkeypatch.setenv(matmul.GEMV_ENV, "v3")
    with pytest.raises(KernelArgumentError, match="GENAI_EP_GEMV='v3' is not a GEMV version"):
        plan()


def _gemm_nk(dev: Device, out: Buffer, x: Buffer, w: Buffer, M: int, N: int, K: int,
             **kw: object) -> matmul.MatmulPlan:  # fmt: skip
    return gemm(dev, out, x, w, M=M, N=N, K=K, transpose_b=1, stream=dev.default_stream, **kw)  # type: ignore[arg-type]


@pytest.mark.usefixtures("dense_v2_anywhere")
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_v2_wrapper_picks_by_alignment_and_the_switch(
    device: Device,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    rel_error: RelError,
    monkeypatch: pytest.MonkeyPatch,
    dtype: np.dtype,
) -> None:
    """Aligned W: v2; W one element off: ep_gemv_nk; x one element off: still v2 (x is staged
    element-wise); GENAI_EP_GEMV=v1: ep_gemv_nk. Every result matches the reference."""
    s = device.default_stream
    M, N, K = 3, 40, 136
    x = _acts(rng, dtype, M, K)
    w = _weights(rng, (N, K), K).astype(dtype)
    want = _dense_ref(x, w, N, 1)
    xs = upload(device, np.concatenate([np.zeros(1, dtype), x.reshape(-1)]))
    ws = upload(device, np.concatenate([np.zeros(1, dtype), w.reshape(-1)]))
    xa, wa = upload(device, x), upload(device, w)
    x_off = xs.view(dtype, (M, K), offset=dtype.itemsize)
    w_off = ws.view(dtype, (N, K), offset=dtype.itemsize)
    sfx = _suffix(dtype)
    results = {}
    for label, xb, wb, kernel in (
        ("aligned", xa, wa, f"ep_gemv_nk_v2_{sfx}"),
        ("w-off", xa, w_off, f"ep_gemv_nk_{sfx}"),
        ("x-off", x_off, wa, f"ep_gemv_nk_v2_{sfx}"),
    ):
        out = _out(device, dtype, M, N, poison)
        plan = _gemm_nk(device, out, xb, wb, M, N, K)
        assert plan.kernel == kernel, (label, plan.reason)
        results[label] = out.to_host(stream=s)
        assert rel_error(results[label], want) < _tol(dtype), label
    if device.kind == "cuda":  # the staging path does not change the arithmetic
        np.testing.assert_array_equal(results["x-off"], results["aligned"])
    monkeypatch.setenv(matmul.GEMV_ENV, "v1")
    out = _out(device, dtype, M, N, poison)
    assert _gemm_nk(device, out, xa, wa, M, N, K).kernel == f"ep_gemv_nk_{sfx}"
    assert rel_error(out.to_host(stream=s), want) < _tol(dtype)


@pytest.mark.usefixtures("dense_v2_anywhere")
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize("M", [1, 3, 16])
@pytest.mark.parametrize("K", [8, 72, 896, 4864])
@pytest.mark.parametrize("N", [1, 7, 900, 9728])
def test_v2_matches_matmul_weight_on_the_gpu(
    cuda_device: Device,
    rng: np.random.Generator,
    poison: Poison,
    rel_error: RelError,
    N: int,
    K: int,
    M: int,
    dtype: np.dtype,
) -> None:
    """Odd N (a partial tile), K of one step or a partial one, the layer shapes; nothing is
    written past y."""
    dev, s = cuda_device, cuda_device.default_stream
    x = _acts(rng, dtype, M, K)
    w = _weights(rng, (N, K), K).astype(dtype)
    out = dev.alloc(M * N + 40, dtype, stream=s, name="y")
    poison(out)
    plan = _gemm_nk(dev, out, dev.to_device(x, stream=s), dev.to_device(w, stream=s), M, N, K)
    assert plan.kernel == f"ep_gemv_nk_v2_{_suffix(dtype)}", plan.reason
    got = out.to_host(stream=s)
    assert np.isnan(got[M * N :].astype(np.float32)).all()
    assert rel_error(got[: M * N].reshape(M, N), _dense_ref(x, w, N, 1)) < _tol(dtype)


@pytest.mark.usefixtures("dense_v2_anywhere")
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
@pytest.mark.parametrize(("K", "N"), [(896, 1152), (4864, 900), (72, 9728)])
def test_v2_rows_are_bitwise_the_same_at_every_batch_size(
    cuda_device: Device,
    rng: np.random.Generator,
    poison: Poison,
    dtype: np.dtype,
    K: int,
    N: int,
) -> None:
    """Every row of a batch of 16 equals that row alone and inside batches of 3, 8 and 9; a
    second run equals the first (no order-dependent sums)."""
    dev, s = cuda_device, cuda_device.default_stream
    x = _acts(rng, dtype, GEMV_MAX_ROWS, K)
    wb = dev.to_device(_weights(rng, (N, K), K).astype(dtype), stream=s)

    def run(rows: np.ndarray) -> np.ndarray:
        M = rows.shape[0]
        out = _out(dev, dtype, M, N, poison)
        plan = _gemm_nk(dev, out, dev.to_device(rows, stream=s), wb, M, N, K)
        assert "_v2_" in plan.kernel
        return out.to_host(stream=s)

    _assert_rows_bitwise(run, x, ((0, 3), (3, 11), (7, 16)))


@pytest.mark.usefixtures("dense_v2_anywhere")
@pytest.mark.cuda
@pytest.mark.parametrize(("K", "N"), [(896, 1000), (4864, 900)])
def test_v2_columns_do_not_depend_on_n_or_the_grid(
    cuda_device: Device,
    rng: np.random.Generator,
    poison: Poison,
    rel_error: RelError,
    monkeypatch: pytest.MonkeyPatch,
    K: int,
    N: int,
) -> None:
    """Pieces with split_n, and one SM (a few blocks walking every tile: the ring runs across
    tiles and rounds, the partial-sum buffers alternate), give the whole launch's bits."""
    dev, s = cuda_device, cuda_device.default_stream
    M = 5
    x = _acts(rng, BF16, M, K)
    w = _weights(rng, (N, K), K).astype(BF16)
    xb = dev.to_device(x, stream=s)
    whole = _out(dev, BF16, M, N, poison)
    plan = _gemm_nk(dev, whole, xb, dev.to_device(w, stream=s), M, N, K)
    assert "_v2_" in plan.kernel and plan.grid[0] == -(-N // 8)  # one tile a block here
    want = whole.to_host(stream=s)
    assert rel_error(want, _dense_ref(x, w, N, 1)) < 1e-2
    parts = []
    for n0 in range(0, N, 264):  # 33 tiles: not a multiple of anything the kernel uses
        n1 = min(n0 + 264, N)
        out = _out(dev, BF16, M, n1 - n0, poison)
        piece = dev.to_device(np.ascontiguousarray(w[n0:n1]), stream=s)
        _gemm_nk(dev, out, xb, piece, M, n1 - n0, K, split_n=N)
        parts.append(out.to_host(stream=s))
    np.testing.assert_array_equal(np.concatenate(parts, axis=1), want)
    monkeypatch.setattr(matmul, "sm_count", lambda dev: 1)
    out = _out(dev, BF16, M, N, poison)
    one = _gemm_nk(dev, out, xb, dev.to_device(w, stream=s), M, N, K)
    assert one.grid[0] < -(-N // 8) // 8  # every block walks many tiles
    np.testing.assert_array_equal(out.to_host(stream=s), want)


@pytest.mark.usefixtures("dense_v2_anywhere")
@pytest.mark.parametrize("dtype", HALF, ids=HALF_IDS)
def test_a_captured_v2_gemv_replays_with_new_inputs(
    device: Device,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    rel_error: RelError,
    dtype: np.dtype,
) -> None:
    s = device.default_stream
    M, N, K = 4, 1152, 896
    w = _weights(rng, (N, K), K).astype(dtype)
    wb = upload(device, w)
    xb = device.alloc((M, K), dtype, stream=s, name="x")
    out = _out(device, dtype, M, N, poison)
    device.compile_all()
    with device.capture(stream=s) as cap:
        plan = _gemm_nk(device, out, xb, wb, M, N, K)
    assert "_v2_" in plan.kernel
    for _ in range(3):
        x = _acts(rng, dtype, M, K)
        xb.copy_from_host(x, stream=s)
        poison(out)
        cap.graph.launch(stream=s)
        assert rel_error(out.to_host(stream=s), _dense_ref(x, w, N, 1)) < _tol(dtype)
