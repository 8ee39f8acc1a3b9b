"""build_model's folder, its failure behaviour, a third flavour plugging in, and the CLI hooks."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import numpy_llama as nl
import onnx
import pytest
from graphs_testlib import PROMPTS, TINY, left_padded, max_row_error, run, session
from onnx import TensorProto

from ep.errors import ConfigError, ModelError
from ep_graphs import (
    FLAVOURS,
    ModelSpec,
    StandardEmitter,
    add_build_arguments,
    build_model,
    random_weights,
    register_flavour,
    run_build,
)

SPEC = ModelSpec.parse("hidden=64,layers=2,heads=4,kv_heads=2,vocab=128,intermediate=96,eps=1e-5")


def test_folder_contents_and_external_data(tmp_path: Path) -> None:
    out = build_model(
        SPEC,
        random_weights(SPEC),
        flavour="standard",
        out_dir=tmp_path / "m",
        tokenizer_dir=TINY / "hf",
    )
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "genai_config.json",
        "model.onnx",
        "model.onnx.data",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    model = onnx.load(out / "model.onnx", load_external_data=False)
    assert all(t.data_location == TensorProto.EXTERNAL for t in model.graph.initializer)
    weight_bytes = sum(v.nbytes for v in random_weights(SPEC).values())
    assert (out / "model.onnx").stat().st_size < 64 * 1024
    assert (out / "model.onnx.data").stat().st_size >= weight_bytes
    for tensor in model.graph.initializer:
        offset = int(next(e.value for e in tensor.external_data if e.key == "offset"))
        assert offset % 64 == 0
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["ep_graphs.flavour"] == "standard"
    assert ModelSpec(**json.loads(meta["ep_graphs.spec"])) == SPEC
    config = json.loads((out / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    assert decoder["inputs"]["position_ids"] == "position_ids"
    assert (decoder["head_size"], decoder["num_key_value_heads"]) == (16, 2)
    # Concat makes present a new, longer tensor: it cannot share the past's buffer
    assert config["search"]["past_present_share_buffer"] is False
    onnx.checker.check_model(str(out / "model.onnx"))  # plain ONNX ops only


def test_standard_uses_plain_onnx_ops_only(tmp_path: Path) -> None:
    out = build_model(SPEC, random_weights(SPEC), flavour="standard", out_dir=tmp_path)
    model = onnx.load(out / "model.onnx", load_external_data=False)
    assert {n.domain for n in model.graph.node} == {""}
    ops = {n.op_type for n in model.graph.node}
    assert {"Pow", "ReduceMean", "Sqrt", "Div", "Softmax", "Where", "Concat", "Sigmoid"} <= ops
    assert [o.domain for o in model.opset_import] == [""]


def test_failed_build_leaves_existing_folder_untouched(tmp_path: Path) -> None:
    out = build_model(SPEC, random_weights(SPEC), flavour="contrib", out_dir=tmp_path / "m")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    weights = random_weights(SPEC)
    del weights["model.layers.1.self_attn.o_proj.weight"]
    with pytest.raises(ModelError, match=r"o_proj\.weight"):
        build_model(SPEC, weights, flavour="standard", out_dir=out)

    class Broken(StandardEmitter):
        name = "broken_for_test"

        def attention(self, layer: int, x: str) -> str:
            raise ConfigError("emitter failed half-way")

    register_flavour(Broken)
    try:
        with pytest.raises(ConfigError, match="half-way"):
            build_model(SPEC, random_weights(SPEC), flavour="broken_for_test", out_dir=out)
    finally:
        FLAVOURS.pop("broken_for_test")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["m"]  # no staging folder left behind


def test_unknown_flavour_and_bad_paths(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"unknown graph flavour 'contribb'; did you mean 'contrib'"
    ):
        build_model(SPEC, random_weights(SPEC), flavour="contribb", out_dir=tmp_path)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ModelError, match="is not a folder"):
        build_model(SPEC, random_weights(SPEC), flavour="standard", out_dir=tmp_path / "file")
    with pytest.raises(ModelError, match=r"no tokenizer\.json"):
        build_model(
            SPEC,
            random_weights(SPEC),
            flavour="standard",
            out_dir=tmp_path / "o",
            tokenizer_dir=tmp_path,
        )


# --- a third flavour plugs in ---------------------------------------------------------------


@pytest.fixture
def rms_flavour() -> Iterator[str]:
    """A flavour that only swaps the norm emitter for ONNX's RMSNormalization (opset 23)."""

    class RMSNormFlavour(StandardEmitter):
        name = "rmsnorm_for_test"
        opsets = {"": 23}  # noqa: RUF012 - a test subclass

        def norm(
            self,
            hf_weight: str,
            onnx_weight: str,
            *,
            residual: str,
            delta: str | None,
            label: str,
            final: bool = False,
        ) -> tuple[str, str]:
            g = self.g
            if delta is not None:
                residual = g.op("Add", [residual, delta], name=f"{label}/residual_add")
            weight = g.initializer(onnx_weight, self.w.cast(self.w.f32(hf_weight)))
            normed = g.op(
                "RMSNormalization",
                [residual, weight],
                name=f"{label}/RMSNorm",
                axis=-1,
                epsilon=self.spec.rms_norm_eps,
            )
            return normed, residual

    register_flavour(RMSNormFlavour)
    try:
        yield RMSNormFlavour.name
    finally:
        FLAVOURS.pop(RMSNormFlavour.name)


def test_third_flavour_plugs_in(tmp_path: Path, rms_flavour: str) -> None:
    weights = random_weights(SPEC, seed=4)
    out = build_model(SPEC, weights, flavour=rms_flavour, out_dir=tmp_path)
    ops = [n.op_type for n in onnx.load(out / "model.onnx", load_external_data=False).graph.node]
    assert ops.count("RMSNormalization") == 2 * SPEC.num_layers + 1 and "Pow" not in ops
    ids, mask = left_padded(PROMPTS)
    pos = nl.positions_from_mask(mask, ids.shape[1])
    got = run(session(out), ids, mask, position_ids=pos)
    ref, _ = nl.forward(SPEC, weights, ids, mask, pos)
    assert max_row_error(got.logits, ref, mask) < 1e-5


def test_flavour_names_cannot_clash(rms_flavour: str) -> None:
    class Other(StandardEmitter):
        name = rms_flavour

    with pytest.raises(ConfigError, match="already registered"):
        register_flavour(Other)


# --- CLI hooks ------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="genai-ep build")
    add_build_arguments(parser)
    return parser


def test_cli_build_from_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(
        [
            "--spec",
            "hidden=64,layers=1,heads=4,vocab=128",
            "--flavour",
            "standard",
            "--dtype",
            "fp16",
            "--seed",
            "3",
            "-o",
            str(tmp_path / "m"),
            "--no-progress",
        ]
    )
    assert run_build(args) == 0
    assert "wrote" in capsys.readouterr().out
    model = onnx.load(tmp_path / "m" / "model.onnx", load_external_data=False)
    past = next(i for i in model.graph.input if i.name == "past_key_values.0.key")
    assert past.type.tensor_type.elem_type == TensorProto.FLOAT16


def test_cli_build_from_hf_int4(tmp_path: Path) -> None:
    args = _parser().parse_args(
        ["--hf", str(TINY / "hf"), "--quant", "int4", "-o", str(tmp_path / "m"), "--no-progress"]
    )
    assert args.flavour == "contrib"
    assert run_build(args) == 0
    ops = {
        n.op_type
        for n in onnx.load(tmp_path / "m" / "model.onnx", load_external_data=False).graph.node
    }
    assert "MatMulNBits" in ops and (tmp_path / "m" / "tokenizer.json").is_file()


def test_cli_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        _parser().parse_args(["--hf", "x", "--spec", "y", "-o", str(tmp_path)])
    with pytest.raises(SystemExit):
        _parser().parse_args(["--spec", "y"])  # no -o
    args = _parser().parse_args(
        [
            "--spec",
            "hidden=64,layers=1,heads=4,vocab=128",
            "--flavour",
            "standard",
            "--quant",
            "int4",
            "-o",
            str(tmp_path / "m"),
        ]
    )
    with pytest.raises(ConfigError, match="does not support quant='int4'"):
        run_build(args)
    args = _parser().parse_args(
        ["--spec", "hidden=64,layer=1,heads=4,vocab=128", "-o", str(tmp_path / "m")]
    )
    with pytest.raises(ConfigError, match="did you mean 'layers'"):
        run_build(args)
    assert not (tmp_path / "m").exists()
    assert list(tmp_path.iterdir()) == []
