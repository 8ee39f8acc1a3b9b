"""tools/bench_sampling.py runs on the CPU device: every setting's ids equal the reference's and
every figure is reported (a smoke run: times are not asserted)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


def test_every_setting_is_checked_and_timed(
    load_tool: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    tool = load_tool("bench_sampling")
    argv = ["--device", "cpu", "--vocab", "4099", "--batch", "1,3", "--reps", "2", "--out",
            str(tmp_path)]  # fmt: skip
    assert tool.main(argv) == 0
    payload = json.loads((tmp_path / "bench_sampling.json").read_text())
    results = payload["results"]
    assert [(r["batch"], r["setting"]) for r in results] == [
        (b, name) for b in (1, 3) for name in tool.SETTINGS
    ]
    for r in results:
        assert r["ids_equal_reference"]
        assert r["sample_graph_us"] > 0 and r["argmax_graph_us"] > 0 and r["host_numpy_us"] > 0


def test_unknown_setting_is_refused(load_tool: Callable[[str], ModuleType]) -> None:
    tool = load_tool("bench_sampling")
    with pytest.raises(SystemExit):
        tool.main(["--device", "cpu", "--settings", "t9"])
