"""Op definitions, their registration through the plugin seam, and the ONNX node helpers."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from onnx import helper

import ep.ops as eo
from ep.errors import ContractError, ModelError, OpError, PluginConflictError
from ep.ops.schema import ArgInfo, AttrSpec, OpDef, OpSchema, TensorSpec, check_outputs, run_infer
from ep.registry import PluginRef, Register, Registry
from ep_builtin import ops_core

_X = (TensorSpec("x", "T"),)
_Y = (TensorSpec("y", "T"),)
_T = (("T", ("float32", "float16")),)


def _identity(**kw) -> OpDef:
    schema = OpSchema("Ident", _X, _Y, type_vars=_T, **kw)
    return OpDef(schema, reference=lambda x, **a: x, infer=lambda inputs, attrs: (inputs[0],))


# --- the built-in pack through the plugin seam -------------------------------------------------


def test_ops_core_registers_every_builtin_op_through_a_register() -> None:
    registry = Registry()
    ops_core.ep_register_ops(Register(registry, "op", ops_core.PLUGIN_REF))
    assert registry.names("op") == sorted(op.name for op in eo.CORE_OPS)
    entry = registry.get("op", "KVAttention")
    assert entry.factory is eo.core_op("KVAttention")
    assert entry.plugin.name == "ops_core" and entry.description.startswith("Causal GQA")
    with pytest.raises(PluginConflictError, match="RMSNorm"):
        other = PluginRef("other", "other_mod", "other-dist", "1.0")
        Register(registry, "op", other).add("RMSNorm", eo.core_op("RMSNorm"))


def test_every_builtin_op_has_three_float_signatures_with_distinct_onnx_types() -> None:
    types = eo.op_types()
    assert len(types) == 3 * len(eo.CORE_OPS)
    rms = eo.core_op("RMSNorm").schema
    assert [rms.op_type(s) for s in rms.signatures()] == ["RMSNorm", "RMSNorm_f16", "RMSNorm_bf16"]
    for op in eo.CORE_OPS:
        assert op.schema.domain == "ai.genai_ep" and op.schema.doc
        assert op.kernel("cpu") is op.reference


def test_kernels_are_keyed_by_device_and_extensible() -> None:
    op = eo.core_op("SwiGLU")
    with pytest.raises(OpError, match="no 'rocm' kernel"):
        op.kernel("rocm")

    def fake_rocm(gate, up):
        return gate

    with_rocm = op.with_kernel("rocm", fake_rocm)
    assert with_rocm.kernel("rocm") is fake_rocm and with_rocm.kernel("cpu") is op.reference
    assert "rocm" not in op.kernels  # the registered definition is unchanged
    with pytest.raises(TypeError):
        op.kernels["rocm"] = fake_rocm  # type: ignore[index]


# --- schema validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "bad name"}, "identifier"),
        ({"inputs": (TensorSpec("x", "U"),)}, "neither a dtype"),
        ({"outputs": (TensorSpec("x", "T"),)}, "names repeat"),
        ({"outputs": ()}, "at least one output"),
        ({"attributes": (AttrSpec("dims", "ints"),)}, "no list attributes"),  # type: ignore[arg-type]
        ({"attributes": (AttrSpec("ep_node", "string"),)}, "reserved"),
        ({"attributes": (AttrSpec("scale", "float", 1 / math.sqrt(96)),)}, "6 significant digits"),
        ({"domain": "com.example"}, "every op lives in"),
        ({"type_vars": (("T", ("float8",)),)}, "unknown dtype"),
    ],
)
def test_malformed_schemas_are_refused(kwargs, message) -> None:
    fields = {"name": "Op", "inputs": _X, "outputs": _Y, "type_vars": _T, **kwargs}
    with pytest.raises(ContractError, match=message):
        OpSchema(**fields)


def test_attributes_coerce_parse_and_encode() -> None:
    assert AttrSpec("n", "int").parse("1099511627779", where="w") == 2**40 + 3
    assert AttrSpec("f", "float").parse("1e-05", where="w") == 1e-5
    cfg = AttrSpec("cfg", "json")
    assert cfg.parse('{"a": [1, 2]}', where="w") == {"a": [1, 2]}
    assert cfg.encode({"a": [1, 2]}) == '{"a":[1,2]}'
    with pytest.raises(OpError, match="not valid JSON"):
        cfg.parse("{nope", where="w")
    with pytest.raises(OpError, match="must be an int"):
        AttrSpec("n", "int").coerce(1.5, where="w")
    with pytest.raises(OpError, match="must be an int"):
        AttrSpec("n", "int").coerce(True, where="w")


@pytest.mark.parametrize(
    ("value", "exact"),
    [
        (1e-5, True),
        (1e-6, True),
        (0.7, True),
        (500000.0, True),
        (0.0, True),
        (1 / math.sqrt(96), False),
        (0.123456789, False),
        (float("nan"), False),
    ],
)
def test_float_attributes_must_survive_six_significant_digits(value: float, exact: bool) -> None:
    assert eo.float_attr_exact(value) is exact


def test_checked_call_validates_arity_dtypes_and_attributes() -> None:
    op = eo.core_op("RMSNorm")
    x = np.ones((2, 4), np.float32)
    with pytest.raises(OpError, match="got 1 inputs; expected 2"):
        op(x)
    with pytest.raises(OpError, match="match no signature"):
        op(x, np.ones(4, np.float64))
    with pytest.raises(OpError, match="unknown attribute"):
        op(x, np.ones(4, np.float32), eps=1.0)
    with pytest.raises(OpError, match="is required"):
        eo.core_op("KVAttention")(
            np.ones((1, 1, 1, 2), np.float32),
            np.zeros((1, 1), np.int64),
            np.ones(1, np.int64),
            np.zeros(7, np.int64),
            np.array(1),
            layer=0,
        )


def test_output_checks_are_addressed_to_the_op_author() -> None:
    op = _identity()
    want = (ArgInfo((2, 3), "float32"),)
    author = "plugin 'bad' (module bad_ops, bad-dist 9.9)"
    good = check_outputs(op, np.ones((3, 2), np.float32).T, want, node="n1", author=author)
    assert good[0].flags.c_contiguous  # a transposed view comes back contiguous
    cases = [
        (np.ones((2, 3), np.float64), "should be float32[2, 3] but came back as float64[2, 3]"),
        (np.ones((3,), np.float32), "came back as float32[3]"),
        ([1.0, 2.0], "is a list"),
        ((np.ones((2, 3), np.float32),) * 2, "returned 2 output"),
    ]
    for result, message in cases:
        with pytest.raises(OpError) as info:
            check_outputs(op, result, want, node="n1", author=author)
        assert message in str(info.value)
        assert "ai.genai_ep::Ident (node 'n1') from plugin 'bad'" in str(info.value)


def test_malformed_infer_answers_are_refused() -> None:
    op = OpDef(
        _identity().schema,
        reference=lambda x: x,
        infer=lambda i, a: [ArgInfo((2, -1), "float32")],  # a negative dim
    )
    with pytest.raises(OpError, match="infer function returned"):
        run_infer(op, [ArgInfo((2,), "float32")], {}, node="n", author="me")

    def not_a_list(inputs: Any, attrs: Any) -> Any:
        return 42

    op2 = OpDef(_identity().schema, reference=lambda x: x, infer=not_a_list)
    with pytest.raises(OpError, match="one \\(shape, dtype name\\) pair per output"):
        run_infer(op2, [ArgInfo((2,), "float32")], {}, node="n", author="me")


# --- node helpers ----------------------------------------------------------------------------


def test_make_nodes_fills_defaults_names_the_node_and_adds_carriers() -> None:
    (node,) = eo.make_nodes("RMSNorm", ["x", "w"], ["y"], name="norm")
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs == {"epsilon": pytest.approx(1e-6), "ep_node": b"norm"}
    assert node.domain == "ai.genai_ep" and node.op_type == "RMSNorm"
    nodes = eo.make_nodes("RMSNorm", ["x", "w"], ["y"], name="norm", dtype="bfloat16")
    assert [n.op_type for n in nodes] == ["BitCast", "BitCast", "RMSNorm_bf16", "BitCast"]
    assert nodes[2].input == ["norm/x_u16", "norm/weight_u16"] and nodes[3].output == ["y"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"scale": 1 / math.sqrt(96)}, "6 significant digits"),
        ({}, "'layer' \\(int\\) is required"),
        ({"layer": 0, "dtype": "float64"}, "no signature"),
    ],
)
def test_make_nodes_refuses_what_would_misbehave(kwargs, message) -> None:
    base = {"kv_heads": 2, **kwargs}
    if "layer" not in kwargs and "scale" in kwargs:
        base["layer"] = 0
    with pytest.raises(OpError, match=message):
        eo.make_nodes("KVAttention", ["q", "p", "l", "g", "c"], ["o"], name="a", **base)
    with pytest.raises(OpError, match="3 inputs"):
        eo.make_nodes("SwiGLU", ["a", "b", "c"], ["y"], name="s")


def _model(nodes, opset: int = 26):
    graph = helper.make_graph(nodes, "g", [], [])
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", opset), helper.make_opsetid("ai.genai_ep", 1)]
    )


def test_check_model_accepts_what_make_nodes_builds() -> None:
    nodes = [
        *eo.make_nodes("SkipRMSNorm", ["x", "r", "w"], ["y", "s"], name="n", dtype="float16"),
        *eo.make_nodes(
            "KVAttention", ["q", "p", "l", "g", "c"], ["o"], name="a", layer=1, kv_heads=2
        ),
    ]
    eo.check_model(_model(nodes))


def test_check_model_lists_every_problem_with_its_node() -> None:
    good = eo.make_nodes("RMSNorm", ["x", "w"], ["y"], name="n0", dtype="float16")
    bad = [
        helper.make_node("RMSNrom", ["x", "w"], ["y"], domain="ai.genai_ep", name="typo"),
        helper.make_node("RMSNorm", ["x", "w"], ["y"], domain="ai.genai_ep", name="bare"),
        helper.make_node(
            "SwiGLU", ["g", ""], ["y"], domain="ai.genai_ep", name="hole", ep_node="hole", extra=1
        ),
        helper.make_node(
            "KVAttention",
            ["q", "p", "l", "g", "c"],
            ["o"],
            domain="ai.genai_ep",
            name="scaled",
            ep_node="scaled",
            layer=0,
            kv_heads=2,
            scale=1 / math.sqrt(96),
        ),
        helper.make_node(
            "KVAttention",
            ["q", "p", "l", "g", "c"],
            ["o"],
            domain="ai.genai_ep",
            name="typed",
            ep_node="typed",
            layer=0.0,
            kv_heads=2,
            scale=0.0,
        ),
    ]
    with pytest.raises(ModelError) as info:
        eo.check_model(_model([*good, *bad], opset=21))
    text = str(info.value)
    for expected in [
        "'typo' (RMSNrom): ai.genai_ep has no op 'RMSNrom' (did you mean 'RMSNorm'?)",
        "'bare' (RMSNorm): missing the string attribute 'ep_node'",
        "'bare' (RMSNorm): attribute 'epsilon' (float) is missing",
        "'hole' (SwiGLU): inputs ['g', '']",
        "'hole' (SwiGLU): unknown attribute(s) ['extra']",
        "'scaled' (KVAttention): float attribute scale=",
        "'typed' (KVAttention): attribute 'layer' must be int",
        "need the default opset >= 26",
    ]:
        assert expected in text, expected


def test_check_model_validates_json_attributes_and_the_domain_import() -> None:
    schema = OpSchema("WithJson", _X, _Y, attributes=(AttrSpec("cfg", "json"),), type_vars=_T)
    op = OpDef(schema, reference=lambda x, cfg: x, infer=lambda i, a: (i[0],))
    (node,) = eo.make_nodes(op, ["x"], ["y"], name="j", cfg={"strides": [4, 1]})
    eo.check_model(_model([node]), ops=[op])
    node.attribute[0].s = b"{broken"
    graph = helper.make_graph([node], "g", [], [])
    no_import = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 26)])
    with pytest.raises(ModelError) as info:
        eo.check_model(no_import, ops=[op])
    assert "not valid JSON" in str(info.value) and "does not import" in str(info.value)


def test_the_public_api_is_what_we_mean() -> None:
    expected = {
        # definitions
        "DOMAIN",
        "NODE_ATTR",
        "CARRIERS",
        "ArgInfo",
        "AttrSpec",
        "OpDef",
        "OpSchema",
        "TensorSpec",
        "CORE_OPS",
        "core_op",
        "float_attr_exact",
        # ONNX nodes
        "BITCAST_OPSET",
        "make_nodes",
        "check_model",
        "op_types",
        "opset_imports",
        "make_model",
        "IR_VERSION",
        # ONNX Runtime bridge (loaded on first use)
        "install",
        "register_session_options",
        "run",
        "run_with_iobinding",
        "raise_op_errors",
        "take_op_errors",
        # where the ops' kernels run inside sessions
        "OpPlacement",
        "current_placement",
        "placement_for",
        "set_device",
        "set_placement",
        "use_device",
        "use_placement",
        # runtime-owned state
        "KV_CACHES",
        "KVCacheTable",
        "KVLayerBuffers",
        "WeightResolver",
        "DictWeights",
        "get_weight_resolver",
        "set_weight_resolver",
        "use_weights",
        # kernels and encodings the native executor, the rewriter and tests call directly
        "kv_commit_into",
        "kv_attention_from",
        "kv_geometry",
        "parse_kv_geometry",
        "rope_cache",
        "rng_at",
        "E2M1_VALUES",
        "MXFP4_BLOCK",
        "decode_e2m1",
        "decode_e8m0",
        "dequantize_mxfp4",
        "quantize_mxfp4",
        "dequantize_nbits",
        "quantize_nbits",
        # references of com.microsoft behaviour the native executor reproduces
        "gather_block_quantized",
        "round_to_int8_blocks",
    }
    assert set(eo.__all__) == expected
    for name in eo.__all__:
        assert getattr(eo, name) is not None, name
    with pytest.raises(AttributeError):
        eo.no_such_thing  # noqa: B018 - the attribute access is the test
