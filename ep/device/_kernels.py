"""Kernel sources, the kernel registry, and NVRTC compilation to cubin with an on-disk cache.

A kernel is CUDA C source with one ``extern "C" __global__`` entry, a declared parameter list
(so launches are checked and converted the same way on every device) and, optionally, a NumPy twin
that the CPU device runs instead. Sources compile to **cubin for one architecture** (never PTX: an
NVRTC newer than the driver emits PTX the driver cannot load). Cubins are cached on disk, keyed by
a hash of the source, architecture, options, NVRTC version and cuda-core version; every file
carries a header with a SHA-256 of its payload, so a truncated or corrupted file is recompiled,
never loaded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import os
import re
import struct
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import ml_dtypes
import numpy as np

from ep.errors import (
    DeviceUnavailableError,
    KernelCompileError,
    KernelRegistryError,
    KernelUnavailableError,
)

__all__ = [
    "CACHE_ENV",
    "KERNELS",
    "CacheLookup",
    "CompileOptions",
    "CompiledKernel",
    "KernelCache",
    "KernelRegistry",
    "KernelReport",
    "KernelSource",
    "compile_all",
    "compile_all_kernels",
    "compile_kernel",
    "cubin_symbols",
    "default_cache",
    "kernel_target",
    "nvrtc_version",
    "param_dtype",
    "register_kernel",
    "skipped_report",
]

CACHE_ENV = "GENAI_EP_KERNEL_CACHE"
_FORMAT_VERSION = 1
_MAGIC = b"GEPCUBIN"
# magic, format version, payload length, SHA-256 of the payload, cache key (hex, ASCII)
_HEADER = struct.Struct("<8sIQ32s64s")

# Parameter type names used in `KernelSource.params`, and the NumPy dtype each one means.
_SCALAR_DTYPES: dict[str, np.dtype] = {
    "i8": np.dtype(np.int8),
    "u8": np.dtype(np.uint8),
    "i16": np.dtype(np.int16),
    "u16": np.dtype(np.uint16),
    "i32": np.dtype(np.int32),
    "u32": np.dtype(np.uint32),
    "i64": np.dtype(np.int64),
    "u64": np.dtype(np.uint64),
    "f16": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
    "f32": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
}
_ARCH = re.compile(r"^sm_(\d{2,3})[af]?$")


def param_dtype(param: str) -> tuple[bool, np.dtype | None]:
    """``(is_pointer, dtype)`` for a parameter type such as ``"f32*"``, ``"void*"`` or ``"i64"``.

    ``void*`` accepts a buffer of any dtype (``dtype`` is None).
    """
    if param == "void*":
        return True, None
    if param.endswith("*") and param[:-1] in _SCALAR_DTYPES:
        return True, _SCALAR_DTYPES[param[:-1]]
    if param in _SCALAR_DTYPES:
        return False, _SCALAR_DTYPES[param]
    raise KernelRegistryError(
        f"unknown kernel parameter type {param!r}: expected one of "
        f"{', '.join(_SCALAR_DTYPES)} (scalars), the same with '*' (typed pointers), or 'void*'"
    )


@dataclass(frozen=True)
class CompileOptions:
    """NVRTC options that change the cubin; every field is part of the cache key."""

    std: str = "c++17"
    fma: bool = True  # False makes a*b+c round twice, exactly like NumPy (bitwise CPU parity)
    use_fast_math: bool = False
    max_register_count: int | None = None
    lineinfo: bool = False
    defines: tuple[tuple[str, str], ...] = ()  # (name, value) pairs for -D name=value
    # Put the CUDA runtime headers (cuda_fp16.h, cuda_bf16.h) from the nvidia-cuda-runtime wheel
    # on the include path; their version joins the cache key.
    cuda_headers: bool = False

    def key_fields(self) -> dict[str, object]:
        """A JSON-able, order-stable form of these options for the cache key."""
        fields: dict[str, object] = dict(sorted(dataclasses.asdict(self).items()))
        if self.cuda_headers:
            fields["cuda_headers"] = cuda_headers()[1]
        return fields


@functools.cache
def cuda_headers() -> tuple[str, str]:
    """The CUDA runtime headers' folder and the version of the package that ships them."""
    import importlib.metadata as md

    folder = ""
    with contextlib.suppress(Exception):
        from cuda.pathfinder import find_nvidia_header_directory

        folder = find_nvidia_header_directory("cudart") or ""
    if not folder:  # an older cuda-pathfinder: look where the wheel puts them
        import sys

        for root in sys.path:
            candidate = os.path.join(root, "nvidia", "cu13", "include")
            if os.path.isfile(os.path.join(candidate, "cuda_bf16.h")):
                folder = candidate
                break
    if not folder:
        raise KernelCompileError(
            "the CUDA runtime headers (cuda_fp16.h, cuda_bf16.h) were not found: "
            "pip install 'nvidia-cuda-runtime>=13,<14'"
        )
    try:
        version = md.version("nvidia-cuda-runtime")
    except md.PackageNotFoundError:
        version = "unknown"
    return folder, f"nvidia-cuda-runtime {version}"


@dataclass(frozen=True)
class KernelSource:
    """One kernel: CUDA C ``source`` with an ``extern "C" __global__`` function ``entry``.

    ``params`` declares each parameter's type in order (``"f32*"``, ``"u64"``, ``"void*"``, …);
    launches are checked and converted against it on every device. ``cpu`` is the NumPy twin the
    CPU device runs: it receives each pointer as a flat NumPy array of the declared dtype (the
    whole buffer) and each scalar as a NumPy scalar, and must compute what the whole launch
    computes, whatever the grid.

    ``pdl_wait`` says where the kernel waits for the previous kernel of its stream (programmatic
    dependent launch, `compiled_source`): ``"entry"``, as its first statement; ``"kernel"``,
    where its source calls ``EP_PDL_WAIT()`` (every thread, before it reads anything an earlier
    kernel wrote and before its first global write), so it can load data no kernel writes
    (resident weights) while the previous kernel still runs.

    ``cooperative`` marks a kernel whose blocks wait for each other (a barrier in global memory):
    every launch is a cooperative one, which the driver starts only if the whole grid is resident
    at once (`Kernel.resident_blocks` says how many blocks that is), and without programmatic
    dependent launch, so no earlier kernel still holds the SMs its blocks need.

    ``targets`` lists the architecture-specific targets a kernel exists for (``("sm_90a",)``: it
    uses instructions only that architecture has, such as wgmma); it compiles for those
    (``sm_90`` means ``sm_90a`` for it), is skipped by `compile_all` elsewhere, and refused there
    with `KernelUnavailableError`. Empty: every architecture.
    """

    name: str
    source: str
    params: tuple[str, ...]
    entry: str = ""  # defaults to ``name``
    options: CompileOptions = field(default_factory=CompileOptions)
    cpu: Callable[..., None] | None = field(default=None, compare=False)
    pdl_wait: Literal["entry", "kernel"] = "entry"
    cooperative: bool = False
    targets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]*", self.name):
            raise KernelRegistryError(
                f"kernel name {self.name!r} is not valid: use letters, digits, '_', '.', '-'"
            )
        if not self.entry:
            object.__setattr__(self, "entry", self.name)
        object.__setattr__(self, "params", tuple(self.params))
        for param in self.params:
            param_dtype(param)
        if self.pdl_wait not in ("entry", "kernel"):
            raise KernelRegistryError(
                f"kernel {self.name!r}: pdl_wait={self.pdl_wait!r}; expected 'entry' (the wait is "
                "the kernel's first statement) or 'kernel' (its source calls EP_PDL_WAIT())"
            )
        if self.pdl_wait == "kernel" and "EP_PDL_WAIT()" not in self.source:
            raise KernelRegistryError(
                f"kernel {self.name!r}: pdl_wait='kernel' but its source never calls "
                "EP_PDL_WAIT(); call it before the kernel reads what an earlier kernel wrote, or "
                "use pdl_wait='entry'"
            )
        object.__setattr__(self, "targets", tuple(self.targets))
        for target in self.targets:
            if not re.fullmatch(r"sm_\d{2,3}[af]", target):
                raise KernelRegistryError(
                    f"kernel {self.name!r}: target {target!r} is not architecture-specific; "
                    "targets name sm_XXa or sm_XXf (leave targets empty for every architecture)"
                )
        pattern = rf"__global__\b[^;{{]*\b{re.escape(self.entry)}\s*\("
        if not re.search(pattern, self.source):
            raise KernelRegistryError(
                f"kernel {self.name!r}: no '__global__ ... {self.entry}(' in its source; "
                f'declare the entry as extern "C" __global__ void {self.entry}(...)'
            )

    @property
    def signature(self) -> str:
        """``name(f32*, u64)`` for messages."""
        return f"{self.name}({', '.join(self.params)})"

    def same_kernel(self, other: KernelSource) -> bool:
        """Whether two sources compile and launch identically (the CPU twin may be re-created)."""
        fields = ("name", "source", "params", "entry", "options", "pdl_wait", "cooperative",
                  "targets")  # fmt: skip
        return all(getattr(self, f) == getattr(other, f) for f in fields)


class KernelRegistry:
    """Kernels by name. The ops register theirs at import; `compile_all` compiles every one."""

    def __init__(self) -> None:
        self._kernels: dict[str, KernelSource] = {}

    def register(self, source: KernelSource) -> KernelSource:
        """Add ``source``; the same kernel again is a no-op, a different one an error."""
        known = self._kernels.get(source.name)
        if known is not None:
            if known.same_kernel(source):
                return known
            raise KernelRegistryError(
                f"kernel name {source.name!r} is already registered with a different source, "
                "parameters or options: give the new kernel its own name"
            )
        self._kernels[source.name] = source
        return source

    def get(self, name: str) -> KernelSource:
        """The kernel registered as ``name``."""
        try:
            return self._kernels[name]
        except KeyError:
            known = ", ".join(sorted(self._kernels)) or "none"
            raise KernelRegistryError(
                f"no kernel named {name!r} is registered (registered: {known}); import the "
                "module that registers it before asking for it"
            ) from None

    def names(self) -> list[str]:
        """Registered names, sorted."""
        return sorted(self._kernels)

    def __contains__(self, name: object) -> bool:
        return name in self._kernels

    def __iter__(self) -> Iterator[KernelSource]:
        return iter([self._kernels[n] for n in self.names()])

    def __len__(self) -> int:
        return len(self._kernels)


KERNELS = KernelRegistry()


def register_kernel(source: KernelSource) -> KernelSource:
    """Register ``source`` in the project-wide registry `KERNELS` and return it."""
    return KERNELS.register(source)


# --- versions --------------------------------------------------------------------------------


@functools.cache
def nvrtc_version() -> str:
    """The NVRTC library's ``major.minor`` (part of every cache key)."""
    try:
        from cuda.bindings import nvrtc
    except ImportError as exc:
        raise DeviceUnavailableError(
            f"NVRTC is not available ({exc}): pip install 'cuda-bindings>=13,<14' "
            "'nvidia-cuda-nvrtc>=13,<14'"
        ) from exc
    try:
        result, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # the NVRTC shared library itself is missing
        raise DeviceUnavailableError(
            f"NVRTC could not be loaded ({exc}): pip install 'nvidia-cuda-nvrtc>=13,<14'"
        ) from exc
    if getattr(result, "name", "NVRTC_SUCCESS") != "NVRTC_SUCCESS":
        raise DeviceUnavailableError(f"nvrtcVersion failed with {result}")
    return f"{major}.{minor}"


@functools.cache
def _cuda_core_version() -> str:
    try:
        from cuda.core import __version__
    except ImportError:
        return "none"
    return str(__version__)


# --- the cache -------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheLookup:
    """What a cache lookup found: the cubin, or why there is none (``problem`` empty: a miss)."""

    cubin: bytes | None
    problem: str = ""


class KernelCache:
    """Cubins on disk, one file per key, each with a checksummed header."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"KernelCache({str(self.root)!r})"

    @staticmethod
    def key(source: KernelSource, arch: str) -> str:
        """SHA-256 over everything that changes the cubin."""
        material = {
            "format": _FORMAT_VERSION,
            "source": compiled_source(source, arch),
            "arch": arch,
            "options": source.options.key_fields(),
            "nvrtc": nvrtc_version(),
            "cuda_core": _cuda_core_version(),
        }
        blob = json.dumps(material, sort_keys=True, default=list).encode()
        return hashlib.sha256(blob).hexdigest()

    def path(self, key: str, name: str = "") -> Path:
        """Where the cubin for ``key`` lives (the kernel name is only for people reading ls)."""
        prefix = f"{name}-" if name else ""
        return self.root / f"{prefix}{key[:32]}.cubin"

    def load(self, key: str, name: str = "") -> CacheLookup:
        """The cached cubin for ``key``; a damaged file is reported in ``problem``, not loaded."""
        path = self.path(key, name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return CacheLookup(None)
        except OSError as exc:
            return CacheLookup(None, f"cannot read {path}: {exc}")
        if len(data) < _HEADER.size:
            return CacheLookup(
                None, f"{path} is truncated ({len(data)} bytes, header alone is {_HEADER.size})"
            )
        magic, version, length, digest, stored_key = _HEADER.unpack_from(data)
        payload = data[_HEADER.size :]
        if magic != _MAGIC:
            return CacheLookup(None, f"{path} is not a genai-ep cubin cache file (bad magic)")
        if version != _FORMAT_VERSION:
            return CacheLookup(
                None, f"{path} has cache format {version}, expected {_FORMAT_VERSION}"
            )
        if stored_key != key.encode()[:64]:
            return CacheLookup(None, f"{path} holds another key")
        if len(payload) != length:
            return CacheLookup(
                None, f"{path} is truncated (payload {len(payload)} of {length} bytes)"
            )
        if hashlib.sha256(payload).digest() != digest:
            return CacheLookup(None, f"{path} is corrupted (checksum mismatch)")
        return CacheLookup(payload)

    def store(self, key: str, cubin: bytes, name: str = "") -> Path:
        """Write atomically: a temporary file in the same folder, fsync, then `os.replace`."""
        path = self.path(key, name)
        header = _HEADER.pack(
            _MAGIC, _FORMAT_VERSION, len(cubin), hashlib.sha256(cubin).digest(), key.encode()[:64]
        )
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as out:
                out.write(header)
                out.write(cubin)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return path


def default_cache() -> KernelCache:
    """``$GENAI_EP_KERNEL_CACHE``, else ``~/.cache/genai-ep/kernels``."""
    root = os.environ.get(CACHE_ENV)
    return KernelCache(root if root else Path.home() / ".cache" / "genai-ep" / "kernels")


# --- compiling -------------------------------------------------------------------------------


@dataclass(frozen=True)
class KernelReport:
    """One row of ``genai-ep kernels``: what compiling (or loading) one kernel did."""

    name: str
    arch: str
    cubin_bytes: int
    # corrupt: the file was bad and rebuilt; skipped: not for this architecture (`targets`)
    cache: Literal["hit", "miss", "corrupt", "none", "skipped"]
    seconds: float
    path: str = ""
    note: str = ""


@dataclass(frozen=True)
class CompiledKernel:
    """A cubin and the report of how it was obtained."""

    source: KernelSource
    arch: str
    cubin: bytes
    report: KernelReport


def check_arch(arch: str) -> str:
    """Accept ``sm_XX`` only: cubins, never PTX."""
    if not _ARCH.match(arch):
        hint = ""
        if arch.startswith("compute_"):
            hint = (
                " (compute_XX means PTX, which an NVRTC newer than the driver emits in a "
                "form the driver cannot load)"
            )
        raise KernelCompileError(
            f"architecture {arch!r} is not a cubin target{hint}: pass sm_XX, for example sm_90 "
            "for an H100 or H200"
        )
    return arch


def cubin_symbols(cubin: bytes) -> frozenset[str]:
    """Names in a cubin's ELF symbol table (to check the entry really is there, unmangled)."""
    try:
        if cubin[:4] != b"\x7fELF" or cubin[4] != 2 or cubin[5] != 1:
            raise ValueError("not a 64-bit little-endian ELF file")
        (shoff,) = struct.unpack_from("<Q", cubin, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", cubin, 0x3A)
        sections = [
            struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize) for i in range(shnum)
        ]
        names: set[str] = set()
        for _, sh_type, _, _, offset, size, link, _, _, entsize in sections:
            if sh_type != 2 or entsize == 0:  # SHT_SYMTAB
                continue
            str_offset, str_size = sections[link][4], sections[link][5]
            strtab = cubin[str_offset : str_offset + str_size]
            for at in range(offset, offset + size, entsize):
                (st_name,) = struct.unpack_from("<I", cubin, at)
                end = strtab.find(b"\0", st_name)
                if end > st_name:
                    names.add(strtab[st_name:end].decode("ascii", "replace"))
        return frozenset(names)
    except (struct.error, IndexError, ValueError) as exc:
        raise KernelCompileError(f"the compiled output is not a readable cubin: {exc}") from exc


# Programmatic dependent launch (sm_90 and later): every kernel starts by letting the next
# kernel in its stream launch (``launch_dependents``: the next one's blocks are scheduled while
# this one runs, hiding the launch latency), and waits for the previous kernel to finish and flush
# its memory (``wait``) before it touches anything an earlier kernel wrote: as its first statement
# (`PDL_PROLOGUE`), or where its source calls ``EP_PDL_WAIT()`` (``KernelSource.pdl_wait ==
# "kernel"``: the GEMVs issue their resident weights' loads first). Either way each kernel sees
# all earlier results, exactly as without PDL; the CUDA device launches with the matching
# attribute.
PDL_TRIGGER = 'asm volatile("griddepcontrol.launch_dependents;" ::: "memory");'
PDL_PROLOGUE = (
    'asm volatile("griddepcontrol.launch_dependents;\\n\\tgriddepcontrol.wait;" ::: "memory");'
)
PDL_WAIT_MACRO = '#define EP_PDL_WAIT() asm volatile("griddepcontrol.wait;" ::: "memory")\n'
NO_PDL_WAIT_MACRO = "#define EP_PDL_WAIT() ((void)0)\n"  # before sm_90: kernels are serialized


def pdl_arch(arch: str) -> bool:
    """Whether ``arch`` (``sm_XX``) has programmatic dependent launch (compute capability 9+)."""
    return int(check_arch(arch)[3:].rstrip("af")) >= 90


def with_pdl_prologue(text: str, entry: str, prologue: str = PDL_PROLOGUE) -> str:
    """``text`` with ``prologue`` as the first statement of the ``__global__`` ``entry``."""
    found = re.search(rf"__global__\b[^;{{]*\b{re.escape(entry)}\s*\(", text)
    if found is None:
        raise KernelCompileError(f"kernel {entry!r}: no __global__ function {entry}( in its source")
    depth, at = 1, found.end()
    while depth and at < len(text):  # the parameter list's closing parenthesis
        depth += {"(": 1, ")": -1}.get(text[at], 0)
        at += 1
    brace = text.find("{", at)
    if depth or brace < 0 or text[at:brace].strip():
        raise KernelCompileError(f"kernel {entry!r}: its body does not follow its parameters")
    return f"{text[: brace + 1]}\n    {prologue}{text[brace + 1 :]}"


def compiled_source(source: KernelSource, arch: str) -> str:
    """The text NVRTC compiles for ``arch``: an ``EP_PDL_WAIT()`` definition (a no-op before
    sm_90), then the source with, from sm_90 on, the PDL prologue (only its trigger when the
    kernel places its own wait: ``pdl_wait == "kernel"``)."""
    if not pdl_arch(arch):
        return NO_PDL_WAIT_MACRO + source.source
    prologue = PDL_TRIGGER if source.pdl_wait == "kernel" else PDL_PROLOGUE
    return PDL_WAIT_MACRO + with_pdl_prologue(source.source, source.entry, prologue)


def _nvrtc_compile(source: KernelSource, arch: str) -> bytes:
    try:
        from cuda.core import Program, ProgramOptions
    except ImportError as exc:
        raise DeviceUnavailableError(
            f"cuda-core is not importable ({exc}): pip install 'cuda-core>=1.2,<2'"
        ) from exc
    opts = source.options
    program_options = ProgramOptions(
        name=source.name,
        arch=arch,
        std=opts.std,
        fma=opts.fma,
        use_fast_math=opts.use_fast_math,
        max_register_count=opts.max_register_count,
        lineinfo=opts.lineinfo,
        define_macro=[tuple(d) for d in opts.defines] or None,
        include_path=[cuda_headers()[0]] if opts.cuda_headers else None,
    )
    log = io.StringIO()
    program = None
    try:
        program = Program(compiled_source(source, arch), "c++", program_options)
        code = program.compile("cubin", logs=log)
        cubin = bytes(code.code)
    except Exception as exc:  # NVRTCError carries the compiler log in its text
        text = str(exc).strip() or log.getvalue().strip()
        raise KernelCompileError(
            f"kernel {source.name!r} did not compile for {arch} with NVRTC {nvrtc_version()}:\n"
            f"{text}"
        ) from exc
    finally:
        if program is not None:
            with contextlib.suppress(Exception):
                program.close()
    symbols = cubin_symbols(cubin)
    if source.entry not in symbols:
        mangled = sorted(s for s in symbols if source.entry in s)
        raise KernelCompileError(
            f"kernel {source.name!r}: the cubin has no symbol {source.entry!r}"
            + (f" (found mangled {', '.join(mangled)})" if mangled else "")
            + f'; declare it extern "C" __global__ void {source.entry}(...)'
        )
    return cubin


def kernel_target(source: KernelSource, arch: str) -> str | None:
    """The target ``source`` compiles for on ``arch``: ``arch`` itself, or the kernel's
    architecture-specific target of the same architecture (``sm_90a`` on ``sm_90``); None when
    the kernel does not exist for ``arch``."""
    if not source.targets:
        return arch
    base = check_arch(arch).rstrip("af")
    return next((t for t in source.targets if t.rstrip("af") == base), None)


def compile_kernel(
    source: KernelSource, arch: str, *, cache: KernelCache | None = None, use_cache: bool = True
) -> CompiledKernel:
    """Cubin for ``source`` on ``arch`` (``sm_XX``), from the cache when a sound copy is there."""
    check_arch(arch)
    target = kernel_target(source, arch)
    if target is None:
        raise KernelUnavailableError(
            f"kernel {source.name!r} uses instructions only {', '.join(source.targets)} has; "
            f"it does not exist for {arch}, where its caller needs another kernel"
        )
    arch = target
    cache = cache if cache is not None else default_cache()
    start = time.perf_counter()
    key = KernelCache.key(source, arch)
    status: Literal["hit", "miss", "corrupt", "none"] = "miss" if use_cache else "none"
    note = ""
    if use_cache:
        found = cache.load(key, source.name)
        if found.cubin is not None:
            report = KernelReport(
                source.name,
                arch,
                len(found.cubin),
                "hit",
                time.perf_counter() - start,
                str(cache.path(key, source.name)),
            )
            return CompiledKernel(source, arch, found.cubin, report)
        if found.problem:
            status, note = "corrupt", f"recompiled: {found.problem}"
    cubin = _nvrtc_compile(source, arch)
    path = ""
    if use_cache:
        try:
            path = str(cache.store(key, cubin, source.name))
        except OSError as exc:
            # A read-only cache must not stop the program: the cubin is in hand.
            note = (note + "; " if note else "") + f"not cached: {exc}"
    report = KernelReport(
        source.name, arch, len(cubin), status, time.perf_counter() - start, path, note
    )
    return CompiledKernel(source, arch, cubin, report)


def compile_all(
    arch: str, *, registry: KernelRegistry | None = None, cache: KernelCache | None = None
) -> list[KernelReport]:
    """Compile every registered kernel for ``arch``; needs NVRTC only, no GPU or driver."""
    registry = registry if registry is not None else KERNELS
    return [
        compile_kernel(source, arch, cache=cache).report
        if kernel_target(source, arch)
        else skipped_report(source, arch)
        for source in registry
    ]


def skipped_report(source: KernelSource, arch: str) -> KernelReport:
    """The row of a kernel that does not exist for ``arch`` (its `KernelSource.targets`)."""
    return KernelReport(
        source.name, arch, 0, "skipped", 0.0, note=f"only for {', '.join(source.targets)}"
    )


def compile_all_kernels(arch: str | None) -> list[KernelReport]:
    """What ``genai-ep kernels [--arch sm_90]`` runs: compile every registered kernel.

    With ``arch=None`` the architecture of ``cuda:0`` is used, which needs a GPU.
    """
    if arch is None:
        from ep.device._probe import probe_cuda

        probe = probe_cuda()
        if not probe.available:
            raise DeviceUnavailableError(
                f"cannot tell which architecture to compile for: {probe.reason}; "
                "pass --arch sm_90 (H100/H200) or another sm_XX"
            )
        from ep.device import get_device

        arch = get_device("cuda:0").arch
        assert arch is not None  # a CUDA device always knows its architecture
    return compile_all(arch)
