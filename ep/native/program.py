"""An ep graph as the native executor reads it: nodes in order, initializers, constants.

BitCast nodes (the fp16/bf16 carriers around this project's ops) are aliases here: the executor
hands every op its real float dtype. Op names lose their dtype suffix (``MatMul_bf16`` is
``MatMul``). A few com.microsoft ops that the rewrite leaves run under their own name: MatMulNBits
and GatherBlockQuantized (4-bit, the onnxruntime-genai builder's embedding of a tied int4 head).
A com.microsoft MatMulNBits runs as ``MatMulNBits`` (``MatMulNBitsZP`` with zero points); with
``accuracy_level=4`` (int8 activations on ONNX Runtime's CPU, the builder's int4 default) an
``Int8Activations`` node is put before it (one per input and block size), which rounds the
activations to int8 steps as MLAS does, so the tokens are onnxruntime-genai's.

Weights are prepacked once here (``prepack=True``, the CUDA device's choice): a MatMul weight
stored [K, N] (``transpose_b=0``, the ONNX orientation) that only such MatMuls read is
transposed to [N, K] and its nodes get ``transpose_b=1``, because the decode GEMV reads [N, K]
rows 2 to 3 times faster on the H200 (`ep.kernels.matmul`, docs/benchmarks/h200.md). The model
file is not changed. The CPU device keeps the file's layout: its
NumPy twins round a transposed product differently from ONNX Runtime's reference kernels, and the
CPU gate is bitwise parity with them.
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
        "Gather", "GatherBlockQuantized", "Add", "Cast", "Split", "Reshape", "BitCast", "Identity",
        "RMSNorm", "SkipRMSNorm", "MatMul", "MatMulNBits", "MatMulNBitsZP",
        "Rotary", "RotaryTheta", "KVCommit", "KVAttention", "KVCommitPaged", "KVAttentionPaged",
        "SwiGLU", "SwiGLUPacked", "Int8Activations",
    }
)  # fmt: skip
_MS_DOMAIN = "com.microsoft"
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


def load_program(path: str | Path, *, prepack: bool = False) -> Program:
    """Read the ep graph at ``path`` (external data from beside it); ``prepack``: see above."""
    path = Path(path)
    model = onnx.load(str(path))
    g = model.graph
    arrays = {t.name: _array(t) for t in g.initializer}
    nodes: list[Node] = []
    bad: list[str] = []
    int8_inputs: dict[tuple[str, int], str] = {}  # (input, block) -> its int8-rounded value
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
        if op not in SUPPORTED_OPS or op == "Int8Activations":
            bad.append(f"{n.op_type} ({n.name})")
            continue
        if op == "MatMulNBits" and n.domain == _MS_DOMAIN:
            nodes += _ms_matmul_nbits(path, n, attrs, arrays, int8_inputs)
            continue
        nodes.append(Node(op, n.name, tuple(n.input), tuple(n.output), attrs))
    if bad:
        raise ModelError(
            f"{path}: the native executor has no implementation for {', '.join(sorted(set(bad)))}"
            f"; it runs: {', '.join(sorted(SUPPORTED_OPS))}. Run this model with --backend ort"
        )
    if prepack:
        nodes = _prepack(nodes, arrays)
    return Program(
        path=path,
        nodes=nodes,
        arrays=arrays,
        inputs=tuple(i.name for i in g.input),
        output=g.output[0].name,
    )


def _ms_matmul_nbits(
    path: Path,
    n: onnx.NodeProto,
    attrs: dict[str, Any],
    arrays: dict[str, np.ndarray],
    int8_inputs: dict[tuple[str, int], str],
) -> list[Node]:
    """A com.microsoft MatMulNBits as the executor runs it (see the module docstring)."""
    inputs = [*n.input, *[""] * (6 - len(n.input))]
    bits, block = int(attrs.get("bits", 4)), int(attrs.get("block_size", 0))
    zp = inputs[3]
    why = ""
    if bits != 4:
        why = f"bits={bits} (4-bit weights only)"
    elif inputs[4] or inputs[5]:
        why = "a g_idx or bias input"
    elif zp and zp in arrays and arrays[zp].dtype != np.uint8:
        why = f"zero points of {arrays[zp].dtype} (packed uint8 only)"
    if why:
        raise ModelError(
            f"{path}: MatMulNBits {n.name} has {why}, which the native executor does not run; "
            "run this model with --backend ort"
        )
    x = inputs[0]
    out: list[Node] = []
    if int(attrs.get("accuracy_level", 0)) == 4:
        found = int8_inputs.get((x, block))
        if found is None:
            found = f"{x}/int8_blocks{block}"
            int8_inputs[(x, block)] = found
            name = f"{n.name}/int8_activations"
            out.append(Node("Int8Activations", name, (x,), (found,), {"block_size": block}))
        x = found
    op, weights = ("MatMulNBitsZP", inputs[1:4]) if zp else ("MatMulNBits", inputs[1:3])
    out.append(Node(op, n.name, (x, *weights), tuple(n.output), attrs))
    return out


def _prepack(nodes: list[Node], arrays: dict[str, np.ndarray]) -> list[Node]:
    """``nodes`` with every [K, N] MatMul weight read as [N, K] (``arrays`` updated in place).

    A weight qualifies when every node that names it is a ``transpose_b=0`` MatMul (a tied
    table that a Gather also reads keeps its layout). BitCast/Identity aliases of the weight are
    followed, as `weight_reads` does.
    """
    readers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        names = list(node.inputs)
        if node.op == "MatMul":
            names.append(str(node.attrs["weight"]))
        for name in names:
            if name in arrays:
                readers.setdefault(name, []).append(i)
    out = list(nodes)
    for name, users in readers.items():
        array = arrays[name]
        if array.ndim != 2 or not all(
            nodes[i].op == "MatMul"
            and str(nodes[i].attrs["weight"]) == name
            and name not in nodes[i].inputs
            and int(nodes[i].attrs.get("transpose_b", 0)) == 0
            for i in users
        ):
            continue
        arrays[name] = np.ascontiguousarray(array.T)
        for i in users:
            out[i] = Node(out[i].op, out[i].name, out[i].inputs, out[i].outputs,
                          {**out[i].attrs, "transpose_b": 1})  # fmt: skip
    return out
