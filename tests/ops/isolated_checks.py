"""Run in a fresh process by test_ops_isolated.py: a test plugin's misbehaving ops inside real
ONNX Runtime sessions. Prints one JSON object of observations on its last line.

A fresh process because the op set is process-wide and frozen at the first session, and because
a regression here (an exception reaching C++) aborts the process: the parent then sees the abort
instead of losing its own test run.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

import ep.ops as eo
from ep.errors import ContractError, OpError
from ep.ops import ort_bridge
from ep.ops.schema import ArgInfo, AttrSpec, OpDef, OpSchema, TensorSpec
from ep.registry import PluginRef, Register, Registry
from ep_builtin import ops_core

BAD_PLUGIN = PluginRef("badops", "badops_module", "badops-dist", "9.9")
_F = (TensorSpec("x", "float32"),)
_Y = (TensorSpec("y", "float32"),)


def _same(inputs: Any, attrs: Any) -> tuple[ArgInfo, ...]:
    return (inputs[0],)


def _raise_zero(x: np.ndarray) -> np.ndarray:
    return x + 1 // (x.size - x.size)  # a genuine ZeroDivisionError from inside the op


def _interrupt(x: np.ndarray) -> np.ndarray:
    raise KeyboardInterrupt


def _bad_infer(inputs: Any, attrs: Any) -> tuple[ArgInfo, ...]:
    raise RuntimeError("infer is broken")


def _json_echo(x: np.ndarray, *, cfg: Any) -> np.ndarray:
    return (x * cfg["scale"] + sum(cfg["shift"])).astype(np.float32)


TEST_OPS = [
    OpDef(OpSchema("Raises", _F, _Y), reference=_raise_zero, infer=_same),
    OpDef(OpSchema("Interrupts", _F, _Y), reference=_interrupt, infer=_same),
    OpDef(OpSchema("BadDtype", _F, _Y), reference=lambda x: x.astype(np.float64), infer=_same),
    OpDef(OpSchema("BadShape", _F, _Y), reference=lambda x: x[:1], infer=_same),
    OpDef(OpSchema("BadCount", _F, _Y), reference=lambda x: (x, x), infer=_same),
    OpDef(OpSchema("BadInfer", _F, _Y), reference=lambda x: x, infer=_bad_infer),
    OpDef(
        OpSchema("JsonEcho", _F, _Y, attributes=(AttrSpec("cfg", "json"),)),
        reference=_json_echo,
        infer=_same,
    ),
]


def _model(nodes: list[Any], outputs: list[str]) -> bytes:
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
        [helper.make_empty_tensor_value_info(n) for n in outputs],
    )
    opsets = [
        helper.make_opsetid("", 26),
        helper.make_opsetid("ai.genai_ep", 1),
        helper.make_opsetid("ai.onnx.contrib", 1),
    ]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = eo.IR_VERSION  # loadable by the onnxruntime on every machine we test on
    return model.SerializeToString()


def _session(nodes: list[Any], outputs: list[str], *, parallel: bool = False) -> Any:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    if parallel:
        so.execution_mode = ort.ExecutionMode.ORT_PARALLEL
    eo.register_session_options(so)
    return ort.InferenceSession(_model(nodes, outputs), so, providers=["CPUExecutionProvider"])


def _op(name: str, node: str, **attrs: Any) -> list[Any]:
    op = next(o for o in TEST_OPS if o.name == name)
    return eo.make_nodes(op, ["x"], ["y"], name=node, **attrs)


def _outcome(fn: Any) -> dict[str, Any]:
    try:
        value = fn()
    except BaseException as exc:
        return {
            "raised": type(exc).__name__,
            "message": str(exc),
            "cause": type(exc.__cause__).__name__ if exc.__cause__ else None,
            "context": type(exc.__context__).__name__ if exc.__context__ else None,
        }
    return {"raised": None, "value": np.asarray(value).tolist()}


def main() -> dict[str, Any]:
    seen: dict[str, Any] = {}
    x = np.arange(6, dtype=np.float32).reshape(2, 3)

    # A foreign op defined the stock way before our install: it must keep working.
    from onnxruntime_extensions import PyCustomOpDef, onnx_op

    @onnx_op(op_type="Negate", inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_float])
    def negate(a: np.ndarray) -> np.ndarray:
        return -a

    registry = Registry()
    ops_core.ep_register_ops(Register(registry, "op", ops_core.PLUGIN_REF))
    register = Register(registry, "op", BAD_PLUGIN)
    for op in TEST_OPS:
        register.add(op.name, op)
    registry.frozen = True
    eo.install(registry)

    good = _session(eo.make_nodes("SwiGLU", ["x", "x"], ["y"], name="act"), ["y"])
    seen["good_before"] = _outcome(lambda: eo.run(good, None, {"x": x})[0])

    # An op that raises, followed by a standard op consuming its (harmless) output.
    raising = _session([*_op("Raises", "boom"), helper.make_node("Add", ["y", "x"], ["z"])], ["z"])
    seen["raises"] = _outcome(lambda: eo.run(raising, None, {"x": x}))
    seen["good_after"] = _outcome(lambda: eo.run(good, None, {"x": x})[0])
    seen["raises_again"] = _outcome(lambda: eo.run(raising, None, {"x": x}))

    for name, node in [
        ("BadDtype", "dt"),
        ("BadShape", "sh"),
        ("BadCount", "ct"),
        ("BadInfer", "inf"),
    ]:
        sess = _session(_op(name, node), ["y"])
        seen[name] = _outcome(lambda sess=sess: eo.run(sess, None, {"x": x}))

    # BadInfer's harmless output is empty: the Add after it fails in ORT; the op's error wins.
    chained = _session(
        [*_op("BadInfer", "inf2"), helper.make_node("Add", ["y", "x"], ["z"])], ["z"]
    )
    seen["chained"] = _outcome(lambda: eo.run(chained, None, {"x": x}))

    interrupting = _session(_op("Interrupts", "ctrl_c"), ["y"])
    seen["interrupt"] = _outcome(lambda: eo.run(interrupting, None, {"x": x}))

    echo = _session(_op("JsonEcho", "json", cfg={"scale": 2.5, "shift": [1, 2]}), ["y"])
    seen["json"] = _outcome(lambda: eo.run(echo, None, {"x": x})[0])

    # A plain session.run: nothing raised there; raise_op_errors reports it.
    seen["plain_run"] = _outcome(lambda: raising.run(None, {"x": x})[0])
    seen["plain_then_check"] = _outcome(eo.raise_op_errors)

    parallel = _session(
        [*_op("Raises", "par"), helper.make_node("Add", ["y", "x"], ["z"])], ["z"], parallel=True
    )
    seen["parallel"] = _outcome(lambda: eo.run(parallel, None, {"x": x}))

    foreign = _session([helper.make_node("Negate", ["x"], ["y"], domain="ai.onnx.contrib")], ["y"])
    seen["foreign"] = _outcome(lambda: foreign.run(None, {"x": x})[0])

    late = OpDef(OpSchema("TooLate", _F, _Y), reference=lambda x: x, infer=_same)
    before = len(ort_bridge.defined_op_types())
    seen["late_define"] = _outcome(lambda: eo.install([late]))
    seen["late_define_count_unchanged"] = len(ort_bridge.defined_op_types()) == before
    seen["frozen"] = ort_bridge.is_frozen()
    seen["good_at_end"] = _outcome(lambda: eo.run(good, None, {"x": x})[0])
    seen["exception_types_ok"] = issubclass(OpError, Exception) and issubclass(
        ContractError, Exception
    )
    return seen


if __name__ == "__main__":
    try:
        result = main()
    except BaseException:
        traceback.print_exc()
        sys.exit(3)
    print(json.dumps(result))
