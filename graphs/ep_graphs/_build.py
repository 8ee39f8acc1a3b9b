"""`build_model` and `convert_checkpoint`: a complete model folder from a spec and weights."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import onnx

from ep.errors import ConfigError, ModelError

from . import _contrib, _ep, _standard  # noqa: F401 - importing registers the built-in flavours
from ._flavour import WeightSource, get_flavour
from ._graph import GraphBuilder
from ._quant import Int4Options
from ._spec import DTYPES, DType, ModelSpec
from ._weights import check_weights, load_hf_checkpoint, progress_bar, progress_enabled

__all__ = [
    "MODEL_FILES",
    "TOKENIZER_FILES",
    "build_model",
    "convert_checkpoint",
    "genai_config",
    "resolve_quant",
]

MODEL_FILES = ("model.onnx", "model.onnx.data", "genai_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
_PRODUCER = "genai-ep ep_graphs"


def resolve_quant(quant: str | Int4Options | None) -> Int4Options | None:
    """``None`` | ``"int4"`` (block 32, symmetric, accuracy level 4) | explicit `Int4Options`."""
    if quant is None or isinstance(quant, Int4Options):
        return quant
    if isinstance(quant, str) and quant.lower() == "int4":
        return Int4Options()
    raise ConfigError(
        f"quant={quant!r} is not supported; use None, 'int4' or an Int4Options(...) value"
    )


def genai_config(
    spec: ModelSpec, *, has_position_ids: bool, past_present_share_buffer: bool = True
) -> dict[str, Any]:
    """The ``genai_config.json`` content, shaped like the onnxruntime-genai builder's."""
    inputs = {
        "input_ids": "input_ids",
        "attention_mask": "attention_mask",
        "past_key_names": "past_key_values.%d.key",
        "past_value_names": "past_key_values.%d.value",
    }
    if has_position_ids:
        inputs["position_ids"] = "position_ids"
    eos: int | list[int] = (
        list(spec.eos_token_ids) if len(spec.eos_token_ids) > 1 else spec.eos_token_ids[0]
    )
    return {
        "model": {
            "bos_token_id": spec.bos_token_id,
            "context_length": spec.context_length,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": "model.onnx",
                "head_size": spec.head_dim,
                "hidden_size": spec.hidden_size,
                "inputs": inputs,
                "outputs": {
                    "logits": "logits",
                    "present_key_names": "present.%d.key",
                    "present_value_names": "present.%d.value",
                },
                "num_attention_heads": spec.num_heads,
                "num_hidden_layers": spec.num_layers,
                "num_key_value_heads": spec.num_kv_heads,
            },
            "eos_token_id": eos,
            "pad_token_id": spec.pad_token_id,
            "type": spec.model_type,
            "vocab_size": spec.vocab_size,
        },
        "search": {
            "diversity_penalty": 0.0,
            "do_sample": False,
            "early_stopping": True,
            "length_penalty": 1.0,
            "max_length": spec.context_length,
            "min_length": 0,
            "no_repeat_ngram_size": 0,
            "num_beams": 1,
            "num_return_sequences": 1,
            "past_present_share_buffer": past_present_share_buffer,
            "repetition_penalty": 1.0,
            "temperature": 1.0,
            "top_k": 50,
            "top_p": 1.0,
        },
    }


# Hugging Face generation_config.json keys that become genai_config.json "search" defaults.
_SEARCH_KEYS = ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")


def search_defaults(checkpoint_dir: Path) -> dict[str, Any]:
    """The sampling defaults of a checkpoint's ``generation_config.json`` (empty when absent)."""
    path = checkpoint_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path} is not valid JSON ({exc}); fix or remove it") from None
    return {k: found[k] for k in _SEARCH_KEYS if k in found}


def _tokenizer_files(tokenizer_dir: Path) -> list[Path]:
    if not tokenizer_dir.is_dir():
        raise ModelError(f"tokenizer folder {tokenizer_dir} does not exist")
    files = [tokenizer_dir / name for name in TOKENIZER_FILES if (tokenizer_dir / name).is_file()]
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise ModelError(
            f"no tokenizer.json in {tokenizer_dir}; give a folder holding the Hugging Face "
            "tokenizer files (tokenizer.json, tokenizer_config.json) or leave tokenizer_dir out"
        )
    return files


def build_model(
    spec: ModelSpec,
    weights: Mapping[str, Any],
    *,
    flavour: str,
    out_dir: str | Path,
    quant: str | Int4Options | None = None,
    tokenizer_dir: str | Path | None = None,
    progress: bool | None = None,
) -> Path:
    """Write a model folder: model.onnx + model.onnx.data, genai_config.json, tokenizer files.

    `weights` are Hugging Face tensors by name (any float dtype; cast to ``spec.dtype``).
    `flavour` is a registered flavour ("standard", "contrib", ...); `quant` "int4" (contrib).
    Everything is validated before anything is written; files are built in a staging folder
    beside `out_dir` and moved in at the end, so a failure leaves an existing folder untouched.
    Returns `out_dir`.
    """
    emitter_cls = get_flavour(flavour)
    options = resolve_quant(quant)
    emitter_cls.check_options(spec, options)
    check_weights(spec, weights)
    tokenizer_files = _tokenizer_files(Path(tokenizer_dir)) if tokenizer_dir is not None else []

    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ModelError(f"output path {out} exists and is not a folder; choose another -o path")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.building-", dir=out.parent))
    try:
        source = WeightSource(spec, weights)
        graph = GraphBuilder(staging)
        emitter = emitter_cls(graph, spec, source, options)
        with graph, progress_bar(progress_enabled(progress), spec.num_layers, "building") as tick:
            emitter.emit(on_layer=tick)
        model = graph.model(f"{spec.model_type}_{flavour}", dict(emitter_cls.opsets), _PRODUCER)
        meta = {
            "ep_graphs.flavour": flavour,
            "ep_graphs.quant": json.dumps(dataclasses.asdict(options) if options else None),
            "ep_graphs.spec": json.dumps(spec.to_dict(), sort_keys=True),
        }
        onnx.helper.set_model_props(model, meta)
        onnx.save_model(model, staging / "model.onnx")
        if emitter_cls.onnx_checkable:
            onnx.checker.check_model(str(staging / "model.onnx"))
        config = genai_config(
            spec,
            has_position_ids=emitter_cls.has_position_ids,
            past_present_share_buffer=emitter_cls.past_present_share_buffer,
        )
        config = emitter_cls.adjust_genai_config(config)
        if tokenizer_dir is not None:
            config["search"].update(search_defaults(Path(tokenizer_dir)))
        (staging / "genai_config.json").write_text(json.dumps(config, indent=4) + "\n")
        for path in tokenizer_files:
            shutil.copyfile(path, staging / path.name)
        out.mkdir(exist_ok=True)
        for path in staging.iterdir():
            os.replace(path, out / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def convert_checkpoint(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    flavour: str = "contrib",
    dtype: DType = "fp32",
    quant: str | Int4Options | None = None,
    progress: bool | None = None,
) -> Path:
    """Convert a Hugging Face Llama/Qwen2 safetensors checkpoint into a model folder.

    The graph is built in `dtype` (not the checkpoint's stored dtype); tokenizer files in
    `hf_dir` are copied when present.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r}; expected one of {DTYPES}")
    hf = Path(hf_dir)
    get_flavour(flavour).check_quant(resolve_quant(quant))  # fail before reading gigabytes
    spec, weights = load_hf_checkpoint(hf, progress=progress)
    spec = dataclasses.replace(spec, dtype=dtype)
    tokenizer = hf if (hf / "tokenizer.json").is_file() else None
    return build_model(
        spec,
        weights,
        flavour=flavour,
        out_dir=out_dir,
        quant=quant,
        tokenizer_dir=tokenizer,
        progress=progress,
    )
