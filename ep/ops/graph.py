"""Build and check ONNX nodes of this project's ops (no ONNX Runtime needed).

`make_nodes` writes a node with every attribute present (onnxruntime-extensions has no defaults),
the node-name attribute error messages need, and, for float16/bfloat16, the uint16 carriers with
an ONNX BitCast (opset 26) on each side. `check_model` finds what would otherwise surface as an
opaque session-creation failure or a silently rounded attribute.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import onnx
from onnx import AttributeProto, TensorProto, helper

from ep.errors import ModelError, OpError
from ep.ops.core import CORE_OPS, core_op
from ep.ops.schema import (
    CARRIERS,
    DOMAIN,
    NODE_ATTR,
    OpDef,
    Signature,
    float_attr_exact,
)

__all__ = [
    "BITCAST_OPSET",
    "check_model",
    "make_nodes",
    "op_types",
    "opset_imports",
]

BITCAST_OPSET = 26  # ONNX BitCast appeared in opset 26; ONNX Runtime 1.32 runs it
_ONNX_ELEM = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}
_ATTR_PROTO = {
    "int": AttributeProto.INT,
    "float": AttributeProto.FLOAT,
    "string": AttributeProto.STRING,
    "json": AttributeProto.STRING,
}


def opset_imports(onnx_opset: int = BITCAST_OPSET) -> list[onnx.OperatorSetIdProto]:
    """Opset imports for a model using these ops (the default domain at ``onnx_opset``)."""
    return [helper.make_opsetid("", onnx_opset), helper.make_opsetid(DOMAIN, 1)]


# The IR version models are written with: onnx 1.23 defaults to 14, which onnxruntime before
# 1.32 refuses ("max supported IR version: 13"); 10 is what onnxruntime 1.20+ and the
# onnxruntime-genai builder use, and it carries opset 26 (BitCast) fine.
IR_VERSION = 10


def make_model(graph: onnx.GraphProto, onnx_opset: int = BITCAST_OPSET) -> onnx.ModelProto:
    """A model of ``graph`` that imports this project's domain, loadable by onnxruntime >= 1.20."""
    model = helper.make_model(graph, opset_imports=opset_imports(onnx_opset))
    model.ir_version = IR_VERSION
    return model


def _signature(op: OpDef, dtype: str | Mapping[str, str] | None) -> dict[str, str]:
    sigs = op.schema.signatures()
    if dtype is None:
        return sigs[0]
    if isinstance(dtype, str):
        if len(op.schema.type_vars) != 1:
            raise OpError(
                f"{op.name}: dtype={dtype!r} is ambiguous; the op has type variables "
                f"{[v for v, _ in op.schema.type_vars]}: pass a mapping"
            )
        dtype = {op.schema.type_vars[0][0]: dtype}
    wanted = dict(dtype)
    if wanted not in sigs:
        raise OpError(f"{op.name}: no signature {wanted}; it has {list(sigs)}")
    return wanted


def make_nodes(
    op: OpDef | str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    *,
    name: str,
    dtype: str | Mapping[str, str] | None = None,
    **attrs: Any,
) -> list[onnx.NodeProto]:
    """The ONNX node(s) for one op call: the op node, plus BitCast nodes for float16/bfloat16.

    ``op``: an `OpDef` or the name of a built-in op. ``dtype``: the type variable's dtype (default
    float32). Missing attributes take the schema's defaults; a float attribute that would not
    reach the op exactly (6 significant digits) is refused.
    """
    opdef = core_op(op) if isinstance(op, str) else op
    schema = opdef.schema
    where = f"node {name!r} ({schema.qualified_name})"
    if not name:
        raise OpError(f"{schema.qualified_name}: every node needs a name (errors name it)")
    if len(inputs) != len(schema.inputs) or len(outputs) != len(schema.outputs):
        raise OpError(
            f"{where}: {len(inputs)} inputs / {len(outputs)} outputs given; the op takes "
            f"{[t.name for t in schema.inputs]} and gives {[t.name for t in schema.outputs]}"
        )
    if any(not n for n in (*inputs, *outputs)):
        raise OpError(f"{where}: empty tensor names (no optional inputs or unused outputs)")
    sig = _signature(opdef, dtype)
    values = schema.resolve_attrs(attrs, where=where)
    for spec in schema.attributes:
        if spec.type == "float" and not float_attr_exact(values[spec.name]):
            raise OpError(_inexact(where, spec.name, values[spec.name]))
    encoded = {spec.name: spec.encode(values[spec.name]) for spec in schema.attributes}
    before: list[onnx.NodeProto] = []
    after: list[onnx.NodeProto] = []
    node_in = list(inputs)
    node_out = list(outputs)
    for i, tensor in enumerate(schema.inputs):
        dt = schema.resolve(tensor, sig)
        if dt in CARRIERS:
            carried = f"{name}/{tensor.name}_u16"
            before.append(
                helper.make_node(
                    "BitCast",
                    [inputs[i]],
                    [carried],
                    name=f"{name}/bitcast_{tensor.name}",
                    to=TensorProto.UINT16,
                )
            )
            node_in[i] = carried
    for i, tensor in enumerate(schema.outputs):
        dt = schema.resolve(tensor, sig)
        if dt in CARRIERS:
            carried = f"{name}/{tensor.name}_u16"
            after.append(
                helper.make_node(
                    "BitCast",
                    [carried],
                    [outputs[i]],
                    name=f"{name}/bitcast_{tensor.name}",
                    to=_ONNX_ELEM[dt],
                )
            )
            node_out[i] = carried
    node = helper.make_node(
        schema.op_type(sig),
        node_in,
        node_out,
        name=name,
        domain=DOMAIN,
        **encoded,
        **{NODE_ATTR: name},
    )
    return [*before, node, *after]


def _inexact(where: str, attr: str, value: float) -> str:
    return (
        f"{where}: float attribute {attr}={value!r} would reach the op as "
        f"{float(f'{float(value):.6g}')!r}: onnxruntime-extensions passes float attributes with 6 "
        "significant digits. Use a value with at most 6 significant digits (for a softmax scale, "
        "0 means 1/sqrt(head_dim), computed exactly)"
    )


def op_types(ops: Iterable[OpDef] = CORE_OPS) -> dict[str, tuple[OpDef, dict[str, str]]]:
    """ONNX op type -> (op, signature) for every signature of ``ops``."""
    out: dict[str, tuple[OpDef, dict[str, str]]] = {}
    for op in ops:
        for sig in op.schema.signatures():
            out[op.schema.op_type(sig)] = (op, sig)
    return out


def check_model(model: onnx.ModelProto, ops: Iterable[OpDef] = CORE_OPS) -> None:
    """Check every node in this project's domain against ``ops``' schemas; a ModelError lists
    each problem with its node (unknown op, arity, missing/mistyped/unknown attributes, inexact
    floats, bad JSON, missing opset imports)."""
    known = op_types(ops)
    problems: list[str] = []
    opsets = {o.domain: o.version for o in model.opset_import}
    ours = [n for n in model.graph.node if n.domain == DOMAIN]
    if ours and DOMAIN not in opsets:
        problems.append(f"the model does not import the {DOMAIN!r} opset; add it (version 1)")
    bitcasts = [
        n for n in model.graph.node if n.op_type == "BitCast" and n.domain in ("", "ai.onnx")
    ]
    if bitcasts and opsets.get("", opsets.get("ai.onnx", 0)) < BITCAST_OPSET:
        problems.append(
            f"BitCast nodes (float16/bfloat16 carriers) need the default opset >= {BITCAST_OPSET}"
        )
    for node in ours:
        problems.extend(_check_node(node, known))
    if problems:
        shown = "\n  ".join(problems[:20])
        more = f"\n  ... and {len(problems) - 20} more" if len(problems) > 20 else ""
        raise ModelError(
            f"{len(problems)} problem(s) with {DOMAIN} nodes:\n  {shown}{more}\n"
            "Build nodes with ep.ops.make_nodes, which writes them correctly"
        )


def _check_node(node: onnx.NodeProto, known: Mapping[str, tuple[OpDef, Signature]]) -> list[str]:
    where = f"node {node.name or '(unnamed)'!r} ({node.op_type})"
    if node.op_type not in known:
        close = difflib.get_close_matches(node.op_type, list(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return [f"{where}: {DOMAIN} has no op {node.op_type!r}{hint}"]
    op, _ = known[node.op_type]
    schema = op.schema
    out: list[str] = []
    if len(node.input) != len(schema.inputs) or any(not n for n in node.input):
        out.append(
            f"{where}: inputs {list(node.input)}; expected exactly "
            f"{[t.name for t in schema.inputs]} (no optional or empty inputs)"
        )
    if len(node.output) != len(schema.outputs) or any(not n for n in node.output):
        out.append(
            f"{where}: outputs {list(node.output)}; expected exactly "
            f"{[t.name for t in schema.outputs]} (every output connected)"
        )
    attrs = {a.name: a for a in node.attribute}
    if NODE_ATTR not in attrs or attrs[NODE_ATTR].type != AttributeProto.STRING:
        out.append(f"{where}: missing the string attribute {NODE_ATTR!r} (the node's name)")
    for spec in schema.attributes:
        attr = attrs.get(spec.name)
        if attr is None:
            out.append(f"{where}: attribute {spec.name!r} ({spec.type}) is missing")
            continue
        if attr.type != _ATTR_PROTO[spec.type]:
            out.append(f"{where}: attribute {spec.name!r} must be {spec.type}")
            continue
        value = helper.get_attribute_value(attr)
        if spec.type == "float" and not float_attr_exact(value):
            out.append(_inexact(where, spec.name, value))
        if spec.type == "json":
            try:
                spec.coerce(value.decode(), where=where)
            except OpError as exc:
                out.append(str(exc))
    extra = sorted(set(attrs) - {NODE_ATTR, *(a.name for a in schema.attributes)})
    if extra:
        out.append(f"{where}: unknown attribute(s) {extra} (ignored by the op: a typo?)")
    return out
