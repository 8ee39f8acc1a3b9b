"""tools/gemv_bits.py on the CPU device (the kernels' NumPy twins): a save then a check agrees
with itself, and a changed digest is named and fails the check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _tool(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, str(ROOT / "tools" / "gemv_bits.py"), *args, "--device", "cpu"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_save_then_check_agrees_and_a_changed_output_fails(tmp_path: Path) -> None:
    path = tmp_path / "bits.json"
    saved = _tool("save", str(path), "--quick")
    assert saved.returncode == 0, saved.stderr[-3000:]
    digests = json.loads(path.read_text())
    # every format and dtype, with and without the workspace and the SwiGLU epilogue
    assert len(digests) == 504
    assert any(k.endswith("-ws-swiglu1") for k in digests)
    assert {k.split("-")[1] for k in digests} == {"nk", "kn", "q4", "q4zp", "mx4"}
    same = _tool("check", str(path), "--quick")
    assert same.returncode == 0 and "504 outputs" in same.stdout and ": 0 differ" in same.stdout

    key = "float32-nk-72x1024-M3-ws-swigluNone"
    digests[key] = "0" * 64
    path.write_text(json.dumps(digests))
    changed = _tool("check", str(path), "--quick")
    assert changed.returncode == 1
    assert "1 differ" in changed.stdout and f"differs: {key}" in changed.stdout
