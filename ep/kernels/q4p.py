"""4-bit MatMulNBits weights repacked for the decode GEMV: ``ep_gemv_q4p_<dt>``.

MatMulNBits stores a row's 32-weight blocks one after another ([N, k_blocks, 16] bytes), so the
GEMVs that read it as is (``ep_gemv_q4`` and ``ep_gemv_q4_v2``) give each lane of an MMA quad a
different block and must scale every weight pair before its MMA. `pack_q4` reorders the bytes
once, at load, so that every MMA's 16 k lie in one block and each warp's weights, scales and zero
points are contiguous streams; `gemv_q4_packed` then runs the exact integers ``q - z`` through
the MMA and applies each block's scale once to the fp32 product of its two MMAs (the .cu file,
"packed 4-bit GEMV", has the layout and the instruction counts).

The arithmetic differs from the unpacked kernels' (which round ``(q - z) * s`` to the activation
dtype before the MMA): the scale is applied in fp32, so the result is at least as close to the
exact product; a row's sums never depend on M, the grid or timing. Block size 32 and fp16/bf16
activations only (`pack_q4` refuses the rest); M <= 16 (`GEMV_MAX_ROWS`).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass

import numpy as np

from ep.device import Buffer, CompileOptions, Device, KernelSource, Stream, register_kernel
from ep.errors import KernelArgumentError
from ep.kernels import matmul

# the .cu's flags, and the argument checks every matmul wrapper makes
from ep.kernels.matmul import _FLAG_EARLY, _FLAG_ZP, _buffer, _disjoint, _product, _x16
from ep.ops.matmul import _unpack_nibbles as unpack_nibbles

__all__ = [
    "BLOCK",
    "Q4P_KERNELS",
    "RINGS",
    "RING_ENV",
    "PackedQ4",
    "gemv_q4_packed",
    "pack_q4",
    "unpack_q4",
    "upload_q4",
]

BLOCK = 32  # the MatMulNBits block size the packed layout takes
_WARPS = 8  # Q4P_WARPS in the .cu
# Ring variants: (ring slots a warp, blocks an SM); the first is the default, the others are
# compiled for A/B runs (``ring=`` of `gemv_q4_packed`, ``GENAI_EP_Q4P=d8b2``). H200, 896 x
# 151936 bf16, µs at M = 1 / 16 in one run (docs/benchmarks/h200.md): d6b2 26.6 / 34.0, d8b2
# 27.2 / 34.3, d4b3 32.4 / 46.3 and d6b3 39.2 / 49.8 (3 blocks an SM cap a thread at 85
# registers: both spill), the v2 GEMV on the unpacked weight 35.2 / 39.5. An L2 prefetch of the
# steps 8 or 16 past a d6b2 ring was slower (28.4 and 29.4 against 26.5 at M = 1).
RINGS: tuple[tuple[int, int], ...] = ((6, 2), (8, 2))
RING_ENV = "GENAI_EP_Q4P"
_ROWS, _STEP = 16, 64  # a row group, the k a step covers (two blocks)
_SIZES = ("i32", "i32", "i32", "u32")  # M, N, K, flags


def _tables() -> tuple[np.ndarray, np.ndarray]:
    """(row in the group, k in the step) of nibble p of word u of lane (g, t): [32, 4, 8]."""
    lane, u, p = np.meshgrid(np.arange(32), np.arange(4), np.arange(8), indexing="ij")
    g, t, r, hi = lane >> 2, lane & 3, p & 3, p >> 2
    return g + 8 * (r & 1), 16 * u + 2 * t + 8 * (r >> 1) + hi


_ROW, _K = _tables()


def _groups(n: int, k: int) -> tuple[int, int]:
    return -(-n // _ROWS), -(-k // _STEP)


def pack_q4(
    b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, *, N: int, K: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """MatMulNBits (b uint8 [N, k_blocks, 16], scales [N * k_blocks], zero points uint8 [N,
    ceil(k_blocks / 2)] or None) of block size 32 -> (weights uint8, scales, zero points uint16
    or None) in the ``ep_gemv_q4p`` layout (the .cu file). Rows past N and k past K are zero
    weights with zero scales."""
    kb = -(-K // BLOCK)
    if b.dtype != np.uint8 or b.size != N * kb * BLOCK // 2:
        raise ValueError(
            f"pack_q4: b must be uint8 [N={N}, {kb}, 16] (block size {BLOCK}); got {b.dtype} of "
            f"{b.size} bytes"
        )
    if scales.size != N * kb:
        raise ValueError(f"pack_q4: scales must hold N * k_blocks = {N * kb}; got {scales.size}")
    G, S = _groups(N, K)
    q = np.zeros((G * _ROWS, S * _STEP), np.uint8)
    q[:N, : kb * BLOCK] = unpack_nibbles(b.reshape(N, kb * BLOCK // 2))
    words = q.reshape(G, _ROWS, S, _STEP).transpose(0, 2, 1, 3)[:, :, _ROW, _K]
    packed = (words.astype(np.uint32) << (4 * np.arange(8, dtype=np.uint32))).sum(
        axis=-1, dtype=np.uint32
    )  # [G, S, 32, 4]
    s = np.zeros((G * _ROWS, 2 * S), scales.dtype)
    s[:N, :kb] = scales.reshape(N, kb)
    # [G, (h, g), S, b] -> [G, S, g, (b, h)]
    ps = s.reshape(G, 2, 8, S, 2).transpose(0, 3, 2, 4, 1).reshape(-1)
    pz = None
    if zero_points is not None:
        if zero_points.dtype != np.uint8 or zero_points.size != N * ((kb + 1) // 2):
            raise ValueError(
                f"pack_q4: zero_points must be uint8 [N, {(kb + 1) // 2}]; got "
                f"{zero_points.dtype} of {zero_points.size}"
            )
        z = np.full((G * _ROWS, 2 * S), 8, np.uint16)
        z[:N, :kb] = unpack_nibbles(zero_points.reshape(N, -1))[:, :kb]
        nib = z.reshape(G, 2, 8, S, 2).transpose(0, 3, 2, 4, 1).reshape(G, S, 8, 4)
        pz = (nib << (4 * np.arange(4, dtype=np.uint16))).sum(axis=-1, dtype=np.uint16).reshape(-1)
    return packed.reshape(-1).view(np.uint8), ps, pz


def unpack_q4(
    packed: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, *, N: int, K: int
) -> np.ndarray:
    """The dequantized weights [N, K] (float32, ``(q - z) * s``) of a `pack_q4` layout."""
    G, S = _groups(N, K)
    words = packed[: G * S * 512].view(np.uint32).reshape(G, S, 32, 4, 1)
    nibbles = (words >> (4 * np.arange(8, dtype=np.uint32))) & 15  # [G, S, 32, 4, 8]
    q = np.zeros((G, S, _ROWS, _STEP), np.float32)
    q[:, :, _ROW, _K] = nibbles
    s = scales[: G * S * 32].astype(np.float32).reshape(G, S, 8, 2, 2)  # [.., g, b, h]
    if zeros is None:
        z = np.full((G, S, 8, 2, 2), 8.0, np.float32)
    else:
        zw = zeros[: G * S * 8].reshape(G, S, 8, 1)
        z = ((zw >> (4 * np.arange(4, dtype=np.uint16))) & 15).astype(np.float32)
        z = z.reshape(G, S, 8, 2, 2)
    # per (row 8h + g, block b): [G, S, h, g, b] broadcast over the block's 32 k
    s = s.transpose(0, 1, 4, 2, 3).reshape(G, S, _ROWS, 2, 1)
    z = z.transpose(0, 1, 4, 2, 3).reshape(G, S, _ROWS, 2, 1)
    w = (q.reshape(G, S, _ROWS, 2, BLOCK) - z) * s
    return w.reshape(G, S, _ROWS, _STEP).transpose(0, 2, 1, 3).reshape(G * _ROWS, S * _STEP)[:N, :K]


@dataclass(frozen=True)
class PackedQ4:
    """A `pack_q4` weight on a device: the arrays of ``ep_gemv_q4p`` and the product's N, K."""

    weights: Buffer  # uint8
    scales: Buffer  # the activations' dtype
    zeros: Buffer | None  # uint16, or None: every zero point is 8
    N: int
    K: int


def upload_q4(
    dev: Device,
    b: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    *,
    N: int,
    K: int,
    stream: Stream,
    name: str = "q4p",
) -> PackedQ4:
    """`pack_q4` on the host, then the arrays to ``dev``."""
    pw, ps, pz = pack_q4(b, scales, zero_points, N=N, K=K)
    return PackedQ4(
        dev.to_device(pw, stream=stream, name=f"{name}.weights"),
        dev.to_device(ps, stream=stream, name=f"{name}.scales"),
        None if pz is None else dev.to_device(pz, stream=stream, name=f"{name}.zeros"),
        N,
        K,
    )


def shared_bytes(M: int, K: int) -> int:
    """Dynamic shared memory of a block: x staged for 8 rows (16 when M > 8)."""
    return (16 if M > 8 else 8) * (_groups(1, K)[1] * 128 + 16)


def gemv_q4_packed(
    dev: Device,
    out: Buffer,
    x: Buffer,
    w: PackedQ4,
    *,
    M: int,
    stream: Stream,
    resident: bool = False,
    ring: str | None = None,
) -> matmul.MatmulPlan:
    """``out[M, N] = x[M, K] @ dequantize(W)^T`` for a `PackedQ4` weight (fp16/bf16, M <= 16).
    ``resident``: as in `ep.kernels.matmul.gemm` (no kernel writes W while this call may run).
    ``ring``: a variant of `RINGS` ("d<steps>b<blocks>"; default `RING_ENV`, else the first)."""
    op = "gemv_q4_packed"
    names = {f"d{d}b{b}": (d, b) for d, b in RINGS}
    ring = ring or os.environ.get(RING_ENV, "").strip() or next(iter(names))
    if ring not in names:
        raise KernelArgumentError(
            f"{op}: ring {ring!r} is not compiled; expected one of {', '.join(names)}"
        )
    per_sm = names[ring][1]
    N, K = w.N, w.K
    if not 1 <= M <= matmul.GEMV_MAX_ROWS:
        raise KernelArgumentError(f"{op}: M={M} must be in [1, {matmul.GEMV_MAX_ROWS}]")
    dtype = x.dtype
    if dtype not in (np.dtype(np.float16), matmul._BF16):
        raise KernelArgumentError(f"{op}: x is {dtype}; the packed GEMV takes fp16/bf16")
    G, S = _groups(N, K)
    _buffer(op, dev, "x", x, M * K, dtype)
    _buffer(op, dev, "weights", w.weights, G * S * 512, np.dtype(np.uint8))
    _buffer(op, dev, "scales", w.scales, G * S * 32, dtype)
    if w.zeros is not None:
        _buffer(op, dev, "zeros", w.zeros, G * S * 8, np.dtype(np.uint16))
    _buffer(op, dev, "out", out, M * N, dtype)
    inputs = {"x": x, "weights": w.weights, "scales": w.scales}
    if w.zeros is not None:
        inputs["zeros"] = w.zeros
    _disjoint(op, out, inputs)
    flags = _x16(x, K) | (_FLAG_EARLY if resident else 0)
    flags |= _FLAG_ZP if w.zeros is not None else 0
    suffix = "bf16" if dtype == matmul._BF16 else "f16"
    sms = matmul.sm_count(dev)
    blocks = max(1, min(per_sm * sms, -(-G // _WARPS)))
    shared = shared_bytes(M, K)
    name = _name(ring, suffix)
    kernel = dev.kernel(name)
    zeros = w.zeros if w.zeros is not None else w.weights  # never read without EPK_ZP
    kernel.launch(blocks, 32 * _WARPS, out, x, w.weights, w.scales, zeros, M, N, K, flags,
                  stream=stream, shared_mem=shared)  # fmt: skip
    return matmul.MatmulPlan(
        name, "gemv", (blocks, 1, 1), 32 * _WARPS, 1, 1,
        f"packed 4-bit GEMV: {G} groups of 16 rows over {blocks} persistent blocks x {_WARPS} "
        f"warps, {S} steps of 64 k a group", shared,
    )  # fmt: skip


def _twin(
    y: np.ndarray, x: np.ndarray, b: np.ndarray, scales: np.ndarray, zeros: np.ndarray,
    M: np.int32, N: np.int32, K: np.int32, flags: np.uint32,
) -> None:  # fmt: skip
    """The NumPy twin: the dequantized weights in fp32, row by row (as the kernel: a row's sums
    do not depend on M), rounded once."""
    m, n, k = int(M), int(N), int(K)
    z = zeros.view(np.uint16) if int(flags) & _FLAG_ZP else None
    w = unpack_q4(b, scales, z, N=n, K=k)
    y[: m * n] = _product(x[: m * k].reshape(m, k), w.T, True).reshape(-1)


def _name(ring: str, suffix: str) -> str:
    """The default ring's kernel is ``ep_gemv_q4p_<dt>``; the others ``ep_gemv_q4p_<ring>_<dt>``."""
    default = f"d{RINGS[0][0]}b{RINGS[0][1]}"
    return f"ep_gemv_q4p_{suffix}" if ring == default else f"ep_gemv_q4p_{ring}_{suffix}"


def _register() -> dict[str, KernelSource]:
    body = matmul._cuda_source()
    out: dict[str, KernelSource] = {}
    for (depth, per_sm), (suffix, ctype) in itertools.product(
        RINGS, (("f16", "__half"), ("bf16", "__nv_bfloat16"))
    ):
        name = _name(f"d{depth}b{per_sm}", suffix)
        entry = (
            f'extern "C" __global__ void __launch_bounds__({32 * _WARPS}, {per_sm}) '
            f"{name}(T* y, const T* x, const u8* b, const T* scales, const void* zp, int M, int N, "
            f"int K, u32 flags) {{\n  epk::q4p_gemv<T, {depth}>(y, x, b, scales, zp, M, N, K, "
            "flags);\n}\n"
        )
        out[name] = register_kernel(
            KernelSource(
                name=name,
                source=f"{body}\ntypedef {ctype} T;\n{entry}",
                params=(f"{suffix}*", f"{suffix}*", "u8*", f"{suffix}*", "void*", *_SIZES),
                options=CompileOptions(cuda_headers=True),
                cpu=_twin,
                pdl_wait="kernel",
            )
        )
    return out


Q4P_KERNELS: dict[str, KernelSource] = _register()
