"""Device.copy_2d: rows of bytes between pitched layouts (a piece's columns into a matrix)."""

from __future__ import annotations

import numpy as np
import pytest

from ep.device import Device
from ep.errors import DeviceError


def test_a_block_lands_in_the_columns_of_a_matrix(device: Device) -> None:
    s = device.default_stream
    rng = np.random.default_rng()
    m, n_all, n0, n = 5, 37, 11, 9
    full = rng.standard_normal((m, n_all)).astype(np.float32)
    block = rng.standard_normal((m, n)).astype(np.float32)
    dst = device.to_device(full, stream=s)
    src = device.to_device(block, stream=s)
    before = device.counters().dtod_bytes
    device.copy_2d(dst, src, width=n * 4, height=m, dst_pitch=n_all * 4, src_pitch=n * 4,
                   dst_offset=n0 * 4, stream=s)  # fmt: skip
    expected = full.copy()
    expected[:, n0 : n0 + n] = block
    assert np.array_equal(dst.to_host(stream=s), expected)  # the other columns are untouched
    assert device.counters().dtod_bytes - before == m * n * 4


def test_a_captured_2d_copy_replays_and_is_counted_per_replay(device: Device) -> None:
    s = device.create_stream(name="copy2d")
    src = device.to_device(np.arange(12, dtype=np.float32).reshape(3, 4), stream=s)
    dst = device.alloc((3, 8), np.float32, stream=s)
    device.fill(dst, 0, stream=s)
    with device.capture(stream=s) as cap:
        device.copy_2d(dst, src, width=16, height=3, dst_pitch=32, src_pitch=16,
                       dst_offset=16, stream=s)  # fmt: skip
    assert not dst.to_host(stream=s).any()  # recorded, not run
    before = device.counters().dtod_bytes
    cap.graph.launch(stream=s)
    cap.graph.launch(stream=s)
    got = dst.to_host(stream=s)
    assert np.array_equal(got[:, 4:], np.arange(12, dtype=np.float32).reshape(3, 4))
    assert not got[:, :4].any()
    assert device.counters().dtod_bytes - before == 2 * 48
    cap.graph.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(width=20, height=2, dst_pitch=16, src_pitch=32), "wider than"),
        (dict(width=16, height=5, dst_pitch=16, src_pitch=16), "runs past the end"),
        (dict(width=16, height=2, dst_pitch=16, src_pitch=16, dst_offset=-4), "integer >= 0"),
        (dict(width=16, height=2.0, dst_pitch=16, src_pitch=16), "integer >= 0"),
    ],
)
def test_bad_2d_copies_are_refused_with_the_numbers(
    device: Device, kwargs: dict, match: str
) -> None:
    s = device.default_stream
    a = device.alloc(64, np.uint8, stream=s)
    b = device.alloc(64, np.uint8, stream=s)
    with pytest.raises(DeviceError, match=match):
        device.copy_2d(b, a, stream=s, **kwargs)


def test_overlapping_spans_in_one_allocation_are_refused(device: Device) -> None:
    s = device.default_stream
    root = device.alloc(256, np.uint8, stream=s)
    with pytest.raises(DeviceError, match="overlap"):
        device.copy_2d(root.view(offset=32), root.view(), width=16, height=4, dst_pitch=32,
                       src_pitch=32, stream=s)  # fmt: skip
