"""Fixtures for the runtime tests: the genai-llama-tiny models, expected tokens, generators."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ep.model import DecoderModel, load_model
from ep.runtime import GenerationOptions, Generator
from ep_builtin.kv_head_major import HeadMajorLayout

DATA = Path(__file__).parents[1] / "data" / "genai-llama-tiny"


@pytest.fixture(scope="session")
def expected() -> dict[str, Any]:
    return json.loads((DATA / "expected_tokens.json").read_text())


@pytest.fixture(scope="session")
def fp32() -> DecoderModel:
    return load_model(DATA / "genai-fp32")


@pytest.fixture(scope="session")
def int4() -> DecoderModel:
    return load_model(DATA / "genai-int4")


@pytest.fixture(scope="session")
def fp32_generator(fp32: DecoderModel) -> Generator:
    """Greedy, 48 new tokens, EOS masked until then: the setting of expected_tokens.json."""
    return Generator(
        fp32,
        layout=HeadMajorLayout(),
        options=GenerationOptions(max_new_tokens=48, min_new_tokens=48),
    )


@pytest.fixture(scope="session")
def make_generator() -> Callable[..., Generator]:
    def make(model: DecoderModel, **kwargs: Any) -> Generator:
        kwargs.setdefault("layout", HeadMajorLayout())
        return Generator(model, **kwargs)

    return make
