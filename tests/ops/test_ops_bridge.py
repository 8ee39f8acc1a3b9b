"""The ONNX Runtime bridge in this process: user sessions, errors surfacing from run(), float16 and
bfloat16 through BitCast, named weights, the freeze, and the pinned onnxruntime-extensions API."""

from __future__ import annotations

import inspect
from typing import Any

import ml_dtypes
import numpy as np
import onnxruntime as ort
import onnxruntime_extensions
import pytest
from onnx import helper
from opsutil import model, run_nodes, session

import ep.ops as eo
from ep.errors import ContractError, OpError
from ep.ops import ort_bridge
from ep.ops.schema import ArgInfo, OpDef, OpSchema, TensorSpec

RNG = np.random.default_rng(7)


def _rms_model() -> bytes:
    feeds = {"x": np.zeros((1, 4), np.float32), "w": np.zeros(4, np.float32)}
    return model(eo.make_nodes("RMSNorm", ["x", "w"], ["y"], name="final_norm"), feeds, ["y"])


def test_a_users_own_session_runs_our_ops() -> None:
    so = ort.SessionOptions()
    assert eo.register_session_options(so) is so
    assert eo.register_session_options(so) is so  # idempotent: a second library load would fail
    sess = ort.InferenceSession(_rms_model(), so, providers=["CPUExecutionProvider"])
    x, w = RNG.standard_normal((3, 4)).astype(np.float32), RNG.standard_normal(4).astype(np.float32)
    (y,) = sess.run(None, {"x": x, "w": w})  # a plain run works too
    np.testing.assert_allclose(y, eo.core_op("RMSNorm")(x, w, epsilon=1e-6), rtol=1e-6)
    assert ort_bridge.is_frozen()


def test_an_op_error_in_a_session_is_raised_naming_op_and_node_and_the_next_run_works() -> None:
    sess = session(_rms_model())
    x = np.ones((2, 4), np.float32)
    with pytest.raises(OpError) as info:
        eo.run(sess, None, {"x": x, "w": np.ones(3, np.float32)})
    text = str(info.value)
    assert "ai.genai_ep::RMSNorm" in text and "'final_norm'" in text
    assert "weight has shape [3]; expected [4]" in text
    (y,) = eo.run(sess, None, {"x": x, "w": np.ones(4, np.float32)})
    np.testing.assert_allclose(y, np.ones((2, 4)), rtol=1e-5)


def test_after_a_plain_run_raise_op_errors_reports_and_clears() -> None:
    sess = session(_rms_model())
    outputs = sess.run(None, {"x": np.ones((1, 4), np.float32), "w": np.ones(2, np.float32)})
    assert not outputs[0].any()  # the harmless zeros the failed op returned
    with pytest.raises(OpError, match="final_norm"):
        eo.raise_op_errors()
    eo.raise_op_errors()  # cleared: nothing left to raise


def test_an_unchecked_error_surfaces_at_the_next_checked_run() -> None:
    sess = session(_rms_model())
    sess.run(None, {"x": np.ones((1, 4), np.float32), "w": np.ones(2, np.float32)})
    good = {"x": np.ones((1, 4), np.float32), "w": np.ones(4, np.float32)}
    with pytest.raises(OpError, match="earlier run on this thread"):
        eo.run(sess, None, good)
    eo.run(sess, None, good)


def test_take_op_errors_returns_them_without_raising() -> None:
    sess = session(_rms_model())
    sess.run(None, {"x": np.ones((1, 4), np.float32), "w": np.ones(5, np.float32)})
    errors = eo.take_op_errors()
    assert len(errors) == 1 and isinstance(errors[0], OpError)
    assert eo.take_op_errors() == []


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_float16_and_bfloat16_cross_through_bitcast(dtype: Any) -> None:
    name = "float16" if dtype is np.float16 else "bfloat16"
    x = RNG.standard_normal((2, 3, 8)).astype(dtype)
    skip = RNG.standard_normal((2, 3, 8)).astype(dtype)
    w = RNG.standard_normal(8).astype(dtype)
    nodes = [
        *eo.make_nodes("SkipRMSNorm", ["x", "skip", "w"], ["y", "sum"], name="n", dtype=name),
        *eo.make_nodes("SwiGLU", ["y", "sum"], ["act"], name="act", dtype=name),
    ]
    assert [n.op_type for n in nodes].count("BitCast") == 3 + 2 + 2 + 1
    feeds = {"x": x, "skip": skip, "w": w}
    outputs = ["y", "sum", "act"]
    if name == "bfloat16":
        # ORT's Python API cannot take or give bfloat16 arrays: cross the graph edge as uint16.
        bf16 = helper.TensorProto.BFLOAT16
        edge_in = [helper.make_node("BitCast", [f"{k}_u16"], [k], to=bf16) for k in feeds]
        edge_out = [
            helper.make_node("BitCast", [k], [f"{k}_u16"], to=helper.TensorProto.UINT16)
            for k in outputs
        ]
        nodes = [*edge_in, *nodes, *edge_out]
        feeds = {f"{k}_u16": v.view(np.uint16) for k, v in feeds.items()}
        outputs = [f"{k}_u16" for k in outputs]
    y, total, act = (o.view(dtype) for o in run_nodes(nodes, feeds, outputs))
    assert y.dtype == total.dtype == act.dtype == np.dtype(dtype)
    want_y, want_sum = eo.core_op("SkipRMSNorm")(x, skip, w, epsilon=1e-6)
    np.testing.assert_array_equal(y, want_y)
    np.testing.assert_array_equal(total, want_sum)
    np.testing.assert_array_equal(act, eo.core_op("SwiGLU")(want_y, want_sum))


def test_named_weight_matmul_resolves_through_the_runtime() -> None:
    w = RNG.standard_normal((6, 4)).astype(np.float32)  # [N, K]
    a = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    nodes = eo.make_nodes(
        "MatMul", ["a"], ["y"], name="proj", weight="layer0.q", N=6, transpose_b=1
    )
    sess = session(model(nodes, {"a": a}, ["y"]))
    with eo.use_weights(eo.DictWeights({"layer0.q": w})):
        (y,) = eo.run(sess, None, {"a": a})
    np.testing.assert_allclose(y, a @ w.T, rtol=1e-6)
    with eo.use_weights(eo.DictWeights({"layer0.k": w})), pytest.raises(OpError) as info:
        eo.run(sess, None, {"a": a})
    assert "'layer0.q'" in str(info.value) and "'proj'" in str(info.value)
    assert "layer0.k" in str(info.value)  # the resolver's names are offered


def test_defining_an_op_after_the_freeze_is_refused_cleanly() -> None:
    session(_rms_model())  # registers into ORT: the op set is frozen from here on
    before = ort_bridge.defined_op_types()
    late = OpDef(
        OpSchema("LateOp", (TensorSpec("x", "float32"),), (TensorSpec("y", "float32"),)),
        reference=lambda x: x,
        infer=lambda inputs, attrs: (inputs[0],),
    )
    with pytest.raises(ContractError, match="frozen"):
        eo.install([late])
    assert ort_bridge.defined_op_types() == before
    assert eo.install(eo.CORE_OPS) == ()  # the same definitions again: nothing to do
    clash = OpDef(eo.core_op("SwiGLU").schema, reference=lambda g, u: g, infer=lambda i, a: i[:1])
    with pytest.raises(ContractError, match="different definition"):
        eo.install([clash])


def test_register_session_options_rejects_other_objects() -> None:
    with pytest.raises(OpError, match="SessionOptions"):
        eo.register_session_options(object())


# --- the pinned, semi-private onnxruntime-extensions API --------------------------------------


def test_onnxruntime_extensions_is_the_pinned_version_with_the_hook_api() -> None:
    """Fails loudly when onnxruntime-extensions moves: the bridge replaces its invocation hook."""
    assert onnxruntime_extensions.__version__.startswith(ort_bridge.EXTENSIONS_PIN), (
        f"onnxruntime-extensions {onnxruntime_extensions.__version__} is not the pinned "
        f"{ort_bridge.EXTENSIONS_PIN}*: re-check ORT-NOTES.md and ep/ops/ort_bridge.py"
    )
    from onnxruntime_extensions import _ocos
    from onnxruntime_extensions._extensions_pydll import PyCustomOpDef, add_custom_op

    assert callable(PyCustomOpDef.install_hooker) and callable(add_custom_op)
    for name in ("dt_float", "dt_uint16", "dt_uint8", "dt_int32", "dt_int64", "dt_string"):
        assert isinstance(getattr(PyCustomOpDef, name), int), name
    native = PyCustomOpDef()
    for field in ("op_type", "obj_id", "input_types", "output_types", "attrs"):
        assert hasattr(native, field), field
    # The stock hook's protocol, which ours mirrors:
    # (obj_id, inputs, attrs) -> (obj_id, shape0, data0, shape1, data1, ...)
    params = list(inspect.signature(_ocos._on_pyop_invocation).parameters)
    assert params == ["k_id", "feed", "attributes"]
    assert "rv.flatten().tolist()" in inspect.getsource(_ocos._on_pyop_invocation)


def test_our_hook_replies_in_the_extensions_protocol() -> None:
    session(_rms_model())
    definition = next(d for d in ort_bridge._STATE.by_id.values() if d.op_type == "RMSNorm_f16")
    x = RNG.standard_normal((2, 4)).astype(np.float16)
    w = np.ones(4, np.float16)
    attrs = {"ep_node": "n0", "epsilon": "1e-06"}
    reply = ort_bridge._invoke(definition.obj_id, [x.view(np.uint16), w.view(np.uint16)], attrs)
    assert reply[0] == definition.obj_id and reply[1] == (2, 4)
    out = reply[2]
    assert out.dtype == np.uint16 and out.flags.c_contiguous
    np.testing.assert_array_equal(out.view(np.float16), eo.core_op("RMSNorm")(x, w, epsilon=1e-6))
    # A failing call replies with zeros of the expected shape instead of raising into C++.
    bad = ort_bridge._invoke(definition.obj_id, [x.view(np.uint16), w[:3].view(np.uint16)], attrs)
    assert bad[1] == (0,) or not bad[2].any()
    with pytest.raises(OpError, match="'n0'"):
        eo.raise_op_errors()


def test_plain_onnx_ops_still_run_in_registered_sessions() -> None:
    feeds = {"a": np.ones(3, np.float32)}
    (y,) = run_nodes([helper.make_node("Neg", ["a"], ["y"])], feeds, ["y"])
    np.testing.assert_array_equal(y, -feeds["a"])


def test_argument_info_is_what_infer_functions_see() -> None:
    info = ArgInfo((2, 3), "float32")
    assert info.describe() == "float32[2, 3]" and info == ((2, 3), "float32")
