"""The 4-bit block-quantized decode GEMV on Hopper's FP8 tensor cores: ``ep_gemv_q4f8_bf16``
for weights with zero points and ``ep_gemv_q4f8_sym_bf16`` for those without (MatMulNBits
weights, block 32; sm_90a only).

`ep.kernels.mx4f8` runs MXFP4 weights through wgmma as e4m3 bytes; this is its 4-bit twin, on
the same loop (the .cu file's ``f8_run``). A 4-bit code q in the low half of a byte is the e4m3
value q x 2^-9 exactly (q < 8 are the subnormals m x 2^-9, q >= 8 the first binade, (8 + m) x
2^-9), so a word of 8 codes becomes its two A registers with a mask and a shift-and-mask:
`pack_q4f8` puts a row's codes in the low nibbles and the row 8 below in the high ones. The zero
points stay out of the products: a block's sum is s (sum of q x - z sum of x), and each row of x
has its 32-block sums staged beside it (from the bf16 x itself, not its e4m3 split). Scales are
bf16 (the activations' dtype), applied in fp32 after the block's wgmma; zero points are 8 or
given (MatMulNBits' packed nibbles). Each form has a kernel of its own: without zero points a
lane keeps one u32 of scales a step in its ring, not two (the .cu file's ``F8Scales``).

The activations are split into two e4m3 columns as `ep.kernels.mx4f8.split_x` says (exact within
9 binades of a row's largest magnitude), so this takes bf16 activations only;
`ep.kernels.q4p.gemv_q4_packed` takes fp16 ones and runs on any GPU.

On the H200 (896 x 151936, docs/benchmarks/h200.md, twenty-fifth session) it takes 23.1-23.9
µs at M = 1 with zero points (`ZP_RING`) and 21.1-21.8 without (`SYM_RING`), but 38.1-38.7 /
35.3-35.8 at M = 16; q4p took 26.3 / 23.4-23.5 at M = 1 and 33.6 / 30.6 at M = 16 when last
measured: above M = 4 q4p is the faster of the two.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ep.device import (
    Buffer,
    CompileOptions,
    Device,
    KernelSource,
    Stream,
    register_kernel,
)
from ep.kernels import matmul, mx4f8
from ep.kernels.matmul import _FLAG_EARLY, _buffer, _disjoint, _x16
from ep.kernels.q4p import _SIZES, _name, _ring, packed_to_device
from ep.ops.matmul import _unpack_nibbles as unpack_nibbles

__all__ = [
    "BLOCK",
    "Q4F8_KERNELS",
    "RINGS",
    "RING_ENV",
    "SYM_RING",
    "ZP_RING",
    "PackedQ4F8",
    "gemv_q4_f8",
    "pack_q4f8",
    "unpack_q4f8",
    "upload_q4f8",
]

BLOCK = 32  # the MatMulNBits block size the layout takes
_BF16 = np.dtype(ml_dtypes.bfloat16)
# Ring variants as `ep.kernels.mx4f8.RINGS` (steps a warp in flight at M <= 4, blocks an SM;
# _WIDER: at M <= 8 and M <= 16); the first is the default. The bf16 scales (a second register
# a step) and zero points (a third) leave less room than mx4f8's: at 3 or 1 blocks an SM (80
# registers) an 8-step ring spills 290-390 bytes (ptxas -v), 6 steps 16-24; at 2 blocks (128)
# 8 and 10 steps none, 12 steps 28. H200, 896 x 151936, µs at M = 1 / 4 / 16 with zero points
# in one run (docs/benchmarks/h200.md, fifteenth session): d8b2 24.59 / 25.00 / 39.69, d6b3
# 26.23 / 26.78 / 39.56, d6b1 26.24 / 26.59 / 39.29, d12b2 26.96 / 27.69 / 40.48 (q4p 26.33 /
# 26.52 / 33.58: faster above M = 4); symmetric, another run: d8b2 23.07 / 23.49, d10b2 24.56 /
# 24.74 (q4p 23.45 / 23.93). The symmetric kernels' u32 scales (twenty-third session) leave a
# register a step: d8b3 then fits 3 blocks an SM without spills, but measured no faster than
# d8b2 at M <= 4 (23.29 / 23.89 against 23.39 / 23.61, medians of three rounds), so it is not
# compiled. With zero points, a ring of 3 blocks an SM holds its scales as the symmetric one does
# (`_scale_slot`: 80 registers leave no room for a uint2 a step), and d4b3 is the fastest of
# those (twenty-fifth session).
RINGS: tuple[tuple[int, int], ...] = ((8, 2), (6, 3), (6, 1), (4, 3))
_WIDER = {(8, 2): (8, 6), (6, 3): (4, 2), (6, 1): (4, 2), (4, 3): (4, 2)}
RING_ENV = "GENAI_EP_Q4F8"
# Without zero points, M <= 8 runs d6b3 instead (3 blocks an SM; the same bits: every ring stores
# the default's). The weights' read order alone streams at 0.92 of copy bandwidth with 3 blocks
# of 8 warps an SM and at 0.78 with 2 (tools/bench_read_pattern.py), and d8b2 was at that bound.
# H200, 896 x 151936, three runs (docs/benchmarks/h200.md, twenty-fourth session): M = 1 22.4-22.7
# us against d8b2's 23.6-23.8, M = 8 25.2-25.6 against 26.2-26.8; M = 16 keeps d8b2 (38.2-38.4
# against 39.1-39.7).
SYM_RING = "d6b3"
# With zero points, M <= 4 runs d4b3: 4 steps in flight a warp at 3 blocks an SM, its scales in
# one u32 a step. H200, 896 x 151936, each ring timed 4 times in alternating order, three
# processes (docs/benchmarks/h200.md, twenty-fifth session): M = 1 23.96-23.99 us against
# d8b2's 24.44-24.51 and d6b3's 25.13-25.26, M = 4 24.43-24.50 against 24.71-24.77; M = 8 keeps
# d8b2 (26.77-26.80 against 27.14-27.21; on a second H200, with the final code, 26.22-26.24
# against 26.17-26.22).
ZP_RING = "d4b3"
# nibble p of a word (`mx4f8._ROW`, `mx4f8._K`: row g + 8 (p >> 2), byte p & 3) sits at these bits
_SHIFTS = (8 * (np.arange(8) & 3) + 4 * (np.arange(8) >> 2)).astype(np.uint32)


def _check(
    op: str, b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, N: int, K: int
) -> int:
    """Refuse MatMulNBits arrays that do not hold [N, K] in blocks of 32; the blocks a row."""
    if K % BLOCK:
        raise ValueError(
            f"{op}: K={K} must be a multiple of {BLOCK} (the FP8 GEMV stages x by whole blocks); "
            "ep.kernels.q4p.pack_q4 takes any K"
        )
    kb = K // BLOCK
    if b.dtype != np.uint8 or b.size != N * kb * BLOCK // 2:
        raise ValueError(
            f"{op}: b must be uint8 [N={N}, {kb}, 16] (block size {BLOCK}); got {b.dtype} of "
            f"{b.size} bytes"
        )
    if scales.dtype != _BF16 or scales.size != N * kb:
        raise ValueError(
            f"{op}: scales must be bfloat16 [N={N}, {kb}] (the activations' dtype: the kernel "
            f"applies bf16 scales); got {scales.dtype} of {scales.size} (convert with "
            ".astype(ml_dtypes.bfloat16) if rounding them is acceptable)"
        )
    if zero_points is not None and (
        zero_points.dtype != np.uint8 or zero_points.size != N * ((kb + 1) // 2)
    ):
        raise ValueError(
            f"{op}: zero_points must be uint8 [N={N}, {(kb + 1) // 2}] (MatMulNBits' packed "
            f"nibbles) or None; got {zero_points.dtype} of {zero_points.size}"
        )
    return kb


def pack_q4f8(
    b: np.ndarray, scales: np.ndarray, zero_points: np.ndarray | None, *, N: int, K: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """MatMulNBits (b uint8 [N, K/32, 16], scales bfloat16 [N, K/32], zero points uint8 [N,
    ceil(K/64)] or None: every zero point 8) -> (weights uint8, scales bfloat16, zero points
    uint16 or None) in the ``ep_gemv_q4f8`` layout (the .cu file: `mx4f8`'s, with 4-bit codes
    and bf16 scales; 4 zero points of a lane's step in one uint16). Rows past N are zero codes
    with zero scales."""
    op = "pack_q4f8"
    kb = _check(op, b, scales, zero_points, N, K)
    T, S = mx4f8._sizes(N, K)
    q = np.zeros((T * 64, S * 64), np.uint8)
    q[:N, :K] = unpack_nibbles(b.reshape(N, K // 2))
    tiles = q.reshape(T, 64, S, 64).transpose(0, 2, 1, 3)[:, :, mx4f8._ROW, mx4f8._K]
    words = (tiles.astype(np.uint32) << _SHIFTS).sum(axis=-1, dtype=np.uint32)
    s = np.zeros((T * 64, 2 * S), _BF16)
    s[:N, :kb] = scales.reshape(N, kb)
    ps = mx4f8.tile_blocks(s, T, S).reshape(-1)
    pz = None
    if zero_points is not None:
        z = np.zeros((T * 64, 2 * S), np.uint16)
        z[:N, :kb] = unpack_nibbles(zero_points.reshape(N, -1))[:, :kb]
        nib = mx4f8.tile_blocks(z, T, S).reshape(T, S, 4, 8, 4)
        pz = (nib << (4 * np.arange(4, dtype=np.uint16))).sum(axis=-1, dtype=np.uint16).reshape(-1)
    return words.reshape(-1).view(np.uint8), ps, pz


def _decode(
    packed: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, N: int, K: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(codes [N, K] float32, scales [N, K/32] float32, zero points [N, K/32] float32) of a
    `pack_q4f8` layout, read as the kernel reads them (masks, bf16 scales)."""
    T, S = mx4f8._sizes(N, K)
    words = packed[: T * S * 2048].view(np.uint32).reshape(T, S, 4, 32, 4, 1)
    codes = (words >> _SHIFTS) & 15  # [T, S, 4 warps, 32 lanes, 4 words, 8 nibbles]
    tiles = np.zeros((T, S, 64, 64), np.float32)
    tiles[:, :, mx4f8._ROW, mx4f8._K] = codes
    q = tiles.transpose(0, 2, 1, 3).reshape(T * 64, S * 64)[:N, :K]
    s = mx4f8.untile_blocks(np.asarray(scales[: T * S * 128], np.float32), T, S)
    if zeros is None:
        z = np.full(s.shape, 8.0, np.float32)
    else:
        zw = zeros[: T * S * 32].reshape(-1, 1)
        z4 = (zw >> (4 * np.arange(4, dtype=np.uint16))) & 15
        z = mx4f8.untile_blocks(z4.reshape(-1), T, S).astype(np.float32)
    kb = K // BLOCK
    return q, s[:N, :kb], z[:N, :kb]


def unpack_q4f8(
    packed: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, *, N: int, K: int
) -> np.ndarray:
    """The dequantized weights [N, K] (float32, ``(q - z) * s``) of a `pack_q4f8` layout."""
    q, s, z = _decode(packed, scales, zeros, N, K)
    w = (q.reshape(N, K // BLOCK, BLOCK) - z[..., None]) * s[..., None]
    return w.reshape(N, K)


@dataclass(frozen=True)
class PackedQ4F8:
    """A `pack_q4f8` weight on a device: the arrays of ``ep_gemv_q4f8`` and the product's N, K."""

    weights: Buffer  # uint8
    scales: Buffer  # bfloat16
    zeros: Buffer | None  # uint16, or None: every zero point is 8
    N: int
    K: int


def upload_q4f8(
    dev: Device,
    b: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    *,
    N: int,
    K: int,
    stream: Stream,
    name: str = "q4f8",
) -> PackedQ4F8:
    """`pack_q4f8` on the host, then the arrays to ``dev``."""
    arrays = packed_to_device(dev, *pack_q4f8(b, scales, zero_points, N=N, K=K),
                              stream=stream, name=name)  # fmt: skip
    return PackedQ4F8(*arrays, N, K)


def gemv_q4_f8(
    dev: Device,
    out: Buffer,
    x: Buffer,
    w: PackedQ4F8,
    *,
    M: int,
    stream: Stream,
    resident: bool = False,
    ring: str | None = None,
) -> matmul.MatmulPlan:
    """``out[M, N] = x[M, K] @ dequantize(W)^T`` for a `PackedQ4F8` weight on the FP8 tensor
    cores (bf16 activations, M <= 16; sm_90a, or the NumPy twin on the CPU device), x split as
    `ep.kernels.mx4f8.split_x` says. ``resident`` and ``ring`` as
    `ep.kernels.q4p.gemv_q4_packed` (default ring `RING_ENV`, else `SYM_RING` for symmetric
    weights at M <= 8 and `ZP_RING` for weights with zero points at M <= 4, else the first of
    `RINGS`)."""
    op = "gemv_q4_f8"
    ring, per_sm = _ring(op, ring, RING_ENV, RINGS, _default_ring(w.zeros is not None, M))
    N, K = w.N, w.K
    name = _name(_family(w.zeros is not None), ring, "bf16", RINGS)
    mx4f8.f8_checks(op, dev, M, x, Q4F8_KERNELS[name], ("gemv_q4_packed", "pack_q4"))
    T, S, blocks, (wbytes, _) = mx4f8.launch_shape(dev, N, K, per_sm)
    _buffer(op, dev, "x", x, M * K, _BF16)
    _buffer(op, dev, "weights", w.weights, wbytes, np.dtype(np.uint8))
    _buffer(op, dev, "scales", w.scales, T * S * 128, _BF16)
    inputs = {"x": x, "weights": w.weights, "scales": w.scales}
    if w.zeros is not None:
        _buffer(op, dev, "zeros", w.zeros, T * S * 32, np.dtype(np.uint16))
        inputs["zeros"] = w.zeros
    _buffer(op, dev, "out", out, M * N, _BF16)
    _disjoint(op, out, inputs)
    flags = _x16(x, K) | (_FLAG_EARLY if resident else 0)
    zeros = w.zeros if w.zeros is not None else w.weights  # never read by the symmetric kernel
    return mx4f8.f8_launch(
        dev, name, "4-bit", per_sm, (T, S, blocks), mx4f8.shared_bytes(M, K, block_sums=True),
        [out, x, w.weights, w.scales, zeros, M, N, K, flags], stream=stream,
    )  # fmt: skip


def _twin(
    y: np.ndarray, x: np.ndarray, b: np.ndarray, scales: np.ndarray, zeros: np.ndarray,
    M: np.int32, N: np.int32, K: np.int32, flags: np.uint32, *, zero_points: bool,
) -> None:  # fmt: skip
    """The NumPy twin of a form's kernel (``zero_points``: read them, else every one is 8):
    the codes times the split x, less the zero points times x itself (as the kernel: `split_x`
    feeds the tensor cores, the block sums come from x), scaled, fp32, rounded once."""
    m, n, k = int(M), int(N), int(K)
    z16 = zeros.view(np.uint16) if zero_points else None
    q, s, z = _decode(b, scales, z16, n, k)
    xv = np.asarray(x[: m * k], np.float32).reshape(m, k)
    xs = mx4f8.split_x(x[: m * k].reshape(m, k))
    kb = k // BLOCK
    sq = (q.reshape(n, kb, BLOCK) * s[..., None]).reshape(n, k)
    sz = np.repeat(s * z, BLOCK, axis=1)
    with np.errstate(invalid="ignore", over="ignore"):
        y[: m * n] = (xs @ sq.T - xv @ sz.T).astype(y.dtype).reshape(-1)


def _default_ring(zero_points: bool, M: int) -> str | None:
    """The ring a form runs at M rows when none is asked for (None: the first of `RINGS`)."""
    if zero_points:
        return ZP_RING if M <= 4 else None
    return SYM_RING if M <= 8 else None


def _scale_slot(zero_points: bool, per_sm: int) -> str:
    """The .cu file's format of a form's kernel on a ring of ``per_sm`` blocks an SM: with zero
    points, a uint2 of scales a step (F8_Q4_ZP) when a thread may hold 128 registers, one u32
    (F8_Q4_ZP_U32, the other two by shuffle) when more than 16 warps an SM leave it 80."""
    if not zero_points:
        return "F8_Q4"
    return "F8_Q4_ZP_U32" if per_sm * mx4f8.block_warps(per_sm) > 16 else "F8_Q4_ZP"


def _family(zero_points: bool) -> str:
    """The kernel family of a weight with or without zero points (one kernel each: the .cu
    file's q4f8_gemv)."""
    return "q4f8" if zero_points else "q4f8_sym"


def _entry(name: str, zero_points: bool, depths: tuple[int, int, int], per_sm: int) -> str:
    """The kernel ``name`` of a form on a ring: ``depths`` steps a warp in flight at M <= 4, 8
    and 16, ``per_sm`` blocks an SM (docs/benchmarks/data/h200_s25_sweep.py compiles variants
    outside `RINGS` with it)."""
    warps = mx4f8.block_warps(per_sm)
    d4, d8, d16 = depths
    return (
        f'extern "C" __global__ void __launch_bounds__({32 * warps}, {per_sm}) {name}('
        "T* y, const T* x, const u8* b, const T* scales, const void* zp, int M, int N, "
        f"int K, u32 flags) {{\n  epk::q4f8_gemv<epk::{_scale_slot(zero_points, per_sm)}, {d4}, "
        f"{d8}, {d16}, {warps}>(y, x, b, (const u8*)scales, (const u8*)zp, M, N, K, flags);"
        "\n}\n"
    )


def _register() -> dict[str, KernelSource]:
    body = matmul._cuda_source()
    out: dict[str, KernelSource] = {}
    for zp, (depth, per_sm) in itertools.product((True, False), RINGS):
        name = _name(_family(zp), f"d{depth}b{per_sm}", "bf16", RINGS)
        entry = _entry(name, zp, (depth, *_WIDER[depth, per_sm]), per_sm)
        out[name] = register_kernel(
            KernelSource(
                name=name,
                source=f"{body}\ntypedef __nv_bfloat16 T;\n{entry}",
                params=("bf16*", "bf16*", "u8*", "bf16*", "void*", *_SIZES),
                options=CompileOptions(cuda_headers=True),
                cpu=functools.partial(_twin, zero_points=zp),
                pdl_wait="kernel",
                targets=mx4f8._TARGETS,
            )
        )
    return out


Q4F8_KERNELS: dict[str, KernelSource] = _register()
