"""tools/trace_mx4f8.py without a GPU: its summary of per-warpgroup records, its traced kernel
(NVRTC, no GPU needed) and the production kernel without the trace, and its refusals."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
from gemv_case import ptx_of

from ep.device import probe_cuda
from ep.kernels.mx4f8 import MX4F8_KERNELS

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "trace_mx4f8.py"
LoadTool = Callable[[str], ModuleType]  # the load_tool fixture (tests/conftest.py)


def _records() -> np.ndarray:
    """Two launches of 4 warpgroups (ns): launch 1 starts 2 µs before launch 0's last end."""
    t = np.zeros((2, 4, 8), np.int64)
    for i, base in enumerate((0, 20_000)):
        t[i, :, 0] = base + np.array([0, 1000, 2000, 3000])  # starts
        t[i, :, 1] = t[i, :, 0] + 2000  # PDL wait
        t[i, :, 2] = t[i, :, 1] + 1500  # staging
        t[i, :, 3] = t[i, :, 2] + np.array([15000, 15000, 16000, 17000])  # loop
        t[i, :, 6] = [0, 0, 1, 1]  # SM
        t[i, :, 7] = 42
    return t


def test_the_summary_names_each_phase_of_each_launch(load_tool: LoadTool) -> None:
    lines = load_tool("trace_mx4f8").summarise(_records())
    assert lines[0].startswith("launch 0: span 23.50 us, start - previous end -")
    assert "starts 1.50/2.70/3.00" in lines[0]  # p50 / p90 / max
    assert "PDL wait 2.00/2.00/2.00" in lines[0] and "staging 1.50/1.50/1.50" in lines[0]
    assert "loop min 15.00 p50/p90/max 15.50/16.70/17.00" in lines[0]
    assert lines[1].startswith("launch 1: span 23.50 us, start - previous end -3.50")
    assert "last launch, 4 warpgroups of 42 steps" in lines[2]
    # warpgroups 0 and 2 started first on SMs 0 and 1, 1 and 3 second
    assert lines[3].endswith("(2): start p50 1.00, loop p50 15.50, end p50 20.00 max 21.50")
    assert lines[4].endswith("(2): start p50 2.00, loop p50 16.00, end p50 21.50 max 23.50")
    assert lines[5].endswith("min 15.00 15.75/16.35/16.50")  # SM 0: 15.0, SM 1: 16.5


def test_only_the_traced_kernel_reads_the_timer(load_tool: LoadTool) -> None:
    """EPK_TRACE adds the timestamps; without it the kernel has none of them (its cubin is the
    untraced kernel's: the instrumentation compiles to nothing)."""
    traced = ptx_of(load_tool("trace_mx4f8").trace_source("d8b3"))
    assert "%globaltimer" in traced and "%smid" in traced
    plain = ptx_of(MX4F8_KERNELS["ep_gemv_mx4f8_bf16"])
    assert "%globaltimer" not in plain and "%smid" not in plain


@pytest.mark.skipif(probe_cuda().available, reason="a GPU is here: the tool would run")
def test_without_a_gpu_the_tool_says_so() -> None:
    run = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "needs a GPU with wgmma (sm_90a)" in run.stderr


def test_an_unknown_ring_is_refused() -> None:
    run = subprocess.run(
        [sys.executable, str(TOOL), "--ring", "d9b9"], capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 2 and "expected one of d8b3, d12b2, d8b2" in run.stderr


def test_saved_records_are_summarised_without_a_gpu(tmp_path: Path, load_tool: LoadTool) -> None:
    path = tmp_path / "trace.npz"
    np.savez_compressed(path, records=_records())
    run = subprocess.run(
        [sys.executable, str(TOOL), "--records", str(path)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == load_tool("trace_mx4f8").summarise(_records())
