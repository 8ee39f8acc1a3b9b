"""Device.fill_2d: rows of bytes at a pitch set to one value (a cache's slots of every sequence
zeroed in one call)."""

from __future__ import annotations

import numpy as np
import pytest

from ep.device import Device
from ep.errors import DeviceError


def test_rows_at_a_pitch_are_set_and_nothing_else(device: Device) -> None:
    s = device.default_stream
    rng = np.random.default_rng()
    data = rng.integers(1, 255, size=(6, 40), dtype=np.uint8)
    buf = device.to_device(data, stream=s)
    device.fill_2d(buf, 0, width=7, height=5, pitch=40, offset=40 + 3, stream=s)
    want = data.copy()
    want[1:6, 3:10] = 0
    assert np.array_equal(buf.to_host(stream=s), want)
    device.fill_2d(buf.view(offset=8), 0xAB, width=5, height=1, pitch=0, stream=s)  # one row
    want.reshape(-1)[8:13] = 0xAB
    assert np.array_equal(buf.to_host(stream=s), want)


def test_a_captured_2d_fill_replays(device: Device) -> None:
    s = device.create_stream(name="fill2d")
    buf = device.to_device(np.full((3, 8), 7, np.uint16), stream=s)
    with device.capture(stream=s) as cap:
        device.fill_2d(buf, 0, width=4, height=3, pitch=16, offset=8, stream=s)
    assert (buf.to_host(stream=s) == 7).all()  # recorded, not run
    cap.graph.launch(stream=s)
    got = buf.to_host(stream=s)
    assert not got[:, 4:6].any() and (got[:, :4] == 7).all() and (got[:, 6:] == 7).all()
    assert cap.graph.check().ok and buf.name in {b.name for b in cap.graph._bound}
    cap.graph.close()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(byte=0, width=20, height=2, pitch=16), "wider than pitch"),
        (dict(byte=0, width=16, height=5, pitch=16), "runs past the end"),
        (dict(byte=0, width=16, height=2, pitch=16, offset=-4), "integer >= 0"),
        (dict(byte=256, width=16, height=2, pitch=16), "expected 0 to 255"),
        (dict(byte=0, width=16, height=2.0, pitch=16), "integer >= 0"),
    ],
)
def test_bad_2d_fills_are_refused_with_the_numbers(
    device: Device, kwargs: dict, match: str
) -> None:
    s = device.default_stream
    buf = device.alloc(64, np.uint8, stream=s)
    sizes = {k: v for k, v in kwargs.items() if k != "byte"}  # the parameters are shared
    with pytest.raises(DeviceError, match=match):
        device.fill_2d(buf, kwargs["byte"], stream=s, **sizes)
