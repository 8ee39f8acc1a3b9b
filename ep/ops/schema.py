"""What an op is: a schema, a NumPy reference, a shape/dtype check, and kernels per device.

An `OpDef` is the unit a plugin registers (``register.add(op.name, op)``). The same definition
serves ONNX Runtime (through `ep.ops.ort_bridge`), the native executor (which calls `OpDef.kernel`
directly) and the tests. Inputs and outputs are typed with concrete dtype names ("int64") or a type
variable ("T") whose allowed dtypes the schema lists; every assignment of the type variables is
one *signature*, and ONNX Runtime gets one definition per signature.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any, Literal, NamedTuple

import ml_dtypes
import numpy as np

from ep.errors import ContractError, OpError

__all__ = [
    "CARRIERS",
    "DOMAIN",
    "DTYPES",
    "NODE_ATTR",
    "ArgInfo",
    "AttrSpec",
    "AttrType",
    "InferFn",
    "Kernel",
    "OpDef",
    "OpSchema",
    "Signature",
    "TensorSpec",
    "check_outputs",
    "dtype_name",
    "float_attr_exact",
    "np_dtype",
    "run_infer",
]

# The one ONNX domain this project owns; every op of every plugin lives in it.
DOMAIN = "ai.genai_ep"

# A string attribute every node of ours carries, holding the node's name: the Python custom-op
# hook does not learn which node it runs, and error messages must name it.
NODE_ATTR = "ep_node"

_NP_DTYPES: dict[str, np.dtype[Any]] = {
    "float32": np.dtype(np.float32),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float64": np.dtype(np.float64),
    "int8": np.dtype(np.int8),
    "uint8": np.dtype(np.uint8),
    "int16": np.dtype(np.int16),
    "uint16": np.dtype(np.uint16),
    "int32": np.dtype(np.int32),
    "uint32": np.dtype(np.uint32),
    "int64": np.dtype(np.int64),
    "uint64": np.dtype(np.uint64),
    "bool": np.dtype(np.bool_),
}
DTYPES: tuple[str, ...] = tuple(_NP_DTYPES)
_BY_NP = {dt: name for name, dt in _NP_DTYPES.items()}

# Dtypes onnxruntime-extensions cannot pass (they abort the process): they travel as uint16 with
# an ONNX BitCast on each side of the node, and the op sees them as float16 / bfloat16 again.
CARRIERS: Mapping[str, str] = MappingProxyType({"float16": "uint16", "bfloat16": "uint16"})
_SHORT = {
    "float32": "f32",
    "float16": "f16",
    "bfloat16": "bf16",
    "float64": "f64",
    "int8": "i8",
    "uint8": "u8",
    "int16": "i16",
    "uint16": "u16",
    "int32": "i32",
    "uint32": "u32",
    "int64": "i64",
    "uint64": "u64",
    "bool": "b",
}


def np_dtype(name: str) -> np.dtype[Any]:
    """The NumPy dtype for a dtype name (bfloat16 through ml_dtypes)."""
    try:
        return _NP_DTYPES[name]
    except KeyError:
        raise ContractError(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


def dtype_name(dtype: Any) -> str:
    """The dtype name of a NumPy dtype (or array); ``str(dtype)`` for dtypes we do not carry."""
    dt = np.dtype(getattr(dtype, "dtype", dtype))
    return _BY_NP.get(dt, str(dt))


class ArgInfo(NamedTuple):
    """The shape and dtype name of one tensor, as an infer function sees and returns it."""

    shape: tuple[int, ...]
    dtype: str

    def describe(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


AttrType = Literal["int", "float", "string", "json"]
_ATTR_TYPES: tuple[str, ...] = ("int", "float", "string", "json")
_NO_DEFAULT = object()


@dataclass(frozen=True)
class TensorSpec:
    """One input or output: its name and type (a dtype name or one of the schema's type vars)."""

    name: str
    type: str
    doc: str = ""


@dataclass(frozen=True)
class AttrSpec:
    """One attribute. ``json`` is an ONNX string holding JSON (structure without list attributes).

    ``default`` is what `ep.ops.make_nodes` writes when the caller gives no value; ONNX Runtime
    itself needs every attribute present on the node (onnxruntime-extensions has no defaults).
    Float attributes reach Python custom ops with 6 significant digits (ORT-NOTES.md), so a float
    that does not survive that is refused when a node is built; see `float_attr_exact`.
    """

    name: str
    type: AttrType
    default: Any = _NO_DEFAULT
    doc: str = ""

    @property
    def required(self) -> bool:
        return self.default is _NO_DEFAULT

    def coerce(self, value: Any, *, where: str) -> Any:
        """A Python value checked against the type (json: a JSON string or a JSON-able object)."""
        if self.type == "int":
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise OpError(f"{where}: attribute {self.name}={value!r} must be an int")
            return int(value)
        if self.type == "float":
            if isinstance(value, (bool, np.bool_)) or not isinstance(
                value, (int, float, np.integer, np.floating)
            ):
                raise OpError(f"{where}: attribute {self.name}={value!r} must be a float")
            return float(value)
        if self.type == "string":
            if not isinstance(value, str):
                raise OpError(f"{where}: attribute {self.name}={value!r} must be a string")
            return value
        if isinstance(value, str):
            try:
                return json.loads(value)
            except json.JSONDecodeError as exc:
                raise OpError(
                    f"{where}: attribute {self.name} is not valid JSON ({exc}): {value[:80]!r}"
                ) from None
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise OpError(
                f"{where}: attribute {self.name}={value!r} cannot be written as JSON ({exc})"
            ) from None
        return value

    def parse(self, raw: str, *, where: str) -> Any:
        """The value from the string onnxruntime-extensions hands the hook for this attribute."""
        try:
            if self.type == "int":
                return int(raw)
            if self.type == "float":
                return float(raw)
        except ValueError:
            raise OpError(f"{where}: attribute {self.name}={raw!r} is not a {self.type}") from None
        if self.type == "json":
            return self.coerce(raw, where=where)
        return raw

    def encode(self, value: Any) -> Any:
        """The value as it goes into an ONNX attribute (json: a compact JSON string)."""
        if self.type == "json":
            return value if isinstance(value, str) else json.dumps(value, separators=(",", ":"))
        return value


def float_attr_exact(value: float) -> bool:
    """Whether a float attribute reaches a Python custom op unchanged.

    ONNX stores float32; onnxruntime-extensions prints it with 6 significant digits before the
    hook parses it back. Values typed by people (1e-5, 0.7, 500000) survive; 1/sqrt(96) does not.
    """
    f32 = np.float32(value)
    if not math.isfinite(float(f32)):
        return False
    return bool(np.float32(float(f"{float(f32):.6g}")) == f32)


Signature = Mapping[str, str]  # type variable -> dtype name
InferFn = Callable[[Sequence[ArgInfo], Mapping[str, Any]], Sequence[ArgInfo]]
Kernel = Callable[..., Any]


@dataclass(frozen=True)
class OpSchema:
    """Name, typed inputs/outputs, attributes and type variables of one op in `DOMAIN`.

    No optional or variadic inputs: onnxruntime-extensions cannot express them, so a second arity
    is a second op (for example ``SwiGLU`` and ``SwiGLUPacked``).
    """

    name: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    attributes: tuple[AttrSpec, ...] = ()
    # (type variable, allowed dtypes); each variable's first dtype makes the default signature
    type_vars: tuple[tuple[str, tuple[str, ...]], ...] = ()
    doc: str = ""
    domain: str = DOMAIN

    def __post_init__(self) -> None:
        where = f"op schema {self.name!r}"
        if not self.name.isidentifier():
            raise ContractError(f"{where}: the name must be a Python identifier")
        if self.domain != DOMAIN:
            raise ContractError(f"{where}: domain {self.domain!r}; every op lives in {DOMAIN!r}")
        if not self.outputs:
            raise ContractError(f"{where}: an op needs at least one output")
        vars_ = dict(self.type_vars)
        if len(vars_) != len(self.type_vars):
            raise ContractError(f"{where}: a type variable is declared twice")
        for var, allowed in self.type_vars:
            if not allowed:
                raise ContractError(f"{where}: type variable {var!r} allows no dtype")
            for dt in allowed:
                np_dtype(dt)
        names = [t.name for t in (*self.inputs, *self.outputs)]
        if len(set(names)) != len(names):
            raise ContractError(f"{where}: input/output names repeat: {names}")
        for t in (*self.inputs, *self.outputs):
            if t.type not in vars_ and t.type not in DTYPES:
                raise ContractError(
                    f"{where}: {t.name!r} has type {t.type!r}, which is neither a dtype nor a "
                    f"declared type variable ({', '.join(vars_) or 'none declared'})"
                )
        attr_names = [a.name for a in self.attributes]
        if len(set(attr_names)) != len(attr_names) or NODE_ATTR in attr_names:
            raise ContractError(
                f"{where}: attribute names repeat or use the reserved {NODE_ATTR!r}: {attr_names}"
            )
        for a in self.attributes:
            if a.type not in _ATTR_TYPES:
                raise ContractError(
                    f"{where}: attribute {a.name!r} has type {a.type!r}; allowed: "
                    f"{', '.join(_ATTR_TYPES)} (no list attributes: use json)"
                )
            if not a.required:
                a.coerce(a.default, where=f"{where}: default of {a.name!r}")
                if a.type == "float" and not float_attr_exact(a.default):
                    raise ContractError(
                        f"{where}: default {a.name}={a.default!r} does not survive the 6 "
                        "significant digits a float attribute is passed with"
                    )

    @property
    def qualified_name(self) -> str:
        return f"{self.domain}::{self.name}"

    def signatures(self) -> tuple[dict[str, str], ...]:
        """Every assignment of the type variables; the first uses each variable's first dtype."""
        if not self.type_vars:
            return ({},)
        names = [v for v, _ in self.type_vars]
        combos = itertools.product(*(allowed for _, allowed in self.type_vars))
        return tuple(dict(zip(names, combo, strict=True)) for combo in combos)

    def op_type(self, signature: Signature) -> str:
        """The ONNX op type of one signature: the bare name for the first (default) signature,
        ``Name_f16``-style suffixes for the others (ONNX Runtime needs one type per kernel)."""
        sigs = self.signatures()
        if not sigs[0] or dict(signature) == sigs[0]:
            return self.name
        return "_".join([self.name, *(_SHORT[signature[v]] for v, _ in self.type_vars)])

    def resolve(self, spec: TensorSpec, signature: Signature) -> str:
        """The dtype name of ``spec`` under ``signature``."""
        return signature.get(spec.type, spec.type)

    def attribute(self, name: str) -> AttrSpec | None:
        return next((a for a in self.attributes if a.name == name), None)

    def resolve_attrs(self, given: Mapping[str, Any], *, where: str) -> dict[str, Any]:
        """``given`` checked and completed with defaults; unknown or missing names are errors."""
        unknown = sorted(set(given) - {a.name for a in self.attributes})
        if unknown:
            known = ", ".join(a.name for a in self.attributes) or "none"
            raise OpError(f"{where}: unknown attribute(s) {unknown}; {self.name} takes: {known}")
        out: dict[str, Any] = {}
        for a in self.attributes:
            if a.name in given:
                out[a.name] = a.coerce(given[a.name], where=where)
            elif a.required:
                raise OpError(f"{where}: attribute {a.name!r} ({a.type}) is required")
            else:
                out[a.name] = a.coerce(a.default, where=where)
        return out


@dataclass(frozen=True, eq=False)  # identity semantics: "the same op" means the same object
class OpDef:
    """An op: schema, NumPy reference, shape/dtype inference, and kernels keyed by device.

    ``reference(*inputs, **attrs)`` takes the schema's inputs as arrays (float16/bfloat16 as real
    float16 / ml_dtypes.bfloat16 arrays) and returns one array or a tuple in output order.
    ``infer(inputs, attrs)`` gets each input's `ArgInfo` and returns each output's; it raises
    `OpError` for inputs that do not fit together, and must depend on shapes, dtypes and
    attributes only (ONNX Runtime calls cache its answer). ``kernels``: device name -> callable
    with the reference's signature; "cpu" falls back to the reference. Add device kernels with
    `with_kernel` (the definition stays frozen).
    """

    schema: OpSchema
    reference: Kernel
    infer: InferFn
    kernels: Mapping[str, Kernel] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernels", MappingProxyType(dict(self.kernels)))
        if not callable(self.reference) or not callable(self.infer):
            raise ContractError(f"op {self.schema.name!r}: reference and infer must be callable")

    @property
    def name(self) -> str:
        return self.schema.name

    def kernel(self, device: str = "cpu") -> Kernel:
        """The kernel for ``device`` ("cpu" defaults to the NumPy reference)."""
        found = self.kernels.get(device)
        if found is not None:
            return found
        if device == "cpu":
            return self.reference
        have = ", ".join(sorted({"cpu", *self.kernels}))
        raise OpError(f"op {self.name} has no {device!r} kernel; it has: {have}")

    def with_kernel(self, device: str, kernel: Kernel) -> OpDef:
        """A copy of this definition with ``kernel`` for ``device`` added (or replaced)."""
        if not callable(kernel):
            raise ContractError(f"op {self.name}: the {device!r} kernel is not callable")
        return replace(self, kernels={**self.kernels, device: kernel})

    def __call__(self, *inputs: Any, device: str = "cpu", **attrs: Any) -> Any:
        """Run the op on arrays with full checks: arity, dtypes, `infer`, output shape/dtype.

        This is the checked entry point for tests and the native executor's validation mode;
        returns one array or a tuple, as the schema has one output or several.
        """
        where = f"op {self.schema.qualified_name}"
        if len(inputs) != len(self.schema.inputs):
            want = ", ".join(t.name for t in self.schema.inputs)
            raise OpError(
                f"{where}: got {len(inputs)} inputs; expected {len(self.schema.inputs)} ({want})"
            )
        arrays = [np.asarray(x) for x in inputs]
        infos = [ArgInfo(tuple(a.shape), dtype_name(a.dtype)) for a in arrays]
        self.check_input_dtypes(infos, where=where)
        values = self.schema.resolve_attrs(attrs, where=where)
        author = f"op {self.name!r}"
        expected = run_infer(self, infos, values, node="", author=author)
        result = self.kernel(device)(*arrays, **values)
        outs = check_outputs(self, result, expected, node="", author=author)
        return outs[0] if len(outs) == 1 else outs

    def check_input_dtypes(self, infos: Sequence[ArgInfo], *, where: str) -> dict[str, str]:
        """The signature the inputs select; an OpError if no signature fits."""
        for sig in self.schema.signatures():
            if all(
                self.schema.resolve(spec, sig) == info.dtype
                for spec, info in zip(self.schema.inputs, infos, strict=True)
            ):
                return sig
        got = ", ".join(
            f"{s.name}: {i.dtype}" for s, i in zip(self.schema.inputs, infos, strict=True)
        )
        allowed = "; ".join(
            ", ".join(f"{s.name}: {self.schema.resolve(s, sig)}" for s in self.schema.inputs)
            for sig in self.schema.signatures()
        )
        raise OpError(f"{where}: input dtypes ({got}) match no signature; allowed: {allowed}")


def run_infer(
    op: OpDef, infos: Sequence[ArgInfo], attrs: Mapping[str, Any], *, node: str, author: str
) -> tuple[ArgInfo, ...]:
    """``op.infer`` with its answer checked: one (shape, dtype) per declared output.

    An OpError from infer (inputs that do not fit) passes through; a malformed answer is an
    OpError addressed to ``author``.
    """
    raw = op.infer(infos, attrs)
    at = f" (node {node!r})" if node else ""
    try:
        out = tuple(ArgInfo(tuple(int(d) for d in s), str(t)) for s, t in raw)
    except (TypeError, ValueError):
        raise OpError(
            f"op {op.schema.qualified_name}{at} from {author}: its infer function returned "
            f"{raw!r}; expected one (shape, dtype name) pair per output. Fix the infer function."
        ) from None
    if len(out) != len(op.schema.outputs) or any(
        min(i.shape, default=0) < 0 or i.dtype not in _NP_DTYPES for i in out
    ):
        raise OpError(
            f"op {op.schema.qualified_name}{at} from {author}: its infer function returned "
            f"{[i.describe() for i in out]}; expected {len(op.schema.outputs)} output(s) with "
            "non-negative dims and known dtypes. Fix the infer function."
        )
    return out


def check_outputs(
    op: OpDef, result: Any, expected: Sequence[ArgInfo], *, node: str, author: str
) -> tuple[np.ndarray, ...]:
    """``result`` as a tuple of C-contiguous arrays, checked against ``expected``.

    A wrong count, type, dtype or shape is an `OpError` addressed to ``author`` (the plugin that
    registered the op), naming the op, the node, what was expected and what came back.
    """
    outs = result if isinstance(result, tuple) else (result,)
    names = [t.name for t in op.schema.outputs]
    at = f" (node {node!r})" if node else ""
    head = f"op {op.schema.qualified_name}{at} from {author}"
    fix = "Fix the op's kernel or its infer function."
    if len(outs) != len(names):
        raise OpError(
            f"{head}: returned {len(outs)} output(s); the schema declares {len(names)} "
            f"({', '.join(names)}). {fix}"
        )
    checked = []
    for i, (out, want, name) in enumerate(zip(outs, expected, names, strict=True)):
        if not isinstance(out, np.ndarray):
            raise OpError(
                f"{head}: output {i} {name!r} is a {type(out).__name__}; expected a numpy array "
                f"{want.describe()}. {fix}"
            )
        got = ArgInfo(tuple(out.shape), dtype_name(out.dtype))
        if got != want:
            raise OpError(
                f"{head}: output {i} {name!r} should be {want.describe()} but came back as "
                f"{got.describe()}. {fix}"
            )
        checked.append(out if out.flags.c_contiguous else np.ascontiguousarray(out))
    return tuple(checked)
