"""The CPU device: NumPy memory, synchronous streams, and graphs as recorded lists of calls.

It keeps the CUDA device's contract so every policy runs in CI: work queued inside a capture is
recorded, not run; a recording bakes in the buffers it touched (as a CUDA graph bakes in
addresses), so replaying it after a buffer was replaced still writes the old one, and
`Graph.check` reports the change.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ep.device._base import (
    Buffer,
    Device,
    Dim3,
    Event,
    Graph,
    Kernel,
    KernelArg,
    Stream,
    _Pointer,
    _Recording,
)
from ep.device._kernels import KERNELS, KernelRegistry, KernelReport, KernelSource
from ep.errors import DeviceError

__all__ = ["CPUDevice"]

_DEVICE_ALIGN = 256  # what cudaMalloc guarantees; kept so alignment bugs show up on the CPU too
_PINNED_ALIGN = 4096


def _aligned_bytes(nbytes: int, align: int) -> tuple[np.ndarray, int]:
    """A uint8 array of ``nbytes`` whose data pointer is a multiple of ``align``."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    array = raw[start : start + nbytes]
    return array, int(array.ctypes.data)


class CPUDevice(Device):
    """The reference device: everything runs at once on the host, in NumPy."""

    kind = "cpu"

    def __init__(self) -> None:
        super().__init__("cpu", None)

    # -- memory --

    def _alloc(self, nbytes: int, stream: Stream) -> tuple[Any, int, np.ndarray | None]:
        array, ptr = _aligned_bytes(nbytes, _DEVICE_ALIGN)
        return array, ptr, array

    def _free(self, native: Any) -> None:
        pass  # NumPy frees the array when the last view of it goes

    def _alloc_pinned(self, nbytes: int, stream: Stream) -> tuple[Any, int, np.ndarray | None]:
        array, ptr = _aligned_bytes(nbytes, _PINNED_ALIGN)
        return array, ptr, array

    def _free_pinned(self, native: Any) -> None:
        pass

    def _reserve(self, reserved: int, stream: Stream) -> tuple[Any, int, np.ndarray | None]:
        # One array for the whole reservation: its data pointer never changes, as on CUDA.
        # np.empty does not touch the pages, so unused reservation costs no resident memory.
        array, ptr = _aligned_bytes(reserved, _PINNED_ALIGN)
        return array, ptr, array

    def _map(self, native: Any, mapped: int, new_mapped: int, stream: Stream) -> None:
        pass  # the reservation is already addressable; the base class counts mapped bytes

    def _unreserve(self, native: Any) -> None:
        pass

    # -- work: run now, or append to the open recording --

    def _submit(self, stream: Stream, call: Callable[[], None]) -> None:
        recording = stream._recording
        if recording is not None:
            recording.native.append(call)
        else:
            call()

    def _copy(
        self,
        dst: Buffer,
        dst_offset: int,
        src: Buffer,
        src_offset: int,
        nbytes: int,
        stream: Stream,
    ) -> None:
        # Views are taken now, so a recording holds the very memory it was captured with.
        target = dst._bytes()[dst_offset : dst_offset + nbytes]
        source = src._bytes()[src_offset : src_offset + nbytes]
        self._submit(stream, functools.partial(np.copyto, target, source))

    def _fill_2d(
        self,
        buffer: Buffer,
        offset: int,
        byte: int,
        width: int,
        height: int,
        pitch: int,
        stream: Stream,
    ) -> None:
        raw = buffer._bytes()[offset : offset + (height - 1) * pitch + width]
        rows = np.lib.stride_tricks.as_strided(raw, (height, width), (pitch, 1))
        self._submit(stream, functools.partial(np.copyto, rows, np.uint8(byte)))

    def _copy_2d(
        self,
        dst: Buffer,
        dst_offset: int,
        src: Buffer,
        src_offset: int,
        width: int,
        height: int,
        dst_pitch: int,
        src_pitch: int,
        stream: Stream,
    ) -> None:
        def rows(buffer: Buffer, offset: int, pitch: int) -> np.ndarray:
            raw = buffer._bytes()[offset : offset + (height - 1) * pitch + width]
            return np.lib.stride_tricks.as_strided(raw, (height, width), (pitch, 1))

        # Views taken now, as in `_copy`: a recording holds the memory it was captured with.
        target = rows(dst, dst_offset, dst_pitch)
        source = rows(src, src_offset, src_pitch)
        self._submit(stream, functools.partial(np.copyto, target, source))

    def _upload(self, dst: Buffer, data: np.ndarray, stream: Stream) -> None:
        dst._bytes()[:] = data.reshape(-1).view(np.uint8)

    def _download(self, out: np.ndarray, src: Buffer, stream: Stream) -> None:
        out.reshape(-1).view(np.uint8)[:] = src._bytes()

    def _load_kernel(self, source: KernelSource) -> tuple[Any, KernelReport]:
        if source.cpu is None:
            raise DeviceError(
                f"kernel {source.name!r} has no CPU implementation (KernelSource.cpu is None): it "
                "runs only on CUDA; give it a NumPy twin to run it on device='cpu'"
            )
        return source.cpu, KernelReport(source.name, "cpu", 0, "none", 0.0)

    def _resident_blocks(self, kernel: Kernel, threads: int, shared_mem: int) -> int:
        """Any grid: the NumPy twin computes the whole launch at once."""
        return int(self.limits["max_grid"][0])

    def _launch(
        self,
        kernel: Kernel,
        grid: Dim3,
        block: Dim3,
        args: list[KernelArg],
        shared_mem: int,
        stream: Stream,
    ) -> None:
        values: list[Any] = []
        for arg in args:
            if isinstance(arg, _Pointer):
                dtype = arg.dtype if arg.dtype is not None else np.dtype(np.uint8)
                values.append(arg.buffer._bytes().view(dtype))
            else:
                values.append(arg)
        self._submit(stream, functools.partial(kernel._native, *values))

    def compile_all(self, *, registry: KernelRegistry | None = None) -> list[KernelReport]:
        """Mark every registered kernel with a NumPy twin ready; the others are reported."""
        registry = registry if registry is not None else KERNELS
        reports = []
        for source in registry:
            if source.cpu is None:
                reports.append(
                    KernelReport(
                        source.name,
                        "cpu",
                        0,
                        "none",
                        0.0,
                        note="no CPU implementation; runs on CUDA only",
                    )
                )
            else:
                reports.append(self.kernel(source).load())
        return reports

    # -- streams and events: the CPU finishes work before returning --

    def _create_stream(self) -> Any:
        return None

    def _stream_sync(self, stream: Stream) -> None:
        pass

    def _stream_wait(self, stream: Stream, event: Event) -> None:
        pass

    def _create_event(self, timing: bool) -> Any:
        return [0]  # the time it was recorded, in ns

    def _event_record(self, event: Event, stream: Stream) -> None:
        event._native[0] = time.perf_counter_ns()

    def _event_sync(self, event: Event) -> None:
        pass

    def _event_done(self, event: Event) -> bool:
        return True

    def _event_elapsed_ms(self, start: Event, end: Event) -> float:
        return float(end._native[0] - start._native[0]) / 1e6

    def _synchronize(self) -> None:
        pass

    # -- capture --

    def _begin_capture(self, stream: Stream, recording: _Recording) -> None:
        recording.native = []

    def _end_capture(self, stream: Stream, recording: _Recording) -> Any:
        return tuple(recording.native)

    def _abort_capture(self, stream: Stream, recording: _Recording) -> None:
        recording.native = None

    def _graph_launch(self, graph: Graph, stream: Stream) -> None:
        for call in graph._native:
            call()

    def _graph_close(self, graph: Graph) -> None:
        graph._native = ()
