"""Int8 activations of MatMulNBits accuracy_level 4: the kernel against the reference, bitwise.

`ep.native._kernels.int8_blocks` rounds each block of K to int8 steps of its amax (one IEEE
division for the scale and its inverse, one multiply and one rounding per value), so the CUDA
kernel and its NumPy twin must equal `ep.ops.round_to_int8_blocks` exactly in every dtype.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ep.ops as eo
from ep.device import KERNELS, Device, KernelCache, compile_kernel
from ep.errors import KernelArgumentError
from ep.native._kernels import int8_blocks

DTYPES = [np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


def test_every_int8_activation_kernel_compiles_to_sm90_cubin(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path)
    names = [f"native_int8_blocks_{dt}" for dt in ("f32", "f16", "bf16")]
    for name in names:
        assert compile_kernel(KERNELS.get(name), "sm_90", cache=cache).report.cubin_bytes > 0


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("rows", "cols", "block"),
    [(1, 128, 32), (5, 200, 32), (3, 93, 16), (2, 4864, 32), (4, 256, 128)],
)
def test_int8_blocks_equal_the_reference_bitwise(
    device: Device, rng: np.random.Generator, dtype: np.dtype, rows: int, cols: int, block: int
) -> None:
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    x[0, :block] = 0  # an all-zero block: scale 0, every value 0
    x[-1, -1] = 1e4  # one large value: the rest of its block rounds to few steps
    x[0, block : 2 * block] *= 1e-3
    x = x.astype(dtype)
    s = device.default_stream
    src = device.to_device(x, stream=s)
    out = device.alloc((rows, cols), dtype, stream=s)
    device.fill(out.view(np.uint8), 0xFF, stream=s)  # NaN: any value not written shows
    int8_blocks(device, out, src, rows=rows, cols=cols, block_size=block, stream=s)
    got = out.to_host(stream=s)
    want = eo.round_to_int8_blocks(x, block_size=block)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    assert not got[0, :block].astype(np.float32).any()


def test_int8_blocks_refuses_bad_arguments(device: Device) -> None:
    s = device.default_stream
    x = device.to_device(np.zeros((2, 64), np.float32), stream=s)
    out16 = device.alloc((2, 64), np.float16, stream=s)
    with pytest.raises(KernelArgumentError, match=r"out .* is float16; expected float32"):
        int8_blocks(device, out16, x, rows=2, cols=64, block_size=32, stream=s)
    out = device.alloc((2, 64), np.float32, stream=s)
    with pytest.raises(KernelArgumentError, match="block_size=0"):
        int8_blocks(device, out, x, rows=2, cols=64, block_size=0, stream=s)
    with pytest.raises(KernelArgumentError, match=r"x .* holds 128 elements"):
        int8_blocks(device, out, x, rows=3, cols=64, block_size=32, stream=s)
