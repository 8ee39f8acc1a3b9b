"""Helpers for the graph builder tests: run a built model in ONNX Runtime, make padded batches."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import numpy_llama as nl
import onnx
import onnxruntime as ort
from onnx import TensorProto, numpy_helper

from ep_graphs import ModelSpec

TINY = Path(__file__).resolve().parents[1] / "data" / "genai-llama-tiny"


@dataclass
class Model:
    """An ORT CPU session plus the cache geometry from the folder's genai_config.json."""

    sess: ort.InferenceSession
    layers: int
    kv_heads: int
    head_dim: int

    @property
    def input_names(self) -> list[str]:
        return [i.name for i in self.sess.get_inputs()]


def session(model_dir: Path) -> Model:
    decoder = json.loads((model_dir / "genai_config.json").read_text())["model"]["decoder"]
    sess = ort.InferenceSession(str(model_dir / "model.onnx"), providers=["CPUExecutionProvider"])
    return Model(
        sess,
        decoder["num_hidden_layers"],
        decoder["num_key_value_heads"],
        decoder["head_size"],
    )


def _kv_value(array: np.ndarray) -> Any:
    if array.dtype == np.dtype(ml_dtypes.bfloat16):
        # The Python API cannot take ml_dtypes arrays; hand ORT the bits with the ONNX type.
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            np.ascontiguousarray(array).view(np.uint16), TensorProto.BFLOAT16
        )
    return array


@dataclass
class Step:
    logits: np.ndarray
    present: list[tuple[np.ndarray, np.ndarray]]


def run(
    model: Model,
    input_ids: np.ndarray,
    attention_mask: np.ndarray,
    *,
    past: list[tuple[np.ndarray, np.ndarray]] | None = None,
    position_ids: np.ndarray | None = None,
    kv_dtype: Any = np.float32,
) -> Step:
    """One forward; `past` None means an empty cache. position_ids only where the graph has it."""
    names = model.input_names
    layers, kv_heads, head_dim = model.layers, model.kv_heads, model.head_dim
    feeds: dict[str, Any] = {
        "input_ids": np.asarray(input_ids, np.int64),
        "attention_mask": np.asarray(attention_mask, np.int64),
    }
    if "position_ids" in names:
        assert position_ids is not None, "this graph takes position_ids"
        feeds["position_ids"] = np.asarray(position_ids, np.int64)
    batch = feeds["input_ids"].shape[0]
    for i in range(layers):
        for j, kind in enumerate(("key", "value")):
            if past is None:
                kv = np.zeros((batch, kv_heads, 0, head_dim), dtype=kv_dtype)
            else:
                kv = past[i][j]
            feeds[f"past_key_values.{i}.{kind}"] = _kv_value(kv)
    sess = model.sess
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds), strict=True))
    present = [(outs[f"present.{i}.key"], outs[f"present.{i}.value"]) for i in range(layers)]
    return Step(outs["logits"], present)


def left_padded(prompts: list[list[int]], pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad, dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def right_padded(prompts: list[list[int]], pad: int = 0) -> tuple[np.ndarray, np.ndarray]:
    width = max(len(p) for p in prompts)
    ids = np.full((len(prompts), width), pad, dtype=np.int64)
    mask = np.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, : len(prompt)] = prompt
        mask[row, : len(prompt)] = 1
    return ids, mask


def max_row_error(actual: np.ndarray, expected: np.ndarray, mask: np.ndarray) -> float:
    """Largest relative error over the rows' real (mask == 1) positions, row by row."""
    worst = 0.0
    for row in range(mask.shape[0]):
        keep = mask[row, -actual.shape[1] :] == 1
        if keep.any():
            worst = max(worst, nl.relative_error(actual[row, keep], expected[row, keep]))
    return worst


PROMPTS = [[5, 17, 99, 3, 64, 8, 120], [42, 7, 11], [100, 1, 2, 90, 33]]


def dequantized_weights(
    model_dir: Path, spec: ModelSpec, hf: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """HF-named float64 weights as the int4 model computes with them, decoded from its file."""
    init = {
        t.name: numpy_helper.to_array(t, str(model_dir))
        for t in onnx.load(model_dir / "model.onnx", load_external_data=False).graph.initializer
    }
    block = {  # each MatMulNBits node's block size and K
        n.input[1]: {a.name: a.i for a in n.attribute}
        for n in onnx.load(model_dir / "model.onnx", load_external_data=False).graph.node
        if n.op_type == "MatMulNBits"
    }

    def deq(stem: str) -> np.ndarray:
        attrs = block[f"{stem}.MatMul.weight_Q4"]
        return nl.dequantize_matmul_nbits(
            init[f"{stem}.MatMul.weight_Q4"],
            init[f"{stem}.MatMul.weight_scales"],
            attrs["K"],
            block_size=attrs["block_size"],
            zero_points=init.get(f"{stem}.MatMul.weight_zero_points"),
        )

    out = {k: v.astype(np.float64) for k, v in hf.items()}
    for layer in range(spec.num_layers):
        attn, mlp = f"model.layers.{layer}.attn", f"model.layers.{layer}.mlp"
        sa = f"model.layers.{layer}.self_attn."
        q, k, v = np.split(deq(f"{attn}.qkv_proj"), [spec.q_size, spec.q_size + spec.kv_size])
        out[sa + "q_proj.weight"], out[sa + "k_proj.weight"], out[sa + "v_proj.weight"] = q, k, v
        out[sa + "o_proj.weight"] = deq(f"{attn}.o_proj")
        for kind in ("gate_proj", "up_proj", "down_proj"):
            out[f"model.layers.{layer}.mlp.{kind}.weight"] = deq(f"{mlp}.{kind}")
    head = deq("lm_head")
    if spec.tie_embeddings:
        out["model.embed_tokens.weight"] = head  # GatherBlockQuantized reads the same blocks
        out.pop("lm_head.weight", None)
    else:
        out["lm_head.weight"] = head
    return out
