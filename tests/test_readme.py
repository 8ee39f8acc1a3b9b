"""The README's Python examples run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_python_examples() -> None:
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_example_runs(index: int, monkeypatch: pytest.MonkeyPatch) -> None:
    block = BLOCKS[index]
    if "@ep.hookimpl" in block:  # the plugin excerpt: tests/test_example_plugin.py installs it
        pytest.skip("the plugin example is tested as an installed package")
    monkeypatch.chdir(ROOT)
    exec(compile(block, f"README.md python block {index}", "exec"), {})
