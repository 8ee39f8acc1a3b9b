"""tools/bench_kernels.py on the CPU device (a smoke run of its NumPy twins): the 4-bit formats
with zero points and symmetric (``+sym``), each checked against its reference by the tool."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench_kernels.py"


def test_the_4_bit_formats_run_with_and_without_zero_points(tmp_path: Path) -> None:
    formats = "q4,q4+sym,q4p,q4p+sym,q4f8,q4f8-d6b3+sym"
    run = subprocess.run(
        [sys.executable, str(TOOL), "--device", "cpu", "--formats", formats, "--shapes",
         "64x256", "--rows", "1,5", "--reps", "1", "--pool-mib", "1", "--copy-mib", "4",
         "--no-attention", "--no-torch", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    rows = json.loads((tmp_path / "bench_kernels.json").read_text())["rows"]
    got = {(r["fmt"], r["M"]): r for r in rows}
    assert set(got) == {(f, m) for f in formats.split(",") for m in (1, 5)}
    for (fmt, _), row in got.items():
        err = float(row["note"].split("rel err ")[1].split()[0])
        assert err < 1e-2, (fmt, row["note"])
    kernels = {f: got[f, 1]["kernel"].split()[0] for f in formats.split(",")}
    assert kernels["q4f8"] == "ep_gemv_q4f8_bf16"
    assert kernels["q4f8-d6b3+sym"] == "ep_gemv_q4f8_d6b3_bf16"
    assert kernels["q4p+sym"] == "ep_gemv_q4p_bf16"
    for fmt in ("q4", "q4p"):  # symmetric: no zero points to move
        assert got[f"{fmt}+sym", 1]["bytes"] < got[fmt, 1]["bytes"]
