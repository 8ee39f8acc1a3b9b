"""MatMul on a named weight, 4-bit block-quantized MatMul (MatMulNBits packing), MXFP4 MatMul.

MatMulNBits packing (com.microsoft, bits=4): B is uint8 [N, k_blocks, block_size/2] with
k_blocks = ceil(K / block_size); within a block element 2i is the low nibble and 2i+1 the high
nibble of byte i. scales are [N * k_blocks] (or [N, k_blocks]); zero points, when given, are uint8
[N * ceil(k_blocks/2)] (or [N, ceil(k_blocks/2)]) packed the same way (block 2j low, 2j+1 high);
without them the zero point is 8. W[n, k] = (q - zero) * scale[n, k // block_size], Y = A @ W^T.

GatherBlockQuantized (com.microsoft, uint8 data, bits=4, gather_axis=0, quantize_axis last):
data is uint8 [V, ..., P] holding 2P values per last-axis row (element 2i low nibble of byte i,
2i+1 high), scales [V, ..., ceil(2P/block_size)], zero points [V, ..., ceil(blocks/2)] packed
like MatMulNBits' (default 8). ``out[ids] = (q - zero) * scale`` computed in float32 and rounded
once to the scales' dtype (the output's). Ids in [-V, 0) count from the end; any other id
outside [0, V) gives a zero row (ONNX Runtime's CPU kernel does both).

MatMulNBits with ``accuracy_level=4`` on ONNX Runtime's CPU (MLAS CompInt8) quantizes its
activations to int8 in blocks of ``block_size`` along K before the product: per block, scale =
amax / 127, q = round-half-even(a * (127 / amax)) (0 when amax is 0), and the integer dot is
scaled back. `round_to_int8_blocks` gives those activations as floats (q * scale, float32,
rounded once to a's dtype); the float MatMulNBits of them equals the int8 product up to float
summation order, which is what onnxruntime-genai's CPU tokens of an int4 model are made of.

MXFP4 (OCP Microscaling v1.0): blocks of 32 values along K share one E8M0 scale (2^(e - 127),
e = 255 is NaN); each value is E2M1 (sign, 2 exponent bits, 1 mantissa bit): codes 0..7 are
0, 0.5, 1, 1.5, 2, 3, 4, 6 and codes 8..15 their negatives. B is uint8 [N, K/32, 16], element 2i
of a block in the low nibble of byte i; scales are uint8 [N, K/32].
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ep.errors import OpError
from ep.ops._infer import FLOATS, as_f32, expect, expect_rank, expect_shape
from ep.ops.runtime import resolve_weight
from ep.ops.schema import ArgInfo, AttrSpec, OpDef, OpSchema, TensorSpec

__all__ = [
    "E2M1_VALUES",
    "MATMUL",
    "MATMUL_MXFP4",
    "MATMUL_NBITS",
    "MATMUL_NBITS_ZP",
    "MXFP4_BLOCK",
    "decode_e2m1",
    "decode_e8m0",
    "dequantize_mxfp4",
    "dequantize_nbits",
    "gather_block_quantized",
    "matmul_mxfp4",
    "matmul_nbits",
    "matmul_weight",
    "quantize_mxfp4",
    "quantize_nbits",
    "round_to_int8_blocks",
]

# --- named-weight MatMul ---------------------------------------------------------------------


def matmul_weight(a: np.ndarray, *, weight: str, N: int, transpose_b: int) -> np.ndarray:
    """``a [..., K] @ W`` where W is the resolver's array for ``weight``: [K, N], or [N, K] when
    ``transpose_b`` is 1. Float32 accumulation; the result is rounded to a's dtype."""
    w = resolve_weight(weight)
    k = a.shape[-1]
    want = (N, k) if transpose_b else (k, N)
    if w.shape != want or w.dtype != a.dtype:
        raise OpError(
            f"MatMul: weight {weight!r} is {w.dtype}{list(w.shape)}; the node needs "
            f"{a.dtype}{list(want)} (K={k} from the input, N={N}, transpose_b={transpose_b})"
        )
    wt = w.T if transpose_b else w
    if a.dtype == np.float32:
        return np.matmul(a, wt)
    return np.matmul(as_f32(a), as_f32(wt)).astype(a.dtype)


def _infer_matmul(inputs: Sequence[ArgInfo], attrs: Mapping[str, Any]) -> tuple[ArgInfo, ...]:
    (a,) = inputs
    expect_rank("MatMul", "a", a, range(1, 9), "[..., K]")
    expect(attrs["N"] > 0, "MatMul", f"N={attrs['N']} must be > 0")
    expect(attrs["transpose_b"] in (0, 1), "MatMul", "transpose_b must be 0 or 1")
    expect(bool(attrs["weight"]), "MatMul", "the weight attribute names no weight")
    return (ArgInfo((*a.shape[:-1], attrs["N"]), a.dtype),)


MATMUL = OpDef(
    OpSchema(
        "MatMul",
        inputs=(TensorSpec("a", "T", "[..., K]"),),
        outputs=(TensorSpec("y", "T", "[..., N]"),),
        attributes=(
            AttrSpec("weight", "string", doc="the weight's name, resolved by the runtime"),
            AttrSpec("N", "int", doc="output features"),
            AttrSpec("transpose_b", "int", 0, "0: the weight is [K, N]; 1: it is [N, K]"),
        ),
        type_vars=(("T", FLOATS),),
        doc="MatMul with a weight the runtime resolves by name (offload policies place it).",
    ),
    reference=matmul_weight,
    infer=_infer_matmul,
)

# --- MatMulNBits -----------------------------------------------------------------------------


def _unpack_nibbles(packed: np.ndarray) -> np.ndarray:
    """uint8 [..., n] -> uint8 [..., 2n]: low nibble first."""
    out = np.empty((*packed.shape[:-1], packed.shape[-1] * 2), dtype=np.uint8)
    out[..., 0::2] = packed & 0x0F
    out[..., 1::2] = packed >> 4
    return out


def _pack_nibbles(values: np.ndarray) -> np.ndarray:
    """uint8 [..., 2n] (each < 16) -> uint8 [..., n]: element 2i low, 2i+1 high."""
    v = values.astype(np.uint8)
    return (v[..., 0::2] | (v[..., 1::2] << 4)).astype(np.uint8)


def dequantize_nbits(
    b: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    *,
    K: int,
    N: int,
    block_size: int,
    bits: int = 4,
) -> np.ndarray:
    """The float32 [N, K] weight of a MatMulNBits (bits=4) B/scales/zero points."""
    if bits != 4:
        raise OpError(f"MatMulNBits: bits={bits}; only 4-bit weights are supported")
    k_blocks = -(-K // block_size)
    q = _unpack_nibbles(b.reshape(N, k_blocks, block_size // 2)).astype(np.float32)
    s = as_f32(scales).reshape(N, k_blocks)
    if zero_points is None:
        zp = np.full((N, k_blocks), 8.0, dtype=np.float32)
    else:
        zp = _unpack_nibbles(zero_points.reshape(N, -(-k_blocks // 2)))[:, :k_blocks]
        zp = zp.astype(np.float32)
    w = (q - zp[..., None]) * s[..., None]
    return w.reshape(N, k_blocks * block_size)[:, :K]


def gather_block_quantized(
    data: np.ndarray,
    indices: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None = None,
    *,
    bits: int = 4,
    block_size: int = 128,
    gather_axis: int = 0,
    quantize_axis: int = -1,
) -> np.ndarray:
    """com.microsoft GatherBlockQuantized on uint8 data (see the module docstring).

    Returns [*indices.shape, *data.shape[1:-1], 2 * data.shape[-1]] in the scales' dtype. Each
    gathered last-axis row is dequantized by `dequantize_nbits` (padded to whole blocks first).
    """
    op = "GatherBlockQuantized"
    rank = data.ndim
    if data.dtype != np.uint8 or rank < 2:
        raise OpError(f"{op}: data is {data.dtype}{list(data.shape)}; expected uint8 of rank >= 2")
    if bits != 4:
        raise OpError(f"{op}: bits={bits}; only 4-bit data is supported (uint8, two per byte)")
    if gather_axis not in (0, -rank) or quantize_axis not in (-1, rank - 1):
        raise OpError(
            f"{op}: gather_axis={gather_axis}, quantize_axis={quantize_axis}; uint8 data needs "
            f"gather_axis 0 and quantize_axis the last axis ({rank - 1})"
        )
    if block_size < 16 or block_size & (block_size - 1):
        raise OpError(f"{op}: block_size={block_size} must be a power of two >= 16")
    vocab, packed = int(data.shape[0]), int(data.shape[-1])
    hidden = 2 * packed
    k_blocks = -(-hidden // block_size)
    middle = tuple(int(d) for d in data.shape[1:-1])
    if scales.shape != (vocab, *middle, k_blocks):
        raise OpError(
            f"{op}: scales has shape {list(scales.shape)}; data {list(data.shape)} at "
            f"block_size {block_size} needs {[vocab, *middle, k_blocks]}"
        )
    zp_cols = -(-k_blocks // 2)
    if zero_points is not None and (
        zero_points.dtype != np.uint8 or zero_points.shape != (vocab, *middle, zp_cols)
    ):
        raise OpError(
            f"{op}: zero_points is {zero_points.dtype}{list(zero_points.shape)}; expected uint8 "
            f"{[vocab, *middle, zp_cols]} (two 4-bit zero points a byte)"
        )
    ids = np.asarray(indices).astype(np.int64)
    ids = np.where(ids < 0, ids + vocab, ids)
    good = (ids >= 0) & (ids < vocab)
    rows = ids[good]
    n = rows.size * math.prod(middle)
    # MatMulNBits rows are whole blocks: pad each gathered row with zero bytes, then cut to hidden.
    b = np.zeros((n, k_blocks * block_size // 2), np.uint8)
    b[:, :packed] = data[rows].reshape(n, packed)
    zp = None if zero_points is None else zero_points[rows].reshape(n, zp_cols)
    w = dequantize_nbits(
        b, scales[rows].reshape(n, k_blocks), zp, K=hidden, N=n, block_size=block_size
    )
    out = np.zeros((*ids.shape, *middle, hidden), dtype=scales.dtype)
    out[good] = w.reshape(rows.size, *middle, hidden).astype(scales.dtype)
    return out


def round_to_int8_blocks(a: np.ndarray, *, block_size: int) -> np.ndarray:
    """``a [..., K]`` as MatMulNBits accuracy_level 4 sees it (see the module docstring): each
    block of ``block_size`` along K (the last one may be shorter) rounded to int8 steps."""
    if block_size < 1:
        raise OpError(f"round_to_int8_blocks: block_size={block_size} must be >= 1")
    k = a.shape[-1]
    k_blocks = -(-k // block_size)
    x = np.zeros((*a.shape[:-1], k_blocks * block_size), np.float32)
    x[..., :k] = as_f32(a)
    blocks = x.reshape(*a.shape[:-1], k_blocks, block_size)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    scale = amax / np.float32(127.0)
    inverse = np.zeros_like(amax)
    np.divide(np.float32(127.0), amax, out=inverse, where=amax != 0)
    q = np.clip(np.rint(blocks * inverse), -127, 127)  # rint: round half to even, as MLAS
    out = (q * scale).reshape(x.shape)[..., :k]
    return out.astype(a.dtype, copy=False)


def quantize_nbits(
    w: np.ndarray, *, block_size: int, zero_point: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Quantize a float [N, K] weight to MatMulNBits (bits=4) ``(B, scales[N*k_blocks], zp)``.

    With ``zero_point`` the blocks are asymmetric (min/max, zero points packed as ORT packs them);
    without, symmetric around the default zero point 8. Scales are float32.
    """
    n, k = w.shape
    k_blocks = -(-k // block_size)
    padded = np.zeros((n, k_blocks * block_size), dtype=np.float32)
    padded[:, :k] = as_f32(w)
    blocks = padded.reshape(n, k_blocks, block_size)
    if zero_point:
        lo = np.minimum(blocks.min(axis=-1), 0.0)
        hi = np.maximum(blocks.max(axis=-1), 0.0)
        scale = (hi - lo) / 15.0
        scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
        zp = np.clip(np.round(-lo / scale), 0, 15).astype(np.uint8)
    else:
        amax = np.abs(blocks).max(axis=-1)
        scale = np.where(amax == 0, 1.0, amax / 8.0).astype(np.float32)
        zp = np.full((n, k_blocks), 8, dtype=np.uint8)
    q = np.clip(np.round(blocks / scale[..., None]) + zp[..., None], 0, 15).astype(np.uint8)
    b = _pack_nibbles(q)
    if not zero_point:
        return b, scale.reshape(-1), None
    zp_even = np.zeros((n, 2 * (-(-k_blocks // 2))), dtype=np.uint8)
    zp_even[:, :k_blocks] = zp
    return b, scale.reshape(-1), _pack_nibbles(zp_even).reshape(-1)


def matmul_nbits(
    a: np.ndarray,
    b: np.ndarray,
    scales: np.ndarray,
    *,
    K: int,
    N: int,
    bits: int,
    block_size: int,
) -> np.ndarray:
    """``a [..., K] @ dequantize(B)^T`` with the default zero point 8."""
    w = dequantize_nbits(b, scales, None, K=K, N=N, block_size=block_size, bits=bits)
    return np.matmul(as_f32(a), w.T).astype(a.dtype, copy=False)


def matmul_nbits_zp(
    a: np.ndarray,
    b: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray,
    *,
    K: int,
    N: int,
    bits: int,
    block_size: int,
) -> np.ndarray:
    """``a [..., K] @ dequantize(B)^T`` with packed 4-bit zero points."""
    w = dequantize_nbits(b, scales, zero_points, K=K, N=N, block_size=block_size, bits=bits)
    return np.matmul(as_f32(a), w.T).astype(a.dtype, copy=False)


def _infer_nbits_common(
    op: str, a: ArgInfo, b: ArgInfo, scales: ArgInfo, attrs: Mapping[str, Any]
) -> tuple[int, int, int]:
    k, n, bits, block = attrs["K"], attrs["N"], attrs["bits"], attrs["block_size"]
    expect(bits == 4, op, f"bits={bits}; only 4 is supported")
    expect(
        block >= 16 and block & (block - 1) == 0,
        op,
        f"block_size={block} must be a power of two >= 16",
    )
    expect(k > 0 and n > 0, op, f"K={k} and N={n} must be > 0")
    expect_rank(op, "a", a, range(1, 9), "[..., K]")
    expect(a.shape[-1] == k, op, f"a has {a.shape[-1]} features in its last axis; K={k}")
    k_blocks = -(-k // block)
    expect_shape(op, "b", b, (n, k_blocks, block // 2), "[N, ceil(K/block_size), block_size/2]")
    expect(
        scales.shape in ((n * k_blocks,), (n, k_blocks)),
        op,
        f"scales has shape {list(scales.shape)}; expected [{n * k_blocks}] or [{n}, {k_blocks}]",
    )
    return k, n, k_blocks


def _infer_nbits(inputs: Sequence[ArgInfo], attrs: Mapping[str, Any]) -> tuple[ArgInfo, ...]:
    a, b, scales = inputs
    _, n, _ = _infer_nbits_common("MatMulNBits", a, b, scales, attrs)
    return (ArgInfo((*a.shape[:-1], n), a.dtype),)


def _infer_nbits_zp(inputs: Sequence[ArgInfo], attrs: Mapping[str, Any]) -> tuple[ArgInfo, ...]:
    a, b, scales, zp = inputs
    _, n, k_blocks = _infer_nbits_common("MatMulNBitsZP", a, b, scales, attrs)
    per_row = -(-k_blocks // 2)
    expect(
        zp.shape in ((n * per_row,), (n, per_row)),
        "MatMulNBitsZP",
        f"zero_points has shape {list(zp.shape)}; expected [{n * per_row}] or [{n}, {per_row}] "
        "(4-bit packed)",
    )
    return (ArgInfo((*a.shape[:-1], n), a.dtype),)


_NBITS_ATTRS = (
    AttrSpec("K", "int", doc="input features"),
    AttrSpec("N", "int", doc="output features"),
    AttrSpec("bits", "int", 4, "bits per weight (4)"),
    AttrSpec("block_size", "int", doc="weights per quantization block along K (2^n >= 16)"),
)
_NBITS_INPUTS = (
    TensorSpec("a", "T", "[..., K]"),
    TensorSpec("b", "uint8", "[N, ceil(K/block_size), block_size/2]"),
    TensorSpec("scales", "T", "[N * ceil(K/block_size)] or [N, ceil(K/block_size)]"),
)

MATMUL_NBITS = OpDef(
    OpSchema(
        "MatMulNBits",
        inputs=_NBITS_INPUTS,
        outputs=(TensorSpec("y", "T", "[..., N]"),),
        attributes=_NBITS_ATTRS,
        type_vars=(("T", FLOATS),),
        doc="4-bit block-quantized MatMul, com.microsoft MatMulNBits packing, zero point 8.",
    ),
    reference=matmul_nbits,
    infer=_infer_nbits,
)

MATMUL_NBITS_ZP = OpDef(
    OpSchema(
        "MatMulNBitsZP",
        inputs=(
            *_NBITS_INPUTS,
            TensorSpec("zero_points", "uint8", "[N * ceil(k_blocks/2)], 4-bit packed"),
        ),
        outputs=(TensorSpec("y", "T", "[..., N]"),),
        attributes=_NBITS_ATTRS,
        type_vars=(("T", FLOATS),),
        doc="4-bit block-quantized MatMul with packed 4-bit zero points (MatMulNBits packing).",
    ),
    reference=matmul_nbits_zp,
    infer=_infer_nbits_zp,
)

# --- MXFP4 -----------------------------------------------------------------------------------

MXFP4_BLOCK = 32
E2M1_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=np.float32,
)


def decode_e2m1(codes: np.ndarray) -> np.ndarray:
    """float32 values of E2M1 codes (uint8 in 0..15)."""
    return E2M1_VALUES[np.asarray(codes, dtype=np.uint8) & 0x0F]


def decode_e8m0(scales: np.ndarray) -> np.ndarray:
    """float32 values 2^(e - 127) of E8M0 scale bytes; 255 is NaN."""
    e = np.asarray(scales, dtype=np.uint8).astype(np.int32)
    # 255 would overflow float32 in ldexp before np.where picks NaN: clamp it first.
    powers = np.ldexp(np.float32(1.0), np.minimum(e, 254) - 127)
    return np.where(e == 255, np.float32(np.nan), powers).astype(np.float32)


def dequantize_mxfp4(b: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The float32 [N, K] weight of MXFP4 blocks b [N, K/32, 16] and scales [N, K/32]."""
    n, k_blocks, _ = b.shape
    values = decode_e2m1(_unpack_nibbles(b))  # [N, K/32, 32]
    return (values * decode_e8m0(scales)[..., None]).reshape(n, k_blocks * MXFP4_BLOCK)


def quantize_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Quantize float [N, K] (K a multiple of 32) to ``(b [N, K/32, 16], scales [N, K/32])``.

    OCP recipe: the shared exponent is floor(log2(amax)) - 2 (E2M1's largest exponent), values are
    divided by 2^exponent, rounded to the nearest E2M1 value (ties to the even code) and clamped to
    ±6.
    """
    n, k = w.shape
    if k % MXFP4_BLOCK:
        raise OpError(f"MXFP4: K={k} is not a multiple of {MXFP4_BLOCK}")
    blocks = as_f32(w).reshape(n, k // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    safe = np.where(amax > 0, amax, 1.0)
    exp = np.floor(np.log2(safe)).astype(np.int32) - 2
    exp = np.where(amax > 0, exp, -127)
    exp = np.clip(exp, -127, 127)
    scaled = blocks / np.ldexp(np.float32(1.0), exp)[..., None]
    codes = _nearest_e2m1(scaled)
    return _pack_nibbles(codes), (exp + 127).astype(np.uint8)


def _nearest_e2m1(x: np.ndarray) -> np.ndarray:
    """E2M1 codes of x: round to nearest, ties to the even code (mantissa 0), clamp to ±6."""
    mags = E2M1_VALUES[:8]
    ax = np.minimum(np.abs(x), 6.0)
    dist = np.abs(ax[..., None] - mags)  # [..., 8]
    best = dist.min(axis=-1, keepdims=True)
    tied = dist == best
    # Among equally near codes prefer an even one (mantissa bit 0); argmax takes the first True.
    even = tied & (np.arange(8) % 2 == 0)
    code = np.where(even.any(axis=-1), even.argmax(axis=-1), tied.argmax(axis=-1))
    sign = np.signbit(x).astype(np.uint8) << 3  # -0.0 keeps its sign, as a cast does
    return (code.astype(np.uint8) | sign).astype(np.uint8)


def matmul_mxfp4(
    a: np.ndarray,
    b: np.ndarray,
    scales: np.ndarray,
    *,
    K: int,
    N: int,
) -> np.ndarray:
    """``a [..., K] @ dequantize_mxfp4(b, scales)^T``, float32 accumulation."""
    w = dequantize_mxfp4(b, scales)
    return np.matmul(as_f32(a), w.T).astype(a.dtype, copy=False)


def _infer_mxfp4(inputs: Sequence[ArgInfo], attrs: Mapping[str, Any]) -> tuple[ArgInfo, ...]:
    a, b, scales = inputs
    op = "MatMulMXFP4"
    k, n = attrs["K"], attrs["N"]
    expect(
        k > 0 and n > 0 and k % MXFP4_BLOCK == 0,
        op,
        f"K={k} must be a positive multiple of {MXFP4_BLOCK} and N={n} > 0",
    )
    expect_rank(op, "a", a, range(1, 9), "[..., K]")
    expect(a.shape[-1] == k, op, f"a has {a.shape[-1]} features in its last axis; K={k}")
    expect_shape(op, "b", b, (n, k // MXFP4_BLOCK, MXFP4_BLOCK // 2), "[N, K/32, 16]")
    expect_shape(op, "scales", scales, (n, k // MXFP4_BLOCK), "[N, K/32] E8M0 bytes")
    return (ArgInfo((*a.shape[:-1], n), a.dtype),)


MATMUL_MXFP4 = OpDef(
    OpSchema(
        "MatMulMXFP4",
        inputs=(
            TensorSpec("a", "T", "[..., K]"),
            TensorSpec("b", "uint8", "[N, K/32, 16]: E2M1 pairs, low nibble first"),
            TensorSpec("scales", "uint8", "[N, K/32]: E8M0 shared scales"),
        ),
        outputs=(TensorSpec("y", "T", "[..., N]"),),
        attributes=(
            AttrSpec("K", "int", doc="input features (multiple of 32)"),
            AttrSpec("N", "int", doc="output features"),
        ),
        type_vars=(("T", FLOATS),),
        doc="MatMul with an OCP MXFP4 weight (E2M1 values, E8M0 scales per 32).",
    ),
    reference=matmul_mxfp4,
    infer=_infer_mxfp4,
)
