"""The command line: plugins, config show, and errors printed as one readable message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ep.cli import main


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_plugins_json_is_valid_and_complete(capsys) -> None:
    code, out, _ = run_cli(capsys, "plugins", "--json")
    assert code == 0
    rows = {row["name"]: row for row in json.loads(out)["plugins"]}
    hm = rows["kv_head_major"]
    assert hm["distribution"] == "genai-ep" and hm["version"]
    assert hm["provides"] == {"kv_layout": ["head_major"]}
    assert hm["hooks"] == ["ep_register_kv_layouts"]
    assert hm["module"] == "ep_builtin.kv_head_major"


def test_plugins_table(capsys) -> None:
    code, out, _ = run_cli(capsys, "plugins")
    assert code == 0 and "kv_head_major" in out and "head_major" in out


def test_config_show_reports_sources(capsys, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "genai-ep.toml").write_text("[decode]\nsync_every = 3\n")
    monkeypatch.setenv("GENAI_EP_OFFLOAD__BUDGET", "40%")
    code, out, _ = run_cli(
        capsys, "config", "show", "--json", "--kv-layout", "head_major",
        "--set", "kv_layout.head_major.min_capacity=8",
    )  # fmt: skip
    assert code == 0
    settings = json.loads(out)["settings"]
    assert settings["decode.sync_every"]["source"].startswith("config file")
    assert settings["offload.budget"] == {
        "value": "40%",
        "source": "environment GENAI_EP_OFFLOAD__BUDGET",
    }
    assert settings["decode.kv_layout"]["source"] == "command line --kv-layout"
    assert settings["kv_layout.head_major.min_capacity"]["value"] == 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["config", "show", "--backend", "tensorrt"], "'tensorrt' is not allowed"),
        (["config", "show", "--set", "nonsense"], "is not KEY=VALUE"),
        (["config", "show", "--capture", "warmupp"], "unknown capture 'warmupp'"),
        (["plugins", "--plugin", "no_such_module_xyz"], "failed to import"),
        (["config", "show", "--config", "/nonexistent/x.toml"], "does not exist"),
    ],
)
def test_errors_are_one_message_without_traceback(capsys, argv, message) -> None:
    code, _, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.startswith("genai-ep: error: ") and message in err
    assert "Traceback" not in err


def test_kernels_without_a_gpu_asks_for_an_architecture(capsys) -> None:
    from ep.device import cuda_available

    if cuda_available()[0]:
        pytest.skip("this machine has a GPU: its own architecture is used")
    code, _, err = run_cli(capsys, "kernels")
    assert code == 2 and "pass --arch sm_90" in err


def test_kernels_lists_the_native_executors_kernels_too() -> None:
    from ep.cli import register_all_kernels

    names = register_all_kernels()
    assert {"native_advance", "native_add_bias_bf16", "ep_gemv_nk_bf16"} <= set(names)
    # the 4-bit embedding (GatherBlockQuantized of onnxruntime-genai int4 models)
    assert {"embed_gather", "embed_q4_f32", "embed_q4_f16", "embed_q4_bf16"} <= set(names)
    # int8 activations of MatMulNBits accuracy_level 4
    assert {f"native_int8_blocks_{dt}" for dt in ("f32", "f16", "bf16")} <= set(names)


def test_kernels_rejects_ptx_style_architectures(capsys) -> None:
    code, _, err = run_cli(capsys, "kernels", "--arch", "compute_90")
    assert code == 2 and "sm_" in err


def test_console_script_runs(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("genai-ep")
    proc = subprocess.run(
        [str(exe), "plugins", "--json"], capture_output=True, text=True, cwd=tmp_path, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["plugins"]
