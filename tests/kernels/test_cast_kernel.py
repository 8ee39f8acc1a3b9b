"""The logits ``Cast`` of fp16/bf16 graphs (`ep.native._kernels.cast_f32`): exact, at every
length and alignment.

The kernel converts 4 elements a thread with one vector load and one 16-byte store where both
pointers allow it, element by element otherwise (a tail shorter than 4, an unaligned view), so
each case is checked: every element written, bitwise NumPy's conversion, nothing past ``n``.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from ep.device import KERNELS, Device, KernelCache, compile_kernel
from ep.errors import KernelArgumentError
from ep.native._kernels import cast_f32

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


def test_every_cast_kernel_compiles_to_sm90_cubin(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path)
    for dt in ("f32", "f16", "bf16"):
        name = f"native_cast_f32_{dt}"
        assert compile_kernel(KERNELS.get(name), "sm_90", cache=cache).report.cubin_bytes > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n", [1, 3, 4, 7, 1024, 4 * 151936 + 3])
@pytest.mark.parametrize("skew", [0, 1], ids=["aligned", "unaligned"])
def test_cast_is_exact_at_every_length_and_alignment(
    device: Device, rng: np.random.Generator, dtype: np.dtype, n: int, skew: int
) -> None:
    x = (rng.standard_normal(n + skew) * 100).astype(dtype)
    x[-1] = np.inf
    s = device.default_stream
    src = device.to_device(x, stream=s).view(dtype, n, offset=skew * dtype.itemsize)
    out_root = device.alloc(n + skew + 4, np.float32, stream=s)
    device.fill(out_root.view(np.uint8), 0xFF, stream=s)  # NaN: any value not written shows
    out = out_root.view(np.float32, n, offset=4 * skew)
    cast_f32(device, out, src, n=n, stream=s)
    got = out_root.to_host(stream=s)
    want = x[skew:].astype(np.float32)
    np.testing.assert_array_equal(got[skew : skew + n].view(np.uint32), want.view(np.uint32))
    assert np.isnan(got[skew + n :]).all()  # nothing past n


def test_cast_refuses_a_short_output(device: Device) -> None:
    s = device.default_stream
    x = device.to_device(np.zeros(8, ml_dtypes.bfloat16), stream=s)
    out = device.alloc(7, np.float32, stream=s)
    with pytest.raises(KernelArgumentError, match="out"):
        cast_f32(device, out, x, n=8, stream=s)
