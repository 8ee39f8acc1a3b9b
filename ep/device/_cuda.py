"""The CUDA device, on `cuda.core` (>= 1.2), with `cuda.bindings` where `cuda.core` has no call.

`cuda.bindings` is used for: ranged copies between any two addresses (``cuMemcpyAsync``; a
`cuda.core` Buffer only copies whole buffers), stable-address growth (``cuMemAddressReserve``,
``cuMemCreate``, ``cuMemMap``, ``cuMemSetAccess``: `cuda.core`'s VirtualMemoryResource may move a
buffer when it cannot extend it in place) and opting a kernel into more than 48 KiB of dynamic
shared memory (``cuKernelSetAttribute``). Every failure becomes a `CudaCallError` sentence.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import ml_dtypes
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
from ep.device._cuda_errors import check_cuda, cuda_error
from ep.device._kernels import (
    KernelReport,
    KernelSource,
    compile_kernel,
    param_dtype,
    pdl_arch,
)
from ep.errors import DeviceError

__all__ = ["CUDADevice"]

_DEFAULT_DYNAMIC_SHARED = 48 * 1024  # above this a kernel must opt in
_BF16 = np.dtype(ml_dtypes.bfloat16)


@contextlib.contextmanager
def _call(name: str) -> Iterator[None]:
    """Turn whatever `cuda.core` raises inside into a `CudaCallError` naming ``name``."""
    try:
        yield
    except DeviceError:
        raise
    except Exception as exc:
        raise cuda_error(name, exc) from exc


class _HostView:
    """Lets NumPy view pinned host memory while keeping the `cuda.core` buffer alive."""

    def __init__(self, ptr: int, nbytes: int, owner: Any) -> None:
        self.__array_interface__ = {
            "version": 3,
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (ptr, False),
        }
        self.owner = owner


class _Reservation:
    """A reserved virtual address range and the physical chunks mapped into it, in order."""

    def __init__(self, base: int, reserved: int) -> None:
        self.base = base
        self.reserved = reserved
        self.chunks: list[tuple[int, int, Any]] = []  # (offset, size, allocation handle)


class CUDADevice(Device):
    """One GPU. Its default stream is a stream of its own (stream 0 cannot be captured)."""

    kind = "cuda"

    def __init__(self, ordinal: int) -> None:
        from cuda.core import Device as CoreDevice
        from cuda.core import LegacyPinnedMemoryResource

        with _call(f"cuda.core Device({ordinal}).set_current"):
            core = CoreDevice(ordinal)
            core.set_current()
            capability = core.compute_capability
            properties = core.properties
            gpu_name = core.name
        super().__init__(f"cuda:{ordinal}", f"sm_{capability.major}{capability.minor}")
        self.ordinal = ordinal
        self.gpu_name = gpu_name
        self._core = core
        self._pinned = LegacyPinnedMemoryResource()
        self._shared_opt_in: dict[str, int] = {}
        self._launch_configs: dict[tuple[Dim3, Dim3, int, bool], Any] = {}
        # Programmatic dependent launch: the kernels compiled for this arch open with the PDL
        # prologue (`ep.device._kernels.PDL_PROLOGUE`); GENAI_EP_PDL=0 launches without it.
        self.pdl = pdl_arch(str(self.arch)) and os.environ.get("GENAI_EP_PDL", "1") != "0"
        with _call("reading device properties"):
            self.limits = {
                "max_threads_per_block": int(properties.max_threads_per_block),
                "max_grid": (
                    int(properties.max_grid_dim_x),
                    int(properties.max_grid_dim_y),
                    int(properties.max_grid_dim_z),
                ),
                "max_shared_mem": int(properties.max_shared_memory_per_block_optin),
            }
        granularity = self._vmm_granularity()
        # The base class rounds growth to `granule`; keep it a multiple of what the driver needs.
        self.granule = max(self.granule, granularity)
        if self.granule % granularity:
            self.granule *= granularity

    def __repr__(self) -> str:
        return f"<CUDADevice {self.name} {self.gpu_name} {self.arch}>"

    # -- memory --

    def _alloc(self, nbytes: int, stream: Stream) -> tuple[Any, int, np.ndarray | None]:
        with _call(f"allocating {nbytes} bytes of device memory (cuMemAllocFromPoolAsync)"):
            native = self._core.allocate(max(nbytes, 1), stream=stream._native)
            return native, int(native.handle), None

    def _free(self, native: Any) -> None:
        with _call("freeing device memory (cuMemFreeAsync)"):
            native.close()

    def _alloc_pinned(self, nbytes: int, stream: Stream) -> tuple[Any, int, np.ndarray | None]:
        with _call(f"allocating {nbytes} bytes of pinned host memory (cuMemAllocHost)"):
            native = self._pinned.allocate(max(nbytes, 1), stream=stream._native)
            ptr = int(native.handle)
        host = np.asarray(_HostView(ptr, nbytes, native))
        return native, ptr, host

    def _free_pinned(self, native: Any) -> None:
        with _call("freeing pinned host memory (cuMemFreeHost)"):
            native.close()

    def _vmm_prop(self) -> Any:
        from cuda.bindings import driver

        prop = driver.CUmemAllocationProp()
        prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.ordinal
        return prop

    def _vmm_granularity(self) -> int:
        from cuda.bindings import driver

        flag = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        result, granularity = driver.cuMemGetAllocationGranularity(self._vmm_prop(), flag)
        check_cuda("cuMemGetAllocationGranularity", result)
        return int(granularity)

    def _reserve(self, reserved: int, stream: Stream) -> tuple[Any, int, np.ndarray | None]:
        from cuda.bindings import driver

        result, base = driver.cuMemAddressReserve(reserved, 0, 0, 0)
        check_cuda(f"cuMemAddressReserve({reserved} bytes)", result)
        return _Reservation(int(base), reserved), int(base), None

    def _map(self, native: Any, mapped: int, new_mapped: int, stream: Stream) -> None:
        from cuda.bindings import driver

        reservation: _Reservation = native
        size = new_mapped - mapped
        address = reservation.base + mapped
        result, handle = driver.cuMemCreate(size, self._vmm_prop(), 0)
        check_cuda(f"cuMemCreate({size} bytes)", result)
        try:
            check_cuda("cuMemMap", driver.cuMemMap(address, size, 0, handle, 0))
            try:
                access = driver.CUmemAccessDesc()
                access.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                access.location.id = self.ordinal
                access.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
                check_cuda("cuMemSetAccess", driver.cuMemSetAccess(address, size, [access], 1))
            except BaseException:
                driver.cuMemUnmap(address, size)
                raise
        except BaseException:
            driver.cuMemRelease(handle)
            raise
        reservation.chunks.append((mapped, size, handle))

    def _unreserve(self, native: Any) -> None:
        from cuda.bindings import driver

        reservation: _Reservation = native
        with _call("synchronising before unmapping a growable buffer"):
            self._core.sync()  # no queued work may still touch the memory
        for offset, size, handle in reversed(reservation.chunks):
            check_cuda("cuMemUnmap", driver.cuMemUnmap(reservation.base + offset, size))
            check_cuda("cuMemRelease", driver.cuMemRelease(handle))
        reservation.chunks.clear()
        check_cuda(
            "cuMemAddressFree", driver.cuMemAddressFree(reservation.base, reservation.reserved)
        )

    # -- copies --

    def _memcpy(self, dst: int, src: int, nbytes: int, stream: Stream, what: str) -> None:
        from cuda.bindings import driver

        # With unified addressing cuMemcpyAsync infers the direction from the two addresses.
        check_cuda(
            f"cuMemcpyAsync ({what}, {nbytes} bytes)",
            driver.cuMemcpyAsync(dst, src, nbytes, stream._native.handle),
        )

    def _copy(
        self,
        dst: Buffer,
        dst_offset: int,
        src: Buffer,
        src_offset: int,
        nbytes: int,
        stream: Stream,
    ) -> None:
        self._memcpy(
            dst.ptr + dst_offset,
            src.ptr + src_offset,
            nbytes,
            stream,
            f"{src.name!r} -> {dst.name!r}",
        )

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
        from cuda.bindings import driver

        # Unified addressing: the driver finds each side's memory type; capturable (a memcpy
        # node), unlike a loop of ranged copies it is one call for any number of rows.
        unified = driver.CUmemorytype.CU_MEMORYTYPE_UNIFIED
        params = driver.CUDA_MEMCPY2D()
        params.srcMemoryType = unified
        params.srcDevice = src.ptr + src_offset
        params.srcPitch = src_pitch
        params.dstMemoryType = unified
        params.dstDevice = dst.ptr + dst_offset
        params.dstPitch = dst_pitch
        params.WidthInBytes = width
        params.Height = height
        check_cuda(
            f"cuMemcpy2DAsync ({src.name!r} -> {dst.name!r}, {height} rows of {width} bytes)",
            driver.cuMemcpy2DAsync(params, stream._native.handle),
        )

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
        from cuda.bindings import driver

        check_cuda(
            f"cuMemsetD2D8Async ({buffer.name!r}, {height} rows of {width} bytes, pitch {pitch})",
            driver.cuMemsetD2D8Async(
                buffer.ptr + offset, pitch, byte, width, height, stream._native.handle
            ),
        )

    def _upload(self, dst: Buffer, data: np.ndarray, stream: Stream) -> None:
        if dst.location == "host":
            self._stream_sync(stream)  # queued copies may still read or write the pinned buffer
            dst._bytes()[:] = data.reshape(-1).view(np.uint8)
            return
        # From pageable memory the call returns once `data` is staged, so it may be freed after.
        self._memcpy(dst.ptr, int(data.ctypes.data), data.nbytes, stream, f"upload to {dst.name!r}")

    def _download(self, out: np.ndarray, src: Buffer, stream: Stream) -> None:
        if src.location == "host":
            self._stream_sync(stream)
            out.reshape(-1).view(np.uint8)[:] = src._bytes()
            return
        self._memcpy(int(out.ctypes.data), src.ptr, out.nbytes, stream, f"download of {src.name!r}")

    # -- kernels --

    def _load_kernel(self, source: KernelSource) -> tuple[Any, KernelReport]:
        from cuda.core import ObjectCode

        assert self.arch is not None
        compiled = compile_kernel(source, self.arch)
        with _call(f"loading kernel {source.name!r} (cuLibraryLoadData, cuLibraryGetKernel)"):
            code = ObjectCode.from_cubin(compiled.cubin, name=source.name)
            native = code.get_kernel(source.entry)
        self._check_params(source, native)
        return (native, code), compiled.report

    def _check_params(self, source: KernelSource, native: Any) -> None:
        """Compare the declared parameter sizes with what the cubin says (driver >= 12.4)."""
        try:
            sizes = [int(info.size) for info in native.arguments_info]
        except Exception:  # the query needs cuKernelGetParamInfo; without it the check is skipped
            return
        declared = []
        for param in source.params:
            is_pointer, dtype = param_dtype(param)
            declared.append(8 if is_pointer or dtype is None else dtype.itemsize)
        if sizes != declared:
            raise DeviceError(
                f"kernel {source.signature}: the declared parameters take {declared} bytes each, "
                f"the compiled kernel's take {sizes}; make KernelSource.params match the C "
                "signature"
            )

    def _launch(
        self,
        kernel: Kernel,
        grid: Dim3,
        block: Dim3,
        args: list[KernelArg],
        shared_mem: int,
        stream: Stream,
    ) -> None:
        from cuda.core import LaunchConfig, launch

        native = kernel._native[0]
        values: list[Any] = []
        for arg in args:
            if isinstance(arg, _Pointer):
                values.append(arg.buffer.ptr)  # a Python int is passed as a pointer
            elif arg.dtype == _BF16:
                values.append(arg.view(np.uint16))  # same 2 bytes; cuda.core has no bf16 scalar
            else:
                values.append(arg)
        if shared_mem > _DEFAULT_DYNAMIC_SHARED:
            self._opt_in_shared(kernel, native, shared_mem)
        cooperative = kernel.source.cooperative
        config = self._launch_configs.get((grid, block, shared_mem, cooperative))
        if config is None:
            if len(self._launch_configs) > 4096:
                self._launch_configs.clear()  # bounded: shapes vary with sequence length
            if cooperative:  # all blocks resident at once; after the previous kernel, not beside it
                extra = {"is_cooperative": True}
            else:
                extra = {"programmatic_stream_serialization": True} if self.pdl else {}
            try:
                config = LaunchConfig(grid=grid, block=block, shmem_size=shared_mem, **extra)
            except TypeError:  # a cuda.core without the PDL attribute: plain launches
                if cooperative:
                    raise
                self.pdl = False
                config = LaunchConfig(grid=grid, block=block, shmem_size=shared_mem)
            self._launch_configs[(grid, block, shared_mem, cooperative)] = config
        recording = stream._recording
        # the capturing stream launches through its graph builder; a stream forked into the
        # capture, on its own handle (the driver records its work into the same graph)
        target = (
            recording.native
            if recording is not None and stream is recording.stream
            else stream._native
        )
        with _call(f"launching kernel {kernel.source.signature} grid={grid} block={block}"):
            launch(target, config, native, *values)

    def _resident_blocks(self, kernel: Kernel, threads: int, shared_mem: int) -> int:
        native = kernel._native[0]
        if shared_mem > _DEFAULT_DYNAMIC_SHARED:
            self._opt_in_shared(kernel, native, shared_mem)
        with _call(f"reading the occupancy of kernel {kernel.name} ({threads} threads a block)"):
            per_sm = native.occupancy.max_active_blocks_per_multiprocessor(threads, shared_mem)
            sms = self._core.properties.multiprocessor_count
        return int(per_sm) * int(sms)

    def _opt_in_shared(self, kernel: Kernel, native: Any, shared_mem: int) -> None:
        from cuda.bindings import driver

        if self._shared_opt_in.get(kernel.name, 0) >= shared_mem:
            return
        attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check_cuda(
            f"cuKernelSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES={shared_mem}) for {kernel.name}",
            driver.cuKernelSetAttribute(
                attribute, shared_mem, native.handle, driver.CUdevice(self.ordinal)
            ),
        )
        self._shared_opt_in[kernel.name] = shared_mem

    # -- streams and events --

    def _create_stream(self) -> Any:
        with _call("creating a stream (cuStreamCreate)"):
            return self._core.create_stream()

    def _stream_sync(self, stream: Stream) -> None:
        with _call(f"synchronising stream {stream.name!r}"):
            stream._native.sync()

    def _stream_wait(self, stream: Stream, event: Event) -> None:
        with _call(f"stream {stream.name!r} waiting on an event"):
            stream._native.wait(event._native)

    def _create_event(self, timing: bool) -> Any:
        from cuda.core import EventOptions

        with _call("creating an event"):
            return self._core.create_event(EventOptions(timing_enabled=timing))

    def _event_record(self, event: Event, stream: Stream) -> None:
        with _call(f"recording an event on stream {stream.name!r}"):
            stream._native.record(event._native)

    def _event_sync(self, event: Event) -> None:
        with _call("synchronising an event"):
            event._native.sync()

    def _event_done(self, event: Event) -> bool:
        with _call("querying an event"):
            return bool(event._native.is_done)

    def _event_elapsed_ms(self, start: Event, end: Event) -> float:
        with _call("reading elapsed time between events"):
            return float(end._native - start._native)

    def set_current(self) -> None:
        """Make this GPU's primary context current on the calling thread."""
        with _call(f"making {self.name} current (cuCtxSetCurrent)"):
            self._core.set_current()

    def _synchronize(self) -> None:
        with _call(f"synchronising {self.name}"):
            self._core.sync()

    # -- capture --

    def _begin_capture(self, stream: Stream, recording: _Recording) -> None:
        with _call(f"beginning capture on stream {stream.name!r} (cuStreamBeginCapture)"):
            builder = stream._native.create_graph_builder()
            builder.begin_building()
        recording.native = builder

    def _end_capture(self, stream: Stream, recording: _Recording) -> Any:
        builder = recording.native
        try:
            with _call(f"ending capture on stream {stream.name!r} (cuStreamEndCapture)"):
                builder.end_building()
            with _call("instantiating the captured graph (cuGraphInstantiate)"):
                graph = builder.complete()
        except BaseException:
            self._abort_capture(stream, recording)
            raise
        with contextlib.suppress(Exception):
            builder.close()  # the executable graph no longer needs the builder
        return graph

    def _abort_capture(self, stream: Stream, recording: _Recording) -> None:
        from cuda.bindings import driver

        builder = recording.native
        recording.native = None
        if builder is not None:
            # Ends the capture if it is still open (an invalidated capture reports an error here,
            # which is expected and ignored: the stream leaves capture mode either way).
            with contextlib.suppress(Exception):
                builder.close()
        # Whatever happened above, the stream must leave capture mode, or every later call on it
        # would fail. The graph handle stays with the builder, which releases it.
        handle = stream._native.handle
        result, status = driver.cuStreamIsCapturing(handle)
        none = driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE
        if getattr(result, "name", "") == "CUDA_SUCCESS" and status != none:
            driver.cuStreamEndCapture(handle)

    def _graph_launch(self, graph: Graph, stream: Stream) -> None:
        with _call(f"launching a graph on stream {stream.name!r} (cuGraphLaunch)"):
            graph._native.launch(stream._native)

    def _graph_close(self, graph: Graph) -> None:
        with _call("destroying a graph"):
            graph._native.close()
