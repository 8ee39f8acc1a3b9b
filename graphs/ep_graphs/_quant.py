"""4-bit block quantization in com.microsoft MatMulNBits' format (ONNX Runtime's MLAS quantizer).

A weight W [N, K] (the Hugging Face [out, in] matrix) is cut along K into blocks of `block_size`.
Per block: symmetric → scale = (the value of largest magnitude) / -8 with the implicit zero point 8;
asymmetric → scale = (max(v, 0) - min(v, 0)) / 15 and a zero point. Codes q = clamp(round(v / scale
+ zp), 0, 15), rounding half away from zero, two codes a byte, low nibble first. This reproduces
ONNX Runtime's quantizer (the onnxruntime-genai builder's int4 files) bit for bit on float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ep.errors import ConfigError

__all__ = ["Int4Options", "Int4Weight", "quantize_int4"]

_BLOCK_SIZES = (16, 32, 64, 128, 256)


@dataclass(frozen=True)
class Int4Options:
    """How `quant="int4"` quantizes: block size, symmetric or with zero points, MatMulNBits'
    ``accuracy_level`` (4 = int8 activations, as onnxruntime-genai writes; 0 = float compute)."""

    block_size: int = 32
    symmetric: bool = True
    accuracy_level: int = 4

    def __post_init__(self) -> None:
        if self.block_size not in _BLOCK_SIZES:
            raise ConfigError(
                f"int4 block_size={self.block_size}; MatMulNBits accepts {_BLOCK_SIZES}"
            )
        if self.accuracy_level not in (0, 1, 2, 3, 4):
            raise ConfigError(
                f"int4 accuracy_level={self.accuracy_level}; expected 0..4 (0 unset, 1 fp32, "
                "2 fp16, 3 bf16, 4 int8 activations)"
            )


@dataclass(frozen=True)
class Int4Weight:
    """A quantized [N, K] matrix: codes [N, blocks, block_size/2] uint8, scales [N, blocks] in the
    model dtype, zero points [N, ceil(blocks/2)] uint8 or None (implicit 8)."""

    packed: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    n: int
    k: int
    block_size: int

    def dequantize(self) -> np.ndarray:
        """The float32 [N, K] matrix MatMulNBits multiplies by."""
        blocks = self.packed.shape[1]
        codes = np.empty((self.n, blocks, self.block_size), dtype=np.float32)
        codes[..., 0::2] = self.packed & 0x0F
        codes[..., 1::2] = self.packed >> 4
        if self.zero_points is None:
            zp = np.full((self.n, blocks), 8.0, dtype=np.float32)
        else:
            unpacked = np.empty((self.n, self.zero_points.shape[1] * 2), dtype=np.float32)
            unpacked[:, 0::2] = self.zero_points & 0x0F
            unpacked[:, 1::2] = self.zero_points >> 4
            zp = unpacked[:, :blocks]
        scales = self.scales.astype(np.float32)
        values = (codes - zp[..., None]) * scales[..., None]
        return values.reshape(self.n, -1)[:, : self.k]


def _round_half_away(x: np.ndarray) -> np.ndarray:
    # C's roundf; NumPy's round is half-to-even, which would differ from ONNX Runtime's codes.
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


# Rows quantized at a time: bounds the float32 temporaries for large (vocabulary) matrices.
_ROWS_PER_CHUNK = 4096


def quantize_int4(weight: np.ndarray, options: Int4Options, scale_dtype: Any) -> Int4Weight:
    """Quantize a [N, K] matrix (any float dtype) to MatMulNBits' 4-bit blocks."""
    w = np.asarray(weight)
    if w.ndim != 2:
        raise ConfigError(f"int4 quantization needs a 2-D [N, K] matrix; got shape {w.shape}")
    n, k = w.shape
    bs = options.block_size
    blocks = -(-k // bs)
    packed = np.empty((n, blocks, bs // 2), dtype=np.uint8)
    scales = np.empty((n, blocks), dtype=scale_dtype)
    zps = np.empty((n, blocks), dtype=np.uint8)
    for start in range(0, n, _ROWS_PER_CHUNK):
        rows = slice(start, min(n, start + _ROWS_PER_CHUNK))
        packed[rows], scales[rows], zps[rows] = _quantize_rows(w[rows], k, options, scale_dtype)
    zero_points = None
    if not options.symmetric:
        if blocks % 2:  # the unused high nibble of an odd count is 8, as ONNX Runtime leaves it
            zps = np.concatenate([zps, np.full((n, 1), 8, np.uint8)], axis=1)
        zero_points = (zps[:, 0::2] | (zps[:, 1::2] << 4)).astype(np.uint8)
    return Int4Weight(packed, scales, zero_points, n, k, bs)


def _quantize_rows(
    rows: np.ndarray, k: int, options: Int4Options, scale_dtype: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Codes [n, blocks, bs/2], scales [n, blocks] and unpacked zero points [n, blocks]."""
    n, bs = rows.shape[0], options.block_size
    blocks = -(-k // bs)
    padded = np.zeros((n, blocks * bs), dtype=np.float32)
    padded[:, :k] = rows  # a partial block's tail is 0: it quantizes to the zero point
    grouped = padded.reshape(n, blocks, bs)
    if k % bs:
        # min/max over the real values only, as ONNX Runtime scans only indices < K
        low = np.full_like(padded, np.inf)
        high = np.full_like(padded, -np.inf)
        low[:, :k] = high[:, :k] = padded[:, :k]
        vmin = low.reshape(n, blocks, bs).min(axis=2)
        vmax = high.reshape(n, blocks, bs).max(axis=2)
    else:
        vmin, vmax = grouped.min(axis=2), grouped.max(axis=2)

    if options.symmetric:
        extreme = np.where(np.abs(vmax) > np.abs(vmin), vmax, vmin)
        scales = (extreme / np.float32(-8.0)).astype(scale_dtype)
        zp = np.full((n, blocks), 8.0, dtype=np.float32)
    else:
        lo = np.minimum(vmin, np.float32(0.0))
        hi = np.maximum(vmax, np.float32(0.0))
        scale_f = ((hi - lo) / np.float32(15.0)).astype(np.float32)
        with np.errstate(divide="ignore", invalid="ignore"):
            zp_f = np.where(scale_f != 0, np.float32(0.0) - lo / scale_f, lo).astype(np.float32)
        zp = np.clip(_round_half_away(zp_f), 0, 15).astype(np.float32)
        scales = scale_f.astype(scale_dtype)
    # Codes use the scale as stored (rounded to the model dtype), like ONNX Runtime.
    stored = scales.astype(np.float32)
    with np.errstate(divide="ignore"):
        recip = np.where(stored != 0, np.float32(1.0) / stored, np.float32(0.0)).astype(np.float32)
    scaled = grouped * recip[..., None]
    scaled += zp[..., None]
    codes = np.clip(_round_half_away(scaled), 0, 15).astype(np.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return packed, scales, zp.astype(np.uint8)
