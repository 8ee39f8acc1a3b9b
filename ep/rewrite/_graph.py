"""A mutable view of an ONNX graph for the rewriter: who produces and reads each tensor, constants.

Patterns match on the original nodes, mark what they replace and add new nodes; `finish` then
drops dead nodes (everything a replaced node fed that nothing reads any more), orders the nodes
topologically and drops initializers nobody needs (named weights are kept: the runtime resolves
them by name).
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ep.errors import ModelError
from ep.ops import make_nodes

__all__ = ["ELEM_DTYPES", "Graph"]

#: ONNX element type -> the ops' dtype name (the float types the ops take)
ELEM_DTYPES: dict[int, str] = {
    TensorProto.FLOAT: "float32",
    TensorProto.FLOAT16: "float16",
    TensorProto.BFLOAT16: "bfloat16",
}

# Constants read for matching (shapes, axes, scales) are small; never read a weight for it.
_CONST_LIMIT = 4096


class Graph:
    """Nodes, their producers/consumers, initializers and constants of one ONNX graph."""

    def __init__(self, model: onnx.ModelProto, base_dir: Path | None) -> None:
        self.model = model
        self.graph = model.graph
        self.base_dir = base_dir
        self.nodes: list[onnx.NodeProto] = list(self.graph.node)
        self.initializers = {t.name: t for t in self.graph.initializer}
        self.inputs = {v.name: v for v in self.graph.input if v.name not in self.initializers}
        self.outputs = {v.name: v for v in self.graph.output}
        self.value_info = {v.name: v for v in self.graph.value_info}
        self.removed: set[int] = set()  # ids of nodes a pattern replaced
        self.added: list[onnx.NodeProto] = []
        self.named_weights: set[str] = set()
        self._names = {n for node in self.nodes for n in (*node.input, *node.output, node.name)}
        self._names |= set(self.initializers) | set(self.inputs) | set(self.outputs)
        self._const_cache: dict[str, np.ndarray | None] = {}
        self.reindex()

    # --- indexes -------------------------------------------------------------------------------

    def reindex(self) -> None:
        live = [n for n in self.nodes if id(n) not in self.removed] + self.added
        self.producer: dict[str, onnx.NodeProto] = {}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in live:
            for out in node.output:
                if out:
                    self.producer[out] = node
            for inp in node.input:
                if inp:
                    self.consumers.setdefault(inp, []).append(node)

    def live(self, node: onnx.NodeProto) -> bool:
        return id(node) not in self.removed

    def readers(self, name: str) -> list[onnx.NodeProto]:
        """Live nodes that read ``name``."""
        return [n for n in self.consumers.get(name, []) if self.live(n)]

    def used(self, name: str) -> bool:
        """Whether a live node or the graph outputs read ``name``."""
        return bool(self.readers(name)) or name in self.outputs

    def fresh(self, name: str) -> str:
        candidate, i = name, 1
        while candidate in self._names:
            candidate = f"{name}_{i}"
            i += 1
        self._names.add(candidate)
        return candidate

    # --- constants -----------------------------------------------------------------------------

    def const(self, name: str) -> np.ndarray | None:
        """The value of a small initializer or Constant-node output; None when not constant."""
        if name in self._const_cache:
            return self._const_cache[name]
        value: np.ndarray | None = None
        init = self.initializers.get(name)
        if init is not None:
            if int(np.prod(init.dims)) <= _CONST_LIMIT:
                value = self.array(name)
        else:
            node = self.producer.get(name)
            if node is not None and node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                for attr in node.attribute:
                    if attr.name == "value":
                        value = numpy_helper.to_array(attr.t)
                    elif attr.name in ("value_float", "value_int", "value_floats", "value_ints"):
                        value = np.array(helper.get_attribute_value(attr))
        self._const_cache[name] = value
        return value

    def const_ints(self, name: str) -> list[int] | None:
        value = self.const(name)
        if value is None or value.dtype.kind not in "iu":
            return None
        return [int(v) for v in value.reshape(-1)]

    def const_float(self, name: str) -> float | None:
        value = self.const(name)
        if value is None or value.size != 1 or value.dtype.kind not in "fiu":
            return None
        return float(value.reshape(-1)[0])

    def array(self, name: str) -> np.ndarray:
        """An initializer's value (its external data read from the model's folder)."""
        init = self.initializers[name]
        try:
            return numpy_helper.to_array(init, str(self.base_dir) if self.base_dir else "")
        except Exception as exc:  # onnx raises OSError, ValueError, ... for unreadable data
            raise ModelError(
                f"cannot read initializer {name!r} ({type(exc).__name__}: {exc}); keep the "
                "model's external data file beside it"
            ) from None

    def elem_type(self, name: str) -> int | None:
        """The ONNX element type of a graph input, initializer or annotated value."""
        if name in self.initializers:
            return int(self.initializers[name].data_type)
        for table in (self.inputs, self.outputs, self.value_info):
            if name in table:
                return int(table[name].type.tensor_type.elem_type)
        return None

    def rank(self, name: str) -> int | None:
        if name in self.initializers:
            return len(self.initializers[name].dims)
        for table in (self.inputs, self.outputs, self.value_info):
            if name in table:
                tt = table[name].type.tensor_type
                return len(tt.shape.dim) if tt.HasField("shape") else None
        return None

    # --- edits ---------------------------------------------------------------------------------

    def remove(self, nodes: Iterable[onnx.NodeProto]) -> None:
        for node in nodes:
            self.removed.add(id(node))

    def add(self, nodes: Sequence[onnx.NodeProto]) -> None:
        for node in nodes:
            self._names |= {*node.output, node.name}
        self.added.extend(nodes)

    def op(
        self,
        op: str,
        inputs: Sequence[str],
        outputs: Sequence[str] | None = None,
        *,
        name: str,
        dtype: str | None = None,
        keep_name: bool = False,
        **attrs: Any,
    ) -> list[str]:
        """Add an ai.genai_ep op (with its BitCast carriers); returns its output names.

        ``keep_name``: use ``name`` as is (the node it replaces is removed).
        """
        from ep.ops import core_op

        schema = core_op(op).schema
        node_name = name if keep_name and name else self.fresh(name or op)
        if outputs is None:
            outputs = [self.fresh(f"{node_name}/{t.name}") for t in schema.outputs]
        self.add(make_nodes(op, inputs, outputs, name=node_name, dtype=dtype, **attrs))
        return list(outputs)

    def onnx_op(
        self,
        op_type: str,
        inputs: Sequence[str],
        outputs: Sequence[str] | None = None,
        *,
        name: str,
        n_outputs: int = 1,
        **attrs: Any,
    ) -> list[str]:
        """Add a default-domain ONNX node; returns its output names."""
        node_name = self.fresh(name)
        if outputs is None:
            outputs = [self.fresh(f"{node_name}/output_{i}") for i in range(n_outputs)]
        self.add([helper.make_node(op_type, list(inputs), list(outputs), name=node_name, **attrs)])
        return list(outputs)

    def const_i64(self, values: Sequence[int], name: str) -> str:
        """A new small int64 initializer (stored inline)."""
        tensor = numpy_helper.from_array(np.array(values, dtype=np.int64), self.fresh(name))
        self.graph.initializer.append(tensor)
        self.initializers[tensor.name] = tensor
        return tensor.name

    def add_initializer(self, name: str, array: np.ndarray) -> str:
        tensor = numpy_helper.from_array(array, self.fresh(name))
        self.graph.initializer.append(tensor)
        self.initializers[tensor.name] = tensor
        return tensor.name

    # --- finishing -----------------------------------------------------------------------------

    def finish(self) -> None:
        """Drop dead nodes and unneeded initializers; write the nodes back in topological order."""
        nodes = [n for n in self.nodes if self.live(n)] + self.added
        needed = set(self.outputs)
        alive: list[onnx.NodeProto] = []
        # Walk backwards from the outputs: a node lives when something alive reads an output.
        order = _toposort(nodes)
        for node in reversed(order):
            if any(out in needed for out in node.output if out):
                alive.append(node)
                needed.update(i for i in node.input if i)
        alive.reverse()
        del self.graph.node[:]
        self.graph.node.extend(alive)
        keep = needed | self.named_weights
        kept = [t for t in self.graph.initializer if t.name in keep]
        del self.graph.initializer[:]
        self.graph.initializer.extend(kept)
        # extend() copies the messages: from here on, edit the graph's own.
        self.initializers = {t.name: t for t in self.graph.initializer}
        self.nodes = list(self.graph.node)
        self.removed = set()
        self.added = []
        self.reindex()

    def set_inputs(self, inputs: Sequence[onnx.ValueInfoProto]) -> None:
        del self.graph.input[:]
        self.graph.input.extend(inputs)
        self.inputs = {v.name: v for v in inputs}

    def set_outputs(self, outputs: Sequence[onnx.ValueInfoProto]) -> None:
        del self.graph.output[:]
        self.graph.output.extend(outputs)
        self.outputs = {v.name: v for v in outputs}

    def op_counts(self) -> Counter[tuple[str, str]]:
        return Counter((n.domain or "ai.onnx", n.op_type) for n in self.graph.node)


def _toposort(nodes: list[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """Kahn's order, stable (original order first); a cycle is a ModelError."""
    producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    waiting = [0] * len(nodes)
    readers: dict[int, list[int]] = {}
    for i, node in enumerate(nodes):
        for inp in {x for x in node.input if x}:
            j = producer.get(inp)
            if j is not None:
                waiting[i] += 1
                readers.setdefault(j, []).append(i)
    ready = [i for i, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    order: list[onnx.NodeProto] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(nodes[i])
        for j in readers.get(i, []):
            waiting[j] -= 1
            if waiting[j] == 0:
                heapq.heappush(ready, j)
    if len(order) != len(nodes):
        stuck = [nodes[i].name for i, w in enumerate(waiting) if w][:5]
        raise ModelError(f"the rewritten graph has a cycle through nodes {stuck}")
    return order
