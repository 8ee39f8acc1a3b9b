"""A small ONNX graph assembler that streams large initializers to an external data file."""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

import ml_dtypes
import numpy as np
import onnx
from onnx import TensorProto, helper

__all__ = ["ONNX_DTYPES", "GraphBuilder"]

ONNX_DTYPES: dict[str, int] = {
    "fp32": TensorProto.FLOAT,
    "fp16": TensorProto.FLOAT16,
    "bf16": TensorProto.BFLOAT16,
}

_NP_TO_ONNX: dict[np.dtype[Any], int] = {
    np.dtype(np.float32): TensorProto.FLOAT,
    np.dtype(np.float16): TensorProto.FLOAT16,
    np.dtype(ml_dtypes.bfloat16): TensorProto.BFLOAT16,
    np.dtype(np.uint8): TensorProto.UINT8,
    np.dtype(np.int32): TensorProto.INT32,
    np.dtype(np.int64): TensorProto.INT64,
}

# Large tensors start on 64 KiB boundaries so ONNX Runtime can memory-map them; small ones on 64 B.
_BIG_TENSOR = 1 << 20
_BIG_ALIGN = 1 << 16
_SMALL_ALIGN = 64


class GraphBuilder:
    """Collects nodes, graph I/O and initializers; weights go to ``<data_name>`` as they come.

    `initializer` writes the array's bytes to the data file at once and keeps only a reference,
    so building a large model holds one tensor in memory at a time.
    """

    def __init__(self, out_dir: Path, data_name: str = "model.onnx.data") -> None:
        self.out_dir = out_dir
        self.data_name = data_name
        self.nodes: list[onnx.NodeProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[TensorProto] = []
        self._names: set[str] = set()
        self._consts: dict[tuple[Any, ...], str] = {}
        self._data: IO[bytes] | None = None
        self._offset = 0
        self.data_bytes = 0

    # --- lifetime of the data file ---------------------------------------------------------

    def __enter__(self) -> GraphBuilder:
        self._data = open(self.out_dir / self.data_name, "wb")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._data is not None:
            self._data.close()
            self._data = None

    # --- names -----------------------------------------------------------------------------

    def fresh(self, name: str) -> str:
        """`name`, or `name` with a numeric suffix if it is taken."""
        candidate, index = name, 1
        while candidate in self._names:
            candidate = f"{name}_{index}"
            index += 1
        self._names.add(candidate)
        return candidate

    # --- graph pieces ----------------------------------------------------------------------

    def add_input(self, name: str, elem_type: int, shape: list[int | str]) -> str:
        self._names.add(name)
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def add_output(self, name: str, elem_type: int, shape: list[int | str]) -> None:
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def node(
        self,
        op_type: str,
        inputs: list[str],
        *,
        name: str,
        outputs: list[str] | None = None,
        n_outputs: int = 1,
        domain: str = "",
        **attrs: Any,
    ) -> list[str]:
        """Append a node named `name`; outputs default to ``<name>/output_<i>``."""
        node_name = self.fresh(name)
        if outputs is None:
            outputs = [self.fresh(f"{node_name}/output_{i}") for i in range(n_outputs)]
        else:
            for out in outputs:
                if out:
                    self._names.add(out)
        self.nodes.append(
            helper.make_node(op_type, inputs, outputs, name=node_name, domain=domain, **attrs)
        )
        return outputs

    def op(self, op_type: str, inputs: list[str], *, name: str, **attrs: Any) -> str:
        """A single-output node; returns its output name."""
        return self.node(op_type, inputs, name=name, **attrs)[0]

    def const_i64(self, values: list[int] | int) -> str:
        """An int64 Constant (a scalar for an int, 1-D for a list), shared by value."""
        key = ("i64", values if isinstance(values, int) else tuple(values))
        if key not in self._consts:
            label = str(values)  # "[512, 64]", as the genai builder names them
            array = np.array(values, dtype=np.int64)
            out = self.fresh(f"/model/constants/INT64/{label}")
            tensor = onnx.numpy_helper.from_array(array, out)
            self.nodes.append(
                helper.make_node(
                    "Constant",
                    [],
                    [out],
                    name=self.fresh(f"/model/constant_nodes/INT64/{label}"),
                    value=tensor,
                )
            )
            self._consts[key] = out
        return self._consts[key]

    def const_f32(self, value: float) -> str:
        """A float32 scalar Constant, shared by value."""
        key = ("f32", float(value))
        if key not in self._consts:
            out = self.fresh(f"/model/constants/FLOAT/{value!r}")
            tensor = onnx.numpy_helper.from_array(np.array(value, dtype=np.float32), out)
            self.nodes.append(
                helper.make_node(
                    "Constant",
                    [],
                    [out],
                    name=self.fresh(f"/model/constant_nodes/{out}"),
                    value=tensor,
                )
            )
            self._consts[key] = out
        return self._consts[key]

    def initializer(self, name: str, array: np.ndarray) -> str:
        """Write `array` to the external data file and declare it as initializer `name`."""
        if self._data is None:
            raise RuntimeError("GraphBuilder.initializer called outside its `with` block")
        array = np.ascontiguousarray(array)
        elem_type = _NP_TO_ONNX[array.dtype]
        raw = array.reshape(-1).view(np.uint8)  # the bytes, without a copy (bf16 included)
        align = _BIG_ALIGN if raw.nbytes >= _BIG_TENSOR else _SMALL_ALIGN
        pad = -self._offset % align
        if pad:
            self._data.write(b"\0" * pad)
            self._offset += pad
        self._data.write(raw.data)
        tensor = TensorProto()
        tensor.name = name
        tensor.data_type = elem_type
        tensor.dims.extend(array.shape)
        tensor.data_location = TensorProto.EXTERNAL
        for key, value in (
            ("location", self.data_name),
            ("offset", str(self._offset)),
            ("length", str(raw.nbytes)),
        ):
            entry = tensor.external_data.add()
            entry.key = key
            entry.value = value
        self._offset += raw.nbytes
        self.data_bytes += raw.nbytes
        self._names.add(name)
        self.initializers.append(tensor)
        return name

    def model(self, graph_name: str, opsets: dict[str, int], producer: str) -> onnx.ModelProto:
        graph = helper.make_graph(
            self.nodes, graph_name, self.inputs, self.outputs, initializer=self.initializers
        )
        model = helper.make_model(
            graph,
            opset_imports=[
                helper.make_opsetid(domain, version) for domain, version in opsets.items()
            ],
            producer_name=producer,
        )
        model.ir_version = 10  # what onnxruntime 1.20+ and the genai builder use
        return model
