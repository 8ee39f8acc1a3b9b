"""The device contract, run on the CPU here and on the GPU where there is one (``-m cuda``)."""

from __future__ import annotations

import gc

import ml_dtypes
import numpy as np
import pytest

from ep.device import (
    Buffer,
    Device,
    GrowableBuffer,
    KernelRegistry,
    KernelSource,
    PinnedBuffer,
    Stream,
    binding_signature,
)
from ep.errors import DeviceError

BF16 = np.dtype(ml_dtypes.bfloat16)


def _random_f32(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.standard_normal(n).astype(np.float32)


def _step_reference(x: np.ndarray) -> np.ndarray:
    """NumPy's answer for `_step` (bitwise: axpy_f32 is built without FMA)."""
    y = np.ones_like(x)
    for _ in range(3):
        y = np.float32(0.5) * x + y
    return y


# --- memory ----------------------------------------------------------------------------------


def test_alloc_reports_shape_dtype_and_counts_bytes(device: Device) -> None:
    s = device.default_stream
    gc.collect()  # buffers of earlier tests in reference cycles must not be freed mid-test
    before = device.counters().allocated_bytes
    buf = device.alloc((3, 5), np.float32, stream=s, name="a")
    assert (buf.shape, buf.dtype, buf.nbytes, buf.size) == ((3, 5), np.float32, 60, 15)
    assert buf.ptr != 0 and buf.ptr % 256 == 0
    assert buf.location == "device"
    assert device.counters().allocated_bytes == before + 60
    buf.free()
    assert buf.closed
    assert device.counters().allocated_bytes == before
    with pytest.raises(DeviceError, match="was freed"):
        buf.to_host(stream=s)


def test_upload_download_round_trip_is_byte_exact(device: Device, rng: np.random.Generator) -> None:
    s = device.default_stream
    for array in (
        _random_f32(rng, 1000).reshape(10, 100),
        rng.integers(0, 256, 4097, dtype=np.uint8),
        _random_f32(rng, 333).astype(BF16),
        rng.integers(-(2**62), 2**62, 17, dtype=np.int64),
    ):
        buf = device.to_device(array, stream=s)
        back = buf.to_host(stream=s)
        assert back.dtype == array.dtype and back.shape == array.shape
        assert back.tobytes() == array.tobytes()


def test_upload_rejects_mismatched_array_and_keeps_contents(device: Device) -> None:
    s = device.default_stream
    buf = device.to_device(np.arange(4, dtype=np.float32), stream=s)
    with pytest.raises(DeviceError, match=r"array is float64\[4\], buffer is float32\[4\]"):
        buf.copy_from_host(np.zeros(4), stream=s)
    with pytest.raises(DeviceError, match="reshape"):
        buf.copy_from_host(np.zeros((2, 2), dtype=np.float32), stream=s)
    np.testing.assert_array_equal(buf.to_host(stream=s), np.arange(4, dtype=np.float32))


def test_copies_between_pinned_and_device_are_byte_exact(
    device: Device, rng: np.random.Generator
) -> None:
    s = device.default_stream
    n = 1 << 20
    data = rng.integers(0, 256, n, dtype=np.uint8)
    host_in = device.alloc_pinned(n, np.uint8, stream=s, name="host_in")
    host_out = device.alloc_pinned(n, np.uint8, stream=s, name="host_out")
    assert isinstance(host_in, PinnedBuffer) and host_in.location == "host"
    host_in.array[:] = data
    host_out.array[:] = 0xAB  # poison
    a = device.alloc(n, np.uint8, stream=s, name="a")
    b = device.alloc(n, np.uint8, stream=s, name="b")
    before = device.counters()

    device.copy(a, host_in, stream=s)  # H2D, all of it
    device.copy(b, a, stream=s, nbytes=n - 100, dst_offset=100)  # D2D, shifted
    device.copy(b, a, stream=s, nbytes=100, src_offset=n - 100)  # D2D, the tail to the head
    device.copy(host_out, b, stream=s)  # D2H
    s.sync()

    expected = np.concatenate([data[n - 100 :], data[: n - 100]])
    assert host_out.array.tobytes() == expected.tobytes()
    after = device.counters()
    assert after.htod_bytes - before.htod_bytes == n
    assert after.dtod_bytes - before.dtod_bytes == n
    assert after.dtoh_bytes - before.dtoh_bytes == n


def test_bad_copies_are_refused_without_side_effects(device: Device) -> None:
    s = device.default_stream
    a = device.to_device(np.arange(16, dtype=np.uint8), stream=s, name="a")
    b = device.to_device(np.zeros(8, dtype=np.uint8), stream=s, name="b")
    before = device.counters()
    with pytest.raises(DeviceError, match="runs past the end of 'b'"):
        device.copy(b, a, stream=s)
    with pytest.raises(DeviceError, match="non-negative"):
        device.copy(b, a, stream=s, nbytes=4, src_offset=-1)
    with pytest.raises(DeviceError, match="overlap"):
        device.copy(a, a, stream=s, nbytes=8, src_offset=4)
    with pytest.raises(DeviceError, match="overlap"):
        device.copy(a.view(offset=2), a.view(offset=0), stream=s, nbytes=4)
    with pytest.raises(DeviceError, match="must be a Buffer"):
        device.copy(b, np.zeros(8, np.uint8), stream=s)  # type: ignore[arg-type]
    assert device.counters() == before
    device.copy(a, a, stream=s, nbytes=4, src_offset=8)  # disjoint ranges of one buffer are fine
    assert b.to_host(stream=s).tolist() == [0] * 8
    assert a.to_host(stream=s).tolist()[:4] == [8, 9, 10, 11]


def test_views_share_memory_and_check_bounds(device: Device) -> None:
    s = device.default_stream
    buf = device.to_device(np.arange(8, dtype=np.float32), stream=s, name="v")
    tail = buf.view(offset=16)
    assert tail.shape == (4,) and tail.ptr == buf.ptr + 16 and tail.root is buf
    device.fill(tail, -1.0, stream=s)
    assert buf.to_host(stream=s).tolist() == [0, 1, 2, 3, -1, -1, -1, -1]
    assert buf.view(np.uint32, (8,)).dtype == np.uint32
    with pytest.raises(DeviceError, match="multiple of the element size 4"):
        buf.view(offset=2)
    with pytest.raises(DeviceError, match="has 32"):
        buf.view(shape=(9,))
    with pytest.raises(DeviceError, match="free its root"):
        tail.free()


def test_fill_every_element_size(device: Device) -> None:
    s = device.default_stream
    for dtype, value in ((np.float32, 2.5), (BF16, -3.0), (np.int64, -(2**40)), (np.uint8, 7)):
        buf = device.alloc(1001, dtype, stream=s)
        device.fill(buf, value, stream=s)
        got = buf.to_host(stream=s)
        assert got.tobytes() == np.full(1001, value, dtype=dtype).tobytes(), dtype
    small = device.alloc(4, np.uint8, stream=s)
    with pytest.raises(DeviceError, match="not representable in uint8"):
        device.fill(small, 300, stream=s)


def test_growable_keeps_address_and_contents_while_growing(
    device: Device, rng: np.random.Generator
) -> None:
    s = device.default_stream
    gc.collect()
    before = device.counters()
    grow = device.alloc_growable((250_000,), np.float32, max_nbytes=64 << 20, stream=s, name="kv")
    assert isinstance(grow, GrowableBuffer)
    address = grow.ptr
    assert grow.reserved_bytes == 64 << 20
    assert grow.mapped_bytes == device.granule and grow.mapped_bytes % (2 << 20) == 0
    first = _random_f32(rng, 250_000)
    grow.copy_from_host(first, stream=s)

    grow.grow((1_500_000,), stream=s)  # 6 MB: several granules
    assert grow.ptr == address
    assert grow.shape == (1_500_000,) and grow.nbytes == 6_000_000
    assert grow.mapped_bytes >= 6_000_000 and grow.mapped_bytes % device.granule == 0
    device.fill(grow.view(offset=first.nbytes), 4.0, stream=s)  # the new part is usable
    got = grow.to_host(stream=s)
    assert got[:250_000].tobytes() == first.tobytes()
    assert np.all(got[250_000:] == 4.0)

    mid = device.counters()
    assert mid.reserved_bytes - before.reserved_bytes == 64 << 20
    assert mid.allocated_bytes - before.allocated_bytes == grow.mapped_bytes
    with pytest.raises(DeviceError, match="max_nbytes"):
        grow.grow((17 << 20,), stream=s)
    with pytest.raises(DeviceError, match="would shrink"):
        grow.grow((10,), stream=s)
    assert grow.shape == (1_500_000,) and grow.ptr == address
    assert device.counters() == mid
    grow.free()
    after = device.counters()
    assert after.reserved_bytes == before.reserved_bytes
    assert after.allocated_bytes == before.allocated_bytes


def test_events_measure_time(device: Device) -> None:
    s = device.default_stream
    start, end = device.create_event(timing=True), device.create_event(timing=True)
    s.record(start)
    buf = device.alloc(1 << 16, np.float32, stream=s)
    device.fill(buf, 1.0, stream=s)
    s.record(end)
    other = device.create_stream(name="other")
    other.wait(end)
    other.sync()
    assert end.done
    assert end.elapsed_ms(start) >= 0.0
    with pytest.raises(DeviceError, match="timing=True"):
        end.elapsed_ms(device.create_event())


# --- kernels ---------------------------------------------------------------------------------


def test_axpy_matches_numpy_bitwise(device: Device, rng: np.random.Generator) -> None:
    s = device.default_stream
    n = 100_003
    x, y = _random_f32(rng, n), _random_f32(rng, n)
    xb, yb = device.to_device(x, stream=s), device.to_device(y, stream=s)
    before = device.counters().launches
    device.kernel("axpy_f32").launch(64, 256, yb, xb, 1.7, n, stream=s)
    expected = np.float32(1.7) * x + y
    assert yb.to_host(stream=s).tobytes() == expected.tobytes()
    assert device.counters().launches == before + 1


def test_launch_arguments_are_checked(device: Device) -> None:
    s = device.default_stream
    axpy = device.kernel("axpy_f32")
    y = device.alloc(8, np.float32, stream=s, name="y")
    x16 = device.alloc(8, np.float16, stream=s, name="x16")
    with pytest.raises(DeviceError, match="takes 4 arguments, got 3"):
        axpy.launch(1, 32, y, y, 1.0, stream=s)
    with pytest.raises(DeviceError, match="'x16' has dtype float16, expected float32"):
        axpy.launch(1, 32, y, x16, 1.0, 8, stream=s)
    with pytest.raises(DeviceError, match="expected a Buffer"):
        axpy.launch(1, 32, y, 0, 1.0, 8, stream=s)
    with pytest.raises(DeviceError, match="not an integer in the range of uint64"):
        axpy.launch(1, 32, y, y, 1.0, -1, stream=s)
    with pytest.raises(DeviceError, match="not an integer"):
        axpy.launch(1, 32, y, y, 1.0, 8.0, stream=s)
    with pytest.raises(DeviceError, match="allows 1024 per block"):
        axpy.launch(1, (64, 32), y, y, 1.0, 8, stream=s)
    with pytest.raises(DeviceError, match="positive"):
        axpy.launch(0, 32, y, y, 1.0, 8, stream=s)
    with pytest.raises(DeviceError, match="shared_mem"):
        axpy.launch(1, 32, y, y, 1.0, 8, stream=s, shared_mem=1 << 30)


def _copy_cpu(out: np.ndarray, inp: np.ndarray, n: np.uint64) -> None:
    out[: int(n)] = inp[: int(n)]


_SHARED_COPY = KernelSource(
    name="test_copy_through_shared_f32",
    source="""
extern "C" __global__ void test_copy_through_shared_f32(float* out, const float* in,
                                                        unsigned long long n) {
    extern __shared__ float tile[];
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) tile[threadIdx.x] = in[i];
    __syncthreads();
    if (i < n) out[i] = tile[threadIdx.x];
}
""",
    params=("f32*", "f32*", "u64"),
    cpu=_copy_cpu,
)


def test_kernel_with_more_than_48k_dynamic_shared_memory(
    device: Device, rng: np.random.Generator
) -> None:
    s = device.default_stream
    n = 10_000
    data = _random_f32(rng, n)
    src = device.to_device(data, stream=s)
    dst = device.alloc(n, np.float32, stream=s)
    device.fill(dst, np.nan, stream=s)
    kernel = device.kernel(_SHARED_COPY)
    kernel.launch(-(-n // 256), 256, dst, src, n, stream=s, shared_mem=64 * 1024)
    assert dst.to_host(stream=s).tobytes() == data.tobytes()


def _rotate_cpu(out: np.ndarray, seen: np.ndarray, counter: np.ndarray, blocks: np.uint32) -> None:
    n = int(blocks)
    out[:n] = np.arange(n)
    seen[:n] = np.roll(np.arange(n), -1)
    counter[0] = n


# Each block writes its index, all meet at a barrier in global memory, then each reads its
# neighbour's: right only if every block of the grid is resident at once (a cooperative launch).
_ROTATE = KernelSource(
    name="test_cooperative_rotate",
    source="""
extern "C" __global__ void test_cooperative_rotate(unsigned* out, unsigned* seen,
                                                   unsigned* counter, unsigned blocks) {
    if (threadIdx.x == 0) {
        out[blockIdx.x] = blockIdx.x;
        __threadfence();
        atomicAdd(counter, 1u);
        while (atomicAdd(counter, 0u) < blocks) __nanosleep(64);
        __threadfence();
        seen[blockIdx.x] = __ldcg(out + (blockIdx.x + 1) % blocks);
    }
}
""",
    params=("u32*", "u32*", "u32*", "u32"),
    cpu=_rotate_cpu,
    cooperative=True,
)


def test_cooperative_kernel_blocks_meet(device: Device, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cooperative kernel's whole grid is resident at once (its blocks wait for each other);
    a grid past what the device holds is refused before anything runs."""
    s = device.default_stream
    kernel = device.kernel(_ROTATE)
    most = kernel.resident_blocks(128)
    assert most >= 1
    blocks = min(most, 256)
    out, seen, counter = (device.alloc(blocks, np.uint32, stream=s) for _ in range(3))
    device.fill(counter, 0, stream=s)
    kernel.launch(blocks, 128, out, seen, counter, blocks, stream=s)
    np.testing.assert_array_equal(seen.to_host(stream=s), np.roll(np.arange(blocks), -1))
    monkeypatch.setattr(kernel, "resident_blocks", lambda block, shared_mem=0: 4)
    device.fill(seen, 7, stream=s)
    with pytest.raises(DeviceError, match=r"cooperative kernel .* 8 blocks, .* at most 4 of 128"):
        kernel.launch(8, 128, out, seen, counter, 8, stream=s)
    assert (seen.to_host(stream=s) == 7).all()


# --- recorded launches ---------------------------------------------------------------------


def test_recorded_launches_replay_the_same_device_work(device: Device) -> None:
    """A block of launches only is replayable: a replay issues its launches again (counted as
    launches), reading the buffers as they are then; the host work before them does not run."""
    s = device.default_stream
    n = 1000
    x = device.to_device(np.arange(n, dtype=np.float32), stream=s)
    y = device.to_device(np.ones(n, np.float32), stream=s)
    axpy = device.kernel("axpy_f32")
    host_work = []
    with device.record_launches() as record:
        host_work.append(1)
        axpy.launch(4, 256, y, x, 0.5, n, stream=s)
        axpy.launch(4, 256, y, x, 0.25, n, stream=s)
    assert record.replayable and len(record.launches) == 2
    before = device.counters().launches
    x.copy_from_host(np.full(n, 2.0, np.float32), stream=s)
    record.replay()
    assert device.counters().launches == before + 2 and host_work == [1]
    want = np.float32(1.0) + np.float32(0.5) * np.arange(n, dtype=np.float32)
    want = want + np.float32(0.25) * np.arange(n, dtype=np.float32)
    want = want + np.float32(0.5) * np.float32(2.0) + np.float32(0.25) * np.float32(2.0)
    np.testing.assert_array_equal(y.to_host(stream=s), want)


@pytest.mark.parametrize("other", ["fill_2d", "copy", "alloc", "sync", "event"])
def test_a_block_doing_more_than_launches_is_not_replayable(device: Device, other: str) -> None:
    s = device.default_stream
    y = device.alloc(64, np.float32, stream=s)
    device.fill(y, 0.0, stream=s)
    with device.record_launches() as record:
        device.kernel("axpy_f32").launch(1, 64, y, y, 1.0, 64, stream=s)
        if other == "fill_2d":
            device.fill_2d(y, 0, width=16, height=2, pitch=64, stream=s)
        elif other == "copy":
            y.copy_from_host(np.zeros(64, np.float32), stream=s)
        elif other == "alloc":
            device.alloc(8, np.float32, stream=s)
        elif other == "sync":
            s.sync()
        else:
            s.record()
    assert not record.replayable


def test_a_fill_is_a_launch_and_replays_as_one(device: Device) -> None:
    s = device.default_stream
    y = device.alloc(64, np.float32, stream=s)
    with device.record_launches() as record:
        device.fill(y, 2.5, stream=s)
    assert record.replayable
    y.copy_from_host(np.zeros(64, np.float32), stream=s)
    record.replay()
    np.testing.assert_array_equal(y.to_host(stream=s), np.full(64, 2.5, np.float32))


def test_recorded_launches_replay_into_a_capture_and_refuse_freed_buffers(device: Device) -> None:
    s = device.default_stream
    n = 256
    x = device.to_device(np.ones(n, np.float32), stream=s)
    y = device.to_device(np.zeros(n, np.float32), stream=s)
    with device.record_launches() as record:
        device.kernel("axpy_f32").launch(1, 256, y, x, 3.0, n, stream=s)
    with device.capture(stream=s) as cap:
        record.replay()
    assert cap.graph.launches == 1
    cap.graph.launch(stream=s)
    np.testing.assert_array_equal(y.to_host(stream=s), np.full(n, 6.0, np.float32))
    cap.graph.close()
    with (
        pytest.raises(DeviceError, match="already open"),
        device.record_launches(),
        device.record_launches(),
    ):
        pass
    x.free()
    with pytest.raises(DeviceError, match=r"closed|freed"):
        record.replay()
    np.testing.assert_array_equal(y.to_host(stream=s), np.full(n, 6.0, np.float32))


# --- capture ---------------------------------------------------------------------------------


def _step(device: Device, y: Buffer, x: Buffer, z: Buffer, *, stream: Stream) -> None:
    """The work under test: y = 1; y = 0.5*x + y, three times; z = y."""
    axpy = device.kernel("axpy_f32")
    device.fill(y, 1.0, stream=stream)
    for _ in range(3):
        axpy.launch(8, 128, y, x, 0.5, y.size, stream=stream)
    device.copy(z, y, stream=stream)


def test_graph_replay_matches_eager(device: Device, rng: np.random.Generator) -> None:
    s = device.default_stream
    n = 4099
    x_host = _random_f32(rng, n)
    x = device.to_device(x_host, stream=s, name="x")
    ye, ze = device.alloc(n, np.float32, stream=s), device.alloc(n, np.float32, stream=s)
    _step(device, ye, x, ze, stream=s)
    eager = ze.to_host(stream=s)
    assert eager.tobytes() == _step_reference(x_host).tobytes()

    y = device.alloc(n, np.float32, stream=s, name="y")
    z = device.alloc(n, np.float32, stream=s, name="z")
    device.fill(y, -7.0, stream=s)
    device.fill(z, -7.0, stream=s)
    before = device.counters()
    with device.capture(stream=s) as cap:
        assert s.capturing
        _step(device, y, x, z, stream=s)
    assert not s.capturing
    # Recording runs nothing, and counts nothing until the graph runs.
    assert np.all(z.to_host(stream=s) == -7.0) and np.all(y.to_host(stream=s) == -7.0)
    recorded = device.counters()
    assert (recorded.launches, recorded.dtod_bytes) == (before.launches, before.dtod_bytes)
    assert recorded.captures == before.captures + 1

    graph = cap.graph
    assert graph.launches == 4 and graph.copied["dtod_bytes"] == 4 * n
    assert [b[0] for b in graph.signature.bindings] == ["x", "y", "z"]
    for _ in range(2):
        device.fill(z, -7.0, stream=s)  # poison between replays
        graph.launch(stream=s)
        assert z.to_host(stream=s).tobytes() == eager.tobytes()
    after = device.counters()
    assert after.graph_launches == recorded.graph_launches + 2
    assert after.dtod_bytes - recorded.dtod_bytes == 2 * 4 * n


def test_replaced_buffer_is_detected_and_graph_keeps_old_binding(
    device: Device, rng: np.random.Generator
) -> None:
    s = device.default_stream
    n = 512
    x_host = _random_f32(rng, n)
    x = device.to_device(x_host, stream=s, name="x")
    y = device.alloc(n, np.float32, stream=s, name="y")
    z = device.alloc(n, np.float32, stream=s, name="z")
    with device.capture(stream=s) as cap:
        _step(device, y, x, z, stream=s)
    graph = cap.graph
    assert graph.check()
    assert graph.check(binding_signature([x, y, z]))

    z_new = device.alloc(n, np.float32, stream=s, name="z")  # the step now wants a new z
    device.fill(z_new, -7.0, stream=s)
    verdict = graph.check(binding_signature([x, y, z_new]))
    assert not verdict and not verdict.address_stable
    assert len(verdict.differences) == 1 and verdict.differences[0].startswith("z: address")
    verdict = graph.check(binding_signature([x, y]))
    assert not verdict and "z: no longer bound" in verdict.reason

    # The recording baked in the old z, on every device: replay writes z, not z_new.
    graph.launch(stream=s)
    assert np.all(z_new.to_host(stream=s) == -7.0)
    assert z.to_host(stream=s).tobytes() == _step_reference(x_host).tobytes()

    z.free()
    verdict = graph.check()
    assert not verdict and "z: freed" in verdict.reason
    with pytest.raises(DeviceError, match="z were freed"):
        graph.launch(stream=s)


def test_growth_of_a_bound_buffer_keeps_address(device: Device) -> None:
    s = device.default_stream
    kv = device.alloc_growable((1024,), np.float32, max_nbytes=8 << 20, stream=s, name="kv")
    with device.capture(stream=s) as cap:
        device.fill(kv, 3.0, stream=s)
    kv.grow((300_000,), stream=s)
    verdict = cap.graph.check()
    assert not verdict and verdict.address_stable
    assert "same address" in verdict.reason
    device.fill(kv, 0.0, stream=s)
    cap.graph.launch(stream=s)  # still valid memory: writes the first 1024 elements
    got = kv.to_host(stream=s)
    assert np.all(got[:1024] == 3.0) and np.all(got[1024:] == 0.0)


def test_capture_forbids_allocation_sync_and_pageable_copies(device: Device) -> None:
    s = device.default_stream
    buf = device.alloc(16, np.float32, stream=s)
    outside = s.record()
    for forbidden, pattern in (
        (lambda: device.alloc(4, np.float32, stream=s), "allocate"),
        (lambda: s.sync(), "synchronise"),
        (lambda: buf.copy_from_host(np.zeros(16, np.float32), stream=s), "pageable"),
        (lambda: s.wait(outside), "isolation"),
    ):
        with pytest.raises(DeviceError, match=pattern), device.capture(stream=s):
            device.fill(buf, 1.0, stream=s)
            forbidden()
        assert not s.capturing
    # The stream works eagerly after the failed captures, and nothing was left half-recorded.
    device.fill(buf, 2.0, stream=s)
    assert np.all(buf.to_host(stream=s) == 2.0)


def test_capture_needs_kernels_compiled_first(device: Device) -> None:
    s = device.default_stream
    registry = KernelRegistry()
    late = registry.register(
        KernelSource(
            name="test_late_scale_f32",
            source='extern "C" __global__ void test_late_scale_f32(float* y, float a) '
            "{ y[threadIdx.x] *= a; }",
            params=("f32*", "f32"),
            cpu=lambda y, a: y.__imul__(a),
        )
    )
    y = device.alloc(32, np.float32, stream=s)
    kernel = device.kernel(late)
    assert not kernel.loaded
    with pytest.raises(DeviceError, match="compile_all"), device.capture(stream=s):
        kernel.launch(1, 32, y, 2.0, stream=s)
    with (
        pytest.raises(DeviceError, match=r"resident blocks .*compile_all"),
        device.capture(stream=s),
    ):
        kernel.resident_blocks(32)
    device.compile_all(registry=registry)
    assert kernel.loaded
    device.fill(y, 1.5, stream=s)
    with device.capture(stream=s) as cap:
        kernel.launch(1, 32, y, 2.0, stream=s)
    cap.graph.launch(stream=s)
    assert np.all(y.to_host(stream=s) == 3.0)


def test_buffer_dropped_during_capture_is_freed_after_it(device: Device) -> None:
    s = device.default_stream
    gc.collect()
    bound = device.alloc(64, np.float32, stream=s)
    temp = device.alloc(1 << 16, np.uint8, stream=s)
    before = device.counters().allocated_bytes
    with device.capture(stream=s) as cap:
        device.fill(bound, 1.0, stream=s)
        del temp
        gc.collect()
        # Freeing now would put a free into the graph (CUDA); it waits for the capture's end.
        assert device.counters().allocated_bytes == before
    assert device.counters().allocated_bytes == before - (1 << 16)
    cap.graph.launch(stream=s)
    assert np.all(bound.to_host(stream=s) == 1.0)


def test_duplicate_names_in_one_graph_are_refused(device: Device) -> None:
    s = device.default_stream
    a = device.alloc(8, np.float32, stream=s, name="same")
    b = device.alloc(8, np.float32, stream=s, name="same")
    with pytest.raises(DeviceError, match="distinct names"), device.capture(stream=s):
        device.copy(a, b, stream=s)
    assert not s.capturing


def test_a_stream_forked_into_a_capture_replays_its_work_in_order(device: Device) -> None:
    """Fork (a stream waits on an event recorded in the capture) and join (the capturing stream
    waits on an event recorded on the fork): the graph holds both streams' work, in order."""
    s, c = device.default_stream, device.create_stream(name="side")
    a, b, d = (device.alloc(64, np.float32, stream=s, name=n) for n in ("a", "b", "d"))
    before = device.counters()
    with device.capture(stream=s) as cap:
        device.fill(b, -1.0, stream=s)
        c.wait(s.record())  # fork: c joins the capture
        assert c.capturing
        device.copy(b, a, stream=c)
        s.wait(c.record())  # join
        device.copy(d, b, stream=s)
    assert not c.capturing and not s.capturing
    for value in (3.0, 7.0):
        device.fill(a, value, stream=s)
        cap.graph.launch(stream=s)
        assert np.all(d.to_host(stream=s) == value)
    # the fork's copy counts once a replay, like the capturing stream's
    assert device.counters().dtod_bytes - before.dtod_bytes == 2 * 2 * a.nbytes
    device.copy(b, d, stream=c)  # the side stream works eagerly again
    c.sync()


def test_an_unjoined_fork_fails_the_capture_and_leaves_no_stream_capturing(device: Device) -> None:
    s, c = device.default_stream, device.create_stream(name="side")
    a, b = (device.alloc(16, np.float32, stream=s, name=n) for n in ("a", "b"))
    with pytest.raises(DeviceError, match="not joined"), device.capture(stream=s):
        c.wait(s.record())
        device.copy(b, a, stream=c)
        joined = c.record()
        s.wait(joined)
        device.copy(a, b, stream=c)  # more work on the fork after the join: not waited for
    assert not s.capturing and not c.capturing
    with pytest.raises(DeviceError, match="has ended"):
        s.wait(joined)  # an event of a finished capture marks no stream
    device.copy(b, a, stream=c)
    c.sync()
