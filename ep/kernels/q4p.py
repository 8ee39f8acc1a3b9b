"""4-bit weights repacked for the decode GEMV: ``ep_gemv_q4p_<dt>`` (MatMulNBits) and
``ep_gemv_mx4p_<dt>`` (MXFP4).

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

MXFP4 (`pack_mx4`, `gemv_mx4_packed`) takes the same geometry with E2M1 codes and E8M0 scale
bytes and no zero points. Its words are XOR-encoded (`_MX4_ROTATIONS`) so that the kernel turns
each into four registers of exact e2m1 pairs with one rotation, one LOP3 and one HMUL2 each (the
.cu file, "packed MXFP4 GEMV", says why and counts them); the layout therefore depends on the
activations' dtype, which `pack_mx4` takes. Each block's scale is applied in fp32 after its MMAs,
so the weights are exactly `ep.ops.matmul.dequantize_mxfp4`'s (`unpack_mx4` returns them).
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ep.device import Buffer, CompileOptions, Device, KernelSource, Stream, register_kernel
from ep.errors import KernelArgumentError
from ep.kernels import matmul

# the .cu's flags, and the argument checks every matmul wrapper makes
from ep.kernels.matmul import _FLAG_EARLY, _FLAG_ZP, _buffer, _disjoint, _product, _x16
from ep.ops.matmul import MXFP4_BLOCK, decode_e8m0
from ep.ops.matmul import _unpack_nibbles as unpack_nibbles

__all__ = [
    "BLOCK",
    "MX4P_KERNELS",
    "MX4P_RING_ENV",
    "Q4P_KERNELS",
    "RINGS",
    "RING_ENV",
    "PackedMX4",
    "PackedQ4",
    "encode_words",
    "gemv_mx4_packed",
    "gemv_q4_packed",
    "gf2_masks",
    "mx4_arguments",
    "pack_mx4",
    "pack_q4",
    "packed_to_device",
    "unpack_mx4",
    "unpack_q4",
    "upload_mx4",
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
MX4P_RING_ENV = "GENAI_EP_MX4P"  # the same rings, for ``ep_gemv_mx4p``
_ROWS, _STEP = 16, 64  # a row group, the k a step covers (two blocks)
_SIZES = ("i32", "i32", "i32", "u32")  # M, N, K, flags
_FLAG_E8X = 32  # EPK_E8X in the .cu: some E8M0 scale is 0 or 255 (decode each exactly)


def _tables() -> tuple[np.ndarray, np.ndarray]:
    """(row in the group, k in the step) of nibble p of word u of lane (g, t): [32, 4, 8]."""
    lane, u, p = np.meshgrid(np.arange(32), np.arange(4), np.arange(8), indexing="ij")
    g, t, r, hi = lane >> 2, lane & 3, p & 3, p >> 2
    return g + 8 * (r & 1), 16 * u + 2 * t + 8 * (r >> 1) + hi


_ROW, _K = _tables()


def _groups(n: int, k: int) -> tuple[int, int]:
    return -(-n // _ROWS), -(-k // _STEP)


def _arrange(q: np.ndarray, G: int, S: int) -> np.ndarray:
    """Codes [16 G, 64 S] -> the packed order [G, S, 32 lanes, 4 words, 8 nibbles]."""
    return q.reshape(G, _ROWS, S, _STEP).transpose(0, 2, 1, 3)[:, :, _ROW, _K]


def _scatter(codes: np.ndarray, G: int, S: int) -> np.ndarray:
    """`_arrange`'s inverse: [G, S, 32, 4, 8] -> [16 G, 64 S]."""
    q = np.zeros((G, S, _ROWS, _STEP), codes.dtype)
    q[:, :, _ROW, _K] = codes
    return q.transpose(0, 2, 1, 3).reshape(G * _ROWS, S * _STEP)


def _arrange_blocks(v: np.ndarray, G: int, S: int) -> np.ndarray:
    """Per-block values [16 G, 2 S] -> the packed order [G, S, 8 g, 4] (flat): block b of row
    g + 8h at 2b + h."""
    return v.reshape(G, 2, 8, S, 2).transpose(0, 3, 2, 4, 1).reshape(-1)


def _block_values(flat: np.ndarray, G: int, S: int) -> np.ndarray:
    """`_arrange_blocks`' inverse: [G, S, 8, 4] (flat) -> [16 G, 2 S]."""
    return flat[: G * S * 32].reshape(G, S, 8, 2, 2).transpose(0, 4, 2, 1, 3).reshape(-1, 2 * S)


def _words(nibbles: np.ndarray) -> np.ndarray:
    """[..., 8] nibbles -> uint32 words, nibble p at bits 4p."""
    shifts = 4 * np.arange(8, dtype=np.uint32)
    return (nibbles.astype(np.uint32) << shifts).sum(axis=-1, dtype=np.uint32)


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
    packed = _words(_arrange(q, G, S))  # [G, S, 32, 4]
    s = np.zeros((G * _ROWS, 2 * S), scales.dtype)
    s[:N, :kb] = scales.reshape(N, kb)
    ps = _arrange_blocks(s, G, S)
    pz = None
    if zero_points is not None:
        if zero_points.dtype != np.uint8 or zero_points.size != N * ((kb + 1) // 2):
            raise ValueError(
                f"pack_q4: zero_points must be uint8 [N, {(kb + 1) // 2}]; got "
                f"{zero_points.dtype} of {zero_points.size}"
            )
        z = np.full((G * _ROWS, 2 * S), 8, np.uint16)
        z[:N, :kb] = unpack_nibbles(zero_points.reshape(N, -1))[:, :kb]
        nib = _arrange_blocks(z, G, S).reshape(G, S, 8, 4)
        pz = (nib << (4 * np.arange(4, dtype=np.uint16))).sum(axis=-1, dtype=np.uint16).reshape(-1)
    return packed.reshape(-1).view(np.uint8), ps, pz


def unpack_q4(
    packed: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, *, N: int, K: int
) -> np.ndarray:
    """The dequantized weights [N, K] (float32, ``(q - z) * s``) of a `pack_q4` layout."""
    G, S = _groups(N, K)
    words = packed[: G * S * 512].view(np.uint32).reshape(G, S, 32, 4, 1)
    nibbles = (words >> (4 * np.arange(8, dtype=np.uint32))) & 15  # [G, S, 32, 4, 8]
    q = _scatter(nibbles.astype(np.float32), G, S)
    s = _block_values(scales, G, S).astype(np.float32)
    if zeros is None:
        z = np.full(s.shape, 8.0, np.float32)
    else:
        zw = zeros[: G * S * 8].reshape(G, S, 8, 1)
        z4 = (zw >> (4 * np.arange(4, dtype=np.uint16))) & 15  # [G, S, g, (b, h)]
        z = _block_values(z4.reshape(-1), G, S).astype(np.float32)
    w = (q.reshape(G * _ROWS, 2 * S, BLOCK) - z[..., None]) * s[..., None]
    return w.reshape(G * _ROWS, S * _STEP)[:N, :K]


# --- MXFP4 -----------------------------------------------------------------------------------
#
# Register r of a word w is the XOR of w rotated left by each rotation of _MX4_ROTATIONS[r],
# masked to the bits _MX4_BITS (E2M1 bits m, e0, e1, s of the low half; + 16 for the high one);
# its 16-bit halves are then e2m1 x 2^(1 - bias) exactly, and 2^(bias - 1) (_MX4_FIX) makes them
# e2m1. The .cu file's `mx4p_pairs` uses these rotations; `_mx4_masks` inverts the map over GF(2).
_MX4_ROTATIONS: dict[np.dtype, tuple[tuple[int, ...], ...]] = {
    np.dtype(np.float16): ((2,), (0, 6), (0, 9), (0, 13)),
    matmul._BF16: ((0,), (12,), (2, 6), (2, 8)),
}
_MX4_BITS = {np.dtype(np.float16): (9, 10, 11, 15), matmul._BF16: (6, 7, 8, 15)}
_MX4_FIX = {np.dtype(np.float16): np.float32(2.0**14), matmul._BF16: np.float32(2.0**126)}


def _rotl(w: np.ndarray, n: int) -> np.ndarray:
    n %= 32
    return w if n == 0 else (w << np.uint32(n)) | (w >> np.uint32(32 - n))


@functools.cache
def _mx4_masks(dtype: np.dtype) -> np.ndarray:
    """uint32 [8 nibbles, 4 bits]: the word bits that bit c of nibble p is XORed into (the
    columns of the inverse, over GF(2), of the map from a word to its registers' code bits)."""
    decode = np.zeros((32, 32), np.uint8)  # row 4p + c: the word bits XORed into it
    for p, c in itertools.product(range(8), range(4)):
        at = _MX4_BITS[dtype][c] + 16 * (p >> 2)
        for rot in _MX4_ROTATIONS[dtype][p & 3]:
            decode[4 * p + c, (at - rot) % 32] ^= 1
    return gf2_masks(decode)


def gf2_masks(decode: np.ndarray) -> np.ndarray:
    """The inverse over GF(2) of a word decode (uint8 [32 code bits, 32 word bits]: row 4p + c,
    bit c of nibble p, is the XOR of the word bits set in it), as uint32 masks [8 nibbles, 4
    bits]: the word bits that bit c of nibble p is XORed into when a word is encoded."""
    aug = np.concatenate([decode, np.eye(32, dtype=np.uint8)], axis=1)
    for col in range(32):  # Gauss-Jordan
        pivot = col + int(np.flatnonzero(aug[col:, col])[0])
        aug[[col, pivot]] = aug[[pivot, col]]
        for row in np.flatnonzero(aug[:, col]):
            if row != col:
                aug[row] ^= aug[col]
    inverse = aug[:, 32:]  # word bit j = XOR over code bits i of inverse[j, i]
    weights = (np.uint64(1) << np.arange(32, dtype=np.uint64))[:, None]
    return (inverse.astype(np.uint64) * weights).sum(axis=0).astype(np.uint32).reshape(8, 4)


def encode_words(codes: np.ndarray, masks: np.ndarray) -> np.ndarray:
    """E2M1 codes [..., 8 nibbles] -> uint32 words encoded with `gf2_masks`' masks."""
    words = np.zeros(codes.shape[:-1], np.uint32)
    for p, c in itertools.product(range(8), range(4)):
        words ^= ((codes[..., p] >> c) & 1).astype(np.uint32) * masks[p, c]
    return words


def _mx4_dtype(op: str, dtype: object) -> np.dtype:
    dt = np.dtype(dtype)  # type: ignore[call-overload]  # any dtype-like; refused below
    if dt not in _MX4_ROTATIONS:
        raise ValueError(
            f"{op}: dtype must be the activations' float16 or bfloat16 (the layout depends on "
            f"it); got {dt}"
        )
    return dt


def _block_check(op: str, b: np.ndarray, scales: np.ndarray, N: int, K: int) -> int:
    """Refuse MXFP4 arrays that do not hold [N, K]; the blocks a row."""
    if K % MXFP4_BLOCK:
        raise ValueError(f"{op}: K={K} must be a multiple of {MXFP4_BLOCK} (the MX block)")
    kb = K // MXFP4_BLOCK
    if b.dtype != np.uint8 or b.size != N * K // 2:
        raise ValueError(
            f"{op}: b must be uint8 [N={N}, {kb}, 16] (E2M1 pairs); got {b.dtype} of {b.size} bytes"
        )
    if scales.dtype != np.uint8 or scales.size != N * kb:
        raise ValueError(
            f"{op}: scales must be uint8 [N={N}, {kb}] (E8M0 bytes); got {scales.dtype} of "
            f"{scales.size}"
        )
    return kb


def pack_mx4(
    b: np.ndarray, scales: np.ndarray, *, N: int, K: int, dtype: object
) -> tuple[np.ndarray, np.ndarray, bool]:
    """MXFP4 (b uint8 [N, K/32, 16], scales uint8 [N, K/32] E8M0; `ep.ops.matmul`) -> (weights
    uint8, scales uint8, exact) in the ``ep_gemv_mx4p`` layout for activations of ``dtype``
    (float16 or bfloat16). ``exact``: some scale is 0 (2^-127) or 255 (NaN), which the kernel then
    decodes exactly for the whole weight. Rows past N and k past K are zero codes, scale byte 0."""
    op = "pack_mx4"
    dt = _mx4_dtype(op, dtype)
    kb = _block_check(op, b, scales, N, K)
    G, S = _groups(N, K)
    q = np.zeros((G * _ROWS, S * _STEP), np.uint8)
    q[:N, :K] = unpack_nibbles(b.reshape(N, K // 2))
    words = encode_words(_arrange(q, G, S), _mx4_masks(dt))  # [G, S, 32, 4]
    s = np.zeros((G * _ROWS, 2 * S), np.uint8)
    s[:N, :kb] = scales.reshape(N, kb)
    exact = bool(np.any((scales == 0) | (scales == 255)))
    return words.reshape(-1).view(np.uint8), _arrange_blocks(s, G, S), exact


def unpack_mx4(
    packed: np.ndarray, scales: np.ndarray, *, N: int, K: int, dtype: object
) -> np.ndarray:
    """The weights [N, K] (float32, e2m1 x 2^(e - 127), NaN for e = 255) of a `pack_mx4` layout,
    decoded as the kernel does (rotations, mask, the 16-bit float times 2^(bias - 1))."""
    dt = _mx4_dtype("unpack_mx4", dtype)
    G, S = _groups(N, K)
    words = packed[: G * S * 512].view(np.uint32).reshape(G, S, 32, 4)
    mask = sum(1 << (at + 16 * hi) for at in _MX4_BITS[dt] for hi in (0, 1))
    values = np.empty((G, S, 32, 4, 8), np.float32)
    for r, rots in enumerate(_MX4_ROTATIONS[dt]):
        reg = np.zeros_like(words)
        for rot in rots:
            reg ^= _rotl(words, rot)
        reg &= np.uint32(mask)
        for hi in (0, 1):
            half = ((reg >> np.uint32(16 * hi)) & np.uint32(0xFFFF)).astype(np.uint16)
            values[..., r + 4 * hi] = half.view(dt).astype(np.float32) * _MX4_FIX[dt]
    w = _scatter(values, G, S).reshape(G * _ROWS, 2 * S, BLOCK)
    with np.errstate(over="ignore"):  # e2m1 x 2^127 overflows to inf, as in the reference
        w = w * decode_e8m0(_block_values(scales, G, S))[..., None]
    return w.reshape(G * _ROWS, S * _STEP)[:N, :K]


@dataclass(frozen=True)
class PackedQ4:
    """A `pack_q4` weight on a device: the arrays of ``ep_gemv_q4p`` and the product's N, K."""

    weights: Buffer  # uint8
    scales: Buffer  # the activations' dtype
    zeros: Buffer | None  # uint16, or None: every zero point is 8
    N: int
    K: int


def packed_to_device(
    dev: Device,
    weights: np.ndarray,
    scales: np.ndarray,
    zeros: np.ndarray | None = None,
    *,
    stream: Stream,
    name: str,
) -> tuple[Buffer, Buffer, Buffer | None]:
    """A repacked weight's host arrays on ``dev`` as ``name.weights``, ``name.scales`` and
    ``name.zeros`` (None stays None): what every ``upload_*`` of the packed formats does."""

    def up(array: np.ndarray, part: str) -> Buffer:
        return dev.to_device(array, stream=stream, name=f"{name}.{part}")

    return (
        up(weights, "weights"),
        up(scales, "scales"),
        None if zeros is None else up(zeros, "zeros"),
    )


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
    arrays = packed_to_device(dev, *pack_q4(b, scales, zero_points, N=N, K=K), stream=stream,
                              name=name)  # fmt: skip
    return PackedQ4(*arrays, N, K)


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
    ring, per_sm = _ring(op, ring, RING_ENV)
    N, K = w.N, w.K
    dtype = _rows_and_dtype(op, M, x)
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
    zeros = w.zeros if w.zeros is not None else w.weights  # never read without EPK_ZP
    return _launch(
        dev, "q4p", "packed 4-bit GEMV", ring, per_sm, [out, x, w.weights, w.scales, zeros],
        M=M, N=N, K=K, flags=flags, stream=stream,
    )  # fmt: skip


def _ring(
    op: str,
    ring: str | None,
    env: str,
    rings: tuple[tuple[int, int], ...] = RINGS,
    default: str | None = None,
) -> tuple[str, int]:
    """The ring variant a call runs (its name and blocks an SM): ``ring``, else ``$env``, else
    ``default``, else the first of ``rings``."""
    names = {f"d{d}b{b}": b for d, b in rings}
    ring = ring or os.environ.get(env, "").strip() or default or next(iter(names))
    if ring not in names:
        raise KernelArgumentError(
            f"{op}: ring {ring!r} is not compiled; expected one of {', '.join(names)} "
            f"(argument ring= or ${env})"
        )
    return ring, names[ring]


def _rows_and_dtype(op: str, M: int, x: Buffer) -> np.dtype:
    if not 1 <= M <= matmul.GEMV_MAX_ROWS:
        raise KernelArgumentError(
            f"{op}: M={M} must be in [1, {matmul.GEMV_MAX_ROWS}] (the decode GEMV's rows); run "
            "larger batches through the GEMM"
        )
    dtype = x.dtype
    if dtype not in (np.dtype(np.float16), matmul._BF16):
        raise KernelArgumentError(f"{op}: x is {dtype}; the packed GEMV takes fp16/bf16")
    return dtype


def _launch(
    dev: Device, family: str, what: str, ring: str, per_sm: int, args: list[object], *,
    M: int, N: int, K: int, flags: int, stream: Stream,
) -> matmul.MatmulPlan:  # fmt: skip
    """Launch a packed GEMV (``args``: its buffers; x is the second) on a persistent grid."""
    G, S = _groups(N, K)
    x = args[1]
    assert isinstance(x, Buffer)
    suffix = "bf16" if x.dtype == matmul._BF16 else "f16"
    blocks = max(1, min(per_sm * matmul.sm_count(dev), -(-G // _WARPS)))
    shared = shared_bytes(M, K)
    name = _name(family, ring, suffix)
    dev.kernel(name).launch(blocks, 32 * _WARPS, *args, M, N, K, flags, stream=stream,
                            shared_mem=shared)  # fmt: skip
    return matmul.MatmulPlan(
        name, "gemv", (blocks, 1, 1), 32 * _WARPS, 1, 1,
        f"{what}: {G} groups of 16 rows over {blocks} persistent blocks x {_WARPS} warps, {S} "
        "steps of 64 k a group", shared,
    )  # fmt: skip


@dataclass(frozen=True)
class PackedMX4:
    """A `pack_mx4` weight on a device: the arrays of ``ep_gemv_mx4p``, the product's N, K, the
    activations' dtype it was packed for, and whether a scale needs the exact E8M0 decode."""

    weights: Buffer  # uint8
    scales: Buffer  # uint8 E8M0
    N: int
    K: int
    dtype: np.dtype
    exact: bool


def upload_mx4(
    dev: Device,
    b: np.ndarray,
    scales: np.ndarray,
    *,
    N: int,
    K: int,
    dtype: object,
    stream: Stream,
    name: str = "mx4p",
) -> PackedMX4:
    """`pack_mx4` on the host, then the arrays to ``dev``."""
    pw, ps, exact = pack_mx4(b, scales, N=N, K=K, dtype=dtype)
    weights, scale_buffer, _ = packed_to_device(dev, pw, ps, stream=stream, name=name)
    return PackedMX4(
        weights,
        scale_buffer,
        N,
        K,
        np.dtype(dtype),  # type: ignore[call-overload]  # checked by pack_mx4
        exact,
    )


def gemv_mx4_packed(
    dev: Device,
    out: Buffer,
    x: Buffer,
    w: PackedMX4,
    *,
    M: int,
    stream: Stream,
    resident: bool = False,
    ring: str | None = None,
) -> matmul.MatmulPlan:
    """``out[M, N] = x[M, K] @ dequantize_mxfp4(W)^T`` for a `PackedMX4` weight (fp16/bf16, M <=
    16), as `gemv_q4_packed` (``resident``, ``ring``; default ring `MX4P_RING_ENV`, else the
    first). x must have the dtype the weight was packed for."""
    op = "gemv_mx4_packed"
    ring, per_sm = _ring(op, ring, MX4P_RING_ENV)
    N, K = w.N, w.K
    dtype = _rows_and_dtype(op, M, x)
    if dtype != w.dtype:
        raise KernelArgumentError(
            f"{op}: x is {dtype}, the weight was packed for {w.dtype} activations (its layout "
            f"depends on them); pack it again with pack_mx4(..., dtype={dtype.name})"
        )
    G, S = _groups(N, K)
    sizes = (G * S * 512, G * S * 32)
    flags = mx4_arguments(
        op, dev, out, x, w.weights, w.scales, M=M, N=N, K=K, sizes=sizes, resident=resident,
        exact=w.exact,
    )  # fmt: skip
    return _launch(
        dev, "mx4p", "packed MXFP4 GEMV", ring, per_sm, [out, x, w.weights, w.scales],
        M=M, N=N, K=K, flags=flags, stream=stream,
    )  # fmt: skip


def mx4_arguments(
    op: str, dev: Device, out: Buffer, x: Buffer, weights: Buffer, scales: Buffer, *, M: int,
    N: int, K: int, sizes: tuple[int, int], resident: bool, exact: bool,
) -> int:  # fmt: skip
    """Check an MXFP4 GEMV's buffers (``sizes``: the bytes its layout needs of weights and
    scales; x and out of M rows in x's dtype, out apart from the rest); its launch flags."""
    u8 = np.dtype(np.uint8)
    _buffer(op, dev, "x", x, M * K, x.dtype)
    _buffer(op, dev, "weights", weights, sizes[0], u8)
    _buffer(op, dev, "scales", scales, sizes[1], u8)
    _buffer(op, dev, "out", out, M * N, x.dtype)
    _disjoint(op, out, {"x": x, "weights": weights, "scales": scales})
    return _x16(x, K) | (_FLAG_EARLY if resident else 0) | (_FLAG_E8X if exact else 0)


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


def _twin_mx4(
    y: np.ndarray, x: np.ndarray, b: np.ndarray, scales: np.ndarray,
    M: np.int32, N: np.int32, K: np.int32, flags: np.uint32,
) -> None:  # fmt: skip
    """The NumPy twin of ``ep_gemv_mx4p``: `unpack_mx4` (the kernel's decode), row by row."""
    m, n, k = int(M), int(N), int(K)
    w = unpack_mx4(b, scales, N=n, K=k, dtype=y.dtype)
    y[: m * n] = _product(x[: m * k].reshape(m, k), w.T, True).reshape(-1)


def _name(family: str, ring: str, suffix: str, rings: tuple[tuple[int, int], ...] = RINGS) -> str:
    """The first ring's kernel is ``ep_gemv_<family>_<dt>``; the others
    ``ep_gemv_<family>_<ring>_<dt>``."""
    default = f"d{rings[0][0]}b{rings[0][1]}"
    return f"ep_gemv_{family}_{suffix}" if ring == default else f"ep_gemv_{family}_{ring}_{suffix}"


def _register(family: str) -> dict[str, KernelSource]:
    body = matmul._cuda_source()
    out: dict[str, KernelSource] = {}
    for (depth, per_sm), (suffix, ctype) in itertools.product(
        RINGS, (("f16", "__half"), ("bf16", "__nv_bfloat16"))
    ):
        name = _name(family, f"d{depth}b{per_sm}", suffix)
        bounds = f'extern "C" __global__ void __launch_bounds__({32 * _WARPS}, {per_sm}) {name}'
        if family == "q4p":
            entry = (
                f"{bounds}(T* y, const T* x, const u8* b, const T* scales, const void* zp, "
                f"int M, int N, int K, u32 flags) {{\n  epk::q4p_gemv<T, {depth}>(y, x, b, "
                "scales, zp, M, N, K, flags);\n}\n"
            )
            params: tuple[str, ...] = (f"{suffix}*", f"{suffix}*", "u8*", f"{suffix}*", "void*")
            twin: Callable[..., None] = _twin
        else:
            entry = (
                f"{bounds}(T* y, const T* x, const u8* b, const u8* scales, int M, int N, "
                f"int K, u32 flags) {{\n  epk::mx4p_gemv<T, {depth}>(y, x, b, scales, M, N, K, "
                "flags);\n}\n"
            )
            params, twin = (f"{suffix}*", f"{suffix}*", "u8*", "u8*"), _twin_mx4
        out[name] = register_kernel(
            KernelSource(
                name=name,
                source=f"{body}\ntypedef {ctype} T;\n{entry}",
                params=(*params, *_SIZES),
                options=CompileOptions(cuda_headers=True),
                cpu=twin,
                pdl_wait="kernel",
            )
        )
    return out


Q4P_KERNELS: dict[str, KernelSource] = _register("q4p")
MX4P_KERNELS: dict[str, KernelSource] = _register("mx4p")
