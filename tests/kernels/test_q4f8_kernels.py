"""The 4-bit GEMV on the FP8 tensor cores (`ep.kernels.q4f8`, ``ep_gemv_q4f8_bf16``): the packer
against `ep.ops.matmul.dequantize_nbits` (every code in every position, with and without zero
points), the e4m3 reading of a code, and the kernel against the float64 product of the
dequantized weights and the exact activations, on the CPU device (the NumPy twin) and, marked
``cuda``, on an sm_90 GPU (wgmma): every M of 1 to 16, odd N, zero points given or 8, a row of x
with inf, every ring. Outputs are poisoned with NaN first.
"""

from __future__ import annotations

from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest
from gemv_case import check_decode_gemv, check_ring_matches_default, ptx_of

from ep.device import Buffer, Device, kernel_target
from ep.errors import KernelArgumentError, KernelUnavailableError
from ep.kernels import q4f8
from ep.kernels.matmul import MatmulPlan
from ep.kernels.q4f8 import (
    Q4F8_KERNELS,
    RINGS,
    PackedQ4F8,
    gemv_q4_f8,
    pack_q4f8,
    unpack_q4f8,
    upload_q4f8,
)
from ep.ops.matmul import dequantize_nbits, quantize_nbits

BF16 = np.dtype(ml_dtypes.bfloat16)
E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BOUND = 1e-2  # bf16: a result rounded once (the sums are fp32)

Upload = Callable[..., Buffer]
Poison = Callable[[Buffer], None]


def _weight(
    rng: np.random.Generator, N: int, K: int, zp: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """MatMulNBits arrays of a random [N, K] weight, bf16 scales."""
    b, scales, zeros = quantize_nbits(
        rng.standard_normal((N, K)).astype(np.float32), block_size=32, zero_point=zp
    )
    return b, scales.astype(BF16).reshape(N, K // 32), zeros if zp else None


def test_a_code_in_the_low_half_of_a_byte_is_the_code_times_2_to_the_minus_9() -> None:
    """What the kernel relies on: no arithmetic turns a 4-bit code into an exact e4m3 value."""
    codes = np.arange(16, dtype=np.uint8)
    np.testing.assert_array_equal(codes.view(E4M3).astype(np.float32), codes * 2.0**-9)


@pytest.mark.parametrize(("N", "K", "zp"), [(37, 224, True), (64, 64, False), (130, 896, True)])
def test_packing_holds_the_dequantized_weights(
    rng: np.random.Generator, N: int, K: int, zp: bool
) -> None:
    b, scales, zeros = _weight(rng, N, K, zp)
    packed, ps, pz = pack_q4f8(b, scales, zeros, N=N, K=K)
    tiles, steps = -(-N // 64), -(-K // 64)
    assert packed.size == tiles * steps * 2048 and ps.size == tiles * steps * 128
    assert ps.dtype == BF16 and (pz is None) == (not zp)
    assert pz is None or (pz.dtype == np.uint16 and pz.size == tiles * steps * 32)
    want = dequantize_nbits(b, scales, zeros, K=K, N=N, block_size=32)
    np.testing.assert_array_equal(unpack_q4f8(packed, ps, pz, N=N, K=K), want)


def test_packing_covers_every_code_in_every_position() -> None:
    """Each of the 16 codes at each (row, k) of a tile's step, and every zero point at each
    (row, block): every nibble of every word of every lane of every warp."""
    N, K = 1024, 64
    n, k = np.meshgrid(np.arange(N), np.arange(K), indexing="ij")
    codes = ((n % 64) * 5 + k * 3 + n // 64) % 16
    b = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8).reshape(N, K // 32, 16)
    scales = np.ones((N, K // 32), BF16)
    zeros = (np.arange(N, dtype=np.uint8) % 16) | ((np.arange(N, dtype=np.uint8) * 7 % 16) << 4)
    packed, ps, pz = pack_q4f8(b, scales, zeros, N=N, K=K)
    want = dequantize_nbits(b, scales, zeros, K=K, N=N, block_size=32)
    np.testing.assert_array_equal(unpack_q4f8(packed, ps, pz, N=N, K=K), want)


def test_packing_refuses_other_layouts(rng: np.random.Generator) -> None:
    b, scales, zeros = _weight(rng, 8, 64, True)
    with pytest.raises(ValueError, match="pack_q4f8: K=48 must be a multiple of 32"):
        pack_q4f8(b, scales, zeros, N=8, K=48)
    with pytest.raises(ValueError, match=r"b must be uint8 \[N=8, 2, 16\]"):
        pack_q4f8(b[:, :1], scales, zeros, N=8, K=64)
    with pytest.raises(ValueError, match=r"scales must be bfloat16 .* \.astype\(ml_dtypes"):
        pack_q4f8(b, scales.astype(np.float32), zeros, N=8, K=64)
    with pytest.raises(ValueError, match=r"zero_points must be uint8 \[N=8, 1\]"):
        pack_q4f8(b, scales, np.zeros(16, np.uint8), N=8, K=64)


@pytest.mark.parametrize(("N", "K", "zp"), [(37, 224, True), (300, 896, False), (130, 96, True)])
def test_gemv_is_the_product_of_the_dequantized_weights(
    f8_device: Device,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    N: int,
    K: int,
    zp: bool,
) -> None:
    dev, s = f8_device, f8_device.default_stream
    b, scales, zeros = _weight(rng, N, K, zp)
    dense = dequantize_nbits(b, scales, zeros, K=K, N=N, block_size=32).astype(np.float64)
    w = upload_q4f8(dev, b, scales, zeros, N=N, K=K, stream=s)

    def run(out: Buffer, x: Buffer, M: int, **kwargs: bool) -> MatmulPlan:
        return gemv_q4_f8(dev, out, x, w, M=M, stream=s, **kwargs)

    def kernel(M: int) -> str:  # a kernel a form: zero points d4b3 at M <= 4, none d6b3 at 8
        if zp:
            return "ep_gemv_q4f8_d4b3_bf16" if M <= 4 else "ep_gemv_q4f8_bf16"
        return "ep_gemv_q4f8_sym_d6b3_bf16" if M <= 8 else "ep_gemv_q4f8_sym_bf16"

    check_decode_gemv(dev, rng, upload, poison, run, dense, kernel, BOUND)


def test_a_row_of_x_with_inf_is_nan_and_a_zero_row_is_zero(
    f8_device: Device, rng: np.random.Generator, poison: Poison, upload: Upload
) -> None:
    dev, s = f8_device, f8_device.default_stream
    N, K, M = 70, 192, 3
    b, scales, zeros = _weight(rng, N, K, True)
    w = upload_q4f8(dev, b, scales, zeros, N=N, K=K, stream=s)
    x = rng.standard_normal((M, K)).astype(BF16)
    x[1, 10] = np.inf
    x[2] = 0
    out = dev.alloc((M, N), BF16, stream=s)
    poison(out)
    gemv_q4_f8(dev, out, upload(dev, x), w, M=M, stream=s)
    got = out.to_host(stream=s).astype(np.float64)
    assert np.isnan(got[1]).all() and (got[2] == 0).all() and np.isfinite(got[0]).all()


def test_gemv_refuses_what_it_cannot_run(
    cpu_device: Device, rng: np.random.Generator, upload: Upload, monkeypatch: pytest.MonkeyPatch
) -> None:
    dev, s = cpu_device, cpu_device.default_stream
    b, scales, zeros = _weight(rng, 20, 64, True)
    w = upload_q4f8(dev, b, scales, zeros, N=20, K=64, stream=s)
    x = upload(dev, rng.standard_normal((17, 64)).astype(BF16))
    out = dev.alloc((17, 20), BF16, stream=s)
    with pytest.raises(KernelArgumentError, match=r"M=17 must be in \[1, 16\]"):
        gemv_q4_f8(dev, out, x, w, M=17, stream=s)
    x16 = upload(dev, np.zeros((1, 64), np.float16))
    with pytest.raises(KernelArgumentError, match=r"takes bfloat16 .*q4p\.gemv_q4_packed"):
        gemv_q4_f8(dev, dev.alloc((1, 20), np.float16, stream=s), x16, w, M=1, stream=s)
    assert w.zeros is not None
    short = PackedQ4F8(w.weights, w.scales, w.zeros.view(np.uint16, (3,)), 20, 64)
    with pytest.raises(KernelArgumentError, match=r"zeros .* holds 3 elements"):
        gemv_q4_f8(dev, out, x, short, M=1, stream=s)
    with pytest.raises(KernelArgumentError, match="overlaps x"):
        gemv_q4_f8(dev, x.view(BF16, (20,)), x, w, M=1, stream=s)
    with pytest.raises(KernelArgumentError, match="ring 'd5b1' is not compiled"):
        gemv_q4_f8(dev, out, x, w, M=1, stream=s, ring="d5b1")
    monkeypatch.setattr(dev, "arch", "sm_80")  # a GPU without wgmma: refused before any launch
    with pytest.raises(KernelUnavailableError, match=r"only sm_90a .* this GPU is sm_80: use .*"):
        gemv_q4_f8(dev, out, x, w, M=1, stream=s)


@pytest.mark.parametrize("ring", [f"d{d}b{b}" for d, b in RINGS])
def test_every_ring_variant_gives_the_bits_of_the_default(
    f8_device: Device, rng: np.random.Generator, upload: Upload, ring: str
) -> None:
    """A ring changes only how far ahead a warp loads and how many blocks share an SM: every
    one, at every accumulator width (M = 1, 6, 13), with zero points and without, stores the
    default's bits."""
    dev, s = f8_device, f8_device.default_stream
    N, K = 300, 896
    for zp in (True, False):
        b, scales, zeros = _weight(rng, N, K, zp)
        w = upload_q4f8(dev, b, scales, zeros, N=N, K=K, stream=s)

        def run(out: Buffer, x: Buffer, M: int, w: PackedQ4F8 = w, **kwargs: str) -> MatmulPlan:
            return gemv_q4_f8(dev, out, x, w, M=M, stream=s, **kwargs)

        family = q4f8._family(zp)
        kernels = (f"ep_gemv_{family}_{ring}_bf16", f"ep_gemv_{family}_bf16")
        check_ring_matches_default(dev, rng, upload, run, (N, K), ring, kernels)


@pytest.mark.parametrize("zp", [True, False])
@pytest.mark.parametrize(("depth", "per_sm"), RINGS)
def test_the_ring_refills_at_m_8_and_below_are_predicated_volatile_loads(
    depth: int, per_sm: int, zp: bool
) -> None:
    """As `ep.kernels.mx4f8`'s: at M <= 8 each unrolled step refills its slot's weights, bf16
    scales and zero points with predicated volatile loads (PTX by NVRTC, no GPU), in both M <= 8
    loops. A kernel has one zero-point form: with zero points on a ring of 2 blocks an SM (128
    registers a thread) a lane's scales are a uint2 (all four of its rows' blocks); without them,
    or on a ring of 24 warps an SM (80 registers), one u32 (its block's pair)."""
    d8, _ = q4f8._WIDER[depth, per_sm]
    family = q4f8._family(zp)
    ptx = ptx_of(Q4F8_KERNELS[q4f8._name(family, f"d{depth}b{per_sm}", "bf16", RINGS)])
    steps = depth + d8
    wide = zp and per_sm == 2
    assert ptx.count("@q ld.global.nc.L1::no_allocate.v4.u32") == steps  # weights
    assert ptx.count("@q ld.global.nc.v2.u32") == (steps if wide else 0)  # scales, uint2
    assert ptx.count("@q ld.global.nc.u32") == (0 if wide else steps)  # scales, u32
    assert ptx.count("@q ld.global.nc.u16") == (steps if zp else 0)  # zero points


def test_the_kernel_exists_for_sm_90a_only() -> None:
    kernel = Q4F8_KERNELS["ep_gemv_q4f8_bf16"]
    assert kernel_target(kernel, "sm_90") == "sm_90a"
    assert kernel_target(kernel, "sm_80") is None and kernel_target(kernel, "sm_100") is None
