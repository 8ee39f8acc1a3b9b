"""tools/profile_native.py runs on the CPU device and reports every op type of the step (a smoke
run: times are not asserted)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

SMALL = "hidden=64,layers=2,heads=4,kv_heads=2,vocab=512,intermediate=96,context=64"


@pytest.fixture
def tool(load_tool: Callable[[str], ModuleType]) -> ModuleType:
    return load_tool("profile_native")


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


def test_ablation_times_the_step_without_each_op_type(tool: ModuleType, tmp_path: Path) -> None:
    argv = ["--device", "cpu", "--spec", SMALL, "--batch", "1", "--reps", "1", "--loop", "0"]
    assert tool.main([*argv, "--context", "64", "--work", str(tmp_path), "--out", str(tmp_path),
                      "--ablate"]) == 0  # fmt: skip
    result = json.loads((tmp_path / "profile_native.json").read_text())["results"][0]
    ablated = result["critical_us"]
    assert set(ablated) == {
        "(whole step)", "Gather", "RMSNorm", "MatMul", "QKVRotaryCommit", "KVAttention",
        "SkipRMSNorm", "SwiGLUPacked",
    }  # fmt: skip
    assert ablated["(whole step)"] > 0


def test_a_commit_inside_a_gemv_is_counted_once_with_its_attention(tool: ModuleType) -> None:
    """The CUDA plan's ``MatMul+QKVRotaryCommit`` is timed alone and with its attention: the sum
    leaves out its own line (and never the plain MatMul line)."""
    ops = {
        name: {"total_us": us}
        for name, us in (
            ("MatMul", 400.0), ("MatMul+QKVRotaryCommit", 70.0),
            ("MatMul+QKVRotaryCommit+KVAttention", 180.0), ("SkipRMSNorm", 70.0),
        )
    }  # fmt: skip
    assert tool.sum_once(ops, {"MatMul+QKVRotaryCommit+KVAttention"}) == 650.0
    plain = {"KVCommit": 5.0, "KVCommit+KVAttention": 9.0, "MatMul": 1.0}
    ops = {name: {"total_us": us} for name, us in plain.items()}
    assert tool.sum_once(ops, {"KVCommit+KVAttention"}) == 10.0
