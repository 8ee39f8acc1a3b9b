"""4-bit embedding gather (GatherBlockQuantized): against the NumPy reference, bit for bit.

Each value is one float32 multiply rounded once to the output's dtype, so the kernel (CUDA or its
NumPy twin) must equal `ep.ops.gather_block_quantized` exactly, in every dtype.
"""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import ep.ops as eo
from ep.device import KERNELS, Buffer, Device, KernelCache, compile_kernel
from ep.errors import KernelArgumentError, KernelFaultError
from ep.kernels import KernelFault, check_faults, embed, new_status

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = [np.dtype(np.float32), np.dtype(np.float16), BF16]


def upload(device: Device, array: np.ndarray) -> Buffer:
    return device.to_device(np.ascontiguousarray(array), stream=device.default_stream)


def poisoned(device: Device, shape: tuple[int, ...], dtype: np.dtype) -> Buffer:
    buf = device.alloc(shape, dtype, stream=device.default_stream)
    device.fill(buf.view(np.uint8), 0xFF, stream=device.default_stream)  # NaN in every dtype
    return buf


def _case(
    rng: np.random.Generator, vocab: int, hidden: int, block: int, dtype: np.dtype, zp: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """GatherBlockQuantized data [vocab, hidden/2], scales, packed zero points (or None)."""
    k_blocks = -(-hidden // block)
    data = rng.integers(0, 256, size=(vocab, hidden // 2), dtype=np.uint8)
    scales = ((rng.random((vocab, k_blocks)) + 0.05) * 0.2).astype(dtype)
    zps = rng.integers(0, 256, size=(vocab, -(-k_blocks // 2)), dtype=np.uint8) if zp else None
    return data, scales, zps


def _run(
    device: Device,
    table: np.ndarray,
    scales: np.ndarray,
    zps: np.ndarray | None,
    ids: np.ndarray,
    *,
    hidden: int,
    block: int,
    ranges: list[tuple[int, int]] | None = None,
    row_bytes: int | None = None,
) -> tuple[np.ndarray, int]:
    """The kernel's rows for ``ids`` (one call per row range when given) and the status bits."""
    s = device.default_stream
    vocab = table.shape[0]
    out = poisoned(device, (ids.size, hidden), scales.dtype)
    status = new_status(device, stream=s)
    id_buf = upload(device, ids)
    for start, stop in ranges or [(0, vocab)]:
        embed.embed_q4(
            device, out, upload(device, table[start:stop]), upload(device, scales[start:stop]),
            id_buf, None if zps is None else upload(device, zps[start:stop]), count=ids.size,
            vocab=vocab, hidden=hidden, block_size=block, status=status, stream=s,
            row_bytes=row_bytes, first_row=start, rows=stop - start,
        )  # fmt: skip
    return out.to_host(stream=s), int(status.to_host(stream=s)[0])


def test_every_4bit_embedding_kernel_compiles_to_sm90_cubin(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path)
    names = {f"embed_q4_{dt}" for dt in ("f32", "f16", "bf16")}
    assert names <= set(KERNELS.names())
    for name in sorted(names):
        report = compile_kernel(KERNELS.get(name), "sm_90", cache=cache).report
        assert report.cubin_bytes > 0, name


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("zp", [False, True], ids=["zp8", "zp"])
@pytest.mark.parametrize(
    ("hidden", "block"),
    [(128, 32), (200, 32), (90, 16), (896, 32), (2, 16)],
    ids=["genai-tiny", "partial-block", "odd-bytes", "qwen-0.5b", "one-byte"],
)
@pytest.mark.parametrize("id_dtype", [np.int64, np.int32])
def test_4bit_gather_equals_the_reference_bitwise(
    device: Device, rng: np.random.Generator, dtype: np.dtype, zp: bool, hidden: int, block: int,
    id_dtype: type,
) -> None:  # fmt: skip
    vocab = 301
    data, scales, zps = _case(rng, vocab, hidden, block, dtype, zp)
    ids: np.ndarray = rng.integers(0, vocab, 9).astype(id_dtype)
    ids[0], ids[-1] = 0, vocab - 1
    got, status = _run(device, data, scales, zps, ids, hidden=hidden, block=block)
    want = eo.gather_block_quantized(data, ids, scales, zps, bits=4, block_size=block)
    assert got.dtype == want.dtype == dtype and status == 0
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [93, 64])
def test_a_matmul_nbits_b_serves_as_the_table(
    device: Device, rng: np.random.Generator, dtype: np.dtype, hidden: int
) -> None:
    """A tied 4-bit head: B [N, k_blocks, block/2] (rows padded to whole blocks, an odd K too)
    gathered by row gives the rows of the weight MatMulNBits multiplies with."""
    vocab, block = 77, 32
    w = rng.standard_normal((vocab, hidden)).astype(np.float32)
    b, scales, zps = eo.quantize_nbits(w, block_size=block, zero_point=True)
    assert zps is not None
    scales = scales.astype(dtype)
    ids = np.array([76, 0, 5, 5, 40], np.int64)
    got, status = _run(device, b.reshape(vocab, -1), scales.reshape(vocab, -1),
                       zps.reshape(vocab, -1), ids, hidden=hidden, block=block,
                       row_bytes=b.shape[1] * b.shape[2])  # fmt: skip
    full = eo.dequantize_nbits(b, scales, zps, K=hidden, N=vocab, block_size=block)
    want = full[ids].astype(dtype)
    assert status == 0
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_out_of_range_ids_give_zero_rows_and_a_fault(
    device: Device, rng: np.random.Generator, dtype: np.dtype
) -> None:
    vocab, hidden, block = 50, 90, 16
    data, scales, zps = _case(rng, vocab, hidden, block, dtype, True)
    ids = np.array([3, -1, 50, 49, 2**40], dtype=np.int64)
    got, status = _run(device, data, scales, zps, ids, hidden=hidden, block=block)
    want = eo.gather_block_quantized(data, ids[[0, 3]], scales, zps, block_size=block)
    np.testing.assert_array_equal(got[[0, 3]].view(np.uint8), want.view(np.uint8))
    # -1 is a bad token id here (ORT's op would count it from the end): zeros, as `embed` does
    assert (got[[1, 2, 4]].astype(np.float32) == 0).all()
    assert status == int(KernelFault.TOKEN_ID)
    s = device.default_stream
    with pytest.raises(KernelFaultError, match="token id was outside"):
        check_faults(device, upload(device, np.array([status], np.uint32)), stream=s)


RANGES = [(0, 64), (64, 128), (128, 150)]


@pytest.mark.parametrize("zp", [False, True], ids=["zp8", "zp"])
def test_pieces_fill_the_rows_of_their_ids_once(
    device: Device, rng: np.random.Generator, zp: bool
) -> None:
    data, scales, zps = _case(rng, 150, 128, 32, np.dtype(np.float16), zp)
    ids = np.array([3, 149, 64, 63, 100, 0, 128, 127, 151], dtype=np.int64)
    got, status = _run(device, data, scales, zps, ids, hidden=128, block=32, ranges=RANGES)
    want = eo.gather_block_quantized(data, ids[:-1], scales, zps, block_size=32)
    np.testing.assert_array_equal(got[:-1].view(np.uint8), want.view(np.uint8))
    assert not got[-1].astype(np.float32).any() and status == int(KernelFault.TOKEN_ID)


def test_without_the_piece_at_row_0_a_bad_id_is_left_alone(
    device: Device, rng: np.random.Generator
) -> None:
    data, scales, _ = _case(rng, 150, 64, 32, np.dtype(np.float32), False)
    ids = np.array([200, 70], np.int64)
    got, status = _run(device, data, scales, None, ids, hidden=64, block=32, ranges=RANGES[1:])
    assert status == 0
    np.testing.assert_array_equal(got[1], eo.gather_block_quantized(data, ids[1:], scales,
                                                                     block_size=32)[0])  # fmt: skip
    assert np.all(got[0].view(np.uint32) == 0xFFFFFFFF)  # still poisoned


def test_a_wrong_zero_point_layout_is_caught_by_the_comparison(
    device: Device, rng: np.random.Generator
) -> None:
    """Negative oracle: zero points packed high nibble first give different rows."""
    data, scales, zps = _case(rng, 40, 128, 32, np.dtype(np.float32), True)
    assert zps is not None
    ids = np.arange(40, dtype=np.int64)
    swapped = ((zps << 4) | (zps >> 4)).astype(np.uint8)
    got, _ = _run(device, data, scales, swapped, ids, hidden=128, block=32)
    want = eo.gather_block_quantized(data, ids, scales, zps, block_size=32)
    assert not np.array_equal(got, want)


def test_embed_q4_refuses_bad_arguments(device: Device) -> None:
    s = device.default_stream
    table = upload(device, np.zeros((4, 16), np.uint8))
    scales = upload(device, np.ones((4, 1), np.float32))
    ids = upload(device, np.zeros(2, np.int64))
    status = new_status(device, stream=s)
    kw = dict(count=2, vocab=4, hidden=32, block_size=32, status=status, stream=s)
    out16 = poisoned(device, (2, 32), np.dtype(np.float16))
    with pytest.raises(KernelArgumentError, match=r"scales .* is float32; expected float16"):
        embed.embed_q4(device, out16, table, scales, ids, **kw)  # type: ignore[arg-type]
    out = poisoned(device, (2, 32), np.dtype(np.float32))
    with pytest.raises(KernelArgumentError, match="block_size=24"):
        embed.embed_q4(device, out, table, scales, ids, **{**kw, "block_size": 24})  # type: ignore[arg-type]
    with pytest.raises(KernelArgumentError, match="row_bytes=8 cannot hold 32"):
        embed.embed_q4(device, out, table, scales, ids, row_bytes=8, **kw)  # type: ignore[arg-type]
    with pytest.raises(KernelArgumentError, match="dtype int32 has no kernel"):
        bad = poisoned(device, (2, 32), np.dtype(np.int32))
        embed.embed_q4(device, bad, table, scales, ids, **kw)  # type: ignore[arg-type]
    with pytest.raises(KernelArgumentError, match=r"table .* holds 64 elements"):
        embed.embed_q4(device, out, table, scales, ids, **{**kw, "vocab": 5})  # type: ignore[arg-type]
