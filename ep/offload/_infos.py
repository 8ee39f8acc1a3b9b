"""`WeightInfo` for a decoder's weights, in the order one decode step reads them."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import numpy as np

from ep.errors import OffloadError
from ep.seams import WeightInfo

__all__ = ["decoder_use_order", "weight_infos"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")

# Within one layer, the order a Llama/Qwen2 decoder reads its tensors (Hugging Face names).
_IN_LAYER = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.q_proj.bias",
    "self_attn.k_proj.weight",
    "self_attn.k_proj.bias",
    "self_attn.v_proj.weight",
    "self_attn.v_proj.bias",
    "self_attn.o_proj.weight",
    "post_attention_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
)


def _layer(name: str) -> int:
    found = _LAYER.search(name)
    return int(found.group(1)) if found else -1


def _op(name: str) -> str:
    if "embed_tokens" in name:
        return "Gather"
    if "norm" in name:
        return "RMSNorm"
    if name.endswith(".bias"):
        return "Add"
    return "MatMul"


def decoder_use_order(names: Sequence[str]) -> list[str]:
    """Hugging Face Llama/Qwen2 names sorted as a decode step reads them.

    Embedding, then each layer (norm, q, k, v, o, norm, gate, up, down), then the final norm and
    the head. Names the pattern does not know keep their relative order, after the rest.
    """

    def key(item: tuple[int, str]) -> tuple[int, int, int, int]:
        index, name = item
        layer = _layer(name)
        if "embed_tokens" in name:
            return (0, 0, 0, index)
        if layer >= 0:
            suffix = _LAYER.split(name)[-1]
            rank = _IN_LAYER.index(suffix) if suffix in _IN_LAYER else len(_IN_LAYER)
            return (1, layer, rank, index)
        if name.endswith("norm.weight"):
            return (2, 0, 0, index)
        if name.startswith("lm_head"):
            return (3, 0, 0, index)
        return (4, 0, 0, index)

    return [name for _, name in sorted(enumerate(names), key=key)]


def weight_infos(
    weights: Mapping[str, np.ndarray],
    use_order: Sequence[str] | None = None,
    *,
    ops: Mapping[str, str] | None = None,
) -> tuple[WeightInfo, ...]:
    """One `WeightInfo` per weight, ``order`` = position in ``use_order``.

    ``use_order`` defaults to `decoder_use_order` of the names; ``layer`` comes from
    ``layers.N.`` in the name (-1 outside the layers); ``op`` from ``ops`` or a guess by name.
    """
    order = list(use_order) if use_order is not None else decoder_use_order(list(weights))
    if sorted(order) != sorted(weights):
        extra = sorted(set(order) - set(weights))
        missing = sorted(set(weights) - set(order))
        raise OffloadError(
            f"use_order must list every weight once: unknown {extra[:4]}, missing {missing[:4]}, "
            f"{len(order)} names for {len(weights)} weights; pass the names the executor reads"
        )
    ops = ops or {}
    return tuple(
        WeightInfo(name, int(weights[name].nbytes), _layer(name), ops.get(name, _op(name)), i)
        for i, name in enumerate(order)
    )
