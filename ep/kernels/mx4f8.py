"""The MXFP4 decode GEMV on Hopper's FP8 tensor cores: ``ep_gemv_mx4f8_bf16`` (sm_90a only).

`ep.kernels.q4p`'s packed MXFP4 GEMV (``mx4p``) turns each E2M1 code into a bf16 weight for a
16-bit MMA: three instructions a pair of weights. Here the code goes to the tensor cores as an
e4m3 byte instead, which needs no arithmetic at all: an E2M1 code (s, e1 e0, m) at bits 7, 4 3, 2
of a byte is the e4m3 value e2m1 x 2^-6 exactly (the subnormal code 1 included). `pack_mx4f8`
stores each word so that its two A registers are ``w & MASK`` and ``(rotl(w, 2) ^ rotl(w, 4)) &
MASK`` (`_ROTATIONS`; 4 instructions for 8 weights), and the products run on wgmma (a warpgroup
of 4 warps; A from registers, x from shared memory), which only sm_90a has: ``mma.sync`` on e4m3
is emulated on sm_90 (it unpacks to f16 first).

The activations are bf16 and the tensor cores take e4m3, so the kernel splits each row of x into
two e4m3 columns: with the row scaled by the power of two 2^e that puts its largest magnitude in
[128, 256), hi = e4m3(x 2^e) and lo = e4m3(x 2^e - hi) hold all 8 significant bits of a bf16
element exactly whenever lo is not an e4m3 subnormal, that is for every element in the binade of
the row's largest magnitude and the 9 below it; below that an element is within 2^-17 of the
row's largest (`split_x` is the exact NumPy form). hi and lo are two columns of one wgmma (4
rows of x in N = 8), and each block's E8M0 scale is applied in fp32 to the sum of its two
columns, as in ``mx4p``. A row of x holding inf or NaN gives NaN outputs (e4m3 has no inf).
fp16 activations (11 significant bits) are refused: `ep.kernels.q4p.gemv_mx4_packed` takes
them.

The .cu file ("MXFP4 GEMV on the FP8 tensor cores") has the layout and the instruction counts.
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
    kernel_target,
    register_kernel,
)
from ep.errors import KernelArgumentError, KernelUnavailableError
from ep.kernels import matmul
from ep.kernels.q4p import (
    _SIZES,
    _block_check,
    _name,
    _ring,
    _rotl,
    _rows_and_dtype,
    encode_words,
    gf2_masks,
    mx4_arguments,
    packed_to_device,
)
from ep.ops.matmul import MXFP4_BLOCK, decode_e8m0
from ep.ops.matmul import _unpack_nibbles as unpack_nibbles

__all__ = [
    "MX4F8_KERNELS",
    "RINGS",
    "RING_ENV",
    "PackedMX4F8",
    "block_warps",
    "f8_checks",
    "f8_launch",
    "gemv_mx4_f8",
    "kernel_source",
    "launch_shape",
    "pack_mx4f8",
    "shared_bytes",
    "split_x",
    "tile_blocks",
    "unpack_mx4f8",
    "untile_blocks",
    "upload_mx4f8",
]

_WARPS = 8  # MX4F8_WARPS in the .cu: two warpgroups a block
_ROWS, _STEP = 64, 64  # a warpgroup's tile of rows, the k a step covers (two blocks)
_MASK_BITS = (2, 3, 4, 7)  # E2M1 bits m, e0, e1, s -> e4m3 bits (each byte of a register)
_ROTATIONS = ((0,), (2, 4))  # register 2j: w & MASK; 2j + 1: (rotl(w, 2) ^ rotl(w, 4)) & MASK
_FIX = np.float32(2.0**6)  # an e4m3 byte of an E2M1 code is e2m1 x 2^-6
# Ring variants, as `ep.kernels.q4p.RINGS`: (steps a warp in flight at M <= 4, blocks an SM);
# _WIDER: the steps at M <= 8 and M <= 16 (wider accumulators, fewer registers for the ring).
# d8b1 puts an SM's six warpgroups in one block of 24 warps (`block_warps`): they start
# together and stage x once an SM. The default is d8b3 at M <= 4 and d8b1 above. H200, 896 x
# 151936, µs at M = 1 / 4 / 8 / 16, medians of three runs (docs/benchmarks/h200.md, fifteenth
# session): d8b3 21.36 / 21.56 / 24.01 / 33.89; d8b1 22.71 / 22.99 / 23.10 / 28.20 with plain
# refills at every width, 22.46 at M = 8 with the volatile ones it now has there; the earlier
# default (d8b3 with plain refills, d12b2 above M = 4) 22.45 / 23.47 / 26.18 / 31.48.
RINGS: tuple[tuple[int, int], ...] = ((8, 3), (12, 2), (8, 2), (8, 1))
_WIDER = {(8, 3): (4, 2), (12, 2): (10, 8), (8, 2): (8, 8), (8, 1): (4, 2)}


def block_warps(per_sm: int) -> int:
    """Warps a block of a ring with ``per_sm`` blocks an SM: 8 (two warpgroups), or for d8b1 24
    (an SM's six warpgroups in one block, all started together: against the start-order
    imbalance that tools/trace_mx4f8.py found, docs/benchmarks/h200.md)."""
    return 24 if per_sm == 1 else _WARPS


RING_ENV = "GENAI_EP_MX4F8"
_TARGETS = ("sm_90a",)
_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)


def _tables() -> tuple[np.ndarray, np.ndarray]:
    """(row in the tile, k in the step) of nibble p of word u of lane l of warp w: [4, 32, 4, 8]."""
    w, lane, u, p = np.meshgrid(np.arange(4), np.arange(32), np.arange(4), np.arange(8),
                                indexing="ij")  # fmt: skip
    g, t = lane >> 2, lane & 3
    return 16 * w + g + 8 * (p >> 2), 32 * (u >> 1) + 16 * (u & 1) + 4 * t + (p & 3)


_ROW, _K = _tables()


def _sizes(n: int, k: int) -> tuple[int, int]:
    """(tiles of 64 rows, steps of 64 k)."""
    return -(-n // _ROWS), -(-k // _STEP)


def tile_blocks(v: np.ndarray, T: int, S: int) -> np.ndarray:
    """Per-block values [64 T, 2 S] -> the kernels' order [T, S, 4 warps, 8 g, 4]: block b of row
    16w + g + 8h at 2b + h."""
    return v.reshape(T, 4, 2, 8, S, 2).transpose(0, 4, 1, 3, 5, 2)


def untile_blocks(flat: np.ndarray, T: int, S: int) -> np.ndarray:
    """`tile_blocks`' inverse: [T, S, 4, 8, 4] (flat) -> [64 T, 2 S]."""
    return flat.reshape(T, S, 4, 8, 2, 2).transpose(0, 2, 5, 3, 1, 4).reshape(T * _ROWS, 2 * S)


@functools.cache
def _masks() -> np.ndarray:
    """uint32 [8 nibbles, 4 bits]: the word bits that bit c of nibble p is XORed into (the
    inverse over GF(2) of the map from a word to its two registers' code bits)."""
    decode = np.zeros((32, 32), np.uint8)  # row 4p + c: the word bits XORed into it
    for p, c in itertools.product(range(8), range(4)):
        at = 8 * (p & 3) + _MASK_BITS[c]
        for rot in _ROTATIONS[p >> 2]:
            decode[4 * p + c, (at - rot) % 32] ^= 1
    return gf2_masks(decode)


def pack_mx4f8(
    b: np.ndarray, scales: np.ndarray, *, N: int, K: int
) -> tuple[np.ndarray, np.ndarray, bool]:
    """MXFP4 (b uint8 [N, K/32, 16], scales uint8 [N, K/32] E8M0; `ep.ops.matmul`) -> (weights
    uint8, scales uint8, exact) in the ``ep_gemv_mx4f8`` layout (the .cu file). ``exact``: some
    scale is 0 (2^-127) or 255 (NaN), which the kernel then decodes exactly for the whole
    weight. Rows past N and k past K are zero codes with scale byte 0."""
    op = "pack_mx4f8"
    kb = _block_check(op, b, scales, N, K)
    T, S = _sizes(N, K)
    q = np.zeros((T * _ROWS, S * _STEP), np.uint8)
    q[:N, :K] = unpack_nibbles(b.reshape(N, K // 2))
    tiles = q.reshape(T, _ROWS, S, _STEP).transpose(0, 2, 1, 3)  # [T, S, 64 rows, 64 k]
    words = encode_words(tiles[:, :, _ROW, _K], _masks())  # [T, S, 4 warps, 32 lanes, 4]
    s = np.zeros((T * _ROWS, 2 * S), np.uint8)
    s[:N, :kb] = scales.reshape(N, kb)
    ps = tile_blocks(s, T, S).reshape(-1)
    exact = bool(np.any((scales == 0) | (scales == 255)))
    return words.reshape(-1).view(np.uint8), ps, exact


def unpack_mx4f8(packed: np.ndarray, scales: np.ndarray, *, N: int, K: int) -> np.ndarray:
    """The weights [N, K] (float32, e2m1 x 2^(e - 127), NaN for e = 255) of a `pack_mx4f8`
    layout, decoded as the kernel does (mask and rotations, the byte as e4m3, times 2^6)."""
    T, S = _sizes(N, K)
    words = packed[: T * S * 2048].view(np.uint32).reshape(T, S, 4, 32, 4)
    mask = np.uint32(sum(1 << (8 * i + b) for i in range(4) for b in _MASK_BITS))
    values = np.empty((T, S, 4, 32, 4, 8), np.float32)
    for r, rots in enumerate(_ROTATIONS):
        reg = np.zeros_like(words)
        for rot in rots:
            reg ^= _rotl(words, rot)
        reg &= mask
        e4m3 = reg[..., None].view(np.uint8).reshape(*reg.shape, 4).view(_E4M3)
        values[..., 4 * r : 4 * r + 4] = e4m3.astype(np.float32) * _FIX
    tiles = np.zeros((T, S, _ROWS, _STEP), np.float32)
    tiles[:, :, _ROW, _K] = values
    w = tiles.transpose(0, 2, 1, 3).reshape(T * _ROWS, S * 2, MXFP4_BLOCK)
    sb = untile_blocks(scales[: T * S * 128], T, S)
    with np.errstate(over="ignore"):  # e2m1 x 2^127 overflows to inf, as in the reference
        w = w * decode_e8m0(sb)[..., None]
    return w.reshape(T * _ROWS, S * _STEP)[:N, :K]


def split_x(x: np.ndarray) -> np.ndarray:
    """x [M, K] (bf16) as the kernel feeds it to the tensor cores, in float32: each row times
    2^e (its largest magnitude in [128, 256)), split into e4m3 hi + lo, times 2^-e; a row with
    inf or NaN is all NaN."""
    x32 = np.asarray(x, np.float32).reshape(x.shape[0], -1)
    out = np.empty_like(x32)
    for m, row in enumerate(x32):
        top = float(np.abs(row).max()) if row.size else 0.0
        if not np.isfinite(top):
            out[m] = np.nan
            continue
        ex = 0 if top == 0.0 else int(np.frexp(np.float32(top))[1]) + 126  # fp32 biased exponent
        e = min(134 - ex, 127)
        f = np.float32(2.0**e)
        v = row * f
        hi = v.astype(_E4M3).astype(np.float32)
        lo = (v - hi).astype(_E4M3).astype(np.float32)
        out[m] = (hi + lo) / f
    return out


@dataclass(frozen=True)
class PackedMX4F8:
    """A `pack_mx4f8` weight on a device: the arrays of ``ep_gemv_mx4f8``, the product's N, K,
    and whether a scale needs the exact E8M0 decode."""

    weights: Buffer  # uint8
    scales: Buffer  # uint8 E8M0
    N: int
    K: int
    exact: bool


def upload_mx4f8(
    dev: Device,
    b: np.ndarray,
    scales: np.ndarray,
    *,
    N: int,
    K: int,
    stream: Stream,
    name: str = "mx4f8",
) -> PackedMX4F8:
    """`pack_mx4f8` on the host, then the arrays to ``dev``."""
    pw, ps, exact = pack_mx4f8(b, scales, N=N, K=K)
    weights, scale_buffer, _ = packed_to_device(dev, pw, ps, stream=stream, name=name)
    return PackedMX4F8(weights, scale_buffer, N, K, exact)


def launch_shape(dev: Device, N: int, K: int, per_sm: int) -> tuple[int, int, int, tuple[int, int]]:
    """(tiles T, steps a tile S, persistent blocks, (weight bytes, scale bytes)) of a launch
    whose ring puts ``per_sm`` blocks on an SM."""
    T, S = _sizes(N, K)
    blocks = max(1, min(per_sm * matmul.sm_count(dev), -(-T // (block_warps(per_sm) // 4))))
    return T, S, blocks, (T * S * 2048, T * S * 128)


def shared_bytes(M: int, K: int, *, block_sums: bool = False) -> int:
    """Dynamic shared memory of a block: x's B tiles (N = 8, 16 or 32 columns: M <= 4, 8, 16),
    then 16 row factors; ``block_sums`` (`ep.kernels.q4f8`, the zero points' term): then each
    staged row's 32-block sums of x (a float each)."""
    cols = 8 if M <= 4 else (16 if M <= 8 else 32)
    steps = _sizes(1, K)[1]
    return 2 * steps * cols * 32 + 64 + (steps * cols * 4 if block_sums else 0)


def f8_checks(
    op: str, dev: Device, M: int, x: Buffer, kernel: KernelSource, instead: tuple[str, str]
) -> None:
    """Refuse what an FP8 GEMV cannot run: M past the decode GEMV's rows, activations other than
    bf16, a GPU without wgmma; ``instead``: the `ep.kernels.q4p` GEMV and packer to use then."""
    dtype = _rows_and_dtype(op, M, x)
    if dtype != matmul._BF16:
        raise KernelArgumentError(
            f"{op}: x is {dtype}; the FP8 GEMV takes bfloat16 activations (two e4m3 halves hold "
            f"a bf16's 8 significant bits, not fp16's 11): use ep.kernels.q4p.{instead[0]}"
        )
    if dev.arch is not None and kernel_target(kernel, dev.arch) is None:
        raise KernelUnavailableError(
            f"{op}: the FP8 GEMV runs on wgmma, which only sm_90a (H100, H200) has; this GPU is "
            f"{dev.arch}: use ep.kernels.q4p.{instead[0]} ({instead[1]}) there"
        )


def gemv_mx4_f8(
    dev: Device,
    out: Buffer,
    x: Buffer,
    w: PackedMX4F8,
    *,
    M: int,
    stream: Stream,
    resident: bool = False,
    ring: str | None = None,
) -> matmul.MatmulPlan:
    """``out[M, N] = x[M, K] @ dequantize_mxfp4(W)^T`` for a `PackedMX4F8` weight on the FP8
    tensor cores (bf16 activations, M <= 16; sm_90a, or the NumPy twin on the CPU device), x
    split as `split_x` says. ``resident`` and ``ring`` as `ep.kernels.q4p.gemv_q4_packed`
    (default ring `RING_ENV`, else d8b3 at M <= 4 and d8b1 above: `RINGS`)."""
    op = "gemv_mx4_f8"
    default = "d8b3" if M <= 4 else "d8b1"  # RINGS: the comment above
    ring, per_sm = _ring(op, ring, RING_ENV, RINGS, default)
    N, K = w.N, w.K
    name = _name("mx4f8", ring, "bf16", RINGS)
    f8_checks(op, dev, M, x, MX4F8_KERNELS[name], ("gemv_mx4_packed", "pack_mx4"))
    T, S, blocks, sizes = launch_shape(dev, N, K, per_sm)
    flags = mx4_arguments(
        op, dev, out, x, w.weights, w.scales, M=M, N=N, K=K, sizes=sizes, resident=resident,
        exact=w.exact,
    )  # fmt: skip
    return f8_launch(
        dev, name, "MXFP4", per_sm, (T, S, blocks), shared_bytes(M, K),
        [out, x, w.weights, w.scales, M, N, K, flags], stream=stream,
    )  # fmt: skip


def f8_launch(
    dev: Device, name: str, what: str, per_sm: int, shape: tuple[int, int, int], shared: int,
    args: list[object], *, stream: Stream,
) -> matmul.MatmulPlan:  # fmt: skip
    """Launch the FP8 GEMV kernel ``name`` of a ring with ``per_sm`` blocks an SM on its
    persistent grid (``shape``: `launch_shape`'s tiles, steps and blocks); its plan."""
    T, S, blocks = shape
    warps = block_warps(per_sm)
    dev.kernel(name).launch(blocks, 32 * warps, *args, stream=stream, shared_mem=shared)
    return matmul.MatmulPlan(
        name, "gemv", (blocks, 1, 1), 32 * warps, 1, 1,
        f"{what} GEMV on the FP8 tensor cores: {T} tiles of 64 rows over {blocks} persistent "
        f"blocks x {warps // 4} warpgroups, {S} steps of 64 k a tile", shared,
    )  # fmt: skip


def _twin(
    y: np.ndarray, x: np.ndarray, b: np.ndarray, scales: np.ndarray,
    M: np.int32, N: np.int32, K: np.int32, flags: np.uint32,
) -> None:  # fmt: skip
    """The NumPy twin: `split_x`, the dequantized weights, fp32 products, rounded once."""
    m, n, k = int(M), int(N), int(K)
    w = unpack_mx4f8(b, scales, N=n, K=k)
    xs = split_x(x[: m * k].reshape(m, k))
    with np.errstate(invalid="ignore", over="ignore"):
        y[: m * n] = (xs @ w.T).astype(y.dtype).reshape(-1)


def kernel_source(name: str, depth: int, per_sm: int, *, trace: bool = False) -> KernelSource:
    """The kernel ``name`` of ring (``depth``, ``per_sm``); ``trace``: compiled with EPK_TRACE
    and a trace pointer as its last argument (tools/trace_mx4f8.py), without a NumPy twin."""
    d8, d16 = _WIDER[depth, per_sm]
    warps = block_warps(per_sm)
    param, arg = (", unsigned long long* trace", ", trace") if trace else ("", "")
    entry = (
        f'extern "C" __global__ void __launch_bounds__({32 * warps}, {per_sm}) {name}('
        f"T* y, const T* x, const u8* b, const u8* scales, int M, int N, int K, u32 flags{param}) "
        f"{{\n  epk::mx4f8_gemv<{depth}, {d8}, {d16}, {warps}>(y, x, b, scales, M, N, K, "
        f"flags{arg});\n}}\n"
    )
    return KernelSource(
        name=name,
        source=f"{matmul._cuda_source()}\ntypedef __nv_bfloat16 T;\n{entry}",
        params=("bf16*", "bf16*", "u8*", "u8*", *_SIZES, *(("u64*",) if trace else ())),
        options=CompileOptions(cuda_headers=True, defines=(("EPK_TRACE", "1"),) if trace else ()),
        cpu=None if trace else _twin,
        pdl_wait="kernel",
        targets=_TARGETS,
    )


def _register() -> dict[str, KernelSource]:
    out: dict[str, KernelSource] = {}
    for depth, per_sm in RINGS:
        name = _name("mx4f8", f"d{depth}b{per_sm}", "bf16", RINGS)
        out[name] = register_kernel(kernel_source(name, depth, per_sm))
    return out


MX4F8_KERNELS: dict[str, KernelSource] = _register()
