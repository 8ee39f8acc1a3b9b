"""Shared fixtures: isolated plugin hosts, throw-away plugin modules, CUDA skipping, tools/
scripts imported as modules."""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from ep.plugins import reset_host

DATA = Path(__file__).parent / "data"
TINY = DATA / "genai-llama-tiny"
TOOLS = Path(__file__).resolve().parents[1] / "tools"


@pytest.fixture(autouse=True)
def _clean_genai_ep_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Tests never see the developer's GENAI_EP_* variables or a ./genai-ep.toml."""
    import os

    for name in list(os.environ):
        if name.startswith("GENAI_EP_") and name not in ("GENAI_EP_CACHE", "GENAI_EP_KERNEL_CACHE"):
            monkeypatch.delenv(name)
    reset_host()
    yield
    reset_host()


@pytest.fixture
def plugin_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[str, str], str]:
    """Write a plugin module with the given source; return its import name. Removed afterwards."""
    root = tmp_path / "plugin_modules"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    made: list[str] = []

    def make(name: str, source: str) -> str:
        (root / f"{name}.py").write_text(textwrap.dedent(source))
        made.append(name)
        return name

    yield make  # type: ignore[misc]  # a generator fixture
    for name in made:
        sys.modules.pop(name, None)


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
