"""A Gather table streamed in pieces: one embed call per row range fills the output once."""

from __future__ import annotations

import numpy as np
import pytest

from ep.device import Device
from ep.errors import KernelArgumentError, KernelFaultError
from ep.kernels import KernelFault, check_faults, embed, new_status

RANGES = [(0, 64), (64, 128), (128, 150)]


def _gather_in_pieces(device: Device, table: np.ndarray, ids: np.ndarray,
                      ranges: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    s = device.default_stream
    vocab, hidden = table.shape
    out = device.alloc((ids.size, hidden), table.dtype, stream=s)
    device.fill(out.view(np.uint8), 0xFF, stream=s)  # poisoned
    status = new_status(device, stream=s)
    id_buf = device.to_device(ids, stream=s)
    for start, stop in ranges:
        piece = device.to_device(np.ascontiguousarray(table[start:stop]), stream=s)
        embed.embed(device, out, piece, id_buf, count=ids.size, vocab=vocab, hidden=hidden,
                    status=status, stream=s, first_row=start, rows=stop - start)  # fmt: skip
    return out.to_host(stream=s), status.to_host(stream=s)


def test_ids_in_different_pieces_give_the_whole_table_gather(device: Device) -> None:
    rng = np.random.default_rng()
    table = rng.standard_normal((150, 40)).astype(np.float32)
    ids = np.array([3, 149, 64, 63, 100, 0, 128, 127], dtype=np.int64)
    got, status = _gather_in_pieces(device, table, ids, RANGES)
    assert np.array_equal(got, table[ids]) and status[0] == 0


def test_an_id_outside_the_vocabulary_faults_once_and_gives_zeros(device: Device) -> None:
    rng = np.random.default_rng()
    table = rng.standard_normal((150, 40)).astype(np.float32)
    ids = np.array([5, 150, 140, -1], dtype=np.int32)
    got, status = _gather_in_pieces(device, table, ids, RANGES)
    assert np.array_equal(got[[0, 2]], table[[5, 140]])
    assert not got[[1, 3]].any()  # zeros, written by the piece at row 0 only
    assert status[0] == int(KernelFault.TOKEN_ID)
    with pytest.raises(KernelFaultError):
        check_faults(device, device.to_device(status, stream=device.default_stream),
                     stream=device.default_stream)  # fmt: skip


def test_without_the_piece_at_row_0_a_bad_id_is_left_alone(device: Device) -> None:
    """Only one piece answers bad ids: the others neither fault nor write."""
    table = np.ones((150, 8), np.float32)
    got, status = _gather_in_pieces(device, table, np.array([200, 70]), RANGES[1:])
    assert status[0] == 0 and np.array_equal(got[1], table[70])
    assert np.all(got[0].view(np.uint32) == 0xFFFFFFFF)  # still poisoned


def test_a_row_range_outside_the_vocabulary_is_refused(device: Device) -> None:
    s = device.default_stream
    out = device.alloc((1, 4), np.float32, stream=s)
    table = device.alloc((10, 4), np.float32, stream=s)
    ids = device.to_device(np.zeros(1, np.int64), stream=s)
    with pytest.raises(KernelArgumentError, match=r"rows \[95, 105\)"):
        status = new_status(device, stream=s)
        embed.embed(device, out, table, ids, count=1, vocab=100, hidden=4, status=status,
                    stream=s, first_row=95, rows=10)  # fmt: skip
