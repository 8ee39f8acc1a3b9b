"""Helpers for the op tests: tiny single-node ONNX models run in real ONNX Runtime sessions."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

import ep.ops as eo
from ep.ops.schema import DOMAIN

ELEM = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(np.int64): TensorProto.INT64,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.uint16): TensorProto.UINT16,
}
try:
    import ml_dtypes

    ELEM[np.dtype(ml_dtypes.bfloat16)] = TensorProto.BFLOAT16
except ImportError:  # pragma: no cover - a project dependency
    pass


def model(
    nodes: Sequence[Any],
    feeds: Mapping[str, np.ndarray],
    outputs: Iterable[str],
    *,
    initializers: Mapping[str, np.ndarray] | None = None,
    onnx_opset: int = eo.BITCAST_OPSET,
) -> bytes:
    """A model of ``nodes`` whose inputs are typed like ``feeds``; outputs left untyped."""
    inits = [
        helper.make_tensor(n, ELEM[a.dtype], a.shape, a.tobytes(), raw=True)
        for n, a in (initializers or {}).items()
    ]
    graph = helper.make_graph(
        list(nodes),
        "test",
        [helper.make_tensor_value_info(n, ELEM[a.dtype], None) for n, a in feeds.items()],
        [helper.make_empty_tensor_value_info(n) for n in outputs],
        initializer=inits,
    )
    opsets = [
        helper.make_opsetid("", onnx_opset),
        helper.make_opsetid(DOMAIN, 1),
        helper.make_opsetid("com.microsoft", 1),
    ]
    m = helper.make_model(graph, opset_imports=opsets)
    m.ir_version = 10
    return m.SerializeToString()


def session(model_bytes: bytes) -> ort.InferenceSession:
    """A CPU session that can run this project's ops."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    eo.register_session_options(so)
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


def run_nodes(
    nodes: Sequence[Any], feeds: Mapping[str, np.ndarray], outputs: Sequence[str], **kw: Any
) -> list[np.ndarray]:
    """Build, open and run a model of ``nodes`` once (our ``run``: op errors surface)."""
    sess = session(model(nodes, feeds, outputs, **kw))
    return eo.run(sess, list(outputs), dict(feeds))


def ms_node(op: str, inputs: Sequence[str], outputs: Sequence[str], **attrs: Any) -> Any:
    return helper.make_node(op, list(inputs), list(outputs), domain="com.microsoft", **attrs)


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    g = np.asarray(got, dtype=np.float64)
    w = np.asarray(want, dtype=np.float64)
    return float(np.abs(g - w).max() / max(np.abs(w).max(), 1e-30))
