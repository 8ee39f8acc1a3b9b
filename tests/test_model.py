"""ep.model.load_model: every accepted source, what it finds in the graph, and every refusal."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest

from ep.errors import ConfigError, ModelError
from ep.model import default_cache_dir, load_model

DATA = Path(__file__).parent / "data" / "genai-llama-tiny"
FP32 = DATA / "genai-fp32"
INT4 = DATA / "genai-int4"
EXPECTED = json.loads((DATA / "expected_tokens.json").read_text())


def _copy_graph(dst: Path, *, rename: dict[str, str] | None = None, config: bool = False) -> Path:
    """Copy the fp32 model into ``dst`` (weights file beside it), renaming graph values."""
    dst.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(FP32 / "model.onnx"), load_external_data=False)
    for old, new in (rename or {}).items():
        for value in [*model.graph.input, *model.graph.output]:
            if value.name == old:
                value.name = new
        for node in model.graph.node:
            node.input[:] = [new if n == old else n for n in node.input]
            node.output[:] = [new if n == old else n for n in node.output]
    onnx.save_model(model, str(dst / "model.onnx"))
    shutil.copyfile(FP32 / "model.onnx.data", dst / "model.onnx.data")
    if config:
        shutil.copyfile(FP32 / "genai_config.json", dst / "genai_config.json")
    return dst / "model.onnx"


# --- what is found ---------------------------------------------------------------------------


def test_genai_folder_fp32() -> None:
    m = load_model(FP32)
    assert (m.kind, m.flavour, m.share_buffer, m.padding) == ("genai", "contrib", True, "right")
    assert (m.num_layers, m.kv_heads, m.head_dim, m.kv_dtype) == (2, 2, 32, "float32")
    assert (m.vocab_size, m.context_length) == (512, 256)
    assert (m.bos_token_id, m.eos_token_ids, m.pad_token_id) == (1, (2,), 0)
    assert m.onnx_path == FP32 / "model.onnx" and m.genai_config == FP32 / "genai_config.json"
    assert m.tokenizer_dir == FP32
    assert m.io.past_keys == ("past_key_values.0.key", "past_key_values.1.key")
    assert m.io.present_values == ("present.0.value", "present.1.value")
    assert m.io.position_ids is None and m.io.logits == "logits"
    assert m.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4


def test_genai_folder_int4_and_the_onnx_file_itself() -> None:
    assert load_model(INT4).flavour == "contrib"
    m = load_model(FP32 / "model.onnx")
    assert m.kind == "genai" and m.genai_config == FP32 / "genai_config.json"


def test_bare_decoder_geometry_comes_from_the_graph(tmp_path: Path) -> None:
    onnx_file = _copy_graph(tmp_path / "bare")
    for source in (onnx_file, onnx_file.parent):
        m = load_model(source)
        assert (m.kind, m.genai_config, m.flavour) == ("onnx", None, "contrib")
        # head_dim is symbolic in the graph's past shape: found from the packed QKV projection
        assert (m.num_layers, m.kv_heads, m.head_dim, m.vocab_size) == (2, 2, 32, 512)
        assert m.context_length == 256  # the rotary table's length
        assert m.eos_token_ids == () and m.tokenizer_dir is None
    assert load_model(onnx_file, context_length=100).context_length == 100


def test_past_dot_variant_names_are_accepted(tmp_path: Path) -> None:
    names = {f"past_key_values.{i}.{k}": f"past.{i}.{k}" for i in (0, 1) for k in ("key", "value")}
    m = load_model(_copy_graph(tmp_path, rename=names))
    assert m.io.past_keys == ("past.0.key", "past.1.key")
    assert m.io.past_values == ("past.0.value", "past.1.value")


def test_default_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENAI_EP_CACHE", "/somewhere/else")
    assert default_cache_dir() == Path("/somewhere/else/models")
    monkeypatch.delenv("GENAI_EP_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "genai-ep" / "models"


# --- conversions through ep_graphs -----------------------------------------------------------


SPEC = "spec:hidden=64,layers=2,heads=4,kv_heads=2,vocab=256,context=128"


def test_spec_builds_once_into_the_cache_atomically(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GENAI_EP_CACHE", str(tmp_path))
    m = load_model(SPEC + ",flavour=standard,seed=1")
    assert m.kind == "spec" and m.flavour == "standard" and m.share_buffer is False
    assert m.padding == "left" and m.io.position_ids == "position_ids"
    assert m.folder.parent == tmp_path / "models"
    stamp = (m.folder / "model.onnx").stat().st_mtime_ns
    again = load_model(SPEC + ",seed=1,flavour=standard")  # same inputs, other order
    assert again.folder == m.folder
    assert (again.folder / "model.onnx").stat().st_mtime_ns == stamp, "rebuilt a cached model"
    other = load_model(SPEC + ",seed=2")
    assert other.folder != m.folder and other.flavour == "contrib"
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == sorted(
        [m.folder.name, other.folder.name]
    ), "no scratch folders may be left behind"


def test_failed_build_leaves_nothing_in_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GENAI_EP_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match="layerz"):
        load_model("spec:hidden=64,layerz=2,heads=4,vocab=256")
    with pytest.raises(ModelError, match="flavour='fancy'"):
        load_model(SPEC + ",flavour=fancy")
    models = tmp_path / "models"
    assert not models.exists() or list(models.iterdir()) == []


def test_hf_checkpoint_converts(tmp_path: Path) -> None:
    m = load_model(DATA / "hf", cache_dir=tmp_path)
    assert m.kind == "hf" and m.flavour == "contrib" and m.folder.parent == tmp_path
    assert m.tokenizer_dir == m.folder
    assert (m.num_layers, m.kv_heads, m.head_dim, m.vocab_size) == (2, 2, 32, 512)


# --- refusals ----------------------------------------------------------------------------------


def test_missing_path() -> None:
    with pytest.raises(ModelError, match="'/no/such/model' does not exist"):
        load_model("/no/such/model")


def test_folder_with_nothing_recognisable(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelError) as info:
        load_model(tmp_path)
    message = str(info.value)
    assert "found: notes.txt, weights.bin" in message
    assert "genai_config.json" in message and ".onnx" in message and "safetensors" in message


def test_folder_with_two_onnx_files(tmp_path: Path) -> None:
    (tmp_path / "a.onnx").write_bytes(b"")
    (tmp_path / "b.onnx").write_bytes(b"")
    with pytest.raises(ModelError, match=r"2 \.onnx files \(a\.onnx, b\.onnx\)"):
        load_model(tmp_path)


def test_malformed_onnx(tmp_path: Path) -> None:
    (tmp_path / "model.onnx").write_bytes(b"\x00\xff this is not a protobuf \xff" * 20)
    with pytest.raises(ModelError, match=r"cannot parse .*model.onnx as an ONNX model"):
        load_model(tmp_path / "model.onnx")


def test_genai_config_naming_a_missing_file(tmp_path: Path) -> None:
    config = json.loads((FP32 / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "decoder.onnx"
    (tmp_path / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"names the model file 'decoder.onnx', which is missing"):
        load_model(tmp_path)


def test_genai_config_that_is_not_json(tmp_path: Path) -> None:
    (tmp_path / "genai_config.json").write_text("{not json")
    with pytest.raises(ModelError, match=r"cannot read .*genai_config.json"):
        load_model(tmp_path)


def test_missing_external_weights(tmp_path: Path) -> None:
    onnx_file = _copy_graph(tmp_path)
    (tmp_path / "model.onnx.data").unlink()
    with pytest.raises(ModelError, match=r"model.onnx.data, which is missing"):
        load_model(onnx_file)


def test_past_names_that_match_no_pattern(tmp_path: Path) -> None:
    names = {
        f"past_key_values.{i}.{k}": f"cache_in_{i}_{k}" for i in (0, 1) for k in ("key", "value")
    }
    with pytest.raises(ModelError) as info:
        load_model(_copy_graph(tmp_path, rename=names))
    message = str(info.value)
    assert "no past key/value inputs" in message
    assert "cache_in_0_key" in message  # the names found
    assert "past_key_values.%d.{key,value}" in message  # the patterns expected


def test_config_patterns_that_do_not_match_the_graph(tmp_path: Path) -> None:
    names = {f"past_key_values.{i}.{k}": f"past.{i}.{k}" for i in (0, 1) for k in ("key", "value")}
    onnx_file = _copy_graph(tmp_path, rename=names, config=True)
    with pytest.raises(ModelError) as info:
        load_model(onnx_file.parent)
    assert "past.0.key" in str(info.value) and "'past_key_values.%d.key'" in str(info.value)


def test_missing_input_ids(tmp_path: Path) -> None:
    with pytest.raises(ModelError) as info:
        load_model(_copy_graph(tmp_path, rename={"input_ids": "tokens"}))
    message = str(info.value)
    assert "no input named 'input_ids'" in message and "tokens" in message


def test_inconsistent_layer_counts_in_the_graph(tmp_path: Path) -> None:
    onnx_file = _copy_graph(tmp_path, rename={"past_key_values.1.value": "past_key_values.5.value"})
    with pytest.raises(ModelError) as info:
        load_model(onnx_file)
    message = str(info.value)
    assert "inconsistent layer counts" in message and "past values: layers [0, 5]" in message


def test_inconsistent_layer_counts_against_the_config(tmp_path: Path) -> None:
    _copy_graph(tmp_path, config=True)
    config = json.loads((tmp_path / "genai_config.json").read_text())
    config["model"]["decoder"]["num_hidden_layers"] = 3
    (tmp_path / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"2 layers of past/present but .* num_hidden_layers=3"):
        load_model(tmp_path)


def test_config_disagreeing_with_the_graph(tmp_path: Path) -> None:
    _copy_graph(tmp_path, config=True)
    config = json.loads((tmp_path / "genai_config.json").read_text())
    config["model"]["decoder"]["num_key_value_heads"] = 4
    (tmp_path / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match=r"kv_heads = 2 but genai_config.json says 4"):
        load_model(tmp_path)


def test_context_length_beyond_the_model(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"context length 512 exceeds .* of 256"):
        load_model(FP32, context_length=512)
    with pytest.raises(ModelError, match="context_length=1; expected an integer >= 2"):
        load_model(FP32, context_length=1)


def test_special_ids_outside_the_vocabulary(tmp_path: Path) -> None:
    _copy_graph(tmp_path, config=True)
    config = json.loads((tmp_path / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = [2, 900]
    (tmp_path / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(ModelError, match="eos token id 900 is outside the vocabulary"):
        load_model(tmp_path)


def test_eos_list_is_kept(tmp_path: Path) -> None:
    _copy_graph(tmp_path, config=True)
    config = json.loads((tmp_path / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = [2, 7]
    (tmp_path / "genai_config.json").write_text(json.dumps(config))
    assert load_model(tmp_path).eos_token_ids == (2, 7)


def test_loaded_model_is_frozen() -> None:
    m = load_model(FP32)
    with pytest.raises(AttributeError):
        m.num_layers = 3  # type: ignore[misc]
    assert np.dtype(m.kv_numpy_dtype) == np.float32


def _ep_graph(path: Path, present_seq: str) -> Path:
    """A graph with genai I/O and one node in this project's domain (loaded, never run)."""
    from onnx import TensorProto, helper

    def kv(name: str, seq: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", 2, seq, 8])

    node = helper.make_node(
        "DecoderStub",
        ["input_ids", "attention_mask", "past_key_values.0.key", "past_key_values.0.value"],
        ["logits", "present.0.key", "present.0.value"],
        domain="ai.genai_ep",
    )
    graph = helper.make_graph(
        [node],
        "ep_stub",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "total"]),
            kv("past_key_values.0.key", "capacity"),
            kv("past_key_values.0.value", "capacity"),
        ],
        [
            helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", "seq", 16]),
            kv("present.0.key", present_seq),
            kv("present.0.value", present_seq),
        ],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 22), helper.make_opsetid("ai.genai_ep", 1)]
    )
    onnx.save_model(model, str(path))
    return path


def test_ep_flavour_and_its_buffer_sharing(tmp_path: Path) -> None:
    shared = load_model(_ep_graph(tmp_path / "shared.onnx", "capacity"), context_length=32)
    assert (shared.flavour, shared.share_buffer, shared.padding) == ("ep", True, "right")
    assert (shared.num_layers, shared.kv_heads, shared.head_dim, shared.vocab_size) == (1, 2, 8, 16)
    concat = load_model(_ep_graph(tmp_path / "concat.onnx", "total"), context_length=32)
    assert (concat.flavour, concat.share_buffer, concat.padding) == ("ep", False, "left")
    with pytest.raises(ModelError, match=r"no context length known .* pass context_length="):
        load_model(tmp_path / "concat.onnx")
