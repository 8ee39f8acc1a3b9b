"""tools/gemv_sass.py (its SASS reading and its errors; nvdisasm itself is not on CI machines)
and tools/bench_gemv_chain.py (a smoke run on the CPU device: the kernels' NumPy twins)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

# Two rounds of a FULL loop as nvdisasm prints them: the first round healthy, the second with a
# weight load (.NA) after its first MMA.
SASS = """
        /*0250*/                   @!P0 BRA `(.L_x_1) ;
        /*0260*/                   LDG.E.NA.128 R52, desc[UR6][R10.64] ;
        /*0270*/                   LDG.E.NA.128 R12, desc[UR6][R8.64] ;
        /*0280*/                   ACQBULK ;
        /*0290*/                   LDG.E.128 R8, desc[UR6][R44.64] ;
        /*02a0*/                   HMMA.16816.F32.BF16 R56, R56, R52, RZ ;
        /*02b0*/                   LDG.E.128 R20, desc[UR6][R30.64] ;
        /*02c0*/                   HMMA.16816.F32.BF16 R8, R60, R12, R8 ;
        /*02c8*/                   HGMMA.64x8x32.F32.E4M3.E4M3 R24, gdesc[UR4], RZ ;
        /*02d0*/                   LDG.E.NA.128 R40, desc[UR6][R52.64] ;
        /*02d8*/                   STL.64 [R1+0x8], R40 ;
        /*02dc*/                   LDL.64 R40, [R1+0x8] ;
        /*02e0*/               @!P0 BRA `(.L_x_2) ;
        /*02f0*/                   EXIT ;
"""


def test_order_reads_loads_mmas_and_the_wait(load_tool: Callable[[str], ModuleType]) -> None:
    sass = load_tool("gemv_sass")
    assert sass.order(SASS, 90) == "|LLWXHXHGLSS|E"  # S: a spill (local store, load)
    # from the FULL path's first round on, when the SASS has one
    assert sass.order(SASS.replace("ACQBULK", "NOP"), 4) == "|LLX"


def test_default_kernels_exist_and_errors_say_what_to_do(
    load_tool: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    sass = load_tool("gemv_sass")
    from ep.cli import register_all_kernels
    from ep.device import KERNELS

    register_all_kernels()
    assert set(sass.DEFAULT) <= set(KERNELS.names()) and len(sass.DEFAULT) == 12
    monkeypatch.setattr(sass.shutil, "which", lambda _name: None)
    monkeypatch.setattr(sass.glob, "glob", lambda _pattern: [])
    with pytest.raises(SystemExit, match="nvdisasm not found: install the CUDA toolkit"):
        sass.find_tool("nvdisasm", None)
    with pytest.raises(SystemExit, match="no kernel named 'ep_gemv_nope_bf16'; registered: "):
        sass.compile_kernel("ep_gemv_nope_bf16")


def test_chain_smoke_run_on_the_cpu(load_tool: Callable[[str], ModuleType], tmp_path: Path) -> None:
    chain = load_tool("bench_gemv_chain")
    argv = ["--device", "cpu", "--layers", "2", "--reps", "1", "--rows", "1,16"]
    assert chain.main([*argv, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "gemv_chain.json").read_text())["results"]
    picked = {(r["K"], r["N"], r["M"], r["swiglu"]): r["kernel"] for r in results}
    assert len(picked) == 10 and all(r["us"] > 0 and r["ratio"] > 0 for r in results)
    # the plan's kernels: nk16 past 8 rows, except the down projection's one-wave grid
    assert picked[(896, 9728, 16, 1)] == "ep_gemv_nk16_swiglu_bf16"
    assert picked[(896, 9728, 1, 1)] == "ep_gemv_nk_swiglu_bf16"
    assert picked[(4864, 896, 16, None)] == "ep_gemv_nk_bf16"
    with pytest.raises(SystemExit):
        chain.main(["--device", "cpu", "--rows", "0,17"])
