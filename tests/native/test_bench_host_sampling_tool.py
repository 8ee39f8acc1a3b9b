"""tools/bench_host_sampling.py: every setting timed beside the argmax and written out (a smoke
run: times are not asserted); an unknown setting is refused."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest


def test_every_setting_is_timed(load_tool: Callable[[str], ModuleType], tmp_path: Path) -> None:
    tool = load_tool("bench_host_sampling")
    argv = ["--vocab", "999", "--batch", "2", "--reps", "2", "--rounds", "2", "--out",
            str(tmp_path)]  # fmt: skip
    assert tool.main(argv) == 0
    payload = json.loads((tmp_path / "bench_host_sampling.json").read_text())
    assert [r["setting"] for r in payload["results"]] == list(tool.SETTINGS)
    assert payload["argmax_ms"]["median"] > 0 and payload["machine"]["numpy"]
    assert all(r["ms"]["median"] > 0 and r["over_argmax"] > 0 for r in payload["results"])


def test_unknown_setting_is_refused(load_tool: Callable[[str], ModuleType]) -> None:
    with pytest.raises(SystemExit):
        load_tool("bench_host_sampling").main(["--settings", "t9"])
