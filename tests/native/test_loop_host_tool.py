"""tools/loop_host.py runs on the CPU device: every round gives the same tokens, every figure is
reported per call, and no timed call captures a graph (a smoke run: times are not asserted)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

SMALL = "hidden=64,layers=2,heads=4,kv_heads=2,vocab=512,intermediate=96,context=128"


def test_rounds_agree_and_every_call_is_timed(
    load_tool: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    tool = load_tool("loop_host")
    argv = [
        "--device",
        "cpu",
        "--spec",
        SMALL,
        "--context",
        "128",
        "--batch",
        "1,2",
        "--k",
        "4",
        "--calls",
        "2",
        "--rounds",
        "2",
        "--work",
        str(tmp_path),
        "--out",
        str(tmp_path),
    ]
    assert tool.main(argv) == 0  # fmt: skip
    results = json.loads((tmp_path / "loop_host.json").read_text())["results"]
    assert [r["batch"] for r in results] == [1, 2]
    for r in results:
        assert r["tokens_agree"] and r["graph_ms"] > 0
        assert set(r["calls"]) == {"wall", "host", "device", "growths"}
        assert all(len(v) == 2 * 2 for v in r["calls"].values())
        c = r["capture"]
        # the warm-up captured the step's graph; every round replays it (same buffers)
        assert (c["captures"], c["invalidations"]) == (1, 0)
