"""Shared by the native executor's tests: the tiny model in the ep flavour, built once a run."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

from ep.model import DecoderModel, load_model
from ep_graphs import build_model, load_hf_checkpoint

DATA = Path(__file__).parents[1] / "data" / "genai-llama-tiny"
TOOLS = Path(__file__).resolve().parents[2] / "tools"


@pytest.fixture(scope="session")
def tiny_ep(tmp_path_factory: pytest.TempPathFactory) -> DecoderModel:
    """tests/data/genai-llama-tiny's checkpoint built as an ep graph (fp32)."""
    spec, weights = load_hf_checkpoint(DATA / "hf")
    out = tmp_path_factory.mktemp("tiny_ep")
    build_model(spec, weights, flavour="ep", out_dir=out)
    return load_model(out)


@pytest.fixture
def load_tool(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """``load_tool("bench_native")``: tools/bench_native.py imported as when run as a script."""

    def load(name: str) -> ModuleType:
        monkeypatch.syspath_prepend(str(TOOLS))  # its own imports: tools/_bench.py
        spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, name, module)  # its dataclasses look it up
        spec.loader.exec_module(module)
        return module

    return load
