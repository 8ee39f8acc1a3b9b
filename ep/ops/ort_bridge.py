"""Registration of this project's ops into ONNX Runtime, through onnxruntime-extensions, safely.

onnxruntime-extensions' Python custom ops are unsafe by default (ORT-NOTES.md): an exception in an
op aborts the process, float16 aborts, outputs go through ``.tolist()``, ORT checks no output
shape or dtype, and defining an op after a session exists can crash. This module

- defines every registered op once per dtype signature (float16/bfloat16 as uint16 carriers),
  then freezes the set at the first `register_session_options`; a later definition is a
  ContractError, never a call into the extension;
- replaces the extension's invocation hook with one that returns contiguous arrays of the
  declared dtype, checks each output against the op's infer function (an OpError addressed to
  the op's plugin), and never lets an exception reach C++: it stores the error and returns zeros;
- re-raises a stored error as an `OpError` naming the op and the node from `run` /
  `run_with_iobinding`, or from `raise_op_errors` after a plain ``session.run``.

Which kernel a node runs is read per call from `ep.ops.placement`: each op's ``"cpu"`` kernel
(its NumPy reference) by default, its ``"cuda"`` kernel under ``ep.ops.use_device("cuda")``.

Your own session::

    so = onnxruntime.SessionOptions()
    ep.ops.register_session_options(so)   # ep.register(so)
    sess = onnxruntime.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    outputs = ep.ops.run(sess, None, feeds)  # or: sess.run(...); ep.ops.raise_op_errors()

Errors are kept per calling thread (ONNX Runtime's default sequential executor runs every node on
the thread that called ``run``). With ``ExecutionMode.ORT_PARALLEL`` nodes run on pool threads;
`run` notices and collects errors from every thread.
"""

from __future__ import annotations

import contextlib
import threading
import traceback
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort
import onnxruntime_extensions as ortx

from ep.errors import ContractError, OpError
from ep.ops.placement import ACTIVE as _PLACEMENT
from ep.ops.schema import (
    CARRIERS,
    DOMAIN,
    NODE_ATTR,
    ArgInfo,
    AttrSpec,
    Kernel,
    OpDef,
    check_outputs,
    np_dtype,
    run_infer,
)
from ep.registry import Entry, PluginRef, Registry

__all__ = [
    "EXTENSIONS_PIN",
    "defined_op_types",
    "extensions_library_path",
    "freeze",
    "install",
    "is_frozen",
    "raise_op_errors",
    "register_session_options",
    "run",
    "run_with_iobinding",
    "take_op_errors",
]

# The onnxruntime-extensions minor version whose invocation-hook protocol this module speaks:
# hook(obj_id, inputs, attrs: dict[str, str]) -> (obj_id, shape0, array0, shape1, array1, ...),
# with array i memcpy'd into output i (no check that its size matches the shape).
EXTENSIONS_PIN = "0.15."

_MAX_ERRORS_PER_THREAD = 16
_CACHE_LIMIT = 4096


def _extension_api() -> tuple[Any, Any, Any]:
    """``(PyCustomOpDef, add_custom_op, stock hook)``; an OpError if the pinned API moved."""
    version = getattr(ortx, "__version__", "?")
    if not str(version).startswith(EXTENSIONS_PIN):
        raise OpError(
            f"onnxruntime-extensions {version} is installed; genai-ep replaces its semi-private "
            f"invocation hook and is tested with {EXTENSIONS_PIN}*. Install "
            f"'onnxruntime-extensions=={EXTENSIONS_PIN}*' (pyproject.toml pins it)"
        )
    # Semi-private modules, imported here so that a moved API is an OpError that says what to do.
    try:
        from onnxruntime_extensions._extensions_pydll import (
            PyCustomOpDef,
            add_custom_op,
        )
        from onnxruntime_extensions._ocos import _on_pyop_invocation
    except ImportError as exc:
        raise OpError(
            f"onnxruntime-extensions {version} lacks the Python custom-op API genai-ep uses "
            f"({exc}); reinstall 'onnxruntime-extensions=={EXTENSIONS_PIN}*'"
        ) from exc
    if not callable(getattr(PyCustomOpDef, "install_hooker", None)):
        raise OpError(
            f"onnxruntime-extensions {version}: PyCustomOpDef.install_hooker is gone; "
            f"reinstall 'onnxruntime-extensions=={EXTENSIONS_PIN}*'"
        )
    return PyCustomOpDef, add_custom_op, _on_pyop_invocation


def extensions_library_path() -> str:
    """The shared library `register_session_options` hands to ONNX Runtime."""
    return str(ortx.get_library_path())


# --- definitions -----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Definition:
    """One ONNX Runtime kernel: an op at one dtype signature."""

    obj_id: int
    op_type: str
    op: OpDef
    plugin: PluginRef | None
    input_views: tuple[np.dtype[Any] | None, ...]  # view a carried uint16 input as this dtype
    input_dtypes: tuple[str, ...]
    output_carried: tuple[bool, ...]
    output_ort: tuple[np.dtype[Any], ...]  # what ORT receives (uint16 for carried outputs)
    attributes: tuple[AttrSpec, ...]
    kernel: Kernel
    any_view: bool  # some input is a float16/bfloat16 carrier

    @property
    def author(self) -> str:
        return self.plugin.describe() if self.plugin else "an unregistered op definition"

    def parse_attrs(self, raw: Mapping[str, str]) -> tuple[str, dict[str, Any]]:
        where = f"op {self.op.schema.qualified_name}"
        node = str(raw.get(NODE_ATTR, ""))
        if node:
            where += f" (node {node!r})"
        return node, {a.name: a.parse(raw[a.name], where=where) for a in self.attributes}


@dataclass
class _Pending:
    """An error an op raised inside ONNX Runtime, waiting for the caller's ``run`` to raise it."""

    message: str
    cause: BaseException


class _State:
    def __init__(self) -> None:
        self.by_id: dict[int, _Definition] = {}
        self.by_type: dict[str, _Definition] = {}
        self.ops: dict[str, tuple[OpDef, PluginRef | None]] = {}
        self.native: list[Any] = []  # PyCustomOpDef objects: the extension keeps pointers to them
        self.frozen = False
        self.hooked = False
        self.stock_hook: Any = None
        self.registered: weakref.WeakSet[Any] = weakref.WeakSet()
        self.errors: dict[int, list[_Pending]] = {}
        self.dropped: dict[int, int] = {}
        self.attr_cache: dict[tuple[Any, ...], tuple[str, dict[str, Any]]] = {}
        self.infer_cache: dict[tuple[Any, ...], _Expected] = {}
        self.parallel: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()


_STATE = _State()


def _op_entries(ops: Registry | Iterable[Entry] | Iterable[OpDef]) -> list[tuple[OpDef, Any]]:
    out: list[tuple[OpDef, PluginRef | None]] = []
    for item in ops:
        if isinstance(item, Entry):
            if item.seam != "op":
                continue
            if not isinstance(item.factory, OpDef):
                raise ContractError(
                    f"{item.plugin.describe()} registered op {item.name!r} as "
                    f"{type(item.factory).__name__}; ep_register_ops must add an ep.ops.OpDef "
                    "(register.add(op.name, op))"
                )
            if item.factory.name != item.name:
                raise ContractError(
                    f"{item.plugin.describe()} registered op {item.factory.name!r} under the "
                    f"name {item.name!r}; use register.add(op.name, op)"
                )
            out.append((item.factory, item.plugin))
        elif isinstance(item, OpDef):
            out.append((item, None))
        else:
            raise ContractError(f"install() takes a Registry, entries or OpDefs; got {item!r}")
    return out


def install(ops: Registry | Iterable[Entry] | Iterable[OpDef]) -> tuple[str, ...]:
    """Define ``ops`` (a frozen plugin `Registry`, its entries, or bare `OpDef`s) for ORT.

    Idempotent for ops already defined (the same `OpDef` objects). Before the freeze, new ops are
    defined; after it, a new or changed op is a ContractError naming it. Every check runs before
    the first definition, so a refused call defines nothing. Returns the ONNX op types defined.
    """
    pycustomopdef, add_custom_op, stock = _extension_api()
    wanted = _op_entries(ops)
    with _STATE.lock:
        new: dict[str, tuple[OpDef, PluginRef | None]] = {}
        for op, plugin in wanted:
            have = _STATE.ops.get(op.name) or new.get(op.name)
            if have is not None:
                if have[0] is not op:
                    first = have[1].describe() if have[1] else "an earlier install()"
                    by = plugin.describe() if plugin else "this install()"
                    raise ContractError(
                        f"op {DOMAIN}::{op.name} is already defined for ONNX Runtime (by {first}); "
                        f"{by} brings a different definition. One op name, one definition: "
                        "rename the op or disable one plugin"
                    )
                continue
            new[op.name] = (op, plugin)
        if new and _STATE.frozen:
            raise ContractError(
                f"cannot define op(s) {', '.join(new)}: the op set was registered into ONNX "
                "Runtime and frozen (defining ops after a session exists can crash the process). "
                "Register every op in ep_register_ops, before the first session is created"
            )
        plans = [(op, plugin, _plan(op, pycustomopdef)) for op, plugin in new.values()]
        owners: dict[str, str] = {t: d.op.name for t, d in _STATE.by_type.items()}
        for op, _, plan in plans:
            for _, op_type, _, _ in plan:
                if op_type in owners:
                    raise ContractError(
                        f"op type {DOMAIN}::{op_type} of op {op.name!r} clashes with op "
                        f"{owners[op_type]!r}; rename one of them"
                    )
                owners[op_type] = op.name
        defined: list[str] = []
        for op, plugin, plan in plans:
            defined.extend(_define(op, plugin, plan, pycustomopdef, add_custom_op))
        if not _STATE.hooked:
            _STATE.stock_hook = stock
            pycustomopdef.install_hooker(_invoke)
            _STATE.hooked = True
    return tuple(defined)


_Plan = list[tuple[dict[str, str], str, tuple[str, ...], tuple[str, ...]]]


def _plan(op: OpDef, pycustomopdef: Any) -> _Plan:
    """(signature, op type, input dtypes, output dtypes) per signature, every dtype checked."""
    schema = op.schema
    plan: _Plan = []
    for sig in schema.signatures():
        in_dt = tuple(schema.resolve(t, sig) for t in schema.inputs)
        out_dt = tuple(schema.resolve(t, sig) for t in schema.outputs)
        for dt in (*in_dt, *out_dt):
            _elem_code(pycustomopdef, CARRIERS.get(dt, dt))
        plan.append((sig, schema.op_type(sig), in_dt, out_dt))
    return plan


def _define(
    op: OpDef, plugin: PluginRef | None, plan: _Plan, pycustomopdef: Any, add_custom_op: Any
) -> list[str]:
    attr_code = {
        "int": pycustomopdef.dt_int64,
        "float": pycustomopdef.dt_float,
        "string": pycustomopdef.dt_string,
        "json": pycustomopdef.dt_string,
    }
    made = []
    for _, op_type, in_dt, out_dt in plan:
        obj_id = len(_STATE.by_id) + 1
        definition = _Definition(
            obj_id=obj_id,
            op_type=op_type,
            op=op,
            plugin=plugin,
            input_views=tuple(np_dtype(d) if d in CARRIERS else None for d in in_dt),
            input_dtypes=in_dt,
            output_carried=tuple(d in CARRIERS for d in out_dt),
            output_ort=tuple(np_dtype(CARRIERS.get(d, d)) for d in out_dt),
            attributes=op.schema.attributes,
            kernel=op.kernel("cpu"),
            any_view=any(d in CARRIERS for d in in_dt),
        )
        native = pycustomopdef()
        native.op_type = f"{DOMAIN}::{op_type}"
        native.obj_id = obj_id
        native.input_types = [_elem_code(pycustomopdef, CARRIERS.get(d, d)) for d in in_dt]
        native.output_types = [_elem_code(pycustomopdef, CARRIERS.get(d, d)) for d in out_dt]
        native.attrs = {
            **{a.name: attr_code[a.type] for a in op.schema.attributes},
            NODE_ATTR: pycustomopdef.dt_string,
        }
        add_custom_op(native)
        _STATE.native.append(native)
        _STATE.by_id[obj_id] = definition
        _STATE.by_type[op_type] = definition
        made.append(op_type)
    _STATE.ops[op.name] = (op, plugin)
    return made


_ELEM_ATTR = {
    "float32": "dt_float",
    "float64": "dt_double",
    "int8": "dt_int8",
    "uint8": "dt_uint8",
    "int16": "dt_int16",
    "uint16": "dt_uint16",
    "int32": "dt_int32",
    "uint32": "dt_uint32",
    "int64": "dt_int64",
    "uint64": "dt_uint64",
    "bool": "dt_bool",
}


def _elem_code(pycustomopdef: Any, dtype: str) -> int:
    # float16/bfloat16 are absent on purpose: they abort the process (they travel as uint16).
    code = getattr(pycustomopdef, _ELEM_ATTR.get(dtype, ""), None)
    if code is None:
        raise ContractError(f"dtype {dtype} cannot cross the onnxruntime-extensions boundary")
    return int(code)


def freeze() -> None:
    """Forbid further definitions (done by the first `register_session_options`)."""
    _STATE.frozen = True


def is_frozen() -> bool:
    return _STATE.frozen


def defined_op_types() -> dict[str, str]:
    """ONNX op type -> op name, for everything defined so far."""
    return {t: d.op.name for t, d in _STATE.by_type.items()}


def register_session_options(
    session_options: ort.SessionOptions, registry: Registry | None = None
) -> ort.SessionOptions:
    """Let sessions made with ``session_options`` run this project's ops (``ep.register``).

    Defines the ops of ``registry`` (default: the plugin host's registry), freezes the op set
    and registers the extension library once per options object. Returns ``session_options``.
    """
    if not isinstance(session_options, ort.SessionOptions):
        raise OpError(
            f"register_session_options needs an onnxruntime.SessionOptions, got "
            f"{type(session_options).__name__}"
        )
    # Idempotent: the host's ops are usually defined already (the same OpDef objects).
    install(registry if registry is not None else _default_registry())
    if session_options in _STATE.registered:
        return session_options
    freeze()
    session_options.register_custom_ops_library(extensions_library_path())
    _STATE.registered.add(session_options)
    return session_options


def _default_registry() -> Registry:
    """The plugin host's registry; imported late because loading the host loads every plugin."""
    from ep.plugins import get_host

    return get_host().registry


# --- the invocation hook ---------------------------------------------------------------------


def _invoke(obj_id: int, feed: Sequence[np.ndarray], attrs: Mapping[str, str]) -> tuple[Any, ...]:
    """Called by the extension for every node run. Never raises (an exception here aborts)."""
    definition = _STATE.by_id.get(obj_id)
    if definition is None:
        # An op someone defined with onnxruntime_extensions.onnx_op: the stock behaviour.
        return _STATE.stock_hook(obj_id, feed, attrs)
    node = ""
    expected: _Expected | None = None
    try:
        attr_key = (obj_id, *attrs.items())
        parsed = _STATE.attr_cache.get(attr_key)
        if parsed is None:
            parsed = definition.parse_attrs(attrs)
            if len(_STATE.attr_cache) > _CACHE_LIMIT:
                _STATE.attr_cache.clear()
            _STATE.attr_cache[attr_key] = parsed
        node, values = parsed
        arrays = feed
        if definition.any_view:
            arrays = [
                x if view is None else x.view(view)
                for x, view in zip(feed, definition.input_views, strict=True)
            ]
        shape_key = (attr_key, *[x.shape for x in arrays])
        expected = _STATE.infer_cache.get(shape_key)
        if expected is None:
            expected = _expect(definition, arrays, values, node)
            if len(_STATE.infer_cache) > _CACHE_LIMIT:
                _STATE.infer_cache.clear()
            _STATE.infer_cache[shape_key] = expected
        # The placement switch (ep.ops.placement): the CPU path is this one comparison.
        kernel = definition.kernel if _PLACEMENT.kernels == "cpu" else _placed(definition)
        result = kernel(*arrays, **values)
        outs = result if type(result) is tuple else (result,)
        if not _fits(outs, expected.fast):
            # The slow path: contiguity fixes, or an OpError that explains the mismatch.
            outs = check_outputs(
                definition.op, result, expected.infos, node=node, author=definition.author
            )
        reply: list[Any] = [obj_id]
        for out, carried in zip(outs, definition.output_carried, strict=True):
            if carried:
                out = out.view(np.uint16)
            reply.append(out.shape)
            reply.append(out)
        return tuple(reply)
    except BaseException as exc:  # anything that reaches C++ aborts the process: keep it here
        _record(definition, node, exc)
        return _harmless(definition, expected.infos if expected is not None else None)


def _placed(definition: _Definition) -> Kernel:
    """The op's kernel of the placement's kernel set; its reference when it has none and the
    placement allows the fallback; else an OpError saying what to do."""
    key = _PLACEMENT.kernels
    op = definition.op
    found = op.kernels.get(key)
    if found is not None:
        return found
    if _PLACEMENT.fallback:
        if (op.name, key) not in _PLACEMENT.warned:
            _PLACEMENT.warned.add((op.name, key))
            warnings.warn(
                f"op {DOMAIN}::{op.name} from {definition.author} has no {key!r} kernel; ONNX "
                "Runtime sessions run its NumPy reference instead (fallback=True)",
                RuntimeWarning,
                stacklevel=2,
            )
        return definition.kernel
    have = ", ".join(sorted({"cpu", *op.kernels}))
    raise OpError(
        f"no {key!r} kernel (it has: {have}), but ONNX Runtime sessions run "
        f"{_PLACEMENT.placement.describe()} (ep.ops.use_device / set_device, or decode.device). "
        f"Add one with OpDef.with_kernel({key!r}, fn) in {definition.author}, run on 'cpu', or "
        "let such ops run their reference: ep.ops.use_device(..., fallback=True)"
    )


@dataclass(frozen=True)
class _Expected:
    """What the outputs must be, once as ArgInfo (messages) and once for the fast check."""

    infos: tuple[ArgInfo, ...]
    fast: tuple[tuple[tuple[int, ...], np.dtype[Any]], ...]


def _expect(
    definition: _Definition, arrays: Sequence[np.ndarray], values: Mapping[str, Any], node: str
) -> _Expected:
    infos = [ArgInfo(x.shape, dt) for x, dt in zip(arrays, definition.input_dtypes, strict=True)]
    out = run_infer(definition.op, infos, values, node=node, author=definition.author)
    return _Expected(out, tuple((i.shape, np_dtype(i.dtype)) for i in out))


def _fits(outs: tuple[Any, ...], fast: tuple[tuple[tuple[int, ...], np.dtype[Any]], ...]) -> bool:
    if len(outs) != len(fast):
        return False
    for out, (shape, dtype) in zip(outs, fast, strict=True):
        if (
            type(out) is not np.ndarray
            or out.shape != shape
            or out.dtype != dtype
            or not out.flags.c_contiguous
        ):
            return False
    return True


def _harmless(definition: _Definition, expected: Sequence[ArgInfo] | None) -> tuple[Any, ...]:
    """Zeros of the expected shapes (or empty) so that ONNX Runtime can finish the run."""
    try:
        reply: list[Any] = [definition.obj_id]
        for i, dt in enumerate(definition.output_ort):
            shape = tuple(expected[i].shape) if expected is not None else (0,)
            zeros = np.zeros(shape, dtype=dt)
            reply += [zeros.shape, zeros]
        return tuple(reply)
    except BaseException:  # as in _invoke: nothing may reach C++
        fallback: list[Any] = [definition.obj_id]
        for dt in definition.output_ort:
            fallback += [(0,), np.zeros((0,), dtype=dt)]
        return tuple(fallback)


def _record(definition: _Definition, node: str, exc: BaseException) -> None:
    try:
        qualified = f"{DOMAIN}::{definition.op.name}"
        at = f"op {qualified} (node {node!r})" if node else f"op {qualified}"
        if isinstance(exc, OpError):
            text = str(exc)
            message = text if text.startswith("op ") else f"{at}: {text}"
        else:
            frames = traceback.extract_tb(exc.__traceback__)
            where = f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""
            message = (
                f"{at} raised {type(exc).__name__}: {exc}{where}. The op comes from "
                f"{definition.author}; the run's outputs are not valid"
            )
        thread = threading.get_ident()
        with _STATE.lock:
            pending = _STATE.errors.setdefault(thread, [])
            if len(pending) < _MAX_ERRORS_PER_THREAD:
                pending.append(_Pending(message, exc))
            else:
                _STATE.dropped[thread] = _STATE.dropped.get(thread, 0) + 1
    except BaseException:  # recording must not raise into C++ either; the op still returns zeros
        pass


# --- getting errors back to the caller -------------------------------------------------------


def take_op_errors(*, all_threads: bool = False) -> list[OpError]:
    """Remove and return the errors ops raised on this thread (or on any thread)."""
    pending, dropped = _take(all_threads)
    return [_as_error(p, [], 0) for p in pending] + (
        [OpError(f"... and {dropped} more op error(s) were not kept")] if dropped else []
    )


def _take(all_threads: bool) -> tuple[list[_Pending], int]:
    if not _STATE.errors and not _STATE.dropped:
        return [], 0  # the common case, without the lock
    thread = threading.get_ident()
    with _STATE.lock:
        if all_threads:
            pending = [p for errs in _STATE.errors.values() for p in errs]
            dropped = sum(_STATE.dropped.values())
            _STATE.errors.clear()
            _STATE.dropped.clear()
        else:
            pending = _STATE.errors.pop(thread, [])
            dropped = _STATE.dropped.pop(thread, 0)
    return pending, dropped


def _as_error(first: _Pending, rest: Sequence[_Pending], dropped: int) -> OpError:
    extra = len(rest) + dropped
    tail = ""
    if extra:
        shown = "; ".join(p.message.split(":")[0] for p in rest[:3])
        tail = f" ({extra} more op error(s) in the same run: {shown}{', ...' if extra > 3 else ''})"
    err = OpError(first.message + tail)
    err.__cause__ = first.cause
    return err


def raise_op_errors(*, all_threads: bool = False) -> None:
    """Raise the first error an op stored on this thread (call after a plain ``session.run``).

    A KeyboardInterrupt or SystemExit caught inside an op is re-raised as itself.
    """
    pending, dropped = _take(all_threads)
    if not pending:
        return
    first = pending[0]
    if not isinstance(first.cause, Exception):
        raise first.cause
    raise _as_error(first, pending[1:], dropped)


def _raise_stale() -> None:
    pending, dropped = _take(False)
    if pending:
        err = _as_error(pending[0], pending[1:], dropped)
        raise OpError(
            "an op failed during an earlier run on this thread whose errors were never checked "
            "(a plain session.run? call ep.ops.raise_op_errors() after it, or use ep.ops.run): "
            f"{err}"
        ) from pending[0].cause


def _is_parallel(session: Any) -> bool:
    try:
        return _STATE.parallel[session]
    except (KeyError, TypeError):
        pass
    try:
        mode = session.get_session_options().execution_mode
        parallel = bool(mode == ort.ExecutionMode.ORT_PARALLEL)
    except Exception:
        parallel = False
    with contextlib.suppress(TypeError):  # a session object without weak references
        _STATE.parallel[session] = parallel
    return parallel


def run(
    session: ort.InferenceSession,
    output_names: Sequence[str] | None,
    input_feed: Mapping[str, Any],
    run_options: ort.RunOptions | None = None,
) -> list[Any]:
    """``session.run`` that raises an op's error as an `OpError` naming the op and the node."""
    _raise_stale()
    parallel = _is_parallel(session)
    try:
        outputs = session.run(output_names, input_feed, run_options)
    except Exception:
        raise_op_errors(all_threads=parallel)  # an op's error explains ORT's failure: it wins
        raise
    raise_op_errors(all_threads=parallel)
    return outputs


def run_with_iobinding(
    session: ort.InferenceSession, binding: Any, run_options: ort.RunOptions | None = None
) -> None:
    """``session.run_with_iobinding`` that raises an op's error like `run`."""
    _raise_stale()
    parallel = _is_parallel(session)
    try:
        session.run_with_iobinding(binding, run_options)
    except Exception:
        raise_op_errors(all_threads=parallel)
        raise
    raise_op_errors(all_threads=parallel)
