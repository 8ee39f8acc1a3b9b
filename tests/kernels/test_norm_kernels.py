"""RMSNorm / SkipRMSNorm kernels against the NumPy references, on the CPU and (marked) the GPU."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ep.device import Buffer, Device
from ep.errors import KernelArgumentError
from ep.kernels import norm
from ep.ops import norm as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
# Max |kernel - reference| / max |reference|: float32 differs only by summation order.
TOL = {np.dtype(np.float32): 1e-5, np.dtype(np.float16): 1e-2, BF16: 1e-2}


def upload(device: Device, array: np.ndarray, name: str = "") -> Buffer:
    return device.to_device(np.ascontiguousarray(array), stream=device.default_stream, name=name)


def poisoned(device: Device, shape: tuple[int, ...], dtype: np.dtype) -> Buffer:
    """An output buffer filled with 0xFF bytes (NaN for every float dtype)."""
    buf = device.alloc(shape, dtype, stream=device.default_stream)
    device.fill(buf.view(np.uint8), 0xFF, stream=device.default_stream)
    return buf


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert not np.isnan(g).any(), "the kernel left NaN (poison) in its output"
    return float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30))


def host(device: Device, buf: Buffer) -> np.ndarray:
    return buf.to_host(stream=device.default_stream)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("rows", "hidden"),
    [(5, 893), (3, 896), (1, 64), (2, 4096), (2, 8200)],  # 8200: > 1024 units
)
def test_rms_norm_matches_reference(
    device: Device, dtype: np.dtype, rows: int, hidden: int
) -> None:
    rng = np.random.default_rng(1000 + hidden)
    x = (rng.standard_normal((rows, hidden)) * 3).astype(dtype)
    w = rng.uniform(0.5, 1.5, hidden).astype(dtype)
    y = poisoned(device, (rows, hidden), dtype)
    norm.rms_norm(
        device,
        y,
        upload(device, x),
        upload(device, w),
        rows=rows,
        hidden=hidden,
        epsilon=1e-6,
        stream=device.default_stream,
    )
    assert rel_err(host(device, y), ref.rms_norm(x, w, epsilon=1e-6)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "hidden"), [(4, 893), (3, 896), (2, 8200)])
def test_skip_rms_norm_matches_reference(
    device: Device, dtype: np.dtype, rows: int, hidden: int
) -> None:
    rng = np.random.default_rng(2000 + hidden)
    x = rng.standard_normal((rows, hidden)).astype(dtype)
    skip = rng.standard_normal((rows, hidden)).astype(dtype)
    w = rng.uniform(0.5, 1.5, hidden).astype(dtype)
    y, total = poisoned(device, (rows, hidden), dtype), poisoned(device, (rows, hidden), dtype)
    norm.skip_rms_norm(
        device,
        y,
        total,
        upload(device, x),
        upload(device, skip),
        upload(device, w),
        rows=rows,
        hidden=hidden,
        epsilon=1e-5,
        stream=device.default_stream,
    )
    want_y, want_sum = ref.skip_rms_norm(x, skip, w, epsilon=1e-5)
    # The sum is one rounding of x + skip on both sides: identical.
    np.testing.assert_array_equal(host(device, total), want_sum)
    assert rel_err(host(device, y), want_y) <= TOL[dtype]


@pytest.mark.parametrize("hidden", [893, 896])
def test_skip_rms_norm_in_place_updates_the_residual(device: Device, hidden: int) -> None:
    """sum written over the residual x and y over skip: the residual stream updated in place."""
    rng = np.random.default_rng(7)
    dtype = BF16
    x = rng.standard_normal((3, hidden)).astype(dtype)
    skip = rng.standard_normal((3, hidden)).astype(dtype)
    w = rng.uniform(0.5, 1.5, hidden).astype(dtype)
    xb, sb = upload(device, x), upload(device, skip)
    norm.skip_rms_norm(
        device,
        sb,
        xb,
        xb,
        sb,
        upload(device, w),
        rows=3,
        hidden=hidden,
        epsilon=1e-6,
        stream=device.default_stream,
    )
    want_y, want_sum = ref.skip_rms_norm(x, skip, w, epsilon=1e-6)
    np.testing.assert_array_equal(host(device, xb), want_sum)
    assert rel_err(host(device, sb), want_y) <= TOL[dtype]


def test_rms_norm_in_place_and_unaligned_rows(device: Device) -> None:
    """y = x in place, on a view 2 bytes into its allocation (the scalar path on a GPU)."""
    rng = np.random.default_rng(8)
    rows, hidden = 3, 896
    x = rng.standard_normal((rows, hidden)).astype(np.float16)
    w = rng.uniform(0.5, 1.5, hidden).astype(np.float16)
    root = device.alloc(rows * hidden + 1, np.float16, stream=device.default_stream)
    xb = root.view(np.float16, (rows, hidden), offset=2)
    xb.copy_from_host(x, stream=device.default_stream)
    norm.rms_norm(
        device,
        xb,
        xb,
        upload(device, w),
        rows=rows,
        hidden=hidden,
        epsilon=1e-6,
        stream=device.default_stream,
    )
    assert rel_err(host(device, xb), ref.rms_norm(x, w, epsilon=1e-6)) <= TOL[np.dtype(np.float16)]


def test_bad_arguments_are_refused_before_launch(device: Device) -> None:
    x = upload(device, np.ones((2, 8), np.float32))
    y = poisoned(device, (2, 8), np.dtype(np.float32))
    w16 = upload(device, np.ones(8, np.float16))
    with pytest.raises(KernelArgumentError, match=r"weight .* is float16; expected float32"):
        norm.rms_norm(
            device, y, x, w16, rows=2, hidden=8, epsilon=1e-6, stream=device.default_stream
        )
    w = upload(device, np.ones(8, np.float32))
    with pytest.raises(KernelArgumentError, match="holds 16 elements; the sizes given need 24"):
        norm.rms_norm(device, y, x, w, rows=3, hidden=8, epsilon=1e-6, stream=device.default_stream)
    with pytest.raises(KernelArgumentError, match="epsilon"):
        norm.rms_norm(device, y, x, w, rows=2, hidden=8, epsilon=-1.0, stream=device.default_stream)
    ints = upload(device, np.ones((2, 8), np.int32))
    with pytest.raises(KernelArgumentError, match="int32 has no kernel"):
        norm.rms_norm(
            device, ints, ints, w, rows=2, hidden=8, epsilon=1e-6, stream=device.default_stream
        )
    assert np.isnan(host(device, y)).all()  # nothing was written
