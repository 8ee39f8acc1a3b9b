"""A checkpoint's generation_config.json becomes the built model's search defaults."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ep.errors import ModelError
from ep_graphs import ModelSpec, build_model, random_weights

HF = Path(__file__).parents[1] / "data" / "genai-llama-tiny" / "hf"
SPEC = ModelSpec.parse("hidden=32,layers=1,heads=2,kv_heads=1,vocab=512")


def test_generation_config_sets_search(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    shutil.copytree(HF, tok)
    (tok / "generation_config.json").write_text(
        json.dumps({"do_sample": True, "temperature": 0.7, "top_k": 40, "max_length": 99})
    )
    out = build_model(SPEC, random_weights(SPEC), flavour="standard", out_dir=tmp_path / "m",
                      tokenizer_dir=tok)  # fmt: skip
    search = json.loads((out / "genai_config.json").read_text())["search"]
    assert (search["do_sample"], search["temperature"], search["top_k"]) == (True, 0.7, 40)
    assert search["top_p"] == 1.0  # untouched default
    assert search["max_length"] == SPEC.context_length  # only sampling keys are taken


def test_malformed_generation_config_is_named(tmp_path: Path) -> None:
    tok = tmp_path / "tok"
    shutil.copytree(HF, tok)
    (tok / "generation_config.json").write_text("{not json")
    with pytest.raises(ModelError, match=r"generation_config\.json is not valid JSON"):
        build_model(SPEC, random_weights(SPEC), flavour="standard", out_dir=tmp_path / "m",
                    tokenizer_dir=tok)  # fmt: skip
