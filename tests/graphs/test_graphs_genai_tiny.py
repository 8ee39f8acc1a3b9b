"""The contrib builder against the real onnxruntime-genai model in tests/data/genai-llama-tiny.

Built from the same Hugging Face checkpoint (hf/), our graph must have the builder's nodes (types,
domains, names, wiring, attributes) and initializers, and give the same logits in ONNX Runtime.
The int4 build must reproduce the builder's packed weights and scales bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import numpy_llama as nl
import onnx
import pytest
from graphs_testlib import TINY, right_padded, run, session
from onnx import numpy_helper

from ep_graphs import ModelSpec, convert_checkpoint, load_hf_checkpoint

PROMPTS = [[1, 40, 99, 7, 300, 12, 5, 77], [1, 250, 3], [1, 18, 400, 401, 402]]


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {
        "genai-fp32": convert_checkpoint(TINY / "hf", root / "fp32", progress=False),
        "genai-int4": convert_checkpoint(TINY / "hf", root / "int4", quant="int4", progress=False),
    }


def _node_view(model: onnx.ModelProto) -> list[tuple[Any, ...]]:
    view = []
    for node in model.graph.node:
        attrs = {}
        for attr in node.attribute:
            value = onnx.helper.get_attribute_value(attr)
            if isinstance(value, onnx.TensorProto):
                value = numpy_helper.to_array(value).tolist()
            elif isinstance(value, float):
                value = round(value, 7)
            attrs[attr.name] = value
        inputs = list(node.input)
        while inputs and not inputs[-1]:
            inputs.pop()  # trailing empty optional inputs are the same as absent ones
        view.append((node.op_type, node.domain, node.name, inputs, list(node.output), attrs))
    return view


@pytest.mark.parametrize("name", ["genai-fp32", "genai-int4"])
def test_graph_mirrors_the_genai_builder(converted: dict[str, Path], name: str) -> None:
    ours = onnx.load(converted[name] / "model.onnx", load_external_data=False)
    real = onnx.load(TINY / name / "model.onnx", load_external_data=False)
    assert _node_view(ours) == _node_view(real)
    assert sorted((t.name, tuple(t.dims), t.data_type) for t in ours.graph.initializer) == sorted(
        (t.name, tuple(t.dims), t.data_type) for t in real.graph.initializer
    )
    assert [i.name for i in ours.graph.input] == [i.name for i in real.graph.input]
    assert [o.name for o in ours.graph.output] == [o.name for o in real.graph.output]
    opsets = {o.domain: o.version for o in ours.opset_import}
    assert opsets == {o.domain: o.version for o in real.opset_import}


@pytest.mark.parametrize("name", ["genai-fp32", "genai-int4"])
def test_weights_equal_the_builders(converted: dict[str, Path], name: str) -> None:
    ours = onnx.load(converted[name] / "model.onnx")
    real = onnx.load(TINY / name / "model.onnx")
    theirs = {t.name: numpy_helper.to_array(t) for t in real.graph.initializer}
    for tensor in ours.graph.initializer:
        mine = numpy_helper.to_array(tensor)
        if tensor.name in ("cos_cache", "sin_cache"):
            # float32 cos/sin from NumPy vs PyTorch: within an ulp, not bitwise.
            np.testing.assert_allclose(mine, theirs[tensor.name], rtol=0, atol=1.2e-7)
        else:
            assert np.array_equal(mine, theirs[tensor.name]), tensor.name


@pytest.mark.parametrize("name", ["genai-fp32", "genai-int4"])
def test_logits_match_the_real_model(converted: dict[str, Path], name: str) -> None:
    ours, real = session(converted[name]), session(TINY / name)
    ids, mask = right_padded(PROMPTS)
    a, b = run(ours, ids, mask), run(real, ids, mask)
    for row in range(len(PROMPTS)):
        keep = mask[row] == 1
        assert nl.relative_error(a.logits[row, keep], b.logits[row, keep]) < 1e-5
    step_ids = np.array([[9], [10], [11]])
    step_mask = np.concatenate([mask, np.ones((3, 1), np.int64)], axis=1)
    a2 = run(ours, step_ids, step_mask, past=a.present)
    b2 = run(real, step_ids, step_mask, past=b.present)
    assert nl.relative_error(a2.logits, b2.logits) < 1e-5
    assert np.array_equal(np.argmax(a2.logits, -1), np.argmax(b2.logits, -1))


def test_real_model_matches_the_numpy_reference() -> None:
    """The reference itself agrees with onnxruntime-genai's model (so it is a fair judge)."""
    spec, weights = load_hf_checkpoint(TINY / "hf", progress=False)
    ids, mask = right_padded(PROMPTS)
    got = run(session(TINY / "genai-fp32"), ids, mask)
    ref, _ = nl.forward(spec, weights, ids, mask, nl.positions_from_mask(mask, ids.shape[1]))
    for row in range(len(PROMPTS)):
        keep = mask[row] == 1
        assert nl.relative_error(got.logits[row, keep], ref[row, keep]) < 1e-5


def test_genai_config_equals_the_builders(converted: dict[str, Path]) -> None:
    ours = json.loads((converted["genai-fp32"] / "genai_config.json").read_text())
    real = json.loads((TINY / "genai-fp32" / "genai_config.json").read_text())
    assert ours == real
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (converted["genai-fp32"] / name).read_bytes() == (TINY / "hf" / name).read_bytes()


def test_spec_from_the_tiny_config() -> None:
    spec = ModelSpec.from_hf_config(TINY / "hf")
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads) == (128, 2, 4, 2)
    assert (spec.head_dim, spec.intermediate_size, spec.vocab_size) == (32, 256, 512)
    assert spec.rope_theta == 500000.0  # from transformers 5's rope_parameters
    assert spec.tie_embeddings and not spec.qkv_bias
    assert (spec.bos_token_id, spec.eos_token_id, spec.pad_token_id) == (1, 2, 0)
    assert spec.context_length == 256 and spec.dtype == "fp32"
