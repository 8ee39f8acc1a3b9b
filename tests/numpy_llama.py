"""An independent NumPy forward of the Hugging Face Llama / Qwen2 decoder, for tests.

Written from the transformers semantics (``LlamaForCausalLM`` / ``Qwen2ForCausalLM``), not from the
ONNX builders in ``graphs/ep_graphs``: it shares no code with them, so agreement between the two is
evidence, not a tautology. All arithmetic is float64.

Weights use the Hugging Face tensor names (``model.layers.0.self_attn.q_proj.weight``, ...) in the
Hugging Face [out, in] orientation. ``spec`` is any object with the attributes of
``ep_graphs.ModelSpec`` that are read below (duck-typed on purpose).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

__all__ = [
    "KV",
    "dequantize_matmul_nbits",
    "forward",
    "positions_from_mask",
    "relative_error",
]

KV = tuple[np.ndarray, np.ndarray]


def _f64(array: Any) -> np.ndarray:
    # bfloat16 (ml_dtypes) does not cast straight to float64 everywhere; float32 is exact for it.
    arr = np.asarray(array)
    if arr.dtype.kind not in "fiu":
        arr = arr.astype(np.float32)
    return arr.astype(np.float64)


def _rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    variance = np.mean(x * x, axis=-1, keepdims=True)
    return weight * (x / np.sqrt(variance + eps))


def _rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rope_cos_sin(position_ids: np.ndarray, head_dim: int, theta: float) -> tuple[np.ndarray, ...]:
    exponents = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    inv_freq = 1.0 / (theta**exponents)  # [D/2]
    angles = position_ids.astype(np.float64)[..., None] * inv_freq  # [B, S, D/2]
    angles = np.concatenate([angles, angles], axis=-1)  # [B, S, D]
    # [B, 1, S, D]: broadcast over heads
    return np.cos(angles)[:, None], np.sin(angles)[:, None]


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _softmax(x: np.ndarray) -> np.ndarray:
    shifted = x - np.max(x, axis=-1, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=-1, keepdims=True)


def positions_from_mask(attention_mask: np.ndarray, seq_len: int) -> np.ndarray:
    """Position ids of the last ``seq_len`` tokens: the running count of real tokens minus one.

    Padding positions get 1 (the value is irrelevant: they are masked), as transformers does.
    """
    mask = np.asarray(attention_mask, dtype=np.int64)
    positions = np.cumsum(mask, axis=-1) - 1
    positions = np.where(mask == 0, 1, positions)
    return positions[:, -seq_len:].astype(np.int64)


def forward(
    spec: Any,
    weights: Mapping[str, Any],
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    position_ids: np.ndarray,
    past: Sequence[KV] | None = None,
) -> tuple[np.ndarray, list[KV]]:
    """Run the decoder: logits [B, S, V] (float64) and per-layer present (K, V) [B, Hkv, P+S, D].

    ``attention_mask`` covers past and new tokens ([B, P+S]); a key whose mask is 0 is never
    attended (padding, left or right), and query i only sees keys at absolute index <= P + i
    (causal). ``past`` holds post-rotary keys, as transformers' cache does.
    """
    ids = np.asarray(input_ids, dtype=np.int64)
    mask = np.asarray(attention_mask, dtype=np.int64)
    batch, seq = ids.shape
    heads, kv_heads, head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
    group = heads // kv_heads
    past_len = 0 if past is None else past[0][0].shape[2]
    total = past_len + seq
    if mask.shape != (batch, total):
        raise ValueError(f"attention_mask shape {mask.shape} != {(batch, total)}")

    def w(name: str) -> np.ndarray:
        return _f64(weights[name])

    hidden = w("model.embed_tokens.weight")[ids]  # [B, S, H]
    cos, sin = _rope_cos_sin(np.asarray(position_ids), head_dim, spec.rope_theta)

    query_abs = past_len + np.arange(seq)[:, None]  # [S, 1]
    key_abs = np.arange(total)[None, :]  # [1, T]
    allowed = (key_abs <= query_abs)[None, None] & (mask[:, None, None, :] == 1)  # [B, 1, S, T]
    # A row with nothing allowed (a padding query) gets uniform weights instead of NaN, as
    # transformers' finite minimum does; such rows are never compared.
    neg = np.finfo(np.float64).min

    present: list[KV] = []
    for layer in range(spec.num_layers):
        prefix = f"model.layers.{layer}."
        x = _rms_norm(hidden, w(prefix + "input_layernorm.weight"), spec.rms_norm_eps)

        def project(name: str, x: np.ndarray = x, prefix: str = prefix) -> np.ndarray:
            out = x @ w(f"{prefix}self_attn.{name}.weight").T
            bias_name = f"{prefix}self_attn.{name}.bias"
            if bias_name in weights:
                out = out + _f64(weights[bias_name])
            return out

        q = project("q_proj").reshape(batch, seq, heads, head_dim).transpose(0, 2, 1, 3)
        k = project("k_proj").reshape(batch, seq, kv_heads, head_dim).transpose(0, 2, 1, 3)
        v = project("v_proj").reshape(batch, seq, kv_heads, head_dim).transpose(0, 2, 1, 3)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        if past is not None:
            k = np.concatenate([_f64(past[layer][0]), k], axis=2)
            v = np.concatenate([_f64(past[layer][1]), v], axis=2)
        present.append((k, v))

        # KV head j serves query heads j*group .. (j+1)*group - 1 (transformers' repeat_kv)
        k_rep = np.repeat(k, group, axis=1)
        v_rep = np.repeat(v, group, axis=1)
        scores = q @ k_rep.transpose(0, 1, 3, 2) / np.sqrt(head_dim)  # [B, Hq, S, T]
        scores = np.where(allowed, scores, neg)
        attn = _softmax(scores) @ v_rep  # [B, Hq, S, D]
        attn = attn.transpose(0, 2, 1, 3).reshape(batch, seq, heads * head_dim)
        hidden = hidden + attn @ w(prefix + "self_attn.o_proj.weight").T

        x = _rms_norm(hidden, w(prefix + "post_attention_layernorm.weight"), spec.rms_norm_eps)
        gate = x @ w(prefix + "mlp.gate_proj.weight").T
        up = x @ w(prefix + "mlp.up_proj.weight").T
        hidden = hidden + (_silu(gate) * up) @ w(prefix + "mlp.down_proj.weight").T

    hidden = _rms_norm(hidden, w("model.norm.weight"), spec.rms_norm_eps)
    head = "lm_head.weight" if "lm_head.weight" in weights else "model.embed_tokens.weight"
    logits = hidden @ w(head).T
    return logits, present


def dequantize_matmul_nbits(
    packed: np.ndarray,
    scales: np.ndarray,
    k: int,
    *,
    block_size: int = 32,
    zero_points: np.ndarray | None = None,
) -> np.ndarray:
    """Dequantize com.microsoft MatMulNBits 4-bit weights to float64 [N, K] (the [out, in] matrix).

    ``packed`` is uint8 [N, blocks, block_size / 2] (two values a byte, low nibble first);
    ``scales`` [N, blocks] (or flat); ``zero_points`` uint8 [N, ceil(blocks / 2)] packed the same
    way, or None for the implicit zero point 8.
    """
    n = packed.shape[0]
    blocks = -(-k // block_size)
    raw = np.asarray(packed, dtype=np.uint8).reshape(n, blocks, block_size // 2)
    values = np.empty((n, blocks, block_size), dtype=np.float64)
    values[..., 0::2] = raw & 0x0F
    values[..., 1::2] = raw >> 4
    if zero_points is None:
        zp = np.full((n, blocks), 8.0)
    else:
        zp_raw = np.asarray(zero_points, dtype=np.uint8).reshape(n, -1)
        zp_all = np.empty((n, zp_raw.shape[1] * 2), dtype=np.float64)
        zp_all[:, 0::2] = zp_raw & 0x0F
        zp_all[:, 1::2] = zp_raw >> 4
        zp = zp_all[:, :blocks]
    scale = _f64(scales).reshape(n, blocks)
    deq = (values - zp[..., None]) * scale[..., None]
    return deq.reshape(n, blocks * block_size)[:, :k]


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """max |actual - expected| / max |expected| (one scale for the whole tensor)."""
    a = _f64(actual)
    e = _f64(expected)
    return float(np.max(np.abs(a - e)) / max(float(np.max(np.abs(e))), 1e-30))
