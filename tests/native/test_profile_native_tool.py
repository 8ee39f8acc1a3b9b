"""tools/profile_native.py runs on the CPU device and reports every op type of the step (a smoke
run: times are not asserted)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = "hidden=64,layers=2,heads=4,kv_heads=2,vocab=512,intermediate=96,context=64"


@pytest.fixture
def tool(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(ROOT / "tools"))  # as when run as a script: tools/_bench.py
    spec = importlib.util.spec_from_file_location(
        "profile_native", ROOT / "tools" / "profile_native.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "profile_native", module)
    spec.loader.exec_module(module)
    return module


def test_every_op_type_is_profiled_and_attention_pairs_counted_once(
    tool: ModuleType, tmp_path: Path
) -> None:
    argv = ["--device", "cpu", "--spec", SMALL, "--batch", "1", "--reps", "2", "--loop", "2"]
    assert (
        tool.main([*argv, "--context", "64", "--work", str(tmp_path), "--out", str(tmp_path)]) == 0
    )
    result = json.loads((tmp_path / "profile_native.json").read_text())["results"][0]
    calls = {op: v["calls"] for op, v in result["ops"].items()}
    assert calls == {
        "QKVRotaryCommit+KVAttention": 2, "QKVRotaryCommit": 2, "MatMul": 9, "SkipRMSNorm": 4,
        "SwiGLUPacked": 2, "Gather": 1, "RMSNorm": 1,
    }  # fmt: skip
    assert sum(calls.values()) - calls["QKVRotaryCommit+KVAttention"] + 2 == result["calls"]
