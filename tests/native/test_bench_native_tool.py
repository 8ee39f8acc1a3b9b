"""tools/bench_native.py runs and writes its JSON (CPU smoke runs: times are not asserted)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

SMALL_QWEN = (  # head_dim 64: the fused modes' kernel (its NumPy twin here) takes it
    "hidden=128,layers=2,heads=2,kv_heads=1,head_dim=64,intermediate=256,vocab=512,dtype=bf16,"
    "type=qwen2,bias=1,tie=1"
)


@pytest.fixture
def tool(load_tool: Callable[[str], ModuleType]) -> ModuleType:
    return load_tool("bench_native")


def test_cpu_mode_times_every_mode_with_equal_tokens(
    tool: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--batches", "1", "2", "--prompt", "8", "--warmup", "3", "--steps", "3"]
    argv += ["--repeats", "2", "--offload", "stream", "--budget", "50%"]
    assert tool.main([*argv, "--out", str(tmp_path), "--work", str(tmp_path / "work")]) == 0
    data = json.loads((tmp_path / "bench_native.json").read_text())
    assert data["errors"] == [] and data["tokens_match"] is True
    assert "onnxruntime" in data["machine"]
    rows = {(r["mode"], r["batch"]): r for r in data["rows"]}
    modes = ("ort", "native-never", "native-warmup", "native-offload")
    assert set(rows) == {(m, b) for m in modes for b in (1, 2)}
    for row in rows.values():
        assert row["samples"] == 6 and 0 < row["step_ms"]["min"] <= row["step_ms"]["median"]
    # the warmup policy captured in the warm-up steps and replayed every timed step
    warm = rows[("native-warmup", 2)]
    assert warm["captures_during_timing"] == 0 and warm["capture"]["replays"] >= 6
    offload = rows[("native-offload", 1)]["offload"]
    assert offload["htod_bytes_per_step"] > 0
    assert set(data["ratio_native_over_ort"]) == {f"{m}/ort@{b}" for m in modes[1:] for b in (1, 2)}
    assert "greedy tokens: identical" in capsys.readouterr().out


def test_cuda_mode_code_path_runs_on_the_cpu_device(tool: ModuleType, tmp_path: Path) -> None:
    argv = ["--device", "cuda", "--run-on", "cpu", "--spec", SMALL_QWEN, "--batches", "1", "16"]
    argv += ["--prompt", "8", "--warmup", "3", "--steps", "5", "--repeats", "1", "--loop", "2"]
    argv += ["--loop-sync"]
    assert tool.main([*argv, "--out", str(tmp_path), "--work", str(tmp_path / "work")]) == 0
    data = json.loads((tmp_path / "bench_native.json").read_text())
    assert data["errors"] == [] and data["tokens_match"] is True
    assert data["floor_ms"] > 0 and data["copy"]["bytes_per_s"] > 0
    assert data["model"]["weight_bytes"] == sum(
        p.stat().st_size for p in (tmp_path / "work").glob("*/model.onnx.data")
    )
    assert "skipped" in data["hf"]  # the transformers reference needs CUDA
    modes = ("native-capture", "native-loop", "native-fused", "native-fused-loop",
             "native-loop-sync", "native-fused-loop-sync", "native-eager")  # fmt: skip
    assert [(r["mode"], r["batch"]) for r in data["rows"]] == [
        (m, b) for b in (1, 16) for m in modes if b == 1 or "fused" not in m
    ]
    for row in (r for r in data["rows"] if "fused" in r["mode"]):  # the kernel took every step
        assert row["fused"]["steps"] == 3 + 5 and row["fused"]["reason"] == ""
    assert set(data["fused_token_agreement"]) == {"native-fused", "native-fused-loop",
                                                  "native-fused-loop-sync"}  # fmt: skip
    # the device token loop (steps of 2, 2 and 1), its runs launched ahead or not, gives the
    # same tokens as step() (tokens_match)
    for mode in ("native-loop", "native-loop-sync"):
        loop = next(r for r in data["rows"] if r["mode"] == mode)
        assert loop["samples"] == 5 and loop["capture"]["captures"] > 0
    assert set(data["targets"]) >= {
        "batch1_ms", "tokens_per_s_16_over_1", "batch1_ms_loop", "tokens_per_s_16_over_1_loop",
        "batch1_ms_fused", "batch1_ms_fused_loop", "tokens_per_s_16_over_1_fused_loop",
    }  # fmt: skip
    assert data["targets"]["tokens_per_s_16_over_1_fused_loop"]["batch16_mode"] == "native-loop"


def test_a_fused_mode_scales_against_the_plan_at_batch_16(tool: ModuleType) -> None:
    runs = [
        tool.ModeRun("native-loop", 1, wall_ms=[0.7]),
        tool.ModeRun("native-loop", 16, wall_ms=[0.76, 0.8, 0.78]),
        tool.ModeRun("native-fused-loop", 1, wall_ms=[0.49, 0.5, 0.6]),
    ]
    t = tool.targets(runs, floor=None)
    assert t["tokens_per_s_16_over_1_loop"]["batch16_mode"] == "native-loop"
    fused = t["tokens_per_s_16_over_1_fused_loop"]
    assert fused["batch16_mode"] == "native-loop"
    assert fused["value"] == pytest.approx(16 / 0.78 * 0.5) and fused["met"] is True
    assert "(native-fused-loop; batch 16: native-loop) 10.3 >= 10.0: met" in tool.table(
        {"machine": {}, "targets": t}
    )


def test_a_failing_part_is_recorded_and_fails_the_run(tool: ModuleType, tmp_path: Path) -> None:
    argv = ["--model", str(tmp_path / "absent"), "--out", str(tmp_path), "--repeats", "1"]
    assert tool.main(argv) == 1
    data = json.loads((tmp_path / "bench_native.json").read_text())
    assert data["errors"] and "absent" in data["errors"][0]["error"]


def test_differing_tokens_are_reported(tool: ModuleType) -> None:
    same = [tool.ModeRun("ort", 1, tokens=[[[5, 6]]]), tool.ModeRun("native", 1, tokens=[[[5, 6]]])]
    assert tool.token_mismatches(same, reference="ort") == []
    differ = [same[0], tool.ModeRun("native", 1, tokens=[[[5, 7]]])]
    assert tool.token_mismatches(differ, reference="ort") == [
        "native batch 1 repeat 0: tokens differ from ort"
    ]


def test_cpu_mode_sweeps_budgets_and_batches_in_pieces(tool: ModuleType, tmp_path: Path) -> None:
    argv = ["--batches", "1,2", "--prompt", "6", "--warmup", "3", "--steps", "2", "--repeats", "1"]
    argv += ["--offload", "scan_resistant", "--budget", "100%,25%", "--piece", "16KiB"]
    assert tool.main([*argv, "--out", str(tmp_path), "--work", str(tmp_path / "work")]) == 0
    data = json.loads((tmp_path / "bench_native.json").read_text())
    assert data["errors"] == [] and data["tokens_match"] is True and data["htod"]["bytes_per_s"] > 0
    rows = {(r["mode"], r["batch"]): r for r in data["rows"] if "offload" in r}
    assert set(rows) == {(f"native-offload@{b}", n) for b in ("100%", "25%") for n in (1, 2)}
    full, quarter = rows[("native-offload@100%", 1)]["offload"], rows[("native-offload@25%", 1)]
    assert full["byte_hit_rate"] == 1.0 and "ms_over_stream_floor" not in full
    assert quarter["offload"]["htod_bytes_per_token"] > 0
    assert quarter["offload"]["ms_over_stream_floor"] > 0
    # htod_bytes_per_token falls as 1/N: the same bytes per step serve twice the tokens
    half = rows[("native-offload@25%", 2)]["offload"]["htod_bytes_per_token"]
    assert half == pytest.approx(quarter["offload"]["htod_bytes_per_token"] / 2)


def test_spec_presets_and_bad_sweeps(tool: ModuleType) -> None:
    assert tool.parse_args(["--spec", "qwen2.5-1.5b"]).spec == tool.QWEN15_SPEC
    assert tool.parse_args(["--batch", "1,2", "4"]).batches == (1, 2, 4)
    with pytest.raises(SystemExit):
        tool.parse_args(["--offload", "stream", "--budget", "100%,lots"])
    with pytest.raises(SystemExit):
        tool.parse_args(["--offload", "stream", "--piece", "10%"])
