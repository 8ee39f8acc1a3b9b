"""ModelSpec: validation, the compact spec string, Hugging Face configs; random weights."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest

from ep.errors import ConfigError
from ep_graphs import ModelSpec, expected_shapes, random_weights


def test_parse_aliases_and_defaults() -> None:
    spec = ModelSpec.parse(
        "hidden=64, layers=2, heads=4, kv_heads=2, vocab=512, theta=1e6, eps=1e-5, tie=true, "
        "bias=1, dtype=FP16, ctx=128, bos=1, eos=2|3, pad=0, type=qwen2"
    )
    assert spec.head_dim == 16 and spec.intermediate_size == 256  # derived defaults
    assert spec.rope_theta == 1e6 and spec.rms_norm_eps == 1e-5
    assert spec.tie_embeddings and spec.qkv_bias and spec.dtype == "fp16"
    assert spec.context_length == 128 and spec.eos_token_ids == (2, 3)
    assert spec.model_type == "qwen2"
    full = ModelSpec.parse("hidden_size=64,num_layers=1,num_heads=4,vocab_size=8,head_dim=32")
    assert full.num_kv_heads == 4 and full.head_dim == 32 and full.q_size == 128


def test_parse_unknown_key_suggests() -> None:
    with pytest.raises(ConfigError, match=r"unknown key 'hiden'; did you mean 'hidden'"):
        ModelSpec.parse("hiden=64,layers=2,heads=4,vocab=512")
    with pytest.raises(ConfigError, match=r"did you mean 'kv_heads'"):
        ModelSpec.parse("hidden=64,layers=2,heads=4,vocab=512,kv_head=2")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("hidden=64,layers=2,heads=4", "missing vocab_size"),
        ("hidden=64,layers=2,heads=4,vocab=512,hidden_size=32", "hidden_size given twice"),
        ("hidden=64,layers,heads=4,vocab=512", "'layers' has no '='"),
        ("hidden=sixty,layers=2,heads=4,vocab=512", "hidden='sixty' is not an integer"),
        ("hidden=64,layers=2,heads=4,vocab=512,tie=maybe", "tie='maybe' is not a boolean"),
        ("hidden=64,layers=2,heads=4,vocab=512,theta=x", "theta='x' is not a number"),
        ("hidden=64,layers=2,heads=4,kv_heads=3,vocab=512", "not divisible by num_kv_heads=3"),
        ("hidden=60,layers=2,heads=8,vocab=512", "not divisible by num_heads=8"),
        ("hidden=64,layers=2,heads=4,vocab=512,head_dim=15", "head_dim=15 is odd"),
        ("hidden=64,layers=0,heads=4,vocab=512", "num_layers=0"),
        ("hidden=64,layers=2,heads=4,vocab=512,dtype=int8", "dtype='int8'"),
        ("hidden=64,layers=2,heads=4,vocab=512,eos=512", r"eos_token_id=512 is outside"),
        ("hidden=64,layers=2,heads=4,vocab=512,eps=0", "rms_norm_eps=0.0"),
        ("hidden=64,layers=2,heads=4,vocab=512,type=gpt2", "model_type='gpt2'"),
    ],
)
def test_bad_specs_say_what_is_wrong(text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        ModelSpec.parse(text)


def test_spec_is_frozen_and_replace_revalidates() -> None:
    spec = ModelSpec.parse("hidden=64,layers=2,heads=4,vocab=512")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.__setattr__("hidden_size", 8)
    with pytest.raises(ConfigError, match="num_kv_heads=3"):
        dataclasses.replace(spec, num_kv_heads=3)


def test_from_hf_config_qwen2_derives_head_dim_and_biases() -> None:
    spec = ModelSpec.from_hf_config(
        {
            "model_type": "qwen2",
            "hidden_size": 896,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "intermediate_size": 4864,
            "vocab_size": 151936,
            "rope_theta": 1000000.0,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
            "max_position_embeddings": 32768,
            "bos_token_id": 151643,
            "eos_token_id": 151645,
            "torch_dtype": "bfloat16",
            "use_sliding_window": False,
        }
    )
    assert spec.head_dim == 64 and spec.qkv_bias and spec.tie_embeddings
    assert spec.dtype == "bf16" and spec.rope_theta == 1e6
    assert spec.pad_token_id == 151645  # no pad id in the config: eos, as genai does


def test_from_hf_config_llama_eos_list_and_missing_key() -> None:
    config = {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "intermediate_size": 128,
        "vocab_size": 300,
        "eos_token_id": [2, 7],
    }
    spec = ModelSpec.from_hf_config(config)
    assert spec.num_kv_heads == 4 and spec.eos_token_ids == (2, 7) and spec.rope_theta == 10000.0
    assert not spec.tie_embeddings and not spec.qkv_bias
    del config["vocab_size"]
    with pytest.raises(ConfigError, match="'vocab_size' is missing"):
        ModelSpec.from_hf_config(config)


def test_random_weights_shapes_dtype_seed_and_scale() -> None:
    spec = ModelSpec.parse("hidden=64,layers=2,heads=4,kv_heads=2,vocab=128,bias=1,dtype=bf16")
    a, b, c = random_weights(spec, 1), random_weights(spec, 1), random_weights(spec, 2)
    assert {k: v.shape for k, v in a.items()} == expected_shapes(spec)
    assert all(v.dtype == np.dtype(ml_dtypes.bfloat16) for v in a.values())
    name = "model.layers.1.mlp.down_proj.weight"
    assert np.array_equal(a[name], b[name]) and not np.array_equal(a[name], c[name])
    assert a[name].shape == (64, 256)
    # ~N(0, 1/fan_in): projection outputs keep unit scale
    assert 0.8 < float(np.std(a[name].astype(np.float32))) * np.sqrt(256) < 1.2
    tied = dataclasses.replace(spec, tie_embeddings=True)
    assert "lm_head.weight" not in random_weights(tied)
