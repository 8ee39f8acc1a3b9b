"""The packed 4-bit GEMV (`ep.kernels.q4p`): the packer against MatMulNBits' dequantization, and
``ep_gemv_q4p_<dt>`` against the float64 product of the dequantized weights, on the CPU device
(the NumPy twin) and, marked ``cuda``, on the GPU: odd N and K (padding rows and k), with and
without zero points, every M of the GEMV's two paths. Outputs are poisoned with NaN first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest

from ep.device import Buffer, Device, KernelCache, compile_kernel
from ep.errors import KernelArgumentError
from ep.kernels.matmul import MatmulPlan
from ep.kernels.q4p import (
    MX4P_KERNELS,
    MX4P_RING_ENV,
    Q4P_KERNELS,
    RING_ENV,
    RINGS,
    PackedQ4,
    gemv_mx4_packed,
    gemv_q4_packed,
    pack_q4,
    unpack_q4,
    upload_mx4,
    upload_q4,
)
from ep.ops.matmul import dequantize_nbits, quantize_mxfp4, quantize_nbits

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float16), BF16]
# relative error bound of a result rounded once to the dtype (the sums are fp32)
BOUND = {np.dtype(np.float16): 2e-3, BF16: 1e-2}

Upload = Callable[..., Buffer]
Poison = Callable[[Buffer], None]


def _weight(
    rng: np.random.Generator, N: int, K: int, zp: bool, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """MatMulNBits arrays (block 32) and their dequantized weights [N, K] in float64."""
    w = rng.standard_normal((N, K)).astype(np.float32) / np.sqrt(K)
    b, scales, z = quantize_nbits(w, block_size=32, zero_point=zp)
    scales = scales.astype(dtype)
    dense = dequantize_nbits(b, scales, z, K=K, N=N, block_size=32).astype(np.float64)
    return b, scales, z, dense


@pytest.mark.parametrize("zp", [True, False], ids=["zp", "no-zp"])
@pytest.mark.parametrize(("N", "K"), [(37, 200), (16, 64), (3, 33), (40, 896)])
def test_packing_holds_the_dequantized_weights(
    rng: np.random.Generator, N: int, K: int, zp: bool
) -> None:
    b, scales, z, dense = _weight(rng, N, K, zp, BF16)
    packed, ps, pz = pack_q4(b, scales, z, N=N, K=K)
    groups, steps = -(-N // 16), -(-K // 64)
    assert packed.size == groups * steps * 512 and ps.size == groups * steps * 32
    assert (pz is None) == (not zp) and (pz is None or pz.size == groups * steps * 8)
    np.testing.assert_array_equal(unpack_q4(packed, ps, pz, N=N, K=K), dense.astype(np.float32))


def test_packing_refuses_other_layouts(rng: np.random.Generator) -> None:
    b, scales, z, _ = _weight(rng, 8, 64, True, BF16)
    with pytest.raises(ValueError, match="block size 32"):
        pack_q4(b[:, :1], scales, z, N=8, K=64)
    with pytest.raises(ValueError, match="scales must hold"):
        pack_q4(b, scales[:3], z, N=8, K=64)
    with pytest.raises(ValueError, match="zero_points must be uint8"):
        pack_q4(b, scales, z.astype(np.uint16), N=8, K=64)


@pytest.mark.parametrize("zp", [True, False], ids=["zp", "no-zp"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize(("N", "K"), [(37, 200), (40, 896), (300, 128)])
def test_packed_gemv_is_the_product_of_the_dequantized_weights(
    device: Device,
    rng: np.random.Generator,
    poison: Poison,
    upload: Upload,
    dtype: np.dtype,
    N: int,
    K: int,
    zp: bool,
) -> None:
    s = device.default_stream
    b, scales, z, dense = _weight(rng, N, K, zp, dtype)
    w = upload_q4(device, b, scales, z, N=N, K=K, stream=s)
    for M in (1, 5, 8, 9, 16):
        x = rng.standard_normal((M, K)).astype(np.float32).astype(dtype)
        out = device.alloc((M, N), dtype, stream=s)
        poison(out)
        plan = gemv_q4_packed(device, out, upload(device, x), w, M=M, stream=s, resident=True)
        assert plan.kernel == f"ep_gemv_q4p_{'f16' if dtype == np.float16 else 'bf16'}"
        got = out.to_host(stream=s).astype(np.float64)
        want = x.astype(np.float64) @ dense.T
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < BOUND[dtype], (M, err)
        # a row's sums do not depend on the other rows
        if M == 9:
            solo = device.alloc((1, N), dtype, stream=s)
            gemv_q4_packed(device, solo, upload(device, x[4:5]), w, M=1, stream=s)
            np.testing.assert_array_equal(solo.to_host(stream=s)[0], out.to_host(stream=s)[4])


@pytest.mark.parametrize("family", ["q4p", "mx4p"])
def test_every_ring_variant_compiles_and_runs(
    device: Device, rng: np.random.Generator, upload: Upload, tmp_path: object,
    monkeypatch: pytest.MonkeyPatch, family: str,
) -> None:  # fmt: skip
    """Each compiled ring of both packed GEMVs (fp16 and bf16) builds for sm_90 without a GPU;
    each computes the same bits (the ring only changes how far ahead a warp loads); the switch
    picks one, and a ring that is not compiled is refused with the ones that are."""
    rings = [f"d{d}b{b}" for d, b in RINGS]
    kernels, env = (Q4P_KERNELS, RING_ENV) if family == "q4p" else (MX4P_KERNELS, MX4P_RING_ENV)
    assert set(kernels) == {
        f"ep_gemv_{family}_{'' if i == 0 else f'{r}_'}{dt}"
        for i, r in enumerate(rings) for dt in ("f16", "bf16")
    }  # fmt: skip
    if device.kind == "cpu":
        cache = KernelCache(tmp_path)  # type: ignore[arg-type]
        for source in kernels.values():
            assert compile_kernel(source, "sm_90", cache=cache).report.cubin_bytes > 0
    s = device.default_stream
    N, K = 300, 896
    if family == "q4p":
        b, scales, z, _ = _weight(rng, N, K, True, BF16)
        w = upload_q4(device, b, scales, z, N=N, K=K, stream=s)
        gemv: Callable[..., object] = functools.partial(gemv_q4_packed, device, w=w)
    else:
        b, scales = quantize_mxfp4(rng.standard_normal((N, K)).astype(np.float32))
        mx = upload_mx4(device, b, scales, N=N, K=K, dtype=BF16, stream=s)
        gemv = functools.partial(gemv_mx4_packed, device, w=mx)
    x = upload(device, rng.standard_normal((3, K)).astype(BF16))
    outs = []
    for ring, (_, blocks) in zip(rings, RINGS, strict=True):
        monkeypatch.setenv(env, ring)
        out = device.alloc((3, N), BF16, stream=s)
        plan = gemv(out=out, x=x, M=3, stream=s)
        assert isinstance(plan, MatmulPlan) and plan.grid[0] <= blocks * 132
        outs.append(out.to_host(stream=s))
    for got in outs[1:]:
        np.testing.assert_array_equal(got.view(np.uint16), outs[0].view(np.uint16))
    monkeypatch.setenv(env, "d5b5")
    with pytest.raises(KernelArgumentError, match="ring 'd5b5' is not compiled; expected one of"):
        gemv(out=device.alloc((3, N), BF16, stream=s), x=x, M=3, stream=s)


def test_packed_gemv_refuses_what_it_cannot_run(
    cpu_device: Device, rng: np.random.Generator, upload: Upload
) -> None:
    dev, s = cpu_device, cpu_device.default_stream
    b, scales, z, _ = _weight(rng, 20, 64, True, BF16)
    w = upload_q4(dev, b, scales, z, N=20, K=64, stream=s)
    x = upload(dev, rng.standard_normal((17, 64)).astype(BF16))
    out = dev.alloc((17, 20), BF16, stream=s)
    with pytest.raises(KernelArgumentError, match=r"M=17 must be in \[1, 16\]"):
        gemv_q4_packed(dev, out, x, w, M=17, stream=s)
    x32 = upload(dev, np.zeros((1, 64), np.float32))
    with pytest.raises(KernelArgumentError, match="takes fp16/bf16"):
        gemv_q4_packed(dev, out, x32, w, M=1, stream=s)
    short = PackedQ4(w.weights.view(np.uint8, (100,)), w.scales, w.zeros, 20, 64)
    with pytest.raises(KernelArgumentError, match=r"weights .* holds 100 elements"):
        gemv_q4_packed(dev, out, x, short, M=1, stream=s)
    with pytest.raises(KernelArgumentError, match="overlaps x"):
        gemv_q4_packed(dev, x.view(BF16, (20,)), x, w, M=1, stream=s)
    both = dev.alloc(64, np.uint16, stream=s)  # the zero points and the output in one buffer
    shared = PackedQ4(w.weights, w.scales, both.view(np.uint16, (16,)), 20, 64)
    with pytest.raises(KernelArgumentError, match="overlaps zeros"):
        gemv_q4_packed(dev, both.view(BF16, (64,)), x, shared, M=1, stream=s)
