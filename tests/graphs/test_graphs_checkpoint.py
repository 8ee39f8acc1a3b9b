"""Hugging Face checkpoints written by the tests (config.json + safetensors) → model folders."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import numpy_llama as nl
import pytest
from graphs_testlib import PROMPTS, left_padded, max_row_error, right_padded, run, session
from safetensors.numpy import save_file

from ep.errors import ConfigError, ModelError
from ep_graphs import DType, ModelSpec, convert_checkpoint, load_hf_checkpoint, random_weights

SPEC = ModelSpec.parse(
    "hidden=64,layers=2,heads=4,kv_heads=2,vocab=128,intermediate=96,theta=250000,eps=1e-6,"
    "context=64,bos=1,eos=2,pad=0"
)
STORED = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
HF_DTYPE = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def hf_config(spec: ModelSpec, stored: str) -> dict[str, Any]:
    config: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM" if spec.model_type == "qwen2" else "LlamaForCausalLM"],
        "model_type": spec.model_type,
        "hidden_size": spec.hidden_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "intermediate_size": spec.intermediate_size,
        "vocab_size": spec.vocab_size,
        "rope_theta": spec.rope_theta,
        "rms_norm_eps": spec.rms_norm_eps,
        "tie_word_embeddings": spec.tie_embeddings,
        "max_position_embeddings": spec.context_length,
        "bos_token_id": spec.bos_token_id,
        "eos_token_id": spec.eos_token_id,
        "pad_token_id": spec.pad_token_id,
        "hidden_act": "silu",
        "torch_dtype": HF_DTYPE[stored],
    }
    if spec.model_type == "llama":
        config["attention_bias"] = False
    return config


def write_checkpoint(
    folder: Path,
    spec: ModelSpec,
    *,
    stored: str = "fp32",
    shards: int = 1,
    drop: tuple[str, ...] = (),
    extra: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write config.json + safetensors (sharded with an index when shards > 1); return weights."""
    folder.mkdir(parents=True, exist_ok=True)
    weights = {
        k: v.astype(np.float32).astype(STORED[stored])
        for k, v in random_weights(dataclasses.replace(spec, dtype="fp32"), seed=3).items()
    }
    tensors = {k: v for k, v in weights.items() if k not in drop}
    tensors.update(extra or {})
    (folder / "config.json").write_text(json.dumps(hf_config(spec, stored)))
    if shards == 1:
        save_file(tensors, str(folder / "model.safetensors"))
    else:
        names = sorted(tensors)
        weight_map = {}
        for index in range(shards):
            part = names[index::shards]
            shard = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
            save_file({k: tensors[k] for k in part}, str(folder / shard))
            weight_map.update(dict.fromkeys(part, shard))
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    return weights


@pytest.mark.parametrize(
    ("label", "spec", "stored", "shards", "flavour"),
    [
        ("llama_fp32_single", SPEC, "fp32", 1, "contrib"),
        ("llama_fp16_sharded", SPEC, "fp16", 3, "contrib"),
        (
            "llama_bf16_sharded_tied",
            dataclasses.replace(SPEC, tie_embeddings=True),
            "bf16",
            2,
            "standard",
        ),
        (
            "qwen2_bf16_single",
            dataclasses.replace(SPEC, model_type="qwen2", qkv_bias=True),
            "bf16",
            1,
            "standard",
        ),
        (
            "qwen2_fp32_sharded_tied",
            dataclasses.replace(SPEC, model_type="qwen2", qkv_bias=True, tie_embeddings=True),
            "fp32",
            2,
            "contrib",
        ),
    ],
)
def test_checkpoint_converts_and_matches_reference(
    tmp_path: Path, label: str, spec: ModelSpec, stored: DType, shards: int, flavour: str
) -> None:
    weights = write_checkpoint(tmp_path / "hf", spec, stored=stored, shards=shards)
    loaded_spec, loaded = load_hf_checkpoint(tmp_path / "hf", progress=False)
    assert loaded_spec == dataclasses.replace(spec, dtype=stored)
    assert set(loaded) == set(weights)
    assert all(loaded[k].dtype == np.dtype(STORED[stored]) for k in loaded)

    out = convert_checkpoint(tmp_path / "hf", tmp_path / "onnx", flavour=flavour, progress=False)
    padded = left_padded if flavour == "standard" else right_padded
    ids, mask = padded(PROMPTS)
    pos = nl.positions_from_mask(mask, ids.shape[1])
    got = run(session(out), ids, mask, position_ids=pos)
    # The fp32 graph computes with the stored values widened exactly, as the reference does.
    ref, _ = nl.forward(spec, weights, ids, mask, pos)
    assert max_row_error(got.logits, ref, mask) < 1e-5


def test_extra_tensors_are_ignored_and_tied_lm_head_may_be_present(tmp_path: Path) -> None:
    spec = dataclasses.replace(SPEC, tie_embeddings=True)
    extra = {
        "model.layers.0.self_attn.rotary_emb.inv_freq": np.ones(8, np.float32),
        "lm_head.weight": np.zeros((spec.vocab_size, spec.hidden_size), np.float32),
    }
    write_checkpoint(tmp_path, spec, extra=extra)
    _, loaded = load_hf_checkpoint(tmp_path, progress=False)
    assert "lm_head.weight" not in loaded and not any("rotary" in k for k in loaded)


def test_progress_bar_reports_on_stderr(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_checkpoint(tmp_path / "hf", SPEC)
    convert_checkpoint(tmp_path / "hf", tmp_path / "out", progress=True)
    err = capsys.readouterr().err
    assert "reading hf" in err and "building" in err


# --- errors -------------------------------------------------------------------------------


def test_missing_config(tmp_path: Path) -> None:
    save_file({"a": np.ones(2, np.float32)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ModelError, match=r"no Hugging Face config at .*config\.json"):
        load_hf_checkpoint(tmp_path)


def test_missing_folder(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="does not exist"):
        convert_checkpoint(tmp_path / "nope", tmp_path / "out")


def test_missing_tensors_are_named(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, SPEC, drop=("model.layers.1.mlp.up_proj.weight", "lm_head.weight"))
    with pytest.raises(ModelError) as info:
        load_hf_checkpoint(tmp_path, progress=False)
    message = str(info.value)
    assert "model.layers.1.mlp.up_proj.weight" in message and "lm_head.weight" in message
    assert "2 tensor(s) missing" in message


def test_missing_qwen2_biases_are_named(tmp_path: Path) -> None:
    spec = dataclasses.replace(SPEC, model_type="qwen2", qkv_bias=True)
    write_checkpoint(tmp_path, spec, drop=("model.layers.0.self_attn.k_proj.bias",))
    with pytest.raises(ModelError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias"):
        load_hf_checkpoint(tmp_path, progress=False)


def test_wrong_shape_is_named(tmp_path: Path) -> None:
    bad = np.zeros((SPEC.intermediate_size + 1, SPEC.hidden_size), np.float32)
    write_checkpoint(tmp_path, SPEC, extra={"model.layers.0.mlp.gate_proj.weight": bad})
    with pytest.raises(
        ModelError, match=r"gate_proj\.weight has shape \[97, 64\]; expected \[96, 64\]"
    ):
        load_hf_checkpoint(tmp_path, progress=False)


def test_missing_shard(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, SPEC, shards=2)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ModelError, match=r"model-00002-of-00002\.safetensors"):
        load_hf_checkpoint(tmp_path, progress=False)


def test_no_weights_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(hf_config(SPEC, "fp32")))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelError, match=r"expected model\.safetensors"):
        load_hf_checkpoint(tmp_path)


def test_corrupt_safetensors(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(hf_config(SPEC, "fp32")))
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{bad json")
    with pytest.raises(ModelError, match="cannot read"):
        load_hf_checkpoint(tmp_path, progress=False)


def test_unsupported_config_features(tmp_path: Path) -> None:
    base = hf_config(SPEC, "fp32")
    cases: list[tuple[dict[str, Any], str]] = [
        ({"model_type": "gpt2"}, "model_type='gpt2'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope type 'llama3'"),
        ({"attention_bias": True}, "attention_bias=true"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"hidden_size": "big"}, "hidden_size='big'"),
        ({"torch_dtype": "float8"}, "dtype 'float8'"),
    ]
    for change, needle in cases:
        with pytest.raises(ConfigError, match=needle):
            ModelSpec.from_hf_config({**base, **change})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelError, match="cannot read"):
        ModelSpec.from_hf_config(tmp_path)
