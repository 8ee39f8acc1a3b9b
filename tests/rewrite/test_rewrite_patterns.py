"""Single patterns on small graphs: the rewritten graph computes what the original computes (both
run in ONNX Runtime), and what cannot be rewritten is left alone with the reason."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import ep.ops as eo
from ep.rewrite import RewriteReport, rewrite_graph


@pytest.fixture(autouse=True)
def _no_leftover_op_state() -> Iterator[None]:
    yield
    eo.take_op_errors(all_threads=True)


def _model(
    nodes: Sequence[onnx.NodeProto],
    inputs: Sequence[onnx.ValueInfoProto],
    output: str,
    inits: dict[str, np.ndarray],
) -> onnx.ModelProto:
    graph = helper.make_graph(
        list(nodes),
        "pattern",
        list(inputs),
        [helper.make_empty_tensor_value_info(output)],
        initializer=[numpy_helper.from_array(a, n) for n, a in inits.items()],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 22), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    return model


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    eo.register_session_options(so)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return np.asarray(eo.run(sess, None, feeds)[0])


def _rewrite(model: onnx.ModelProto) -> tuple[onnx.ModelProto, RewriteReport]:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    return rewrite_graph(copy, None)


def _rope_tables(positions: int, rot: int) -> dict[str, np.ndarray]:
    inv = 1.0 / (10000.0 ** (np.arange(0, rot, 2, dtype=np.float32) / rot))
    angles = np.arange(positions, dtype=np.float32)[:, None] * inv[None, :]
    return {"cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}


@pytest.mark.parametrize(("layout", "interleaved"), [("bsd", 0), ("bsd", 1), ("bnsh", 0)])
def test_rotary_embedding_becomes_rotary(layout: str, interleaved: int) -> None:
    batch, seq, heads, dim = 2, 5, 3, 8
    rng = np.random.default_rng(0)
    if layout == "bsd":
        shape, num_heads = [batch, seq, heads * dim], heads
    else:
        shape, num_heads = [batch, heads, seq, dim], 0
    node = helper.make_node(
        "RotaryEmbedding",
        ["x", "position_ids", "cos", "sin"],
        ["y"],
        domain="com.microsoft",
        interleaved=interleaved,
        num_heads=num_heads,
    )
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)
    pos_info = helper.make_tensor_value_info("position_ids", TensorProto.INT64, [batch, seq])
    model = _model([node], [x_info, pos_info], "y", _rope_tables(32, dim))
    rewritten, report = _rewrite(model)
    assert dict(report.rewritten) == {"rotary_embedding": 1} and report.left == ()
    assert "RotaryEmbedding" not in {n.op_type for n in rewritten.graph.node}
    feeds = {
        "x": rng.standard_normal(shape).astype(np.float32),
        "position_ids": np.array([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]], np.int64),
    }
    want, got = _run(model, feeds), _run(rewritten, feeds)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def test_rotary_embedding_with_offset_positions_is_left_alone() -> None:
    node = helper.make_node(
        "RotaryEmbedding", ["x", "p", "cos", "sin"], ["y"], domain="com.microsoft", num_heads=2
    )
    inputs = [
        helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 16]),
        helper.make_tensor_value_info("p", TensorProto.INT64, [1]),
    ]
    _, report = _rewrite(_model([node], inputs, "y", _rope_tables(16, 8)))
    assert report.rewritten == {}
    (item,) = report.left
    assert "1-D (an offset)" in item.reason and item.op_type == "RotaryEmbedding"


def _norm_model(**attrs: Any) -> onnx.ModelProto:
    node = helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["y"], name="n", **attrs)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])
    w = np.linspace(0.5, 1.5, 8, dtype=np.float32)
    return _model([node], [x], "y", {"w": w})


def test_simplified_layer_norm_becomes_rms_norm() -> None:
    model = _norm_model(axis=-1, epsilon=1e-5, stash_type=1)
    rewritten, report = _rewrite(model)
    assert dict(report.rewritten) == {"simplified_layer_norm": 1}
    feeds = {"x": np.random.default_rng(1).standard_normal((2, 3, 8)).astype(np.float32)}
    np.testing.assert_allclose(_run(rewritten, feeds), _run(model, feeds), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("attrs", "reason"),
    [
        ({"axis": 1}, "axis=1: RMSNorm normalizes the last axis only"),
        ({"epsilon": 1.2345678e-5}, "has more than 6 significant digits"),
        ({"stash_type": 0}, "stash_type is not 1"),
    ],
)
def test_norms_rms_norm_cannot_express_are_left_alone(attrs: dict, reason: str) -> None:
    _, report = _rewrite(_norm_model(**attrs))
    assert report.rewritten == {}
    (item,) = report.left
    assert reason in item.reason and item.node == "n"


def test_matmul_nbits_with_a_bias_and_matmul_on_an_activation_are_left_alone() -> None:
    nbits = helper.make_node(
        "MatMulNBits",
        ["a", "b", "s", "", "", "bias"],
        ["y"],
        name="q4",
        domain="com.microsoft",
        K=32,
        N=4,
        bits=4,
        block_size=32,
    )
    mm = helper.make_node("MatMul", ["y", "a2"], ["z"], name="mm")
    inputs = [
        helper.make_tensor_value_info("a", TensorProto.FLOAT, [1, 32]),
        helper.make_tensor_value_info("a2", TensorProto.FLOAT, [4, 4]),
    ]
    inits = {
        "b": np.zeros((4, 1, 16), np.uint8),
        "s": np.ones((4, 1), np.float32),
        "bias": np.zeros(4, np.float32),
    }
    _, report = _rewrite(_model([nbits, mm], inputs, "z", inits))
    reasons = {i.node: i.reason for i in report.left}
    assert "g_idx or bias input" in reasons["q4"]
    assert "B is computed by a graph input" in reasons["mm"]
