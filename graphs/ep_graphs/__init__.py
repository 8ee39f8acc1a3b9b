"""Genai-style decoder graph builders (Llama / Qwen2 family).

`build_model(spec, weights, flavour=..., out_dir=...)` writes a model folder (model.onnx with its
weights in model.onnx.data, genai_config.json, tokenizer files) in one of the registered flavours:
``standard`` (plain ONNX ops) or ``contrib`` (the onnxruntime-genai builder's format). Weights come
from `random_weights` or `load_hf_checkpoint`; `convert_checkpoint` does both steps for a folder.
"""

from __future__ import annotations

from pathlib import Path

from ._build import build_model, convert_checkpoint, genai_config
from ._cli import add_build_arguments, run_build
from ._contrib import ContribEmitter
from ._flavour import FLAVOURS, DecoderEmitter, Linear, WeightSource, register_flavour
from ._quant import Int4Options, Int4Weight, quantize_int4
from ._spec import DTYPES, DType, ModelSpec
from ._standard import StandardEmitter
from ._weights import check_weights, expected_shapes, load_hf_checkpoint, random_weights

# The bundled default model: a Hugging Face checkpoint trained by tools/train_default_model.py.
DEFAULT_MODEL = Path(__file__).parent / "default_model"

__all__ = [
    "DEFAULT_MODEL",
    "DTYPES",
    "FLAVOURS",
    "ContribEmitter",
    "DType",
    "DecoderEmitter",
    "Int4Options",
    "Int4Weight",
    "Linear",
    "ModelSpec",
    "StandardEmitter",
    "WeightSource",
    "add_build_arguments",
    "build_model",
    "check_weights",
    "convert_checkpoint",
    "expected_shapes",
    "genai_config",
    "load_hf_checkpoint",
    "quantize_int4",
    "random_weights",
    "register_flavour",
    "run_build",
]
