"""Rotary kernels (cache and theta modes, half-split and interleaved) against the references."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ep.device import Buffer, Device
from ep.errors import KernelArgumentError, KernelFaultError
from ep.kernels import check_faults, new_status, rotary
from ep.ops import rotary as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
# Max |kernel - reference| / max |reference|: float32 cos/sin of the same float32 angle differ by
# an ulp or two, so 1e-5 holds up to position ~4000 and beyond.
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 1e-2, BF16: 1e-2}


def upload(device: Device, array: np.ndarray) -> Buffer:
    return device.to_device(np.ascontiguousarray(array), stream=device.default_stream)


def poisoned(device: Device, shape: tuple[int, ...], dtype: np.dtype) -> Buffer:
    buf = device.alloc(shape, dtype, stream=device.default_stream)
    device.fill(buf.view(np.uint8), 0xFF, stream=device.default_stream)
    return buf


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert not np.isnan(g).any(), "the kernel left NaN (poison) in its output"
    return float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30))


def positions_for(rng: np.random.Generator, batch: int, seq: int, top: int) -> np.ndarray:
    """Left-padded rows of increasing positions (padding -1), ending anywhere below ``top``."""
    pos = np.full((batch, seq), -1, dtype=np.int64)
    for b in range(batch):
        pad = int(rng.integers(0, seq))
        start = int(rng.integers(0, top - seq))
        pos[b, pad:] = start + np.arange(seq - pad)
    return pos


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 0), (128, 64)])
def test_rotary_from_caches(
    device: Device, dtype: np.dtype, interleaved: int, head_dim: int, rotary_dim: int
) -> None:
    rng = np.random.default_rng(head_dim + interleaved)
    batch, seq, heads, max_pos = 3, 5, 14, 4096
    rot = rotary_dim or head_dim
    cos, sin = ref.rope_cache(10000.0, rot, max_pos, dtype)
    x = rng.standard_normal((batch, seq, heads, head_dim)).astype(dtype)
    pos = positions_for(rng, batch, seq, max_pos)
    out = poisoned(device, x.shape, dtype)
    status = new_status(device, stream=device.default_stream)
    rotary.rotary(
        device,
        out,
        upload(device, x),
        upload(device, pos),
        upload(device, cos),
        upload(device, sin),
        batch=batch,
        seq=seq,
        heads=heads,
        head_dim=head_dim,
        max_positions=max_pos,
        rotary_dim=rotary_dim,
        interleaved=interleaved,
        status=status,
        stream=device.default_stream,
    )
    want = ref.rotary(x, pos, cos, sin, interleaved=interleaved)
    assert rel_err(out.to_host(stream=device.default_stream), want) <= TOL[dtype]
    check_faults(device, status, stream=device.default_stream)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_theta_q_and_k_in_place_in_a_packed_projection(
    device: Device, dtype: np.dtype, interleaved: int
) -> None:
    """q and k rotated in one launch, in place, as views into a packed [B, S, (Hq+2Hk)*D] QKV."""
    rng = np.random.default_rng(40 + interleaved)
    batch, seq, hq, hk, d, theta = 3, 4, 14, 2, 64, 1e6
    width = (hq + 2 * hk) * d
    qkv = rng.standard_normal((batch, seq, width)).astype(dtype)
    pos = positions_for(rng, batch, seq, 4000).astype(np.int32)  # int32 positions too
    buf = upload(device, qkv)
    q = buf.view(dtype, offset=0)
    k = buf.view(dtype, offset=hq * d * dtype.itemsize)
    status = new_status(device, stream=device.default_stream)
    inv_freq = rotary.rotary_inv_freq(device, theta, d, stream=device.default_stream)
    rotary.rotary_theta(
        device,
        q,
        q,
        upload(device, pos),
        inv_freq,
        theta=theta,
        batch=batch,
        seq=seq,
        heads=hq,
        head_dim=d,
        interleaved=interleaved,
        x_token_stride=width,
        out_token_stride=width,
        k_out=k,
        k=k,
        kv_heads=hk,
        k_token_stride=width,
        k_out_token_stride=width,
        status=status,
        stream=device.default_stream,
    )
    got = buf.to_host(stream=device.default_stream)
    p64 = pos.astype(np.int64)
    want_q = ref.rotary_theta(
        qkv[..., : hq * d].reshape(batch, seq, hq, d),
        p64,
        theta=theta,
        rotary_dim=0,
        interleaved=interleaved,
    )
    want_k = ref.rotary_theta(
        qkv[..., hq * d : (hq + hk) * d].reshape(batch, seq, hk, d),
        p64,
        theta=theta,
        rotary_dim=0,
        interleaved=interleaved,
    )
    assert rel_err(got[..., : hq * d].reshape(want_q.shape), want_q) <= TOL[dtype]
    assert rel_err(got[..., hq * d : (hq + hk) * d].reshape(want_k.shape), want_k) <= TOL[dtype]
    np.testing.assert_array_equal(got[..., (hq + hk) * d :], qkv[..., (hq + hk) * d :])  # v


def test_rotary_theta_out_of_place_partial_rotary_dim(device: Device) -> None:
    rng = np.random.default_rng(9)
    batch, seq, heads, d, rot = 2, 3, 4, 80, 32
    x = rng.standard_normal((batch, seq, heads, d)).astype(np.float32)
    pos = np.array([[-1, 0, 1], [30000, 30001, 30002]], dtype=np.int64)
    out = poisoned(device, x.shape, np.dtype(np.float32))
    status = new_status(device, stream=device.default_stream)
    inv_freq = rotary.rotary_inv_freq(device, 10000.0, rot, stream=device.default_stream)
    rotary.rotary_theta(
        device,
        out,
        upload(device, x),
        upload(device, pos),
        inv_freq,
        theta=10000.0,
        batch=batch,
        seq=seq,
        heads=heads,
        head_dim=d,
        rotary_dim=rot,
        status=status,
        stream=device.default_stream,
    )
    got = out.to_host(stream=device.default_stream)
    want = ref.rotary_theta(x, pos, theta=10000.0, rotary_dim=rot, interleaved=0)
    assert rel_err(got, want) <= 1e-5  # float32 at position 30002
    np.testing.assert_array_equal(got[0, 0], x[0, 0])  # padding passes through


def test_position_outside_the_cache_is_flagged_and_passes_through(device: Device) -> None:
    rng = np.random.default_rng(11)
    cos, sin = ref.rope_cache(10000.0, 64, 16, np.float32)
    x = rng.standard_normal((1, 3, 2, 64)).astype(np.float32)
    pos = np.array([[14, 15, 16]], dtype=np.int64)
    out = poisoned(device, x.shape, np.dtype(np.float32))
    status = new_status(device, stream=device.default_stream)
    rotary.rotary(
        device,
        out,
        upload(device, x),
        upload(device, pos),
        upload(device, cos),
        upload(device, sin),
        batch=1,
        seq=3,
        heads=2,
        head_dim=64,
        max_positions=16,
        status=status,
        stream=device.default_stream,
    )
    got = out.to_host(stream=device.default_stream)
    want = ref.rotary(x[:, :2], pos[:, :2], cos, sin, interleaved=0)
    assert rel_err(got[:, :2], want) <= 1e-5
    np.testing.assert_array_equal(got[0, 2], x[0, 2])
    with pytest.raises(KernelFaultError, match="outside the cos/sin cache"):
        check_faults(device, status, stream=device.default_stream)


def test_rotary_refuses_bad_arguments(device: Device) -> None:
    x = upload(device, np.zeros((1, 2, 2, 8), np.float32))
    pos = upload(device, np.zeros((1, 2), np.int64))
    cos = upload(device, np.zeros((4, 4), np.float32))
    status = new_status(device, stream=device.default_stream)
    common = dict(batch=1, seq=2, heads=2, head_dim=8, status=status, stream=device.default_stream)
    with pytest.raises(KernelArgumentError, match="rotary_dim=7 must be even"):
        rotary.rotary(device, x, x, pos, cos, cos, max_positions=4, rotary_dim=7, **common)
    with pytest.raises(KernelArgumentError, match=r"cos_cache .* holds 16 elements"):
        rotary.rotary(device, x, x, pos, cos, cos, max_positions=5, **common)
    with pytest.raises(KernelArgumentError, match="positions must be an int64 or int32"):
        rotary.rotary(device, x, x, cos, cos, cos, max_positions=4, **common)
    with pytest.raises(KernelArgumentError, match="theta"):
        rotary.rotary_inv_freq(device, 0.0, 8, stream=device.default_stream)
