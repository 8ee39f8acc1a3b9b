"""Embedding gather kernel: rows of any dtype, int64/int32 ids, out-of-range ids flagged."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ep.device import Buffer, Device
from ep.errors import KernelArgumentError, KernelFaultError
from ep.kernels import KernelFault, check_faults, embed, new_status

BF16 = np.dtype(ml_dtypes.bfloat16)


def upload(device: Device, array: np.ndarray) -> Buffer:
    return device.to_device(np.ascontiguousarray(array), stream=device.default_stream)


def poisoned(device: Device, shape: tuple[int, ...], dtype: np.dtype) -> Buffer:
    buf = device.alloc(shape, dtype, stream=device.default_stream)
    device.fill(buf.view(np.uint8), 0xFF, stream=device.default_stream)
    return buf


@pytest.mark.parametrize(
    ("dtype", "hidden"),
    [(np.dtype(np.float32), 893), (BF16, 893), (BF16, 896), (np.dtype(np.float16), 1), (BF16, 3)],
    ids=str,
)
@pytest.mark.parametrize("id_dtype", [np.int64, np.int32])
def test_gather_matches_numpy(device: Device, dtype: np.dtype, hidden: int, id_dtype: type) -> None:
    rng = np.random.default_rng(hidden)
    vocab, count = 1031, 7
    table = rng.standard_normal((vocab, hidden)).astype(dtype)
    ids = rng.integers(0, vocab, count).astype(id_dtype)
    ids[-1] = vocab - 1  # the last row of the table is in range
    out = poisoned(device, (count, hidden), dtype)
    status = new_status(device, stream=device.default_stream)
    embed.embed(
        device,
        out,
        upload(device, table),
        upload(device, ids),
        count=count,
        vocab=vocab,
        hidden=hidden,
        status=status,
        stream=device.default_stream,
    )
    got = out.to_host(stream=device.default_stream)
    np.testing.assert_array_equal(got.view(np.uint8), table[ids].view(np.uint8))
    check_faults(device, status, stream=device.default_stream)  # no fault


def test_out_of_range_ids_give_zero_rows_and_a_fault(device: Device) -> None:
    rng = np.random.default_rng(5)
    vocab, hidden = 50, 896
    table = rng.standard_normal((vocab, hidden)).astype(BF16)
    ids = np.array([3, -1, 50, 49, 2**40], dtype=np.int64)
    out = poisoned(device, (5, hidden), BF16)
    status = new_status(device, stream=device.default_stream)
    embed.embed(
        device,
        out,
        upload(device, table),
        upload(device, ids),
        count=5,
        vocab=vocab,
        hidden=hidden,
        status=status,
        stream=device.default_stream,
    )
    got = out.to_host(stream=device.default_stream).astype(np.float32)
    np.testing.assert_array_equal(got[[0, 3]], table[[3, 49]].astype(np.float32))
    assert (got[[1, 2, 4]] == 0).all()
    with pytest.raises(KernelFaultError, match="token id was outside") as info:
        check_faults(device, status, stream=device.default_stream)
    assert info.value.faults == KernelFault.TOKEN_ID
    check_faults(device, status, stream=device.default_stream)  # the check reset the status


def test_embed_refuses_bad_buffers(device: Device) -> None:
    table = upload(device, np.zeros((4, 8), np.float32))
    out = poisoned(device, (2, 8), np.dtype(np.float16))
    status = new_status(device, stream=device.default_stream)
    ids = upload(device, np.zeros(2, np.int64))
    with pytest.raises(KernelArgumentError, match="one dtype"):
        embed.embed(
            device,
            out,
            table,
            ids,
            count=2,
            vocab=4,
            hidden=8,
            status=status,
            stream=device.default_stream,
        )
    out32 = poisoned(device, (2, 8), np.dtype(np.float32))
    with pytest.raises(KernelArgumentError, match="ids must be an int64 or int32"):
        embed.embed(
            device,
            out32,
            table,
            upload(device, np.zeros(2, np.float32)),
            count=2,
            vocab=4,
            hidden=8,
            status=status,
            stream=device.default_stream,
        )
    with pytest.raises(KernelArgumentError, match=r"table .* holds 32 elements"):
        embed.embed(
            device,
            out32,
            table,
            ids,
            count=2,
            vocab=5,
            hidden=8,
            status=status,
            stream=device.default_stream,
        )
