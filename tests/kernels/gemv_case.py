"""A GEMV weight of every format for the kernel tests of the GEMV epilogues, and the checks the
packed and FP8 GEMV tests share."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from ep.device import Buffer, Device, KernelSource
from ep.device._kernels import compiled_source, cuda_headers
from ep.kernels.matmul import MatmulPlan, MatmulWorkspace, gemm, gemm_mxfp4, gemm_nbits
from ep.ops.matmul import dequantize_mxfp4, dequantize_nbits, quantize_mxfp4, quantize_nbits

Upload = Callable[..., Buffer]


class GemvCase:
    """One [N, K] weight of ``fmt`` (nk, q4, q4-zp, mx4) on ``dev``, its dequantized values
    (``dense``), and the GEMV call that runs it."""

    def __init__(
        self,
        dev: Device,
        rng: np.random.Generator,
        upload: Upload,
        fmt: str,
        dtype: np.dtype,
        N: int,
        K: int,
    ) -> None:
        self.dev, self.fmt, self.dtype, self.N, self.K = dev, fmt, dtype, N, K
        w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
        if fmt == "nk":
            self.dense = w.astype(dtype)
            self.weights = [upload(dev, self.dense)]
        elif fmt.startswith("q4"):
            b, scales, zp = quantize_nbits(w, block_size=32, zero_point=fmt == "q4-zp")
            self.dense = dequantize_nbits(b, scales.astype(dtype), zp, K=K, N=N, block_size=32)
            self.weights = [upload(dev, b), upload(dev, scales.astype(dtype))]
            self.weights.append(upload(dev, zp) if zp is not None else None)
        else:
            b, scales = quantize_mxfp4(w)
            self.dense = dequantize_mxfp4(b, scales)
            self.weights = [upload(dev, b), upload(dev, scales)]

    def run(
        self,
        out: Buffer,
        x: Buffer,
        M: int,
        ws: MatmulWorkspace | None,
        **epilogue: Any,
    ) -> MatmulPlan:
        """``out = x @ W^T`` for M rows (``epilogue``: `gemm`'s ``swiglu`` or ``rope``)."""
        dev, s, N, K = self.dev, self.dev.default_stream, self.N, self.K
        common = dict(M=M, N=N, K=K, stream=s, workspace=ws, **epilogue)
        if self.fmt == "nk":
            return gemm(dev, out, x, self.weights[0], transpose_b=1, **common)
        if self.fmt.startswith("q4"):
            return gemm_nbits(dev, out, x, *self.weights, block_size=32, **common)
        return gemm_mxfp4(dev, out, x, *self.weights, **common)


def check_decode_gemv(
    dev: Device,
    rng: np.random.Generator,
    upload: Upload,
    poison: Callable[[Buffer], None],
    run: Callable[..., MatmulPlan],
    dense: np.ndarray,
    kernel: Callable[[int], str],
    bound: float,
) -> None:
    """A bf16 decode GEMV (``run(out, x, M, **kwargs)`` over one weight, ``dense`` [N, K] its
    dequantized values) at every M of 1 to 16 against the float64 product, its plan's kernel
    ``kernel(M)``; at M = 4, 8, 16 a row's bits do not depend on the other rows, and x 4 bytes
    past a 16-byte boundary (the 4-byte loads) gives the same bits."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    s = dev.default_stream
    N, K = dense.shape
    for M in range(1, 17):
        x = (rng.standard_normal((M, K)) * 4).astype(bf16)
        out = dev.alloc((M, N), bf16, stream=s)
        poison(out)
        plan = run(out, upload(dev, x), M, resident=True)
        assert plan.kernel == kernel(M)
        host = out.to_host(stream=s)
        want = x.astype(np.float64) @ dense.T
        err = np.abs(host.astype(np.float64) - want).max() / np.abs(want).max()
        assert err < bound, (M, err)
        if M in (4, 8, 16):
            solo = dev.alloc((1, N), bf16, stream=s)
            run(solo, upload(dev, x[3:4]), 1)
            alone = solo.to_host(stream=s)[0]
            np.testing.assert_array_equal(alone.view(np.uint16), host[3].view(np.uint16))
            padded = upload(dev, np.concatenate([np.zeros(2, bf16), x.reshape(-1)]))
            poison(out)
            run(out, padded.view(bf16, (M, K), offset=4), M)
            np.testing.assert_array_equal(
                out.to_host(stream=s).view(np.uint16), host.view(np.uint16)
            )


def check_ring_matches_default(
    dev: Device,
    rng: np.random.Generator,
    upload: Upload,
    run: Callable[..., MatmulPlan],
    shape: tuple[int, int],
    ring: str,
    kernels: tuple[str, str],
) -> None:
    """A ring variant (``run(out, x, M, ring=ring)``) at every accumulator width (M = 1, 6, 13)
    stores the default ring's bits; its plan's kernel is one of ``kernels`` (the variant's, or
    the default's when ``ring`` is the default)."""
    bf16 = np.dtype(ml_dtypes.bfloat16)
    s = dev.default_stream
    N, K = shape
    for M in (1, 6, 13):
        x = upload(dev, rng.standard_normal((M, K)).astype(bf16))
        ref, got = (dev.alloc((M, N), bf16, stream=s) for _ in range(2))
        run(ref, x, M)
        assert run(got, x, M, ring=ring).kernel in kernels
        np.testing.assert_array_equal(
            got.to_host(stream=s).view(np.uint16), ref.to_host(stream=s).view(np.uint16)
        )


def check_exact_scales(
    got: np.ndarray, x: np.ndarray, b: np.ndarray, scales: np.ndarray, bound: float, *, tiny: bool
) -> None:
    """An MXFP4 GEMV's output ``got`` [M, N] for weights whose E8M0 scales hold 255 at column 7
    (NaN: that column is NaN, no other) and 0 across column 9: the other columns within
    ``bound`` of the float64 product, and with ``tiny`` column 9 the tiny product, not 0."""
    assert np.isnan(got[:, 7]).all() and not np.isnan(np.delete(got, 7, axis=1)).any()
    want = x.astype(np.float64) @ dequantize_mxfp4(b, scales).astype(np.float64).T
    keep = np.arange(got.shape[1]) != 7
    err = np.abs(got[:, keep] - want[:, keep]).max() / np.abs(want[:, keep]).max()
    assert err < bound
    if tiny:
        small = np.abs(got[:, 9] - want[:, 9]).max() / np.abs(want[:, 9]).max()
        assert np.abs(got[:, 9]).max() > 0 and small < 2 * bound, small


def ptx_of(source: KernelSource, arch: str = "sm_90a") -> str:
    """The PTX NVRTC makes of ``source`` (through cuda.bindings' NVRTC: no GPU, no driver)."""
    from cuda.bindings import nvrtc

    text = compiled_source(source, arch).encode()
    err, prog = nvrtc.nvrtcCreateProgram(text, source.name.encode(), 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    opts = [f"--gpu-architecture={arch}".encode(), b"-std=c++17", f"-I{cuda_headers()[0]}".encode()]
    opts += [f"-D{k}={v}".encode() for k, v in source.options.defines]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS, err
    err, size = nvrtc.nvrtcGetPTXSize(prog)
    ptx = b" " * size
    (err,) = nvrtc.nvrtcGetPTX(prog, ptx)
    nvrtc.nvrtcDestroyProgram(prog)
    return ptx.decode(errors="replace")
