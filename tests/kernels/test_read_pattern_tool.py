"""tools/bench_read_pattern.py: its kernels compile for the H200 (NVRTC, no GPU), a smoke run on
the CPU device (their NumPy twins) writes every pattern, its checksum guard refuses a kernel that
misses words, and bad arguments are refused with what to pass."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from ep.device import KERNELS, KernelCache, KernelSource, compile_kernel, get_device


def test_every_default_pattern_compiles_to_sm90_cubin(
    load_tool: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    rp = load_tool("bench_read_pattern")
    cache = KernelCache(tmp_path)
    rings = [*rp.DEFAULT_RINGS.split(","), "d8b1"]
    for stream, ring, order in [("q4f8", r, o) for r in rings for o in rp.ORDERS] + [
        ("mx4f8", "d8b3", "tiles"), ("weights", "d8b2", "round-robin")
    ]:  # fmt: skip
        source = rp.register(ring, order, stream)
        assert source.name == f"read_pattern_{stream}_{ring}_{order.replace('-', '_')}"
        assert compile_kernel(source, "sm_90", cache=cache).report.cubin_bytes > 0


def test_smoke_run_on_the_cpu_writes_every_pattern(
    load_tool: Callable[[str], ModuleType], tmp_path: Path
) -> None:
    rp = load_tool("bench_read_pattern")
    argv = ["--device", "cpu", "--shape", "128x640", "--rings", "d8b2,d6b4", "--reps", "1",
            "--rounds", "1", "--pool-mib", "1", "--out", str(tmp_path)]  # fmt: skip
    assert rp.main(argv) == 0
    rows = json.loads((tmp_path / "read_pattern.json").read_text())["rows"]
    assert {(r["ring"], r["order"]) for r in rows} == {
        (ring, order) for ring in ("d8b2", "d6b4") for order in rp.ORDERS
    }
    T, S = 640 // 64, 128 // 64
    assert all(r["bytes"] == T * S * (2048 + 256) and r["ratio"] > 0 for r in rows)


def test_a_kernel_that_misses_a_word_fails_the_checksum(
    load_tool: Callable[[str], ModuleType], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The guard compares the kernel's sum of every word with NumPy's: a kernel reading one step
    less (here its twin) is refused, naming the kernel."""
    rp = load_tool("bench_read_pattern")

    def short(w: np.ndarray, sc: np.ndarray, T: np.int32, S: np.int32, total: np.ndarray) -> None:
        rp._twin(w, sc, T, np.int32(int(S) - 1), total, sw=rp.SCALE_WORDS["q4f8"])

    name = "read_pattern_test_short"
    if name not in KERNELS.names():
        good = rp.register("d8b2", "tiles", "q4f8")
        source = good.source.replace(good.name, name)
        rp.register_kernel(
            KernelSource(name=name, source=source, params=good.params, cpu=short, pdl_wait="kernel")
        )
    monkeypatch.setattr(rp, "register", lambda *_args: KERNELS.get(name))
    with pytest.raises(SystemExit, match=r"read_pattern_test_short: checksum .* exactly once"):
        rp.measure(get_device("cpu"), "d8b2", "tiles", "q4f8", (128, 256), pool_bytes=1 << 20,
                   reps=1, copy_bps=1e9)  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rings", "d8x2"], "expected dDbB, e.g. d8b2"),
        (["--rings", "d40b2"], "1 <= D <= 32 steps"),
        (["--orders", "tiles,zigzag"], "expected a comma-separated subset of"),
        (["--shape", "32x1024"], "K, N >= 64"),
        (["--shape", "896"], "--shape '896'"),
    ],
)
def test_bad_arguments_are_refused(
    load_tool: Callable[[str], ModuleType],
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    rp = load_tool("bench_read_pattern")
    with pytest.raises(SystemExit):
        rp.main(["--device", "cpu", *argv])
    assert message in capsys.readouterr().err
