"""The MXFP4 GEMV on the FP8 tensor cores (`ep.kernels.mx4f8`, ``ep_gemv_mx4f8_bf16``): the
packer against `ep.ops.matmul.dequantize_mxfp4` (every E2M1 code in every position, E8M0 0 and
255), the activations' split into two e4m3 halves, and the kernel against the float64 product of
the dequantized weights and the exact activations, on the CPU device (the NumPy twin) and, marked
``cuda``, on an sm_90 GPU (wgmma): every M of 1 to 16, odd N and K, both scale decodes, a row of
x with inf. Outputs are poisoned with NaN first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
from gemv_case import (
    check_decode_gemv,
    check_exact_scales,
    check_ring_matches_default,
    ptx_of,
)

from ep.device import Buffer, Device, KernelRegistry, compile_all, compile_kernel, kernel_target
from ep.errors import KernelArgumentError, KernelRegistryError, KernelUnavailableError
from ep.kernels import mx4f8
from ep.kernels.matmul import MatmulPlan
from ep.kernels.mx4f8 import (
    MX4F8_KERNELS,
    RINGS,
    PackedMX4F8,
    gemv_mx4_f8,
    pack_mx4f8,
    split_x,
    unpack_mx4f8,
    upload_mx4f8,
)
from ep.ops.matmul import dequantize_mxfp4, quantize_mxfp4

BF16 = np.dtype(ml_dtypes.bfloat16)
BOUND = 1e-2  # bf16: a result rounded once (the sums are fp32)

Upload = Callable[..., Buffer]
Poison = Callable[[Buffer], None]


def _weight(
    rng: np.random.Generator, N: int, K: int, *, scale_bytes: tuple[int, int] = (118, 124)
) -> tuple[np.ndarray, np.ndarray]:
    b = rng.integers(0, 256, (N, K // 32, 16), dtype=np.uint8)
    return b, rng.integers(*scale_bytes, (N, K // 32), dtype=np.uint8)


@pytest.mark.parametrize(("N", "K"), [(37, 224), (64, 64), (3, 32), (130, 896)])
def test_packing_holds_the_dequantized_weights(rng: np.random.Generator, N: int, K: int) -> None:
    """Bit for bit, NaN blocks (E8M0 255) and overflow to inf included."""
    b, scales = _weight(rng, N, K, scale_bytes=(0, 256))
    scales.flat[:3] = (0, 255, 254)
    packed, ps, exact = pack_mx4f8(b, scales, N=N, K=K)
    tiles, steps = -(-N // 64), -(-K // 64)
    assert packed.size == tiles * steps * 2048 and ps.size == tiles * steps * 128 and exact
    with np.errstate(over="ignore"):
        want = dequantize_mxfp4(b, scales)
    np.testing.assert_array_equal(unpack_mx4f8(packed, ps, N=N, K=K), want)


def test_packing_covers_every_code_in_every_position() -> None:
    """Each of the 16 codes at each (row, k) of a tile's step: every nibble of every word of
    every lane of every warp."""
    N, K = 1024, 64
    n, k = np.meshgrid(np.arange(N), np.arange(K), indexing="ij")
    codes = ((n % 64) * 5 + k * 3 + n // 64) % 16
    b = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).reshape(N, K // 32, 16)
    scales = np.full((N, K // 32), 127, np.uint8)
    packed, ps, exact = pack_mx4f8(b, scales, N=N, K=K)
    assert not exact
    np.testing.assert_array_equal(unpack_mx4f8(packed, ps, N=N, K=K), dequantize_mxfp4(b, scales))
    assert len(np.unique(packed)) > 16  # encoded, not the codes' bytes


def test_packing_refuses_other_layouts(rng: np.random.Generator) -> None:
    b, scales = _weight(rng, 8, 64)
    with pytest.raises(ValueError, match="pack_mx4f8: K=48 must be a multiple of 32"):
        pack_mx4f8(b, scales, N=8, K=48)
    with pytest.raises(ValueError, match=r"b must be uint8 \[N=8, 2, 16\]"):
        pack_mx4f8(b[:, :1], scales, N=8, K=64)
    with pytest.raises(ValueError, match=r"scales must be uint8 \[N=8, 2\]"):
        pack_mx4f8(b, scales.astype(np.float32), N=8, K=64)


def test_split_holds_bf16_exactly_within_nine_binades_of_the_row_maximum() -> None:
    """hi + lo is every bf16 value of the row's largest binade and the 9 below it (positive and
    negative, every mantissa), within 2^-17 of the largest magnitude below that, and a row
    holding inf or NaN is NaN (the other rows untouched)."""
    mantissas = np.arange(128, 256, dtype=np.float32) / 128  # every bf16 significand
    exact = np.concatenate([mantissas * 2.0**-e for e in range(10)])
    row = np.concatenate([exact, -exact, [0.0]]).astype(BF16)
    for scale in (2.0**-100, 1.0, 2.0**7, 2.0**100):
        x = (row.astype(np.float32) * np.float32(scale)).astype(BF16)[None]
        np.testing.assert_array_equal(split_x(x), x.astype(np.float32))
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 896)) * np.logspace(-8, 0, 896)).astype(BF16)
    err = np.abs(split_x(x) - x.astype(np.float32)).max(axis=1)
    assert (err <= 2.0**-17 * np.abs(x.astype(np.float32)).max(axis=1)).all()
    x[2, 7] = np.inf
    x[3, 0] = np.nan
    got = split_x(x)
    assert np.isnan(got[2:]).all() and not np.isnan(got[:2]).any()


@pytest.mark.parametrize(("N", "K"), [(37, 224), (64, 896), (300, 128), (130, 96)])
def test_gemv_is_the_product_of_the_dequantized_weights(
    f8_device: Device, rng: np.random.Generator, poison: Poison, upload: Upload, N: int, K: int
) -> None:
    dev, s = f8_device, f8_device.default_stream
    b, scales = quantize_mxfp4(rng.standard_normal((N, K)).astype(np.float32))
    dense = dequantize_mxfp4(b, scales).astype(np.float64)
    w = upload_mx4f8(dev, b, scales, N=N, K=K, stream=s)
    assert not w.exact

    def run(out: Buffer, x: Buffer, M: int, **kwargs: bool) -> MatmulPlan:
        return gemv_mx4_f8(dev, out, x, w, M=M, stream=s, **kwargs)

    def kernel(M: int) -> str:
        return "ep_gemv_mx4f8_bf16" if M <= 4 else "ep_gemv_mx4f8_d8b1_bf16"

    check_decode_gemv(dev, rng, upload, poison, run, dense, kernel, BOUND)


def test_exact_scales_and_non_finite_rows(
    f8_device: Device, rng: np.random.Generator, poison: Poison, upload: Upload
) -> None:
    """E8M0 255 (NaN) makes its column NaN, 0 (2^-127) stays a tiny product (the exact
    decode), and a row of x holding inf is NaN while the other rows are the product."""
    dev, s = f8_device, f8_device.default_stream
    N, K, M = 70, 192, 3
    b, scales = _weight(rng, N, K)
    scales[7, 2] = 255
    scales[9, :] = 0
    scales[11, 1] = 0
    w = upload_mx4f8(dev, b, scales, N=N, K=K, stream=s)
    assert w.exact
    x = rng.standard_normal((M, K)).astype(BF16)
    out = dev.alloc((M, N), BF16, stream=s)
    poison(out)
    gemv_mx4_f8(dev, out, upload(dev, x), w, M=M, stream=s)
    check_exact_scales(out.to_host(stream=s).astype(np.float64), x, b, scales, BOUND, tiny=True)

    b2, s2 = _weight(rng, N, K)
    w2 = upload_mx4f8(dev, b2, s2, N=N, K=K, stream=s)
    x[1, 10] = np.inf
    poison(out)
    gemv_mx4_f8(dev, out, upload(dev, x), w2, M=M, stream=s)
    got = out.to_host(stream=s).astype(np.float64)
    assert np.isnan(got[1]).all() and not np.isnan(got[[0, 2]]).any()


def test_gemv_refuses_what_it_cannot_run(
    cpu_device: Device, rng: np.random.Generator, upload: Upload, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev, s = cpu_device, cpu_device.default_stream
    b, scales = _weight(rng, 20, 64)
    w = upload_mx4f8(dev, b, scales, N=20, K=64, stream=s)
    x = upload(dev, rng.standard_normal((17, 64)).astype(BF16))
    out = dev.alloc((17, 20), BF16, stream=s)
    with pytest.raises(KernelArgumentError, match=r"M=17 must be in \[1, 16\]"):
        gemv_mx4_f8(dev, out, x, w, M=17, stream=s)
    x16 = upload(dev, np.zeros((1, 64), np.float16))
    with pytest.raises(KernelArgumentError, match=r"takes bfloat16 .*q4p\.gemv_mx4_packed"):
        gemv_mx4_f8(dev, dev.alloc((1, 20), np.float16, stream=s), x16, w, M=1, stream=s)
    short = PackedMX4F8(w.weights.view(np.uint8, (100,)), w.scales, 20, 64, False)
    with pytest.raises(KernelArgumentError, match=r"weights .* holds 100 elements"):
        gemv_mx4_f8(dev, out, x, short, M=1, stream=s)
    with pytest.raises(KernelArgumentError, match="overlaps x"):
        gemv_mx4_f8(dev, x.view(BF16, (20,)), x, w, M=1, stream=s)
    with pytest.raises(KernelArgumentError, match="ring 'd5b1' is not compiled"):
        gemv_mx4_f8(dev, out, x, w, M=1, stream=s, ring="d5b1")
    monkeypatch.setattr(dev, "arch", "sm_80")  # a GPU without wgmma: refused before any launch
    with pytest.raises(KernelUnavailableError, match=r"only sm_90a .* this GPU is sm_80: use .*"):
        gemv_mx4_f8(dev, out, x, w, M=1, stream=s)


@pytest.mark.parametrize("ring", [f"d{d}b{b}" for d, b in RINGS])
def test_every_ring_variant_gives_the_bits_of_the_default(
    f8_device: Device, rng: np.random.Generator, upload: Upload, ring: str
) -> None:
    """A ring changes only how far ahead a warp loads and how many blocks share an SM: every
    one, at every accumulator width (M = 1, 6, 13), stores the default's bits."""
    dev, s = f8_device, f8_device.default_stream
    N, K = 300, 896
    b, scales = quantize_mxfp4(rng.standard_normal((N, K)).astype(np.float32))
    w = upload_mx4f8(dev, b, scales, N=N, K=K, stream=s)

    def run(out: Buffer, x: Buffer, M: int, **kwargs: str) -> MatmulPlan:
        return gemv_mx4_f8(dev, out, x, w, M=M, stream=s, **kwargs)

    kernels = (f"ep_gemv_mx4f8_{ring}_bf16", "ep_gemv_mx4f8_bf16")
    check_ring_matches_default(dev, rng, upload, run, (N, K), ring, kernels)


@pytest.mark.parametrize(("depth", "per_sm"), RINGS)
def test_the_ring_refills_at_m_8_and_below_are_predicated_volatile_loads(
    depth: int, per_sm: int
) -> None:
    """At M <= 8 each step refills its ring slot with predicated volatile loads, which ptxas
    keeps in place (plain conditional loads were sunk to the end of a round: the ring drained,
    1-2 us slower on the H200); at M > 8 plain loads (measured faster there). PTX by NVRTC, no
    GPU: every unrolled step of the two M <= 8 loops (each with and without E8M0 x scales)."""
    d8, _ = mx4f8._WIDER[depth, per_sm]
    name = (
        "ep_gemv_mx4f8_bf16"
        if (depth, per_sm) == RINGS[0]
        else f"ep_gemv_mx4f8_d{depth}b{per_sm}_bf16"
    )
    ptx = ptx_of(MX4F8_KERNELS[name])
    steps = 2 * (depth + d8)
    assert ptx.count("@q ld.global.nc.L1::no_allocate.v4.u32") == steps  # the weights
    assert ptx.count("@q ld.global.nc.u32") == steps  # the E8M0 scales


def test_the_kernel_exists_for_sm_90a_only() -> None:
    """It compiles for sm_90 as sm_90a (NVRTC, no GPU needed) and does not exist elsewhere."""
    kernel = MX4F8_KERNELS["ep_gemv_mx4f8_bf16"]
    assert kernel_target(kernel, "sm_90") == "sm_90a"
    assert kernel_target(kernel, "sm_80") is None and kernel_target(kernel, "sm_100") is None
    with pytest.raises(KernelUnavailableError, match=r"only sm_90a has; .* for sm_80"):
        compile_kernel(kernel, "sm_80", use_cache=False)
    registry = KernelRegistry()
    registry.register(kernel)
    [row] = compile_all("sm_80", registry=registry)
    assert (row.cache, row.cubin_bytes, row.note) == ("skipped", 0, "only for sm_90a")
    with pytest.raises(KernelRegistryError, match="target 'sm_90' is not architecture-specific"):
        dataclasses.replace(kernel, targets=("sm_90",))
