"""The README's example plugin, a real separate distribution, pip-installed and used."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parent / "example_plugin"


def genai_ep(*argv: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ep.cli", *argv],
        capture_output=True, text=True, env=env, cwd=cwd, check=False,
    )  # fmt: skip


@pytest.mark.slow
def test_third_party_plugin_installs_is_found_selected_and_removed(tmp_path: Path) -> None:
    target = tmp_path / "site"
    source = tmp_path / "src"  # a copy: setuptools writes build/ and egg-info into the source
    shutil.copytree(EXAMPLE, source)
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
         "--target", str(target), str(source)],
        capture_output=True, text=True, check=False,
        env={**os.environ, "PIP_NO_INPUT": "1", "TMPDIR": str(tmp_path)}, cwd=tmp_path,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr
    assert (target / "ep_fixed_context.py").exists()

    env = {k: v for k, v in os.environ.items() if not k.startswith("GENAI_EP_")}
    env["PYTHONPATH"] = os.pathsep.join([str(target), env.get("PYTHONPATH", "")])

    listed = genai_ep("plugins", "--json", env=env, cwd=tmp_path)
    assert listed.returncode == 0, listed.stderr
    rows = {row["name"]: row for row in json.loads(listed.stdout)["plugins"]}
    plugin = rows["fixed_context"]
    assert plugin["distribution"] == "genai-ep-fixed-context"
    assert plugin["version"] == "1.0.0"
    assert plugin["origin"] == "entry point"
    assert plugin["provides"] == {"kv_layout": ["fixed_context"]}

    (tmp_path / "genai-ep.toml").write_text(
        '[decode]\nkv_layout = "fixed_context"\n[kv_layout.fixed_context]\nreserve = 128\n'
    )
    shown = genai_ep("config", "show", "--json", env=env, cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr
    settings = json.loads(shown.stdout)["settings"]
    assert settings["decode.kv_layout"]["value"] == "fixed_context"
    assert settings["kv_layout.fixed_context.reserve"]["value"] == 128

    bad = genai_ep("config", "show", "--set", "kv_layout.fixed_context.reserve=-1",
                   env=env, cwd=tmp_path)  # fmt: skip
    assert bad.returncode == 2 and "must be >= 0" in bad.stderr

    # Removed: the layout is gone and selecting it is a clear error.
    env["PYTHONPATH"] = env["PYTHONPATH"].replace(str(target), "")
    gone = genai_ep("config", "show", env=env, cwd=tmp_path)
    assert gone.returncode == 2
    assert "no kv layout plugin 'fixed_context'" in gone.stderr
