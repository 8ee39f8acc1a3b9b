"""``genai-ep rewrite MODEL -o OUT``: the happy path into ``genai-ep run``, and bad inputs, each
refused with one readable message (exit status 2) and nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest
from onnx import TensorProto, helper

from ep.cli import main

DATA = Path(__file__).parents[1] / "data" / "genai-llama-tiny"
FP32 = DATA / "genai-fp32"


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("genai-ep: error: ") and "Traceback" not in err
    return err


def test_rewrite_then_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "ep"
    assert main(["rewrite", str(FP32), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "gqa_attention: 2" in text and "runtime-owned" in text
    assert main(["run", "--model", str(out), "--prompt-ids", "23,508,62", "--max-new-tokens",
                 "48", "--min-new-tokens", "48", "--json"]) == 0  # fmt: skip
    got = json.loads(capsys.readouterr().out)
    expected = json.loads((DATA / "expected_tokens.json").read_text())
    assert got["tokens"] == [expected["genai-fp32"][3]]
    assert got["text"][0].startswith("w")  # the tokenizer came along


def test_rewrite_json_report(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["rewrite", str(DATA / "genai-int4"), "-o", str(tmp_path / "ep"), "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["kv"] == "runtime" and report["rewritten"]["gqa_attention"] == 2
    assert report["kv_inputs"]["kv_cache"] == "kv_cache"
    assert {item["op_type"] for item in report["left"]} == {"MatMulNBits", "GatherBlockQuantized"}
    assert report["ops_before"]["com.microsoft::GroupQueryAttention"] == 2
    assert "com.microsoft::GroupQueryAttention" not in report["ops_after"]


def test_missing_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _error(capsys, ["rewrite", str(tmp_path / "nope"), "-o", str(tmp_path / "out")])
    assert "does not exist" in err and "onnxruntime-genai model folder" in err
    assert not (tmp_path / "out").exists()


def test_not_a_decoder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "a"], ["b"])],
        "adder",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("b", TensorProto.FLOAT, [2])],
    )
    onnx.save(helper.make_model(graph), tmp_path / "add.onnx")
    err = _error(capsys, ["rewrite", str(tmp_path / "add.onnx"), "-o", str(tmp_path / "out")])
    assert "no input named 'input_ids'" in err
    assert not (tmp_path / "out").exists()


def test_output_exists_and_is_not_empty(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    err = _error(capsys, ["rewrite", str(FP32), "-o", str(out)])
    assert "exists and is not empty" in err and "--force" in err
    assert (out / "keep.txt").read_text() == "mine"  # untouched
    assert main(["rewrite", str(FP32), "-o", str(out), "--force"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.onnx").is_file()
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no staging left


def test_output_inside_the_source_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _error(capsys, ["rewrite", str(FP32), "-o", str(FP32), "--force"])
    assert "holds the source model" in err
    assert (FP32 / "model.onnx").is_file()


def test_checkpoints_specs_and_ep_graphs_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _error(capsys, ["rewrite", str(DATA / "hf"), "-o", str(tmp_path / "a")])
    assert "Hugging Face checkpoint" in err and "--flavour ep" in err
    err = _error(capsys, ["rewrite", "spec:hidden=64,layers=1,heads=4,vocab=64", "-o", "x"])
    assert "build one in the ep flavour" in err
    assert main(["rewrite", str(FP32), "-o", str(tmp_path / "ep")]) == 0
    capsys.readouterr()
    err = _error(capsys, ["rewrite", str(tmp_path / "ep"), "-o", str(tmp_path / "again")])
    assert "already keeps its KV cache in the runtime" in err


def test_bad_context_length(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["rewrite", str(FP32), "-o", str(tmp_path / "o"), "--context-length", "1"]
    assert "context_length=1; expected an integer >= 2" in _error(capsys, argv)


def test_a_bare_onnx_gets_a_genai_config(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A decoder .onnx without genai_config.json: the context comes from the rotary table, the
    written config carries only the ids the source knew, and the result runs like the source."""
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("model.onnx", "model.onnx.data"):
        shutil.copyfile(FP32 / name, bare / name)
    assert main(["rewrite", str(bare / "model.onnx"), "-o", str(tmp_path / "ep")]) == 0
    config = json.loads((tmp_path / "ep" / "genai_config.json").read_text())["model"]
    assert config["context_length"] == 256 and config["decoder"]["head_size"] == 32
    assert "eos_token_id" not in config and "bos_token_id" not in config
    runs = []
    for model in (bare / "model.onnx", tmp_path / "ep"):
        argv = ["run", "--model", str(model), "--prompt-ids", "23,508,62", "--json"]
        assert main([*argv, "--max-new-tokens", "16"]) == 0
        runs.append(json.loads(capsys.readouterr().out.splitlines()[-1])["tokens"])
    assert runs[0] == runs[1]
