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


def test_readme_config_example_is_valid(tmp_path: Path) -> None:
    from ep.config import load_config
    from ep.plugins import PluginHost

    blocks = re.findall(r"```toml\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    config_block = next(b for b in blocks if "[decode]" in b)
    path = tmp_path / "genai-ep.toml"
    path.write_text(config_block)
    config = load_config(PluginHost(environ={}).registry, config_file=path, environ={})
    assert config["offload.budget"] == "50%" and config["decode.sync_every"] == 1
