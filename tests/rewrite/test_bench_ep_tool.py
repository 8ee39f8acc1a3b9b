"""tools/bench_ep_vs_contrib.py runs and writes its JSON (a smoke run: timings are not asserted)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


@pytest.mark.parametrize("source", ["build", "rewrite"])
def test_bench_ep_vs_contrib_smoke_run(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    source: str,
    load_tool: Callable[[str], ModuleType],
) -> None:
    tool = load_tool("bench_ep_vs_contrib")
    out = tmp_path / "bench.json"
    argv = ["--from", source, "--batch", "1", "2", "--new-tokens", "3", "--repeats", "2"]
    assert tool.main([*argv, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["machine"]["onnxruntime_extensions"].startswith("0.15.")
    assert [c["batch"] for c in data["cases"]] == [1, 2]
    for case in data["cases"]:
        assert len(case["ratio_ep_over_contrib"]["all"]) == 2
        assert all(v["median"] > 0 for v in case["tokens_per_s"].values())
    assert "ep/contrib" in capsys.readouterr().out
