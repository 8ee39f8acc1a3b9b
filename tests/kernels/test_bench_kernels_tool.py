"""tools/bench_kernels.py on the CPU device (a smoke run of its NumPy twins): the 4-bit formats
with zero points and symmetric (``+sym``), each checked against its reference by the tool; and
its reference rows, decoded from a slice of a repacked weight, against the whole weight's."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "bench_kernels.py"


@pytest.mark.parametrize(
    "fmt", ["bf16-nk", "bf16-kn", "q4", "q4+sym", "q4p", "q4p+sym", "q4f8", "q4f8+sym", "mxfp4",
            "mx4p", "mx4f8"],
)  # fmt: skip
def test_reference_rows_are_the_whole_weights_rows(
    fmt: str, load_tool: Callable[[str], ModuleType]
) -> None:
    """Rows 40 .. 269 of a 300-row weight (from inside a 16- and a 64-row unit to the partial
    last one) decode to the same values from their units' bytes as from the whole weight."""
    bench = load_tool("bench_kernels")
    K, N = 128, 300
    w = bench._weights(fmt, np.random.default_rng(3), K, N)
    whole = bench._dense_rows(fmt, w, K, N, slice(0, N))
    assert whole.shape == (N, K)
    for r in (slice(40, 270), slice(0, 64), slice(N - 17, N)):
        np.testing.assert_array_equal(bench._dense_rows(fmt, w, K, N, r), whole[r])


def test_the_4_bit_formats_run_with_and_without_zero_points(tmp_path: Path) -> None:
    formats = "q4,q4+sym,q4p,q4p+sym,q4f8,q4f8+sym,q4f8-d8b2+sym"
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
    assert kernels["q4f8"] == "ep_gemv_q4f8_d4b3_bf16"  # its ring at M <= 4
    assert got["q4f8", 5]["kernel"].split()[0] == "ep_gemv_q4f8_bf16"  # and above
    assert kernels["q4f8-d8b2+sym"] == "ep_gemv_q4f8_sym_bf16"  # a kernel without zero points
    assert kernels["q4f8+sym"] == "ep_gemv_q4f8_sym_d6b3_bf16"  # its ring at M <= 8
    assert kernels["q4p+sym"] == "ep_gemv_q4p_bf16"
    for fmt in ("q4", "q4p"):  # symmetric: no zero points to move
        assert got[f"{fmt}+sym", 1]["bytes"] < got[fmt, 1]["bytes"]
