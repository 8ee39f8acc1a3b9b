"""SwiGLU kernels (two inputs, packed halves, packed interleaved) against the NumPy references."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ep.device import Buffer, Device
from ep.errors import KernelArgumentError
from ep.kernels import mlp
from ep.ops import mlp as ref

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]
# Max |kernel - reference| / max |reference|: float32 differs only in expf's last bits.
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


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "inter"), [(3, 893), (2, 896), (1, 4864)])
def test_swiglu_two_inputs(device: Device, dtype: np.dtype, rows: int, inter: int) -> None:
    rng = np.random.default_rng(inter)
    gate = (rng.standard_normal((rows, inter)) * 4).astype(dtype)
    up = rng.standard_normal((rows, inter)).astype(dtype)
    out = poisoned(device, (rows, inter), dtype)
    mlp.swiglu(
        device,
        out,
        upload(device, gate),
        upload(device, up),
        rows=rows,
        inter=inter,
        stream=device.default_stream,
    )
    assert rel_err(out.to_host(stream=device.default_stream), ref.swiglu(gate, up)) <= TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize(("rows", "inter"), [(3, 893), (2, 896)])
def test_swiglu_packed(
    device: Device, dtype: np.dtype, interleaved: int, rows: int, inter: int
) -> None:
    rng = np.random.default_rng(10 * inter + interleaved)
    packed = (rng.standard_normal((rows, 2 * inter)) * 3).astype(dtype)
    out = poisoned(device, (rows, inter), dtype)
    mlp.swiglu_packed(
        device,
        out,
        upload(device, packed),
        rows=rows,
        inter=inter,
        interleaved=interleaved,
        stream=device.default_stream,
    )
    want = ref.swiglu_packed(packed, interleaved=interleaved)
    assert rel_err(out.to_host(stream=device.default_stream), want) <= TOL[dtype]


def test_swiglu_views_into_wider_rows(device: Device) -> None:
    """gate and up as column blocks of one [rows, 3*inter] projection output (row stride 3I)."""
    rng = np.random.default_rng(3)
    rows, inter = 4, 896
    wide = rng.standard_normal((rows, 3 * inter)).astype(BF16)
    buf = upload(device, wide)
    gate = buf.view(BF16, offset=0)
    up = buf.view(BF16, offset=2 * inter * BF16.itemsize)
    out = poisoned(device, (rows, inter), BF16)
    mlp.swiglu(
        device,
        out,
        gate,
        up,
        rows=rows,
        inter=inter,
        gate_row_stride=3 * inter,
        up_row_stride=3 * inter,
        stream=device.default_stream,
    )
    want = ref.swiglu(wide[:, :inter], wide[:, 2 * inter :])
    assert rel_err(out.to_host(stream=device.default_stream), want) <= TOL[BF16]


def test_swiglu_refuses_mismatched_buffers(device: Device) -> None:
    out = poisoned(device, (2, 8), np.dtype(np.float32))
    gate = upload(device, np.ones((2, 8), np.float32))
    up16 = upload(device, np.ones((2, 8), np.float16))
    with pytest.raises(KernelArgumentError, match=r"up .* is float16; expected float32"):
        mlp.swiglu(device, out, gate, up16, rows=2, inter=8, stream=device.default_stream)
    with pytest.raises(KernelArgumentError, match=r"gate .* holds 16 elements"):
        mlp.swiglu(
            device,
            out,
            gate,
            gate,
            rows=2,
            inter=8,
            gate_row_stride=9,
            stream=device.default_stream,
        )
    with pytest.raises(KernelArgumentError, match="interleaved"):
        mlp.swiglu_packed(
            device, out, gate, rows=1, inter=8, interleaved=2, stream=device.default_stream
        )
    assert np.isnan(out.to_host(stream=device.default_stream)).all()
