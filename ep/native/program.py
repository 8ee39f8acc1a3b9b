"""An ep graph as the native executor reads it: nodes in order, initializers, constants.

BitCast nodes (the fp16/bf16 carriers around this project's ops) are aliases here: the executor
hands every op its real float dtype. Op names lose their dtype suffix (``MatMul_bf16`` is
``MatMul``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from ep.errors import ModelError
from ep.ops import DOMAIN

__all__ = ["SUPPORTED_OPS", "Node", "Program", "load_program"]

SUPPORTED_OPS = frozenset(
    {
        "Gather", "Add", "Cast", "Split", "Reshape", "BitCast", "Identity",
        "RMSNorm", "SkipRMSNorm", "MatMul", "MatMulNBits", "MatMulNBitsZP",
        "Rotary", "RotaryTheta", "KVCommit", "KVAttention", "KVCommitPaged", "KVAttentionPaged",
        "SwiGLU", "SwiGLUPacked",
    }
)  # fmt: skip
_SUFFIXES = ("_f32", "_f16", "_bf16")


@dataclass(frozen=True)
class Node:
    op: str
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Program:
    """The graph: ``nodes`` in execution order; ``arrays`` holds initializers and constants."""

    path: Path
    nodes: list[Node]
    arrays: dict[str, np.ndarray]
    inputs: tuple[str, ...]
    output: str


def _array(tensor: onnx.TensorProto) -> np.ndarray:
    array = numpy_helper.to_array(tensor)
    if tensor.data_type == onnx.TensorProto.BFLOAT16 and array.dtype != np.dtype("bfloat16"):
        import ml_dtypes

        array = array.view(ml_dtypes.bfloat16) if array.dtype.itemsize == 2 else array
    return np.asarray(array)


def _attr(a: onnx.AttributeProto) -> Any:
    value = onnx.helper.get_attribute_value(a)
    if isinstance(value, bytes):
        return value.decode()
    if isinstance(value, onnx.TensorProto):
        return _array(value)
    return value


def load_program(path: str | Path) -> Program:
    """Read the ep graph at ``path`` (external data from beside it)."""
    path = Path(path)
    model = onnx.load(str(path))
    g = model.graph
    arrays = {t.name: _array(t) for t in g.initializer}
    nodes: list[Node] = []
    bad: list[str] = []
    for n in g.node:
        op = n.op_type
        if n.domain == DOMAIN:
            for suffix in _SUFFIXES:
                if op.endswith(suffix):
                    op = op[: -len(suffix)]
        attrs = {a.name: _attr(a) for a in n.attribute}
        if op == "Constant":
            arrays[n.output[0]] = attrs["value"]
            continue
        if op == "Transpose" and n.input[0] in arrays:
            # Folded once at load time (e.g. a tied head reading the embedding transposed).
            perm = attrs.get("perm")
            arrays[n.output[0]] = np.ascontiguousarray(
                np.transpose(arrays[n.input[0]], None if perm is None else tuple(perm))
            )
            continue
        if op not in SUPPORTED_OPS:
            bad.append(f"{n.op_type} ({n.name})")
            continue
        nodes.append(Node(op, n.name, tuple(n.input), tuple(n.output), attrs))
    if bad:
        raise ModelError(
            f"{path}: the native executor has no implementation for {', '.join(sorted(set(bad)))}"
            f"; it runs: {', '.join(sorted(SUPPORTED_OPS))}. Run this model with --backend ort"
        )
    return Program(
        path=path,
        nodes=nodes,
        arrays=arrays,
        inputs=tuple(i.name for i in g.input),
        output=g.output[0].name,
    )
