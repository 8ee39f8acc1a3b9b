"""What the op kernels share: the CUDA prelude, per-dtype registration, the fault status buffer,
and the host-side argument checks of the wrappers.

Every float kernel is registered once per dtype (``<name>_f32``, ``<name>_f16``, ``<name>_bf16``)
from one CUDA C body in which ``T`` is the element type; loads convert to float32, all arithmetic
is float32 (float64 where a NumPy reference uses float64), and stores round once to ``T``.

Kernels never raise: an index read from device memory that is out of range (a token id, a position,
a block-table page) is skipped and a bit is set in a ``uint32`` status buffer the caller owns. The
host reads it when it chooses (`check_faults`), so a decode step stays capturable.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence

import ml_dtypes
import numpy as np

from ep.device import Buffer, CompileOptions, Device, KernelSource, Stream, register_kernel
from ep.errors import KernelArgumentError, KernelFaultError

__all__ = [
    "FLOAT_DTYPES",
    "PRELUDE",
    "SILU_MUL",
    "KernelFault",
    "check_faults",
    "dtype_suffix",
    "new_status",
    "register_per_dtype",
    "set_fault",
]

BF16 = np.dtype(ml_dtypes.bfloat16)
# dtype -> (kernel-name suffix, CUDA C type, elements in 16 bytes)
FLOAT_DTYPES: dict[np.dtype, tuple[str, str, int]] = {
    np.dtype(np.float32): ("f32", "float", 4),
    np.dtype(np.float16): ("f16", "__half", 8),
    BF16: ("bf16", "__nv_bfloat16", 8),
}

PRELUDE = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;

static __device__ __forceinline__ float to_f32(float v) { return v; }
static __device__ __forceinline__ float to_f32(__half v) { return __half2float(v); }
static __device__ __forceinline__ float to_f32(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename X> __device__ __forceinline__ X from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f32<__half>(float v) {
    return __float2half_rn(v);
}
template <> __device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

// Elements of X in one 16-byte vector.
template <typename X> struct Pack { static constexpr int N = 16 / (int)sizeof(X); };

// 16-byte vector load/store; the caller guarantees 16-byte alignment.
template <typename X> __device__ __forceinline__ void load16(const X* p, float* out) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    const X* e = reinterpret_cast<const X*>(&raw);
#pragma unroll
    for (int i = 0; i < Pack<X>::N; ++i) out[i] = to_f32(e[i]);
}
template <typename X> __device__ __forceinline__ void store16(X* p, const float* in) {
    uint4 raw;
    X* e = reinterpret_cast<X*>(&raw);
#pragma unroll
    for (int i = 0; i < Pack<X>::N; ++i) e[i] = from_f32<X>(in[i]);
    *reinterpret_cast<uint4*>(p) = raw;
}

static __device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
static __device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block, returned to every thread. blockDim.x must be a multiple of 32 and every
// thread must call it; ``scratch`` holds 32 floats of shared memory.
static __device__ float block_sum(float v, float* scratch) {
    v = warp_sum(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();  // the scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = (int)(blockDim.x >> 5);
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// Max over the block, returned to every thread (same rules as block_sum).
static __device__ float block_max(float v, float* scratch) {
    v = warp_max(v);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    const int warps = (int)(blockDim.x >> 5);
    v = lane < warps ? scratch[lane] : __int_as_float(0xff800000u);
    return warp_max(v);
}

// An index from an int64 or int32 buffer.
static __device__ __forceinline__ i64 load_index(const void* p, i64 i, int is64) {
    return is64 ? reinterpret_cast<const i64*>(p)[i] : (i64)reinterpret_cast<const int*>(p)[i];
}

static __device__ __forceinline__ void set_fault(u32* status, u32 bit) { atomicOr(status, bit); }
"""

# silu(g) * u in float32, the one definition of the SwiGLU kernels (`ep.kernels.mlp`) and of the
# GEMVs with a SwiGLU epilogue (`ep.kernels.matmul`): both compile it with `OPTIONS`' settings, so
# the fused GEMV stores the bits of the GEMV followed by the SwiGLU kernel.
SILU_MUL = r"""
static __device__ __forceinline__ float silu_mul(float g, float u) {
    return g / (1.0f + expf(-g)) * u;
}
"""

# Headers for fp16/bf16; the kernels are tolerance-tested, so FMA contraction stays on.
OPTIONS = CompileOptions(cuda_headers=True)
# No FMA contraction anywhere (library code such as sincosf included): kernels that must store
# the same bits as another kernel computing the same expressions (rotary and the fused QKV commit).
EXACT_OPTIONS = CompileOptions(cuda_headers=True, fma=False)


class KernelFault(enum.IntFlag):
    """Bits a kernel sets in the status buffer when device data is out of range."""

    TOKEN_ID = 1  # an embedding id outside [0, vocab): its row was written as zeros
    ROTARY_POSITION = 2  # a position outside the cos/sin cache: the token passed unrotated
    KV_POSITION = 4  # a KV position >= capacity (or past the row's length): skipped / zeros
    KV_PAGE = 8  # a block-table column or page outside the table or the cache: skipped
    KV_ORDER = 16  # positions not increasing along a row in KVCommit (written anyway)
    SAMPLE_LOGITS = 32  # no finite logit to sample from (or a NaN/inf): the argmax was taken
    SAMPLE_KEY = 64  # a negative rng key or step: the argmax was taken

    def describe(self) -> str:
        """Each set bit in words."""
        return "; ".join(_FAULT_TEXT[bit] for bit in KernelFault if bit in self)


_FAULT_TEXT: dict[KernelFault, str] = {
    KernelFault.TOKEN_ID: "an embedding token id was outside [0, vocab) (its row was zeroed)",
    KernelFault.ROTARY_POSITION: "a rotary position was outside the cos/sin cache (not rotated)",
    KernelFault.KV_POSITION: (
        "a KV position was >= the cache capacity or past the row's committed length; grow the "
        "cache before the step and feed KVCommit's lengths"
    ),
    KernelFault.KV_PAGE: (
        "a paged-KV token mapped to a block-table column or page outside the table or the cache"
    ),
    KernelFault.KV_ORDER: "KVCommit positions did not increase along a row (padding first)",
    KernelFault.SAMPLE_LOGITS: "a row had no finite largest logit (NaN, +inf or all -inf)",
    KernelFault.SAMPLE_KEY: "a sampling rng key or step was negative",
}


def new_status(dev: Device, *, stream: Stream) -> Buffer:
    """A zeroed uint32[1] status buffer for the kernels' fault bits."""
    status = dev.alloc(1, np.uint32, stream=stream, name="kernel-status")
    dev.fill(status, 0, stream=stream)
    return status


def check_faults(dev: Device, status: Buffer, *, stream: Stream, reset: bool = True) -> None:
    """Raise `KernelFaultError` if a kernel set a fault bit in ``status`` (then zero it)."""
    bits = int(status.to_host(stream=stream).reshape(-1)[0])
    if bits and reset:
        dev.fill(status, 0, stream=stream)
    if bits:
        faults = KernelFault(bits & sum(KernelFault))
        raise KernelFaultError(
            f"a kernel flagged bad data on {dev.name}: {faults.describe() or hex(bits)} "
            f"(status {bits:#x})",
            faults=bits,
        )


def set_fault(status: np.ndarray, fault: KernelFault) -> None:
    """The CPU twins' ``atomicOr``."""
    status[0] |= np.uint32(fault)


# --- registration ----------------------------------------------------------------------------


def dtype_suffix(dtype: np.dtype, what: str) -> str:
    """``f32``/``f16``/``bf16`` for a float dtype; anything else is a `KernelArgumentError`."""
    found = FLOAT_DTYPES.get(np.dtype(dtype))
    if found is None:
        raise KernelArgumentError(
            f"{what}: dtype {dtype} has no kernel; expected float32, float16 or bfloat16"
        )
    return found[0]


def _params(params: str | Sequence[str]) -> tuple[str, ...]:
    """Parameter types as a tuple; a string lists them separated by spaces (long signatures)."""
    return tuple(params.split()) if isinstance(params, str) else tuple(params)


def register_per_dtype(
    name: str,
    body: str,
    params: str | Sequence[str],
    cpu: Callable[..., None],
    options: CompileOptions = OPTIONS,
    *,
    suffixes: Sequence[str] = ("f32", "f16", "bf16"),
    cooperative: bool = False,
) -> dict[str, KernelSource]:
    """Register ``<name>_<suffix>`` for each float dtype (of ``suffixes``) from ``body``.

    In ``body`` the entry is spelled ``KERNEL`` and the element type ``T``; in ``params`` ``"T*"``
    is the element pointer. ``cooperative``: see `KernelSource`.
    """
    params = _params(params)
    out: dict[str, KernelSource] = {}
    for suffix, ctype, _ in FLOAT_DTYPES.values():
        if suffix not in suffixes:
            continue
        entry = f"{name}_{suffix}"
        source = PRELUDE + f"typedef {ctype} T;\n" + body.replace("KERNEL", entry)
        out[suffix] = register_kernel(
            KernelSource(
                name=entry,
                source=source,
                params=tuple(p.replace("T*", f"{suffix}*") for p in params),
                options=options,
                cpu=cpu,
                cooperative=cooperative,
            )
        )
    return out


def register_one(
    name: str, body: str, params: str | Sequence[str], cpu: Callable[..., None]
) -> str:
    """Register one dtype-agnostic kernel (byte copies, integer work); returns its name."""
    source = PRELUDE + body
    register_kernel(KernelSource(name, source, _params(params), options=OPTIONS, cpu=cpu))
    return name


# --- host-side checks --------------------------------------------------------------------------


def need(ok: bool, op: str, message: str) -> None:
    """Raise `KernelArgumentError` naming the op unless ``ok``."""
    if not ok:
        raise KernelArgumentError(f"{op}: {message}")


def check_buffer(
    op: str, name: str, buffer: Buffer, elements: int, dtype: np.dtype | None = None
) -> None:
    """``buffer`` is a Buffer of ``dtype`` holding at least ``elements`` elements."""
    # Plain ifs: the messages are formatted only on failure (every eager launch passes here).
    if not isinstance(buffer, Buffer):
        need(False, op, f"{name} must be a device Buffer, got {type(buffer).__name__}")
    if dtype is not None and buffer.dtype != dtype:
        need(False, op, f"{name} {buffer.name!r} is {buffer.dtype}; expected {np.dtype(dtype)}")
    if buffer.size < elements:
        need(
            False,
            op,
            f"{name} {buffer.name!r} holds {buffer.size} elements; the sizes given need {elements}",
        )


def check_index_buffer(op: str, name: str, buffer: Buffer, elements: int) -> int:
    """An int64 or int32 index buffer of at least ``elements``; returns 1 for int64, 0 for int32."""
    need(
        isinstance(buffer, Buffer) and buffer.dtype in (np.dtype(np.int64), np.dtype(np.int32)),
        op,
        f"{name} must be an int64 or int32 Buffer, got "
        f"{getattr(buffer, 'dtype', type(buffer).__name__)}",
    )
    check_buffer(op, name, buffer, elements)
    return 1 if buffer.dtype == np.dtype(np.int64) else 0


def check_status(op: str, status: Buffer) -> None:
    check_buffer(op, "status", status, 1, np.dtype(np.uint32))


def aligned(*buffers: Buffer, to: int = 16) -> bool:
    """Whether every buffer's address is a multiple of ``to`` bytes."""
    return all(b.ptr % to == 0 for b in buffers)


def positive(op: str, **sizes: int) -> None:
    """Every size is a non-negative int."""
    for key, value in sizes.items():
        need(
            isinstance(value, int | np.integer) and not isinstance(value, bool) and value >= 0,
            op,
            f"{key}={value!r} must be a non-negative integer",
        )


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def threads_for(units: int, *, most: int = 1024, least: int = 32) -> int:
    """A block size: enough warps for ``units`` work items, between ``least`` and ``most``."""
    return max(least, min(most, round_up(max(units, 1), 32)))
