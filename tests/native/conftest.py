"""Shared by the native executor's tests: the tiny model in the ep flavour, built once a run."""

from __future__ import annotations

from pathlib import Path

import pytest

from ep.model import DecoderModel, load_model
from ep_graphs import build_model, load_hf_checkpoint

DATA = Path(__file__).parents[1] / "data" / "genai-llama-tiny"


@pytest.fixture(scope="session")
def tiny_ep(tmp_path_factory: pytest.TempPathFactory) -> DecoderModel:
    """tests/data/genai-llama-tiny's checkpoint built as an ep graph (fp32)."""
    spec, weights = load_hf_checkpoint(DATA / "hf")
    out = tmp_path_factory.mktemp("tiny_ep")
    build_model(spec, weights, flavour="ep", out_dir=out)
    return load_model(out)
