"""tools/bench_op_overhead.py runs and writes its JSON (a smoke run: timings are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_op_overhead_smoke_run_writes_json(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "bench_op_overhead.py"),
            "--shapes",
            "1x8",
            "--inner",
            "5",
            "--repeats",
            "3",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["machine"]["onnxruntime_extensions"].startswith("0.15.")
    (result,) = data["results"]
    assert result["shape"] == [1, 8]
    assert set(result["stats"]) == {
        "identity_run",
        "builtin_run",
        "ours_run",
        "ours_checked_run",
        "numpy_kernel",
    }
    assert all(s["median_us"] > 0 and s["samples"] == 3 for s in result["stats"].values())
    assert result["ours_over_builtin"] > 0
    assert "ours/builtin" in done.stdout
