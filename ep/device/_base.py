"""The device contract, shared by the CPU (NumPy) and CUDA implementations.

The public methods here do all the bookkeeping (byte counters, bounds, dtype and shape checks,
capture rules) and then call one private hook of the `Device` subclass (``_alloc``, ``_copy``,
``_launch``, …). A subclass that lacks a hook raises an error naming it, so a half-built backend
fails on first use with a sentence, not an AttributeError.

Every call that allocates, copies or launches takes a keyword-only ``stream``. A stream inside
``device.capture(stream=...)`` records instead of running: CUDA captures a graph; the CPU device
keeps the list of calls with the buffers they touch. A recording bakes in buffer addresses, so a
replaced buffer makes it stale, which `Graph.check` reports the same way on both devices.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import ml_dtypes
import numpy as np

from ep.device._kernels import (
    KERNELS,
    KernelRegistry,
    KernelReport,
    KernelSource,
    kernel_target,
    param_dtype,
    skipped_report,
)
from ep.errors import DeviceError
from ep.seams import BindingSignature

__all__ = [
    "Buffer",
    "Capture",
    "Device",
    "DeviceCounters",
    "Event",
    "Graph",
    "GraphCheck",
    "GrowableBuffer",
    "Kernel",
    "PinnedBuffer",
    "Stream",
    "as_dtype",
    "binding_signature",
]

GRANULE = 2 * 1024 * 1024  # VMM mapping granularity on the H200; the CPU mirrors it
Location = Literal["device", "host"]
Dim3 = tuple[int, int, int]


def as_dtype(dtype: Any) -> np.dtype:
    """A NumPy dtype from a dtype, a type or a name (``"bfloat16"`` included)."""
    if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
        return np.dtype(ml_dtypes.bfloat16)
    try:
        return np.dtype(dtype)
    except TypeError as exc:
        raise DeviceError(
            f"{dtype!r} is not a dtype: pass a NumPy dtype or a name like 'float32'"
        ) from exc


def _as_shape(shape: int | Sequence[int]) -> tuple[int, ...]:
    dims = (shape,) if isinstance(shape, int | np.integer) else tuple(shape)
    if not all(isinstance(d, int | np.integer) and d >= 0 for d in dims):
        raise DeviceError(f"shape {shape!r} is not a tuple of non-negative integers")
    return tuple(int(d) for d in dims)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


# --- counters --------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceCounters:
    """A snapshot of what a device has done; bytes copied always equal bytes counted here.

    Work inside a capture is counted when the graph runs, once per replay, not when recorded.
    """

    htod_bytes: int = 0
    dtoh_bytes: int = 0
    dtod_bytes: int = 0
    htoh_bytes: int = 0
    launches: int = 0
    graph_launches: int = 0
    captures: int = 0
    allocated_bytes: int = 0  # device memory in use now (growables: mapped bytes)
    peak_allocated_bytes: int = 0
    pinned_bytes: int = 0  # pinned host memory in use now
    reserved_bytes: int = 0  # address space reserved by growable buffers


class _Ledger:
    """The mutable counters behind `DeviceCounters`."""

    def __init__(self) -> None:
        self.values: dict[str, int] = dict.fromkeys(DeviceCounters.__dataclass_fields__, 0)

    def add(self, name: str, amount: int) -> None:
        self.values[name] += amount
        if name == "allocated_bytes":
            self.values["peak_allocated_bytes"] = max(
                self.values["peak_allocated_bytes"], self.values["allocated_bytes"]
            )

    def snapshot(self) -> DeviceCounters:
        return DeviceCounters(**self.values)


# --- memory ----------------------------------------------------------------------------------


class _Allocation:
    """What a finaliser needs to give one allocation back (never refers to the Buffer)."""

    def __init__(self, kind: str, native: Any, nbytes: int, reserved: int = 0) -> None:
        self.kind = kind  # "device" | "pinned" | "growable"
        self.native = native
        self.nbytes = nbytes  # device bytes held (growables: bytes mapped so far)
        self.reserved = reserved
        self.released = False


class _Memory:
    """One allocation: its device, base pointer, host view (where the host can read it), life."""

    def __init__(
        self, device: Device, allocation: _Allocation, ptr: int, host: np.ndarray | None
    ) -> None:
        self.device = device
        self.allocation = allocation
        self.ptr = ptr
        self.host = host  # uint8 array over the whole allocation, or None (CUDA device memory)
        self.finalizer = weakref.finalize(self, device._release, allocation)
        self.finalizer.atexit = False  # never call a driver that is shutting down

    @property
    def closed(self) -> bool:
        return self.allocation.released


class Buffer:
    """Memory on a device with a dtype and shape; views share the memory of their root."""

    location: Location = "device"

    def __init__(
        self,
        memory: _Memory,
        *,
        offset: int,
        nbytes: int,
        dtype: np.dtype,
        shape: tuple[int, ...],
        name: str,
        root: Buffer | None = None,
    ) -> None:
        self._memory = memory
        self._offset = offset
        self._nbytes = nbytes
        self._dtype = dtype
        self._shape = shape
        self.name = name
        self._root = root

    def __repr__(self) -> str:
        state = " freed" if self.closed else ""
        return (
            f"<{type(self).__name__} {self.name!r} {self.dtype}{list(self.shape)} "
            f"{self.nbytes} B on {self.device.name}{state}>"
        )

    @property
    def device(self) -> Device:
        return self._memory.device

    @property
    def ptr(self) -> int:
        """The address kernels see (CPU: the NumPy data pointer)."""
        return self._memory.ptr + self._offset

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def dtype(self) -> np.dtype:
        return self._dtype

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def size(self) -> int:
        """Number of elements."""
        return math.prod(self._shape)

    @property
    def root(self) -> Buffer:
        """The buffer that owns the memory (itself unless this is a view)."""
        return self._root if self._root is not None else self

    @property
    def offset(self) -> int:
        """Byte offset from the root's address."""
        return self._offset

    @property
    def closed(self) -> bool:
        return self._memory.closed

    @property
    def binding(self) -> tuple[str, int, tuple[int, ...], str]:
        """``(name, address, shape, dtype)`` as a `BindingSignature` holds it."""
        return (self.name, self.ptr, self.shape, str(self.dtype))

    def _check_open(self, what: str) -> None:
        if self.closed:
            raise DeviceError(f"{what}: buffer {self.name!r} was freed; allocate a new one")

    def _bytes(self) -> np.ndarray:
        """The raw bytes as a host uint8 array (only where the host can read this memory)."""
        self._check_open("reading on the host")
        host = self._memory.host
        if host is None:
            raise DeviceError(
                f"buffer {self.name!r} lives in {self.device.name} device memory, which the host "
                "cannot read: copy it with buffer.to_host(stream=...)"
            )
        return host[self._offset : self._offset + self._nbytes]

    @property
    def array(self) -> np.ndarray:
        """A NumPy view of the memory (CPU device memory and pinned host memory only)."""
        return self._bytes().view(self._dtype).reshape(self._shape)

    def view(
        self,
        dtype: Any = None,
        shape: int | Sequence[int] | None = None,
        *,
        offset: int = 0,
        name: str | None = None,
    ) -> Buffer:
        """A buffer over ``offset`` bytes into this one; it keeps this memory alive.

        Without ``shape`` the view runs to the end of this buffer as a 1-D array.
        """
        self._check_open("view")
        new_dtype = self._dtype if dtype is None else as_dtype(dtype)
        if offset < 0 or offset % new_dtype.itemsize:
            raise DeviceError(
                f"view of {self.name!r} at byte offset {offset}: expected a non-negative multiple "
                f"of the element size {new_dtype.itemsize} (kernels need aligned elements)"
            )
        if shape is None:
            if dtype is None and offset == 0:
                new_shape = self._shape
            else:
                new_shape = ((self._nbytes - offset) // new_dtype.itemsize,)
        else:
            new_shape = _as_shape(shape)
        nbytes = math.prod(new_shape) * new_dtype.itemsize
        if offset + nbytes > self._nbytes:
            raise DeviceError(
                f"view of {self.name!r} needs bytes [{offset}, {offset + nbytes}) but the buffer "
                f"has {self._nbytes}: shrink the view's shape or offset"
            )
        return Buffer(
            self._memory,
            offset=self._offset + offset,
            nbytes=nbytes,
            dtype=new_dtype,
            shape=new_shape,
            name=name or f"{self.name}[{offset}:{offset + nbytes}]",
            root=self.root,
        )

    def free(self) -> None:
        """Give the memory back now (it is also given back when the last reference goes)."""
        if self._root is not None:
            raise DeviceError(
                f"{self.name!r} is a view; free its root buffer {self._root.name!r} instead"
            )
        self.device._free_now(self)

    def to_host(self, *, stream: Stream) -> np.ndarray:
        """A new host array with this buffer's contents (waits for ``stream``)."""
        return self.device.download(self, stream=stream)

    def copy_from_host(self, array: np.ndarray, *, stream: Stream) -> None:
        """Copy a host array of the same dtype and shape into this buffer."""
        self.device.upload(self, array, stream=stream)


class PinnedBuffer(Buffer):
    """Page-locked host memory (CPU device: a plain aligned array); ``array`` always works."""

    location: Location = "host"


class GrowableBuffer(Buffer):
    """Device memory whose address never changes while it grows.

    CUDA reserves ``reserved_bytes`` of address space and maps 2 MiB granules as it grows; the CPU
    device reserves one array and shows a prefix of it. Contents survive growth.
    """

    @property
    def reserved_bytes(self) -> int:
        return self._memory.allocation.reserved

    @property
    def mapped_bytes(self) -> int:
        """Bytes backed by memory now (a multiple of 2 MiB)."""
        return self._memory.allocation.nbytes

    def grow(self, shape: int | Sequence[int], *, stream: Stream) -> None:
        """Show a larger ``shape`` (same dtype) at the same address, mapping memory as needed."""
        self.device._grow(self, _as_shape(shape), stream=stream)


# --- streams and events ----------------------------------------------------------------------


class Stream:
    """An ordered queue of work on one device."""

    def __init__(self, device: Device, native: Any, name: str) -> None:
        self.device = device
        self._native = native
        self.name = name
        self._recording: _Recording | None = None

    def __repr__(self) -> str:
        return f"<Stream {self.name!r} on {self.device.name}>"

    @property
    def capturing(self) -> bool:
        """Whether work on this stream is being recorded into a graph right now."""
        return self._recording is not None

    def sync(self) -> None:
        """Wait until all work queued on this stream has finished."""
        if self._recording is not None:
            raise DeviceError(
                f"cannot synchronise stream {self.name!r} while it is capturing a graph: end the "
                "capture first"
            )
        self.device._note_operation()
        self.device._stream_sync(self)

    def record(self, event: Event | None = None) -> Event:
        """Mark this point of the stream with ``event`` (a new one if None) and return it.

        Inside a capture the event marks a point of the graph: another stream that waits on it
        joins the capture (a fork), and the capturing stream waiting on an event recorded on a
        forked stream joins that branch back (CUDA's cross-stream capture).
        """
        event = event if event is not None else self.device.create_event()
        if event.device is not self.device:
            raise DeviceError(f"event from {event.device.name} recorded on {self.device.name}")
        self.device._note_operation()
        self.device._event_record(event, self)
        event._recorded = True
        recording = self._recording
        event._capture = recording
        event._mark = (self, recording.work.get(self, 0)) if recording is not None else None
        return event

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``."""
        self.device._note_operation()
        if not event._recorded:
            raise DeviceError("waiting on an event that was never recorded: record it first")
        recording, captured = self._recording, event._capture
        if captured is not None and captured.closed:
            raise DeviceError(
                "waiting on an event recorded inside a capture that has ended: it marks a point "
                "of that graph, not of any stream now; record a new event"
            )
        if recording is not None and captured is not recording:
            raise DeviceError(
                f"stream {self.name!r} is capturing and waits on an event recorded outside its "
                "capture, which CUDA refuses (capture isolation): record the event inside the "
                "capture, or wait before it begins"
            )
        if recording is None and captured is not None:  # a fork: this stream joins the capture
            if self in captured.streams:
                raise DeviceError(f"stream {self.name!r} was already forked into this capture")
            captured.streams.append(self)
            self._recording = captured
        self.device._stream_wait(self, event)
        if recording is not None and event._mark is not None:
            source, work = event._mark
            if source is not recording.stream and recording.work.get(source, 0) == work:
                recording.joined.add(source)  # everything queued on that branch is waited for


class Event:
    """A point in a stream; with ``timing`` it measures elapsed device time."""

    def __init__(self, device: Device, native: Any, timing: bool) -> None:
        self.device = device
        self._native = native
        self.timing = timing
        self._recorded = False
        self._capture: _Recording | None = None  # recorded inside this capture
        self._mark: tuple[Stream, int] | None = None  # (stream, its work count) when recorded

    def sync(self) -> None:
        """Wait until the work before this event has finished."""
        if self._recorded:
            self.device._event_sync(self)

    @property
    def done(self) -> bool:
        return not self._recorded or self.device._event_done(self)

    def elapsed_ms(self, start: Event) -> float:
        """Milliseconds from ``start`` to this event (both recorded with ``timing=True``)."""
        if not (self.timing and start.timing):
            raise DeviceError("elapsed time needs two events created with timing=True")
        if not (self._recorded and start._recorded):
            raise DeviceError("elapsed time needs both events recorded on a stream first")
        self.sync()
        return self.device._event_elapsed_ms(start, self)


# --- kernels ---------------------------------------------------------------------------------


class _Pointer:
    """A buffer argument with the element type the kernel declared (None for ``void*``)."""

    __slots__ = ("buffer", "dtype")

    def __init__(self, buffer: Buffer, dtype: np.dtype | None) -> None:
        self.buffer = buffer
        self.dtype = dtype


KernelArg = _Pointer | np.generic


def _as_dim3(value: int | Sequence[int], what: str) -> Dim3:
    dims = (value,) if isinstance(value, int | np.integer) else tuple(value)
    if not 1 <= len(dims) <= 3 or not all(isinstance(d, int | np.integer) and d >= 1 for d in dims):
        raise DeviceError(
            f"{what} {value!r}: expected a positive int or a tuple of 1 to 3 positive ints"
        )
    x, y, z = (*(int(d) for d in dims), 1, 1)[:3]
    return (x, y, z)


class Kernel:
    """A registered kernel bound to one device; `launch` runs it (or records it in a capture)."""

    def __init__(self, device: Device, source: KernelSource) -> None:
        self.device = device
        self.source = source
        self._params = [param_dtype(p) for p in source.params]
        # integer parameters' ranges, looked up once: launches are on the eager step's hot path
        self._ranges = [
            (int(np.iinfo(dt).min), int(np.iinfo(dt).max))
            if dt is not None and not ptr and dt.kind in "iu"
            else None
            for ptr, dt in self._params
        ]
        self._native: Any = None
        self.report: KernelReport | None = None
        self._resident: dict[tuple[int, int], int] = {}

    def __repr__(self) -> str:
        state = "loaded" if self.loaded else "not loaded"
        return f"<Kernel {self.source.signature} on {self.device.name}, {state}>"

    @property
    def name(self) -> str:
        return self.source.name

    @property
    def loaded(self) -> bool:
        return self._native is not None

    def load(self) -> KernelReport:
        """Compile (CUDA: cubin from the cache or NVRTC) and load; a no-op once loaded."""
        if self._native is None:
            self._native, self.report = self.device._load_kernel(self.source)
        assert self.report is not None
        return self.report

    def resident_blocks(self, block: int | Sequence[int], shared_mem: int = 0) -> int:
        """How many blocks of ``block`` threads (and ``shared_mem`` dynamic shared bytes) this
        device holds at once: the largest grid a cooperative launch of this kernel may have."""
        threads = math.prod(_as_dim3(block, f"block of {self.name}"))
        key = (threads, int(shared_mem))
        count = self._resident.get(key)
        if count is None:
            if not self.loaded and self.device._open_captures:
                raise DeviceError(
                    f"kernel {self.name!r} was asked its resident blocks inside a capture before "
                    "it was compiled: call device.compile_all() (or kernel.load()) before capturing"
                )
            self.load()
            count = self._resident[key] = self.device._resident_blocks(self, threads, key[1])
        return count

    def launch(
        self,
        grid: int | Sequence[int],
        block: int | Sequence[int],
        *args: Any,
        stream: Stream,
        shared_mem: int = 0,
    ) -> None:
        """Run on ``grid`` × ``block`` threads; arguments follow `KernelSource.params`.

        Buffers go to pointer parameters (dtype checked); Python numbers are converted to the
        declared scalar type (range checked), so no argument is silently passed at a wrong width.
        """
        device = self.device
        device._check_stream(stream)
        grid3 = _as_dim3(grid, f"grid of {self.name}")
        block3 = _as_dim3(block, f"block of {self.name}")
        limits = device.limits
        if math.prod(block3) > limits["max_threads_per_block"]:
            raise DeviceError(
                f"block {block3} of {self.name} has {math.prod(block3)} threads; this device "
                f"allows {limits['max_threads_per_block']} per block"
            )
        for axis, (count, most) in enumerate(zip(grid3, limits["max_grid"], strict=True)):
            if count > most:
                raise DeviceError(
                    f"grid {grid3} of {self.name}: dimension {'xyz'[axis]} is {count}, at most "
                    f"{most} allowed"
                )
        if not 0 <= shared_mem <= limits["max_shared_mem"]:
            raise DeviceError(
                f"shared_mem={shared_mem} for {self.name}: expected 0 to "
                f"{limits['max_shared_mem']} bytes"
            )
        if self.source.cooperative and math.prod(grid3) > (
            most := self.resident_blocks(block3, shared_mem)
        ):
            raise DeviceError(
                f"cooperative kernel {self.name}: grid {grid3} has {math.prod(grid3)} blocks, but "
                f"{self.device.name} holds at most {most} of {math.prod(block3)} threads at once; "
                "launch fewer blocks"
            )
        converted = self._convert(args)
        if stream._recording is not None and not self.loaded:
            raise DeviceError(
                f"kernel {self.name!r} was launched inside a capture before it was compiled: "
                "call device.compile_all() (or kernel.load()) before capturing"
            )
        self.load()
        launch = _Launch(self, grid3, block3, converted, shared_mem, stream)
        if device._recorder is not None:
            device._recorder.launches.append(launch)
        launch.issue()

    def _convert(self, args: Sequence[Any]) -> list[KernelArg]:
        if len(args) != len(self._params):
            raise DeviceError(
                f"{self.source.signature} takes {len(self._params)} arguments, got {len(args)}"
            )
        # Messages are built only on failure: this runs for every launch of an eager step.
        out: list[KernelArg] = []
        for index, (arg, (is_pointer, dtype), limits) in enumerate(
            zip(args, self._params, self._ranges, strict=True)
        ):
            if is_pointer:
                if not isinstance(arg, Buffer):
                    raise DeviceError(
                        f"{self._where(index)}: expected a Buffer, got {type(arg).__name__}"
                    )
                if arg.closed:
                    arg._check_open(self._where(index))
                if arg.device is not self.device:
                    raise DeviceError(
                        f"{self._where(index)}: buffer {arg.name!r} is on {arg.device.name}, the "
                        f"kernel on {self.device.name}"
                    )
                if dtype is not None and arg.dtype != dtype:
                    raise DeviceError(
                        f"{self._where(index)}: buffer {arg.name!r} has dtype {arg.dtype}, "
                        f"expected {dtype}; pass buffer.view(dtype) if reinterpreting the bytes "
                        "is intended"
                    )
                out.append(_Pointer(arg, dtype))
                continue
            assert dtype is not None
            if isinstance(arg, Buffer) or not isinstance(arg, int | float | np.generic):
                raise DeviceError(f"{self._where(index)}: expected a number, got "
                                  f"{type(arg).__name__}")  # fmt: skip
            if isinstance(arg, np.generic) and arg.dtype == dtype:
                out.append(arg)
                continue
            if limits is not None:
                if isinstance(arg, float | np.floating) or not limits[0] <= int(arg) <= limits[1]:
                    raise DeviceError(
                        f"{self._where(index)}: {arg!r} is not an integer in the range of {dtype}"
                    )
                out.append(dtype.type(int(arg)))
            else:
                out.append(dtype.type(float(arg)))
        return out

    def _where(self, index: int) -> str:
        return f"argument {index} ({self.source.params[index]}) of {self.source.signature}"


class _Launch:
    """One checked kernel launch, its arguments converted: issued again as it was by a
    `LaunchRecord`'s replay."""

    __slots__ = ("args", "block", "buffers", "grid", "kernel", "shared_mem", "stream")

    def __init__(
        self,
        kernel: Kernel,
        grid: Dim3,
        block: Dim3,
        args: list[KernelArg],
        shared_mem: int,
        stream: Stream,
    ) -> None:
        self.kernel, self.grid, self.block, self.args = kernel, grid, block, args
        self.shared_mem, self.stream = shared_mem, stream
        self.buffers = [arg.buffer for arg in args if isinstance(arg, _Pointer)]

    def issue(self) -> None:
        """Launch (inside a capture: into the graph, its buffers bound to it)."""
        device, stream = self.kernel.device, self.stream
        recording = stream._recording
        if recording is not None:
            for buffer in self.buffers:
                recording.bind(buffer)
            recording.launches += 1
            recording.queued(stream)
            device._launch(self.kernel, self.grid, self.block, self.args, self.shared_mem, stream)
            return
        device._launch(self.kernel, self.grid, self.block, self.args, self.shared_mem, stream)
        device._ledger.add("launches", 1)


class LaunchRecord:
    """The kernel launches made inside `Device.record_launches`, to be issued again as they were.

    ``replayable`` holds when the block did nothing on the device but launch kernels (no
    allocation, copy, fill, synchronisation or event): then `replay` repeats exactly its device
    work without its host work (the ops' checks and planning, the arguments' conversion). The
    launches read each buffer's address when they run, as a graph replay does, so a replay is
    right as long as the recorded call would launch the same kernels with the same arguments.
    """

    def __init__(self) -> None:
        self.launches: list[_Launch] = []
        self.operations = 0  # device operations of any kind, launches included

    @property
    def replayable(self) -> bool:
        return self.operations == len(self.launches)

    def replay(self) -> None:
        for launch in self.launches:
            for buffer in launch.buffers:
                if buffer.closed:
                    buffer._check_open(f"replaying {launch.kernel.source.signature}")
            launch.issue()


# --- capture and graphs ----------------------------------------------------------------------


class _Recording:
    """What a capture has seen so far: on its stream and on the streams forked into it.

    A stream joins by waiting on an event recorded inside the capture (``streams`` lists them
    after the capturing one); ``work`` counts what each stream queued, and a forked stream is
    ``joined`` once the capturing stream waited on an event recorded after its last work.
    """

    def __init__(self, stream: Stream) -> None:
        self.stream = stream
        self.streams: list[Stream] = [stream]
        self.work: dict[Stream, int] = {}
        self.joined: set[Stream] = set()
        self.closed = False
        self.native: Any = None  # CUDA: the graph builder; CPU: the list of calls
        self.bound: dict[int, Buffer] = {}
        self.launches = 0
        self.copied: dict[str, int] = {
            "htod_bytes": 0,
            "dtoh_bytes": 0,
            "dtod_bytes": 0,
            "htoh_bytes": 0,
        }

    def bind(self, buffer: Buffer) -> None:
        root = buffer.root
        self.bound.setdefault(id(root), root)

    def queued(self, stream: Stream) -> None:
        """``stream`` queued one more piece of work into this capture."""
        self.work[stream] = self.work.get(stream, 0) + 1
        self.joined.discard(stream)

    def unjoined(self) -> list[str]:
        return [s.name for s in self.streams[1:] if self.work.get(s, 0) and s not in self.joined]

    def close(self) -> None:
        """The capture ended: every forked stream leaves it."""
        self.closed = True
        for stream in self.streams:
            stream._recording = None


def binding_signature(buffers: Iterable[Buffer]) -> BindingSignature:
    """The signature of a set of buffers: each root buffer's name, address, shape and dtype.

    Views count as their root: a graph bakes in addresses inside the root's memory, which hold as
    long as the root does. Two different buffers with one name are an error (names are the key).
    """
    by_name: dict[str, Buffer] = {}
    for buffer in buffers:
        root = buffer.root
        other = by_name.setdefault(root.name, root)
        if other is not root:
            raise DeviceError(
                f"two different buffers are named {root.name!r} ({other!r} and {root!r}); give "
                "buffers distinct names so a binding signature can tell them apart"
            )
    return BindingSignature(tuple(by_name[name].binding for name in sorted(by_name)))


@dataclass(frozen=True)
class GraphCheck:
    """Whether a graph's baked-in bindings still hold; falsy when they do not."""

    ok: bool
    differences: tuple[str, ...]
    address_stable: bool  # every bound address holds; only shapes or dtypes changed
    reason: str

    def __bool__(self) -> bool:
        return self.ok


class Graph:
    """A recorded sequence of work; `launch` replays it on a stream.

    It holds every buffer it touches, so they stay alive while it can run.
    """

    def __init__(
        self,
        device: Device,
        native: Any,
        bound: tuple[Buffer, ...],
        launches: int,
        copied: dict[str, int],
    ) -> None:
        self.device = device
        self._native = native
        self._bound = bound
        self.signature = binding_signature(bound)
        self.launches = launches
        self.copied = dict(copied)
        self.closed = False

    def __repr__(self) -> str:
        names = ", ".join(b.name for b in self._bound)
        return f"<Graph on {self.device.name}: {self.launches} launches, bound [{names}]>"

    def launch(self, *, stream: Stream) -> None:
        """Replay the recorded work on ``stream``."""
        if self.closed:
            raise DeviceError("this graph was closed; capture a new one")
        self.device._check_stream(stream)
        if stream.capturing:
            raise DeviceError("launching a graph inside another capture is not supported")
        freed = [b.name for b in self._bound if b.closed]
        if freed:
            raise DeviceError(
                f"graph replay refused: bound buffer(s) {', '.join(freed)} were freed after the "
                "capture; capture again with the new buffers"
            )
        self.device._graph_launch(self, stream)
        ledger = self.device._ledger
        ledger.add("graph_launches", 1)
        ledger.add("launches", self.launches)
        for name, amount in self.copied.items():
            ledger.add(name, amount)

    def check(self, signature: BindingSignature | None = None) -> GraphCheck:
        """Compare the recorded bindings with ``signature`` (default: the bound buffers now).

        Only names the graph recorded are compared; extra names in ``signature`` are ignored.
        """
        if signature is None:
            current = {b.name: None if b.closed else b.binding[1:] for b in self._bound}
        else:
            current = {entry[0]: entry[1:] for entry in signature.bindings}
        differences: list[str] = []
        stable = True
        for name, address, shape, dtype in self.signature.bindings:
            now = current.get(name)
            if now is None:
                stable = False
                gone = "freed" if name in current else "no longer bound"
                differences.append(f"{name}: {gone} (was {address:#x} {dtype}{list(shape)})")
            elif now[0] != address:
                stable = False
                differences.append(f"{name}: address {address:#x} -> {now[0]:#x}")
            elif (now[1], now[2]) != (shape, dtype):
                differences.append(
                    f"{name}: {dtype}{list(shape)} -> {now[2]}{list(now[1])} at the same address"
                )
        if not differences:
            return GraphCheck(True, (), True, "every bound buffer keeps its address and shape")
        return GraphCheck(False, tuple(differences), stable, "; ".join(differences))

    def close(self) -> None:
        """Release the graph and its hold on the bound buffers."""
        if not self.closed:
            self.device._graph_close(self)
            self.closed = True
            self._bound = ()


class Capture:
    """``with device.capture(stream=s) as cap:`` records the work queued on ``s``: ``cap.graph``.

    Inside the block nothing runs (as with CUDA stream capture), and no memory may be allocated
    or freed on the device. An exception inside the block discards the recording.
    """

    def __init__(self, device: Device, stream: Stream) -> None:
        self.device = device
        self.stream = stream
        self._graph: Graph | None = None

    def __enter__(self) -> Capture:
        device, stream = self.device, self.stream
        device._check_stream(stream)
        if stream.capturing:
            raise DeviceError(f"stream {stream.name!r} is already capturing")
        recording = _Recording(stream)
        device._begin_capture(stream, recording)
        stream._recording = recording
        device._open_captures += 1
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        device, stream = self.device, self.stream
        recording = stream._recording
        assert recording is not None
        recording.close()
        device._open_captures -= 1
        try:
            if exc_type is not None:
                device._abort_capture(stream, recording)
                return
            bound = tuple(recording.bound.values())
            try:
                binding_signature(bound)
                unjoined = recording.unjoined()
                if unjoined:
                    raise DeviceError(
                        f"stream(s) {', '.join(unjoined)} were forked into the capture on "
                        f"{stream.name!r} and not joined: record an event on each after its last "
                        f"work and make {stream.name!r} wait on it before the capture ends"
                    )
            except DeviceError:
                device._abort_capture(stream, recording)
                raise
            native = device._end_capture(stream, recording)
            self._graph = Graph(device, native, bound, recording.launches, recording.copied)
            device._ledger.add("captures", 1)
        finally:
            device._release_deferred()

    @property
    def graph(self) -> Graph:
        if self._graph is None:
            raise DeviceError("the capture has not finished (or failed): no graph to launch")
        return self._graph


# --- the device ------------------------------------------------------------------------------


def _check_byte_sizes(where: str, sizes: dict[str, Any]) -> None:
    """Each of ``sizes`` (a 2-D copy's or fill's bytes and rows) is an integer >= 0."""
    for key, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int | np.integer) or value < 0:
            raise DeviceError(f"{where}: {key}={value!r} must be an integer >= 0 (bytes or rows)")


class Device:
    """A place where buffers live and kernels run: ``cpu`` or ``cuda:N``."""

    kind: str = "abstract"

    def __init__(self, name: str, arch: str | None) -> None:
        self.name = name
        self.arch = arch  # "sm_90" on an H200; None on the CPU
        self.limits: dict[str, Any] = {
            "max_threads_per_block": 1024,
            "max_grid": (2**31 - 1, 65535, 65535),
            "max_shared_mem": 227 * 1024,
        }
        self.granule = GRANULE  # growable buffers map memory in multiples of this
        self._ledger = _Ledger()
        self._open_captures = 0
        self._deferred: list[_Allocation] = []
        self._kernels: dict[str, Kernel] = {}
        self._recorder: LaunchRecord | None = None  # `record_launches`, while one is open
        self._default_stream: Stream | None = None
        self._serial = 0

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name}>"

    # -- bookkeeping helpers --

    def counters(self) -> DeviceCounters:
        """A snapshot of the byte and launch counters."""
        return self._ledger.snapshot()

    def _missing(self, method: str) -> DeviceError:
        return DeviceError(
            f"{type(self).__name__} does not implement {method}: a device backend must fill in "
            f"{method} (see ep/device/_base.py for its contract)"
        )

    def _next_name(self, kind: str) -> str:
        self._serial += 1
        return f"{kind}#{self._serial}"

    def _note_operation(self) -> None:
        if self._recorder is not None:
            self._recorder.operations += 1

    @contextlib.contextmanager
    def record_launches(self) -> Iterator[LaunchRecord]:
        """Record the kernel launches made inside the block (they run as usual) and count every
        other device operation, so the block's device work can be replayed without its host
        work when it was launches only (`LaunchRecord`). Not nested."""
        if self._recorder is not None:
            raise DeviceError(f"record_launches on {self.name} is already open; they do not nest")
        record = self._recorder = LaunchRecord()
        try:
            yield record
        finally:
            self._recorder = None

    def _check_stream(self, stream: Stream) -> None:
        self._note_operation()  # every operation on a stream checks it first
        if not isinstance(stream, Stream):
            raise DeviceError(f"stream must be a Stream, got {type(stream).__name__}")
        if stream.device is not self:
            raise DeviceError(
                f"stream {stream.name!r} belongs to {stream.device.name}, not {self.name}"
            )

    def _check_alloc_allowed(self, what: str) -> None:
        if self._open_captures:
            raise DeviceError(
                f"cannot {what} on {self.name} while a graph capture is open: allocate every "
                "buffer before capturing"
            )

    # -- streams and events --

    def create_stream(self, *, name: str = "") -> Stream:
        """A new stream."""
        return Stream(self, self._create_stream(), name or self._next_name("stream"))

    @property
    def default_stream(self) -> Stream:
        """This device's own stream (not CUDA's legacy stream 0, which cannot be captured)."""
        if self._default_stream is None:
            self._default_stream = self.create_stream(name="default")
        return self._default_stream

    def create_event(self, *, timing: bool = False) -> Event:
        """A new, unrecorded event."""
        return Event(self, self._create_event(timing), timing)

    def set_current(self) -> None:
        """Make this device current on the calling thread (CUDA needs it once per thread)."""

    def synchronize(self) -> None:
        """Wait for all work on every stream of this device."""
        if self._open_captures:
            raise DeviceError("cannot synchronise the device while a graph capture is open")
        self._synchronize()

    # -- memory --

    def _make(
        self,
        cls: type[Buffer],
        allocation: _Allocation,
        ptr: int,
        host: np.ndarray | None,
        dtype: np.dtype,
        shape: tuple[int, ...],
        name: str,
    ) -> Any:
        memory = _Memory(self, allocation, ptr, host)
        nbytes = math.prod(shape) * dtype.itemsize
        return cls(memory, offset=0, nbytes=nbytes, dtype=dtype, shape=shape, name=name)

    def alloc(
        self, shape: int | Sequence[int], dtype: Any, *, stream: Stream, name: str = ""
    ) -> Buffer:
        """Uninitialised device memory of ``shape`` × ``dtype``."""
        self._check_stream(stream)
        self._check_alloc_allowed("allocate")
        dims, dt = _as_shape(shape), as_dtype(dtype)
        nbytes = math.prod(dims) * dt.itemsize
        native, ptr, host = self._alloc(nbytes, stream)
        self._ledger.add("allocated_bytes", nbytes)
        allocation = _Allocation("device", native, nbytes)
        return self._make(
            Buffer, allocation, ptr, host, dt, dims, name or self._next_name("buffer")
        )

    def alloc_pinned(
        self, shape: int | Sequence[int], dtype: Any, *, stream: Stream, name: str = ""
    ) -> PinnedBuffer:
        """Page-locked host memory (fast, capturable host↔device copies)."""
        self._check_stream(stream)
        self._check_alloc_allowed("allocate pinned memory")
        dims, dt = _as_shape(shape), as_dtype(dtype)
        nbytes = math.prod(dims) * dt.itemsize
        native, ptr, host = self._alloc_pinned(nbytes, stream)
        self._ledger.add("pinned_bytes", nbytes)
        allocation = _Allocation("pinned", native, nbytes)
        result: PinnedBuffer = self._make(
            PinnedBuffer, allocation, ptr, host, dt, dims, name or self._next_name("pinned")
        )
        return result

    def alloc_growable(
        self,
        shape: int | Sequence[int],
        dtype: Any,
        *,
        max_nbytes: int,
        stream: Stream,
        name: str = "",
    ) -> GrowableBuffer:
        """A buffer of ``shape`` that can grow in place up to ``max_nbytes`` (address stable)."""
        self._check_stream(stream)
        self._check_alloc_allowed("allocate a growable buffer")
        dims, dt = _as_shape(shape), as_dtype(dtype)
        nbytes = math.prod(dims) * dt.itemsize
        reserved = _round_up(max(max_nbytes, 1), self.granule)
        if nbytes > reserved:
            raise DeviceError(
                f"growable buffer {name or '(unnamed)'}: initial size {nbytes} bytes exceeds "
                f"max_nbytes={max_nbytes}; raise max_nbytes"
            )
        native, ptr, host = self._reserve(reserved, stream)
        allocation = _Allocation("growable", native, 0, reserved)
        self._ledger.add("reserved_bytes", reserved)
        buffer: GrowableBuffer = self._make(
            GrowableBuffer, allocation, ptr, host, dt, (0,), name or self._next_name("growable")
        )
        self._grow(buffer, dims, stream=stream)
        return buffer

    def _grow(self, buffer: GrowableBuffer, shape: tuple[int, ...], *, stream: Stream) -> None:
        self._check_stream(stream)
        buffer._check_open("grow")
        self._check_alloc_allowed("grow a buffer")
        nbytes = math.prod(shape) * buffer.dtype.itemsize
        allocation = buffer._memory.allocation
        if nbytes < buffer.nbytes:
            raise DeviceError(
                f"grow {buffer.name!r} to {list(shape)} ({nbytes} bytes) would shrink it from "
                f"{buffer.nbytes} bytes: use a view for a smaller shape"
            )
        if nbytes > allocation.reserved:
            raise DeviceError(
                f"cannot grow {buffer.name!r} to {nbytes} bytes: only {allocation.reserved} "
                "bytes of address space are reserved; allocate it with a larger max_nbytes"
            )
        mapped = _round_up(nbytes, self.granule)
        if mapped > allocation.nbytes:
            self._map(allocation.native, allocation.nbytes, mapped, stream)
            self._ledger.add("allocated_bytes", mapped - allocation.nbytes)
            allocation.nbytes = mapped
        buffer._nbytes = nbytes
        buffer._shape = shape

    def _free_now(self, buffer: Buffer) -> None:
        self._check_alloc_allowed("free memory")
        buffer._memory.finalizer()

    def _release(self, allocation: _Allocation) -> None:
        """Give one allocation back (called once, by `free` or when its last reference goes)."""
        if allocation.released:
            return
        if self._open_captures:
            # A buffer collected during a capture must not free memory into the graph.
            self._deferred.append(allocation)
            return
        allocation.released = True
        if allocation.kind == "device":
            self._free(allocation.native)
            self._ledger.add("allocated_bytes", -allocation.nbytes)
        elif allocation.kind == "pinned":
            self._free_pinned(allocation.native)
            self._ledger.add("pinned_bytes", -allocation.nbytes)
        else:
            self._unreserve(allocation.native)
            self._ledger.add("allocated_bytes", -allocation.nbytes)
            self._ledger.add("reserved_bytes", -allocation.reserved)

    def _release_deferred(self) -> None:
        if self._open_captures:
            return
        deferred, self._deferred = self._deferred, []
        for allocation in deferred:
            self._release(allocation)

    # -- copies --

    def copy(
        self,
        dst: Buffer,
        src: Buffer,
        *,
        stream: Stream,
        nbytes: int | None = None,
        dst_offset: int = 0,
        src_offset: int = 0,
    ) -> None:
        """Copy ``nbytes`` (default: all of ``src`` after ``src_offset``) between two buffers.

        Any pair of device and pinned buffers of this device; offsets are in bytes.
        """
        self._check_stream(stream)
        for role, buffer in (("dst", dst), ("src", src)):
            if not isinstance(buffer, Buffer):
                raise DeviceError(
                    f"copy {role} must be a Buffer, got {type(buffer).__name__}; for NumPy arrays "
                    "use buffer.copy_from_host / buffer.to_host"
                )
            buffer._check_open(f"copy {role}")
            if buffer.device is not self:
                raise DeviceError(f"copy {role} {buffer.name!r} is on {buffer.device.name}")
        if nbytes is None:
            nbytes = src.nbytes - src_offset
        if min(nbytes, dst_offset, src_offset) < 0:
            raise DeviceError(
                f"copy {src.name!r} -> {dst.name!r}: nbytes={nbytes}, src_offset={src_offset}, "
                f"dst_offset={dst_offset} must all be non-negative"
            )
        for role, buffer, offset in (("src", src, src_offset), ("dst", dst, dst_offset)):
            if offset + nbytes > buffer.nbytes:
                raise DeviceError(
                    f"copy of {nbytes} bytes at {role}_offset={offset} runs past the end of "
                    f"{buffer.name!r} ({buffer.nbytes} bytes)"
                )
        if nbytes == 0:
            return
        if dst._memory is src._memory:
            a, b = dst.offset + dst_offset, src.offset + src_offset
            if a < b + nbytes and b < a + nbytes:
                raise DeviceError(
                    f"copy {src.name!r} -> {dst.name!r}: the byte ranges overlap in one "
                    "allocation, which CUDA copies leave undefined; copy through a scratch buffer"
                )
        self._counted_copy(
            dst, src, nbytes, stream,
            functools.partial(self._copy, dst, dst_offset, src, src_offset, nbytes, stream),
        )  # fmt: skip

    def _counted_copy(
        self, dst: Buffer, src: Buffer, nbytes: int, stream: Stream, run: Callable[[], None]
    ) -> None:
        """Run a checked copy of ``nbytes`` and count it by direction: in the device's ledger,
        or, inside a capture, in the recording (whose replays the ledger counts)."""
        direction = {
            ("host", "device"): "htod_bytes",
            ("device", "host"): "dtoh_bytes",
            ("device", "device"): "dtod_bytes",
            ("host", "host"): "htoh_bytes",
        }[(src.location, dst.location)]
        recording = stream._recording
        if recording is not None:
            recording.bind(dst)
            recording.bind(src)
            recording.copied[direction] += nbytes
            recording.queued(stream)
            run()
            return
        run()
        self._ledger.add(direction, nbytes)

    def copy_2d(
        self,
        dst: Buffer,
        src: Buffer,
        *,
        width: int,
        height: int,
        dst_pitch: int,
        src_pitch: int,
        stream: Stream,
        dst_offset: int = 0,
        src_offset: int = 0,
    ) -> None:
        """Copy ``height`` rows of ``width`` bytes: row r from ``src_offset + r * src_pitch`` of
        ``src`` to ``dst_offset + r * dst_pitch`` of ``dst`` (all in bytes).

        E.g. a [M, n] block into columns [n0, n0 + n) of an [M, N] matrix: ``width = n * item``,
        ``dst_pitch = N * item``, ``src_pitch = n * item``, ``dst_offset = n0 * item``. Counted
        as ``width * height`` bytes; capturable (CUDA: ``cuMemcpy2DAsync``).
        """
        self._check_stream(stream)
        for role, buffer in (("dst", dst), ("src", src)):
            if not isinstance(buffer, Buffer):
                raise DeviceError(f"copy_2d {role} must be a Buffer, got {type(buffer).__name__}")
            buffer._check_open(f"copy_2d {role}")
            if buffer.device is not self:
                raise DeviceError(f"copy_2d {role} {buffer.name!r} is on {buffer.device.name}")
        sizes = {
            "width": width, "height": height, "dst_pitch": dst_pitch, "src_pitch": src_pitch,
            "dst_offset": dst_offset, "src_offset": src_offset,
        }  # fmt: skip
        _check_byte_sizes(f"copy_2d {src.name!r} -> {dst.name!r}", sizes)
        if width > dst_pitch or width > src_pitch:
            raise DeviceError(
                f"copy_2d {src.name!r} -> {dst.name!r}: width={width} bytes is wider than "
                f"dst_pitch={dst_pitch} or src_pitch={src_pitch}; rows would overlap. Pass pitches "
                ">= width (the byte distance between the starts of two rows)"
            )
        if width == 0 or height == 0:
            return
        spans: dict[str, tuple[int, int]] = {}
        for role, buffer, offset, pitch in (
            ("src", src, int(src_offset), int(src_pitch)),
            ("dst", dst, int(dst_offset), int(dst_pitch)),
        ):
            end = offset + (int(height) - 1) * pitch + int(width)
            if end > buffer.nbytes:
                raise DeviceError(
                    f"copy_2d of {height} rows of {width} bytes (pitch {pitch}) at "
                    f"{role}_offset={offset} runs past the end of {buffer.name!r} "
                    f"({buffer.nbytes} bytes; needs {end})"
                )
            spans[role] = (buffer.offset + offset, buffer.offset + end)
        if dst._memory is src._memory:
            (a0, a1), (b0, b1) = spans["dst"], spans["src"]
            if a0 < b1 and b0 < a1:
                raise DeviceError(
                    f"copy_2d {src.name!r} -> {dst.name!r}: the byte spans overlap in one "
                    "allocation, which CUDA copies leave undefined; copy through a scratch buffer"
                )
        args = (int(width), int(height), int(dst_pitch), int(src_pitch))
        self._counted_copy(
            dst, src, int(width) * int(height), stream,
            functools.partial(self._copy_2d, dst, int(dst_offset), src, int(src_offset), *args,
                              stream),
        )  # fmt: skip

    def _check_buffer(self, buffer: Buffer, what: str) -> None:
        """``buffer`` is an open Buffer of this device, or ``what`` fails saying which not."""
        if not isinstance(buffer, Buffer):
            raise DeviceError(f"{what}: expected a Buffer, got {type(buffer).__name__}")
        buffer._check_open(what)
        if buffer.device is not self:
            raise DeviceError(f"{what}: buffer {buffer.name!r} is on {buffer.device.name}")

    def _host_transfer_checks(self, buffer: Buffer, stream: Stream, what: str) -> None:
        self._check_stream(stream)
        self._check_buffer(buffer, what)
        if stream.capturing:
            raise DeviceError(
                f"{what} of {buffer.name!r} inside a capture: pageable NumPy memory cannot be "
                "captured; stage through a PinnedBuffer and device.copy"
            )

    def upload(self, dst: Buffer, array: np.ndarray, *, stream: Stream) -> None:
        """Copy a host NumPy array (same dtype and shape) into ``dst``."""
        self._host_transfer_checks(dst, stream, "upload")
        if not isinstance(array, np.ndarray):
            raise DeviceError(
                f"upload into {dst.name!r}: expected a NumPy array, got {type(array).__name__}"
            )
        if array.dtype != dst.dtype or array.shape != dst.shape:
            raise DeviceError(
                f"upload into {dst.name!r}: array is {array.dtype}{list(array.shape)}, buffer is "
                f"{dst.dtype}{list(dst.shape)}; convert or reshape the array first"
            )
        data = np.ascontiguousarray(array)
        if data.nbytes:
            self._upload(dst, data, stream)
            direction = "htoh_bytes" if dst.location == "host" else "htod_bytes"
            self._ledger.add(direction, data.nbytes)

    def download(self, src: Buffer, *, stream: Stream) -> np.ndarray:
        """A new host array with ``src``'s contents; waits for ``stream``."""
        self._host_transfer_checks(src, stream, "download")
        out = np.empty(src.shape, dtype=src.dtype)
        if out.nbytes:
            self._download(out, src, stream)
            direction = "htoh_bytes" if src.location == "host" else "dtoh_bytes"
            self._ledger.add(direction, out.nbytes)
        self._stream_sync(stream)
        return out

    def to_device(self, array: np.ndarray, *, stream: Stream, name: str = "") -> Buffer:
        """A new device buffer holding a copy of ``array``."""
        array = np.asarray(array)
        buffer = self.alloc(array.shape, array.dtype, stream=stream, name=name)
        self.upload(buffer, array, stream=stream)
        return buffer

    def fill(self, buffer: Buffer, value: float | int, *, stream: Stream) -> None:
        """Set every element of ``buffer`` to ``value`` (runs the built-in fill kernels)."""
        if not isinstance(buffer, Buffer):
            raise DeviceError(f"fill: expected a Buffer, got {type(buffer).__name__}")
        buffer._check_open("fill")
        itemsize = buffer.dtype.itemsize
        if itemsize not in (1, 2, 4, 8):
            raise DeviceError(f"fill {buffer.name!r}: dtype {buffer.dtype} has no fill kernel")
        try:
            scalar = np.array(value).astype(buffer.dtype)
        except (TypeError, ValueError, OverflowError) as exc:
            raise DeviceError(f"fill {buffer.name!r}: {value!r} is not a number") from exc
        if buffer.dtype.kind in "iub" and scalar.item() != value:
            raise DeviceError(
                f"fill {buffer.name!r}: {value!r} is not representable in {buffer.dtype}"
            )
        bits_dtype = np.dtype(f"u{itemsize}")
        bits = scalar.view(bits_dtype)[()]
        count = buffer.nbytes // itemsize
        if count == 0:
            self._check_stream(stream)
            return
        grid = max(1, min(-(-count // 256), 4096))
        kernel = self.kernel(f"fill_u{8 * itemsize}")
        kernel.launch(grid, 256, buffer.view(bits_dtype), bits, np.uint64(count), stream=stream)

    def fill_2d(
        self,
        buffer: Buffer,
        byte: int,
        *,
        width: int,
        height: int,
        pitch: int,
        offset: int = 0,
        stream: Stream,
    ) -> None:
        """Set ``height`` rows of ``width`` bytes of ``buffer`` to ``byte`` (0 to 255): row r
        at ``offset + r * pitch`` (bytes).

        E.g. the same token slots of every sequence of a cache with a fixed per-sequence stride:
        one call, where `fill` would take one per row. Capturable (CUDA: ``cuMemsetD2D8Async``).
        """
        self._check_stream(stream)
        self._check_buffer(buffer, "fill_2d")
        sizes = {"width": width, "height": height, "pitch": pitch, "offset": offset}
        _check_byte_sizes(f"fill_2d {buffer.name!r}", sizes)
        if isinstance(byte, bool) or not isinstance(byte, int | np.integer) or not 0 <= byte < 256:
            raise DeviceError(f"fill_2d {buffer.name!r}: byte={byte!r}; expected 0 to 255")
        if height > 1 and width > pitch:
            raise DeviceError(
                f"fill_2d {buffer.name!r}: width={width} bytes is wider than pitch={pitch}; rows "
                "would overlap. Pass a pitch >= width (the byte distance between row starts)"
            )
        if width == 0 or height == 0:
            return
        end = int(offset) + (int(height) - 1) * int(pitch) + int(width)
        if end > buffer.nbytes:
            raise DeviceError(
                f"fill_2d of {height} rows of {width} bytes (pitch {pitch}) at offset={offset} "
                f"runs past the end of {buffer.name!r} ({buffer.nbytes} bytes; needs {end})"
            )
        recording = stream._recording
        if recording is not None:
            recording.bind(buffer)
            recording.queued(stream)
        pitch = max(int(pitch), int(width))  # one row: any pitch (the driver wants >= width)
        self._fill_2d(buffer, int(offset), int(byte), int(width), int(height), pitch, stream)

    # -- kernels --

    def kernel(
        self, kernel: str | KernelSource, *, registry: KernelRegistry | None = None
    ) -> Kernel:
        """This device's handle on a kernel, by registered name or by source (loaded lazily)."""
        registry = registry if registry is not None else KERNELS
        source = registry.get(kernel) if isinstance(kernel, str) else kernel
        known = self._kernels.get(source.name)
        if known is not None:
            if known.source is not source and not known.source.same_kernel(source):
                raise DeviceError(
                    f"{self.name} already loaded a different kernel named {source.name!r}"
                )
            return known
        handle = Kernel(self, source)
        self._kernels[source.name] = handle
        return handle

    def compile_all(self, *, registry: KernelRegistry | None = None) -> list[KernelReport]:
        """Compile and load every registered kernel; call it before any capture. A kernel that
        does not exist for this device's architecture (`KernelSource.targets`) is reported as
        skipped."""
        registry = registry if registry is not None else KERNELS
        assert self.arch is not None  # a device that compiles knows its architecture
        return [
            self.kernel(source).load()
            if kernel_target(source, self.arch)
            else skipped_report(source, self.arch)
            for source in registry
        ]

    # -- capture --

    def capture(self, *, stream: Stream) -> Capture:
        """Record the work queued on ``stream`` into a `Graph` (see `Capture`)."""
        return Capture(self, stream)

    # -- hooks a backend fills in --

    def _alloc(self, nbytes: int, stream: Stream) -> tuple[Any, int, np.ndarray | None]:
        raise self._missing("_alloc")

    def _free(self, native: Any) -> None:
        raise self._missing("_free")

    def _alloc_pinned(self, nbytes: int, stream: Stream) -> tuple[Any, int, np.ndarray | None]:
        raise self._missing("_alloc_pinned")

    def _free_pinned(self, native: Any) -> None:
        raise self._missing("_free_pinned")

    def _reserve(self, reserved: int, stream: Stream) -> tuple[Any, int, np.ndarray | None]:
        raise self._missing("_reserve")

    def _map(self, native: Any, mapped: int, new_mapped: int, stream: Stream) -> None:
        raise self._missing("_map")

    def _unreserve(self, native: Any) -> None:
        raise self._missing("_unreserve")

    def _copy(
        self,
        dst: Buffer,
        dst_offset: int,
        src: Buffer,
        src_offset: int,
        nbytes: int,
        stream: Stream,
    ) -> None:
        raise self._missing("_copy")

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
        raise self._missing("_copy_2d")

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
        raise self._missing("_fill_2d")

    def _upload(self, dst: Buffer, data: np.ndarray, stream: Stream) -> None:
        raise self._missing("_upload")

    def _download(self, out: np.ndarray, src: Buffer, stream: Stream) -> None:
        raise self._missing("_download")

    def _load_kernel(self, source: KernelSource) -> tuple[Any, KernelReport]:
        raise self._missing("_load_kernel")

    def _launch(
        self,
        kernel: Kernel,
        grid: Dim3,
        block: Dim3,
        args: list[KernelArg],
        shared_mem: int,
        stream: Stream,
    ) -> None:
        raise self._missing("_launch")

    def _resident_blocks(self, kernel: Kernel, threads: int, shared_mem: int) -> int:
        raise self._missing("_resident_blocks")

    def _create_stream(self) -> Any:
        raise self._missing("_create_stream")

    def _stream_sync(self, stream: Stream) -> None:
        raise self._missing("_stream_sync")

    def _stream_wait(self, stream: Stream, event: Event) -> None:
        raise self._missing("_stream_wait")

    def _create_event(self, timing: bool) -> Any:
        raise self._missing("_create_event")

    def _event_record(self, event: Event, stream: Stream) -> None:
        raise self._missing("_event_record")

    def _event_sync(self, event: Event) -> None:
        raise self._missing("_event_sync")

    def _event_done(self, event: Event) -> bool:
        raise self._missing("_event_done")

    def _event_elapsed_ms(self, start: Event, end: Event) -> float:
        raise self._missing("_event_elapsed_ms")

    def _synchronize(self) -> None:
        raise self._missing("_synchronize")

    def _begin_capture(self, stream: Stream, recording: _Recording) -> None:
        raise self._missing("_begin_capture")

    def _end_capture(self, stream: Stream, recording: _Recording) -> Any:
        raise self._missing("_end_capture")

    def _abort_capture(self, stream: Stream, recording: _Recording) -> None:
        raise self._missing("_abort_capture")

    def _graph_launch(self, graph: Graph, stream: Stream) -> None:
        raise self._missing("_graph_launch")

    def _graph_close(self, graph: Graph) -> None:
        raise self._missing("_graph_close")
