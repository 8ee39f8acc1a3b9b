"""The packed MXFP4 GEMV (`ep.kernels.q4p`, ``mx4p``): the packer against
`ep.ops.matmul.dequantize_mxfp4` (every E2M1 code, E8M0 extremes and NaN, odd N, K not a
multiple of the 64-k step), and ``ep_gemv_mx4p_<dt>`` against the float64 product of the
dequantized weights on the CPU device (the NumPy twin) and, marked ``cuda``, on the GPU: every M of
1 to 16, both scale decodes (plain, and exact for E8M0 0 and 255). Outputs are poisoned with NaN
first.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
from gemv_case import check_exact_scales

from ep.device import Buffer, Device
from ep.errors import KernelArgumentError
from ep.kernels.q4p import (
    PackedMX4,
    gemv_mx4_packed,
    pack_mx4,
    unpack_mx4,
    upload_mx4,
)
from ep.ops.matmul import dequantize_mxfp4, quantize_mxfp4

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16]
# relative error bound of a result rounded once to the dtype (the sums are fp32)
BOUND = {np.dtype(np.float16): 2e-3, BF16: 1e-2}

Upload = Callable[..., Buffer]
Poison = Callable[[Buffer], None]


def _weight(
    rng: np.random.Generator, N: int, K: int, *, scale_bytes: tuple[int, int] = (118, 124)
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random MXFP4 arrays (every code occurs) and their dequantized weights [N, K] in float64."""
    b = rng.integers(0, 256, (N, K // 32, 16), dtype=np.uint8)
    scales = rng.integers(*scale_bytes, (N, K // 32), dtype=np.uint8)
    with np.errstate(over="ignore"):  # E8M0 254 times 6 is inf in the reference too
        return b, scales, dequantize_mxfp4(b, scales).astype(np.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize(("N", "K"), [(37, 224), (16, 64), (3, 32), (40, 896)])
def test_packing_holds_the_dequantized_weights(
    rng: np.random.Generator, N: int, K: int, dtype: np.dtype
) -> None:
    """Bit for bit, NaN blocks (E8M0 255) and overflow to inf included, every code and scale."""
    b, scales, _ = _weight(rng, N, K, scale_bytes=(0, 256))
    scales.flat[:3] = (0, 255, 254)
    packed, ps, exact = pack_mx4(b, scales, N=N, K=K, dtype=dtype)
    groups, steps = -(-N // 16), -(-K // 64)
    assert packed.size == groups * steps * 512 and ps.size == groups * steps * 32 and exact
    with np.errstate(over="ignore"):
        want = dequantize_mxfp4(b, scales)
    got = unpack_mx4(packed, ps, N=N, K=K, dtype=dtype)
    np.testing.assert_array_equal(got, want)
    assert np.isnan(got[0, 32:64]).all() and np.isinf(want).any()


@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
def test_packing_covers_every_code_in_every_position(dtype: np.dtype) -> None:
    """Each of the 16 codes at each (row, k) of a step, so in every nibble of every word of
    every lane: 16 row groups, group j holding the codes of group 0 plus j."""
    N, K = 256, 64
    n, k = np.meshgrid(np.arange(N), np.arange(K), indexing="ij")
    codes = ((n % 16) * 5 + k * 3 + n // 16) % 16
    b = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).reshape(N, K // 32, 16)
    scales = np.full((N, K // 32), 127, np.uint8)
    packed, ps, exact = pack_mx4(b, scales, N=N, K=K, dtype=dtype)
    assert not exact
    got = unpack_mx4(packed, ps, N=N, K=K, dtype=dtype)
    np.testing.assert_array_equal(got, dequantize_mxfp4(b, scales))
    assert len(np.unique(packed)) > 16  # not the codes' bytes: encoded


def test_packing_refuses_other_layouts(rng: np.random.Generator) -> None:
    b, scales, _ = _weight(rng, 8, 64)
    with pytest.raises(ValueError, match="K=48 must be a multiple of 32"):
        pack_mx4(b, scales, N=8, K=48, dtype=BF16)
    with pytest.raises(ValueError, match=r"b must be uint8 \[N=8, 2, 16\]"):
        pack_mx4(b[:, :1], scales, N=8, K=64, dtype=BF16)
    with pytest.raises(ValueError, match=r"scales must be uint8 \[N=8, 2\]"):
        pack_mx4(b, scales.astype(np.float32), N=8, K=64, dtype=BF16)
    with pytest.raises(ValueError, match="dtype must be the activations' float16 or bfloat16"):
        pack_mx4(b, scales, N=8, K=64, dtype=np.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize(("N", "K"), [(37, 224), (40, 896), (300, 128)])
def test_packed_gemv_is_the_product_of_the_dequantized_weights(
    device: Device,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    dtype: np.dtype,
    N: int,
    K: int,
) -> None:
    s = device.default_stream
    w_real = rng.standard_normal((N, K)).astype(np.float32)
    b, scales = quantize_mxfp4(w_real)  # realistic blocks; bytes 0/255 absent: the plain decode
    dense = dequantize_mxfp4(b, scales).astype(np.float64)
    w = upload_mx4(device, b, scales, N=N, K=K, dtype=dtype, stream=s)
    assert not w.exact
    suffix = "f16" if dtype == np.float16 else "bf16"
    for M in range(1, 17):
        x = rng.standard_normal((M, K)).astype(np.float32).astype(dtype)
        out = device.alloc((M, N), dtype, stream=s)
        poison(out)
        plan = gemv_mx4_packed(device, out, upload(device, x), w, M=M, stream=s, resident=True)
        assert plan.kernel == f"ep_gemv_mx4p_{suffix}"
        host = out.to_host(stream=s)
        got = host.astype(np.float64)
        want = x.astype(np.float64) @ dense.T
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < BOUND[dtype], (M, err)
        if M in (8, 16):  # a row's sums do not depend on the other rows (either path)
            solo = device.alloc((1, N), dtype, stream=s)
            gemv_mx4_packed(device, solo, upload(device, x[5:6]), w, M=1, stream=s)
            alone = solo.to_host(stream=s)[0]
            np.testing.assert_array_equal(alone.view(np.uint16), host[5].view(np.uint16))


@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
def test_exact_scales_decode_e8m0_zero_and_nan(
    device: Device, rng: np.random.Generator, poison: Poison, upload: Upload, dtype: np.dtype
) -> None:
    """A weight with E8M0 255 (NaN) and 0 (2^-127) bytes takes the exact decode: a NaN block
    makes its output column NaN (as the reference), the rest stays the reference's product."""
    s = device.default_stream
    N, K, M = 40, 192, 3
    b, scales, _ = _weight(rng, N, K)
    scales[7, 2] = 255
    scales[9, :] = 0  # a row of 2^-127 blocks: products far below every other column
    scales[11, 1] = 0
    w = upload_mx4(device, b, scales, N=N, K=K, dtype=dtype, stream=s)
    assert w.exact
    x = rng.standard_normal((M, K)).astype(np.float32).astype(dtype)
    out = device.alloc((M, N), dtype, stream=s)
    poison(out)
    gemv_mx4_packed(device, out, upload(device, x), w, M=M, stream=s)
    got = out.to_host(stream=s).astype(np.float64)
    # bf16 holds 2^-127-sized results: column 9 is the tiny product, not 0
    check_exact_scales(got, x, b, scales, BOUND[dtype], tiny=dtype == BF16)


def test_packed_gemv_refuses_what_it_cannot_run(
    cpu_device: Device, rng: np.random.Generator, upload: Upload
) -> None:
    dev, s = cpu_device, cpu_device.default_stream
    b, scales, _ = _weight(rng, 20, 64)
    w = upload_mx4(dev, b, scales, N=20, K=64, dtype=BF16, stream=s)
    x = upload(dev, rng.standard_normal((17, 64)).astype(BF16))
    out = dev.alloc((17, 20), BF16, stream=s)
    with pytest.raises(KernelArgumentError, match=r"M=17 must be in \[1, 16\]"):
        gemv_mx4_packed(dev, out, x, w, M=17, stream=s)
    x32 = upload(dev, np.zeros((1, 64), np.float32))
    with pytest.raises(KernelArgumentError, match="takes fp16/bf16"):
        gemv_mx4_packed(dev, out, x32, w, M=1, stream=s)
    x16 = upload(dev, np.zeros((1, 64), np.float16))
    with pytest.raises(KernelArgumentError, match=r"packed for bfloat16 .* dtype=float16"):
        gemv_mx4_packed(dev, dev.alloc((1, 20), np.float16, stream=s), x16, w, M=1, stream=s)
    short = PackedMX4(w.weights.view(np.uint8, (100,)), w.scales, 20, 64, BF16, False)
    with pytest.raises(KernelArgumentError, match=r"weights .* holds 100 elements"):
        gemv_mx4_packed(dev, out, x, short, M=1, stream=s)
    few = PackedMX4(w.weights, w.scales.view(np.uint8, (31,)), 20, 64, BF16, False)
    with pytest.raises(
        KernelArgumentError, match=r"scales .* holds 31 elements; these sizes need 64"
    ):
        gemv_mx4_packed(dev, out, x, few, M=1, stream=s)
    with pytest.raises(KernelArgumentError, match="overlaps x"):
        gemv_mx4_packed(dev, x.view(BF16, (20,)), x, w, M=1, stream=s)
    both = dev.alloc(1024, np.uint8, stream=s)  # the scales and the output in one buffer
    shared = PackedMX4(w.weights, both.view(np.uint8, (64,)), 20, 64, BF16, False)
    with pytest.raises(KernelArgumentError, match="overlaps scales"):
        gemv_mx4_packed(dev, both.view(BF16, (512,)), x, shared, M=1, stream=s)
