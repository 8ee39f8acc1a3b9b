"""A static plan of one graph at one (batch, seq): shapes, one arena, kernels bound to addresses.

`StepPlan` walks the program once: it infers every value's shape, makes Split / Reshape / BitCast
outputs views (a Split along the last axis is a view whose tokens are ``tok`` elements apart; the
kernels that read it take that token stride), and gives every other value a slot in one arena
buffer, reusing bytes whose value is dead (first fit over lifetimes). `StepPlan.bind` turns the
nodes into a list of calls of `ep.kernels` wrappers with every buffer fixed; the same list runs
eagerly or inside a capture. The KV cache's buffers and geometry come in at `bind`, so a plan
survives cache growth and is only rebound.

Weights: a weight whose address the source says is fixed (``weights.fixed(name, stream=...)``
returns its buffer: a resident one) is bound once; every other weight is fetched by the call
itself, ``weights.get(name, stream=...)`` right before its kernel, at every step, in the same
order (the offload store streams or pages it in then). `weight_reads` lists what each node reads.

Pieces: a weight the source holds in pieces (``weights.split(name)``, `ep.offload.SplitWeight`;
`split_specs` says which weights may be split and along which axis) runs as one call per piece,
each fetching its piece right before its kernel. A MatMul piece computes output columns
``[n0, n1)``: the GEMV/GEMM of x against the piece into a scratch [M, n1 - n0] buffer (at M = 1
straight into the output row), then a 2-D copy into the output's columns; every piece passes
``split_n`` = the whole N, so each column gets the K split, and the arithmetic, of the unsplit
product. A Gather piece writes the rows of the ids inside its vocabulary rows.

Fusion: q's and k's rotations of one layer run as one launch (`StepPlan._rotary_pairs`). Where the
graph allows it exactly, the step from the QKV projection to the attention is one call
(`ep.kernels.attention.kv_commit_rotary`, named ``QKVRotaryCommit`` in `call_names`): the packed
projection's bias ``Add`` (when its sum feeds nothing but the q/k/v views), the rotation pair and
the ``KVCommit`` of the rotated k (when nothing else reads it) — bitwise what the separate calls
store, without the biased sum and the rotated k ever reaching memory (they get no arena bytes).
A packed gate/up projection read only by its ``SwiGLUPacked`` runs as one GEMV with a SwiGLU
epilogue (``MatMul+SwiGLUPacked``, `StepPlan._swiglu_fusions`) in plans of up to 16 rows, also
bitwise, without the packed product in memory. ``GENAI_EP_FUSE=0`` (`FUSE_ENV`,
read when a plan is made) binds every node on its own; ``GENAI_EP_FUSE_MLP=0`` (`FUSE_MLP_ENV`)
only the SwiGLU.

4-bit embedding (GatherBlockQuantized, uint8 data, bits 4, gather_axis 0, quantize_axis 1): the
onnxruntime-genai builder gathers it from the tied head's MatMulNBits B through a Reshape
([V, k_blocks, block/2] -> [V, hidden/2]). A Reshape, BitCast or Identity of an initializer is
the initializer itself here (an alias with the Reshape's shape: `_weight_shape`), so the gather
and the head read one weight, bound or fetched once per read. Its weights are (data, scales[,
zero points]) and may be held in pieces of vocabulary rows: the same `SplitSpec` as the head's
MatMulNBits (rows of B/scales/zero points are output indices there, token ids here; both are the
leading axis of the same row-major bytes), so a tied table is split once, for both readers.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ep.device import Buffer, Device, Stream
from ep.errors import ConfigError, ModelError
from ep.native import _kernels as nk
from ep.native.program import Node, Program
from ep.native.weights import WeightSource
from ep.offload import SplitSpec, SplitWeight
from ep.seams import KVStrides

__all__ = ["EARLY_ENV", "FUSE_ENV", "FUSE_MLP_ENV", "FUSE_QKV_ENV", "REPLAY_ENV",
           "KVBinding", "StepPlan", "WeightRead", "early_enabled", "fuse_enabled",
           "fuse_mlp_enabled", "fuse_qkv_enabled", "replay_enabled", "split_specs",
           "weight_reads"]  # fmt: skip

_ALIGN = 256  # bytes: every arena slot starts on a 256-byte boundary (vector loads, cp.async)
_VIEWS = ("BitCast", "Identity", "Split", "Reshape")  # no work: no call, no weight read
# Inputs a node's kernel reads (the rest are the runtime's KV cache and geometry, bound apart).
_KERNEL_INPUTS = {"KVCommit": 3, "KVCommitPaged": 3, "KVAttention": 3, "KVAttentionPaged": 3}
_COMMITS = ("KVCommit", "KVCommitPaged")
FUSE_ENV = "GENAI_EP_FUSE"  # 0: no fused QKV commit (each node its own call), for A/B runs
FUSE_MLP_ENV = "GENAI_EP_FUSE_MLP"  # 0: no SwiGLU epilogue in the gate/up GEMV (A/B runs)
FUSE_QKV_ENV = "GENAI_EP_FUSE_QKV"  # 0: the fused QKV commit is its own call, not a GEMV epilogue
EARLY_ENV = "GENAI_EP_EARLY"  # 0: GEMVs never load resident weights before their PDL wait (A/B)
REPLAY_ENV = "GENAI_EP_REPLAY"  # 0: eager calls run their op's host work every time (A/B runs)


def _switch(name: str, off: str, on: str, environ: Mapping[str, str] | None) -> bool:
    value = (os.environ if environ is None else environ).get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ConfigError(f"{name}={value!r}; expected 0 ({off}) or 1 ({on}, the default)")
    return value != "0"


def fuse_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether plans fuse a layer's bias/rotary/commit chain (`FUSE_ENV`: unset or 1 yes, 0 no)."""
    return _switch(FUSE_ENV, "bind each node on its own", "fuse", environ)


def fuse_mlp_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether plans that fuse also run a packed gate/up projection and its SwiGLUPacked as one
    GEMV with a SwiGLU epilogue (`FUSE_MLP_ENV`: unset or 1 yes, 0 no; an A/B of that fusion)."""
    return _switch(FUSE_MLP_ENV, "the GEMV, then SwiGLUPacked", "one GEMV", environ)


def fuse_qkv_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether plans that fuse run a fused QKV commit as its projection's GEMV epilogue where
    they can (`FUSE_QKV_ENV`: unset or 1 yes, 0 no; an A/B of that fusion)."""
    return _switch(FUSE_QKV_ENV, "the projection, then the fused commit", "one GEMV", environ)


def early_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether plans tell GEMVs that weights bound once are resident (`EARLY_ENV`: unset or 1
    yes, 0 no), so they load them before waiting for the previous kernel."""
    return _switch(EARLY_ENV, "weights after the wait", "resident weights first", environ)


def replay_enabled(environ: Mapping[str, str] | None = None) -> bool:
    """Whether an eager call issues the kernel launches its first run recorded (`REPLAY_ENV`:
    unset or 1 yes, 0 no: the op's checks and planning run every time)."""
    return _switch(REPLAY_ENV, "the op's host work every call", "replay its launches", environ)


@dataclass(frozen=True)
class WeightRead:
    """The weights one working node reads, all at once, in the order its call fetches them."""

    node: str
    op: str
    weights: tuple[str, ...]


def weight_reads(program: Program) -> list[WeightRead]:
    """Per working node (in step order), the initializers its kernel reads as weights.

    The same rule as `StepPlan.buffer`: a kernel input that no node produced (BitCast and
    Identity of an initializer are the initializer itself) and that is not a step input.
    """
    return [read for _, read in _node_reads(program)]


def _spec_of(node: Node, read: WeightRead, program: Program) -> dict[str, SplitSpec | None]:
    """How ``node`` could read each of its weights in pieces (None: only whole)."""
    names = read.weights
    out: dict[str, SplitSpec | None] = dict.fromkeys(names)
    arrays = program.arrays
    if node.op == "Gather" and names and arrays[names[0]].ndim == 2:
        table = names[0]
        out[table] = SplitSpec((table,), (0,), int(arrays[table].shape[0]))
    elif node.op == "MatMul" and names:
        weight, n = names[-1], int(node.attrs["N"])
        shape = arrays[weight].shape
        transposed = int(node.attrs.get("transpose_b", 0)) == 1
        if len(shape) == 2 and shape[0 if transposed else 1] == n:
            out[weight] = SplitSpec((weight,), (0 if transposed else 1,), n)
    elif node.op in ("MatMulNBits", "MatMulNBitsZP"):
        group = tuple(names)
        wanted = 3 if node.op == "MatMulNBitsZP" else 2
        if len(group) == wanted and len(set(group)) == wanted:
            spec = SplitSpec(group, (0,) * wanted, int(node.attrs["N"]))
            out.update(dict.fromkeys(group, spec))
    elif node.op == "GatherBlockQuantized":
        # rows of the data's leading axis (token ids), with their scales and zero points; the
        # same spec as a tied head's MatMulNBits when the vocabulary is its N
        group = tuple(names)
        wanted = 3 if len(node.inputs) > 3 and node.inputs[3] else 2
        data = _weight_shape(program, node.inputs[0])
        if len(group) == wanted and len(set(group)) == wanted and len(data) == 2:
            spec = SplitSpec(group, (0,) * wanted, int(data[0]))
            out.update(dict.fromkeys(group, spec))
    return out


def _reshaped(shape: tuple[int, ...], target: np.ndarray) -> tuple[int, ...]:
    """ONNX Reshape's output shape (0 copies a dim, -1 is inferred) of ``shape``."""
    dims = [shape[i] if int(d) == 0 else int(d) for i, d in enumerate(target)]
    if -1 in dims:
        known = math.prod(d for d in dims if d != -1)
        dims[dims.index(-1)] = math.prod(shape) // max(known, 1)
    return tuple(dims)


def _weight_shape(program: Program, name: str) -> tuple[int, ...]:
    """The shape a node sees for weight ``name``: an initializer, or a BitCast / Identity /
    Reshape of one (the executor reads the initializer's bytes under that shape)."""
    found = program.arrays.get(name)
    if found is not None:
        return tuple(int(d) for d in found.shape)
    for node in program.nodes:
        if name in node.outputs and node.op in ("BitCast", "Identity", "Reshape"):
            shape = _weight_shape(program, node.inputs[0])
            if node.op == "Reshape":
                target = program.arrays.get(node.inputs[1])
                if target is None:
                    break
                return _reshaped(shape, target)
            return shape
    raise ModelError(
        f"{program.path}: {name!r} must be an initializer (or a BitCast, Identity or Reshape of "
        "one) for the native executor; the graph computes it, which no kernel here reads as a "
        "weight"
    )


def split_specs(program: Program, exclude: frozenset[str] = frozenset()) -> list[SplitSpec]:
    """The weights that may be held in pieces, and how (`ep.offload.split_weights`).

    A weight qualifies when every node that reads it reads it the same splittable way: a Gather
    table (rows), a MatMul weight (rows of [N, K], columns of [K, N]), MatMulNBits b, scales and
    zero points (rows, one group). A tied table that a Gather and a ``transpose_b=1`` head both
    read is split once, in vocabulary rows, for both. ``exclude``: weights kept whole.
    """
    seen: dict[str, set[SplitSpec | None]] = {}
    for node, read in _node_reads(program):
        for name, spec in _spec_of(node, read, program).items():
            seen.setdefault(name, set()).add(spec)
    specs: list[SplitSpec] = []
    for found in seen.values():
        if len(found) != 1:
            continue
        spec = next(iter(found))
        if spec is None or spec in specs or any(n in exclude for n in spec.names):
            continue
        if all(seen.get(n) == {spec} for n in spec.names):
            specs.append(spec)
    return specs


def _node_reads(program: Program) -> list[tuple[Node, WeightRead]]:
    produced = {n for n in program.inputs if n in ("input_ids", "positions")}
    aliases: dict[str, str] = {}
    reads: list[tuple[Node, WeightRead]] = []
    for node in program.nodes:
        ins = [aliases.get(n, n) for n in node.inputs]
        if node.op in ("BitCast", "Identity", "Reshape") and ins[0] not in produced:
            aliases[node.outputs[0]] = ins[0]  # a weight's carrier or view: the weight itself
            continue
        produced.update(node.outputs)
        if node.op in _VIEWS:
            continue
        names = [n for n in ins[: _KERNEL_INPUTS.get(node.op)] if n and n not in produced]
        if node.op == "MatMul":
            names.append(aliases.get(str(node.attrs["weight"]), str(node.attrs["weight"])))
        for name in names:
            if name not in program.arrays:
                raise ModelError(
                    f"{program.path}: node {node.name} ({node.op}) reads {name!r}, which is "
                    "neither an initializer nor computed by an earlier node; the graph is "
                    "incomplete (rebuild or re-export it)"
                )
        reads.append((node, WeightRead(node.name, node.op, tuple(names))))
    return reads


def _math_attrs(node: Node) -> dict[str, Any]:
    """A node's attributes less its ``ep_node`` name tag."""
    return {k: v for k, v in node.attrs.items() if k != "ep_node"}


@dataclass(frozen=True)
class _Deferred:
    """A weight argument fetched by the call itself (its address may change between steps)."""

    name: str
    shape: tuple[int, ...]


class _FetchingCall:
    """A kernel call that gets its deferred weights from ``weights`` right before running."""

    __slots__ = ("_args", "_func", "_kwargs", "_slots", "_stream", "_weights")

    def __init__(self, call: functools.partial[Any], weights: WeightSource, stream: Stream):
        self._func = call.func
        self._args = call.args
        self._kwargs = call.keywords
        self._weights = weights
        self._stream = stream
        self._slots: list[tuple[int | str, str]] = [
            (i, a.name) for i, a in enumerate(call.args) if isinstance(a, _Deferred)
        ]
        self._slots += [(k, a.name) for k, a in call.keywords.items() if isinstance(a, _Deferred)]

    def __call__(self) -> object:
        args = list(self._args)
        kwargs = dict(self._kwargs)
        for where, name in self._slots:
            buffer = self._weights.get(name, stream=self._stream)
            if isinstance(where, int):
                args[where] = buffer
            else:
                kwargs[where] = buffer
        return self._func(*args, **kwargs)

    @property
    def weights(self) -> tuple[str, ...]:
        return tuple(name for _, name in self._slots)


class _PieceCall:
    """A node whose weights are held in pieces: per piece, fetch it, then run that piece's part.

    ``parts``: (the piece names one part reads, in fetch order; the part's kernel calls, given
    the fetched buffers). Every step fetches the same pieces in the same order, so a streamed
    piece lands in the same staging slot each time (capture-safe).
    """

    __slots__ = ("_parts", "_stream", "_weights")

    def __init__(
        self,
        parts: list[tuple[tuple[str, ...], Callable[[list[Buffer]], None]]],
        weights: WeightSource,
        stream: Stream,
    ) -> None:
        self._parts = parts
        self._weights = weights
        self._stream = stream

    def __call__(self) -> None:
        get, stream = self._weights.get, self._stream
        for names, run in self._parts:
            run([get(name, stream=stream) for name in names])

    @property
    def weights(self) -> tuple[str, ...]:
        return tuple(name for names, _ in self._parts for name in names)


@dataclass
class _Value:
    shape: tuple[int, ...]
    dtype: np.dtype[Any]
    base: str  # the value owning the storage (itself unless a view)
    offset: int = 0  # elements into the base
    tok: int = 0  # elements between consecutive tokens (B*S axis)
    storage: int = 0  # elements the storage spans when tokens are strided (0: the size)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def per_token(self) -> int:
        return math.prod(self.shape[2:]) if len(self.shape) > 2 else self.shape[-1]


@dataclass(frozen=True)
class _QKVFusion:
    """One layer's [bias Add ->] Rotary(q) + Rotary(k) -> KVCommit(rotated k, v), one call.

    ``first``/``last``: the node indices it spans; every working node between them is one of
    its own (the views in between cost nothing), so its call may run at ``first``.
    """

    add: Node | None  # the packed projection's bias Add, when its sum feeds only q, k and v
    q: Node
    k: Node
    commit: Node
    first: int
    last: int
    # the packed QKV projection, when the call is its GEMV with the chain as the epilogue
    # (`StepPlan._with_projection`); ``first`` is then its index
    projection: Node | None = None

    @property
    def nodes(self) -> tuple[Node, ...]:
        chain = (self.projection, self.add, self.q, self.k, self.commit)
        return tuple(n for n in chain if n is not None)


@dataclass(frozen=True)
class _SwigluFusion:
    """A packed gate/up projection and the SwiGLUPacked that alone reads it, one GEMV call with
    a SwiGLU epilogue (`ep.kernels.matmul.gemm`'s ``swiglu``): the packed product never reaches
    memory. ``first``/``last``: the two nodes (only views between them)."""

    matmul: Node
    swiglu: Node
    first: int
    last: int

    @property
    def nodes(self) -> tuple[Node, ...]:
        return (self.matmul, self.swiglu)


@dataclass(frozen=True)
class KVBinding:
    """What the KV ops of one step are bound to."""

    keys: tuple[Buffer, ...]
    values: tuple[Buffer, ...]
    strides: KVStrides
    capacity: int  # the capacity bound the kernels check positions against
    block_table: Buffer | None
    table_cols: int


class StepPlan:
    """``program`` at ``batch`` × ``seq`` on ``device``: buffers assigned once, calls bound."""

    def __init__(
        self,
        program: Program,
        *,
        device: Device,
        stream: Stream,
        weights: WeightSource,
        batch: int,
        seq: int,
        kv_heads: int,
        status: Buffer,
        matmul_workspace: Any,
        inv_freq: dict[tuple[float, int], Buffer],
        split_attention: bool,
        max_context: int,
        fuse: bool | None = None,
    ) -> None:
        self.program = program
        self.device = device
        self.stream = stream
        self.weights = weights
        self.batch = batch
        self.seq = seq
        self.kv_heads = kv_heads
        self.status = status
        self.matmul_workspace = matmul_workspace
        self.inv_freq = inv_freq
        self.split_attention = split_attention
        self.max_context = max_context
        tag = f"b{batch}s{seq}"
        self.input_ids = device.alloc((batch, seq), np.int64, stream=stream, name=f"ids:{tag}")
        self.positions = device.alloc((batch, seq), np.int64, stream=stream, name=f"pos:{tag}")
        self.values: dict[str, _Value] = {}
        self.aliases: dict[str, str] = {}
        self.weight_views: dict[str, tuple[int, ...]] = {}  # a reshaped weight's shape, by alias
        self._infer()
        # the fused QKV commits (``fuse`` None: as `FUSE_ENV` says); the arena depends on them
        self.fuse = fuse_enabled() if fuse is None else fuse
        self.fusions = self._qkv_fusions(fuse_qkv_enabled()) if self.fuse else []
        self.mlp_fusions = self._swiglu_fusions() if self.fuse and fuse_mlp_enabled() else []
        self.early = early_enabled()  # resident weights loaded before a GEMV's PDL wait
        self._assign(tag)
        out = self.values[program.output]
        self.logits = device.alloc(out.shape, out.dtype, stream=stream, name=f"logits:{tag}")
        self._attn_workspaces: dict[Any, Buffer | None] = {}
        self._piece_scratch: dict[tuple[str, int], Buffer] = {}
        self.arena_bytes = self.arena.nbytes
        self.bound_weights: list[str] = []  # weights bound once by the last `bind`, per read
        self.call_names: list[str] = []  # "op:node" of each call of the last `bind`

    # --- shapes --------------------------------------------------------------------------------

    def _const(self, name: str) -> np.ndarray:
        name = self.aliases.get(name, name)
        found = self.program.arrays.get(name)
        if found is None:
            raise ModelError(f"{self.program.path}: {name!r} must be a constant or initializer")
        return found

    def _shape_of(self, name: str) -> tuple[tuple[int, ...], np.dtype[Any]]:
        if name in self.values:
            v = self.values[name]
            return v.shape, v.dtype
        array = self._const(name)
        return tuple(array.shape), array.dtype

    def _weight_shape(self, name: str) -> tuple[int, ...]:
        """The shape a node sees for a weight (a Reshape of an initializer has its own)."""
        found = self.weight_views.get(name)
        return found if found is not None else tuple(int(d) for d in self._const(name).shape)

    def _infer_gbq(self, node: Node) -> None:
        """GatherBlockQuantized as the 4-bit kernel runs it: data uint8 [V, P] (2P values a
        row), scales [V, ceil(2P / block_size)], zero points [V, ceil(blocks / 2)] packed."""
        a, ins = node.attrs, node.inputs
        bits, block = int(a.get("bits", 4)), int(a.get("block_size", 128))
        data = self._weight_shape(ins[0])
        fix = "run this model with --backend ort"
        if (
            bits != 4
            or int(a.get("gather_axis", 0)) != 0
            or int(a.get("quantize_axis", 1)) not in (1, -1)
            or len(data) != 2
        ):
            raise ModelError(
                f"{node.name}: the native executor gathers 4-bit rows only (bits=4, gather_axis "
                f"0, quantize_axis 1 of 2-D data); got bits={bits}, gather_axis="
                f"{a.get('gather_axis', 0)}, quantize_axis={a.get('quantize_axis', 1)}, data "
                f"{list(data)}; {fix}"
            )
        table, scales = self._const(ins[0]), self._const(ins[2])
        vocab, hidden = data[0], 2 * data[1]
        k_blocks = -(-hidden // block)
        want = {"scales": (vocab, k_blocks), "zero_points": (vocab, -(-k_blocks // 2))}
        seen = {"scales": self._weight_shape(ins[2])}
        if len(ins) > 3 and ins[3]:
            seen["zero_points"] = self._weight_shape(ins[3])
            if self._const(ins[3]).dtype != np.uint8:
                raise ModelError(f"{node.name}: zero points must be uint8 (4-bit packed); {fix}")
        bad = {k: v for k, v in seen.items() if v != want[k]}
        if table.dtype != np.uint8 or block < 16 or block & (block - 1) or bad:
            raise ModelError(
                f"{node.name}: GatherBlockQuantized data {table.dtype}{list(data)} at block_size "
                f"{block} needs uint8 data, a power-of-two block >= 16 and "
                f"{ {k: list(want[k]) for k in seen} }; got "
                f"{ {k: list(v) for k, v in seen.items()} }; {fix}"
            )
        ids_shape, _ = self._shape_of(ins[1])
        self._new(node.outputs[0], (*ids_shape, hidden), scales.dtype)

    def _new(self, name: str, shape: tuple[int, ...], dtype: Any) -> None:
        per = math.prod(shape[2:]) if len(shape) > 2 else shape[-1]
        self.values[name] = _Value(tuple(int(s) for s in shape), np.dtype(dtype), name, 0, per)

    def _infer(self) -> None:
        b, s = self.batch, self.seq
        i64 = np.dtype(np.int64)
        for name in self.program.inputs:
            if name in ("input_ids", "positions"):
                self.values[name] = _Value((b, s), i64, name, 0, 1)
        for node in self.program.nodes:
            self._infer_node(node)

    def _infer_node(self, node: Node) -> None:
        op, ins, outs = node.op, node.inputs, node.outputs
        if op in ("BitCast", "Identity") or (op == "Reshape" and ins[0] not in self.values):
            src = self.values.get(ins[0])
            if src is None:  # a weight's carrier or view: the initializer itself
                self.aliases[outs[0]] = self.aliases.get(ins[0], ins[0])
                shape = self._weight_shape(ins[0])
                if op == "Reshape":
                    shape = _reshaped(shape, self._const(ins[1]))
                    if math.prod(shape) != math.prod(self._const(ins[0]).shape):
                        raise ModelError(
                            f"{node.name}: reshape of weight {ins[0]!r} "
                            f"{self._const(ins[0]).shape} to {shape} changes its size"
                        )
                self.weight_views[outs[0]] = shape
            else:
                self.values[outs[0]] = src
            return
        if op == "GatherBlockQuantized":
            self._infer_gbq(node)
            return
        if op == "Gather":
            table_shape, dtype = self._shape_of(ins[0])
            ids_shape, _ = self._shape_of(ins[1])
            self._new(outs[0], (*ids_shape, table_shape[1]), dtype)
        elif op in ("Rotary", "RotaryTheta"):
            # The output keeps its input's token stride, so a rotated K and its unrotated V
            # (views of one QKV projection) reach KVCommit with one source stride.
            x = self.values[ins[0]]
            n = x.shape[0] * x.shape[1]
            self.values[outs[0]] = _Value(x.shape, x.dtype, outs[0], 0, x.tok, n * x.tok)
        elif op in ("RMSNorm", "Add", "Int8Activations"):
            shape, dtype = self._shape_of(ins[0])
            self._new(outs[0], shape, dtype)
        elif op == "SkipRMSNorm":
            shape, dtype = self._shape_of(ins[0])
            self._new(outs[0], shape, dtype)
            self._new(outs[1], shape, dtype)
        elif op in ("MatMul", "MatMulNBits", "MatMulNBitsZP"):
            shape, dtype = self._shape_of(ins[0])
            self._new(outs[0], (*shape[:-1], int(node.attrs["N"])), dtype)
        elif op == "Cast":
            shape, _ = self._shape_of(ins[0])
            if int(node.attrs.get("to", 1)) != 1:
                raise ModelError(f"{node.name}: the native executor casts to float32 only")
            self._new(outs[0], shape, np.float32)
        elif op == "Split":
            src = self.values[ins[0]]
            axis = int(node.attrs.get("axis", -1))
            if axis not in (-1, len(src.shape) - 1) or len(src.shape) != 3:
                raise ModelError(f"{node.name}: the native executor splits the last axis only")
            sizes = [int(x) for x in self._const(ins[1])]
            at = 0
            for out, size in zip(outs, sizes, strict=True):
                self.values[out] = _Value(
                    (*src.shape[:-1], size), src.dtype, src.base, src.offset + at, src.tok
                )
                at += size
        elif op == "Reshape":
            src = self.values[ins[0]]
            want = [int(x) for x in self._const(ins[1])]
            dims = [src.shape[i] if d == 0 else d for i, d in enumerate(want)]
            if -1 in dims:
                known = math.prod(d for d in dims if d != -1)
                dims[dims.index(-1)] = src.size // known
            if tuple(dims[:2]) != src.shape[:2] or math.prod(dims) != src.size:
                raise ModelError(
                    f"{node.name}: reshape {src.shape} -> {tuple(dims)} must keep the (batch, "
                    "seq) axes for the native executor"
                )
            self.values[outs[0]] = _Value(tuple(dims), src.dtype, src.base, src.offset, src.tok)
        elif op in ("KVCommit", "KVCommitPaged"):
            self._new(outs[0], (self.batch,), np.int64)
        elif op in ("KVAttention", "KVAttentionPaged"):
            shape, dtype = self._shape_of(ins[0])
            self._new(outs[0], shape, dtype)
        elif op == "SwiGLUPacked":
            shape, dtype = self._shape_of(ins[0])
            self._new(outs[0], (*shape[:-1], shape[-1] // 2), dtype)
        elif op == "SwiGLU":
            shape, dtype = self._shape_of(ins[0])
            self._new(outs[0], shape, dtype)
        else:  # load_program refused it already
            raise ModelError(f"{node.name}: op {op} has no native implementation")

    # --- buffers -------------------------------------------------------------------------------

    def _assign(self, tag: str) -> None:
        """First-fit arena offsets over [first, last] node lifetimes of each storage value."""
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        for i, node in enumerate(self.program.nodes):
            for name in node.inputs:
                v = self.values.get(name)
                if v is not None:
                    last[v.base] = i
            for name in node.outputs:
                v = self.values.get(name)
                if v is not None and v.base == name:
                    first.setdefault(name, i)
                    last.setdefault(name, i)
        output = self.values[self.program.output].base
        last[output] = len(self.program.nodes)
        nodes = self.program.nodes
        for fusion in self._all_fusions:
            # One call reads and writes at once: what the span reads lives to its end, what it
            # writes from its start (so nothing it writes reuses bytes it still reads).
            for node in nodes[fusion.first : fusion.last + 1]:
                for name in node.inputs:
                    v = self.values.get(name)
                    if v is not None:
                        last[v.base] = max(last[v.base], fusion.last)
                for name in node.outputs:
                    v = self.values.get(name)
                    if v is not None and v.base == name:
                        first[name] = min(first[name], fusion.first)
            for name in self._unwritten(fusion):
                first.pop(name, None)
        live: list[tuple[int, int, int]] = []  # (offset, nbytes, last)
        offsets: dict[str, int] = {}
        top = 0
        for name in sorted(first, key=lambda n: first[n]):
            if name in ("input_ids", "positions"):
                continue
            start = first[name]
            live = [x for x in live if x[2] >= start]
            v = self.values[name]
            nbytes = -(-max(v.size, v.storage) * v.dtype.itemsize // _ALIGN) * _ALIGN
            at = 0
            for off, size, _ in sorted(live):
                if at + nbytes <= off:
                    break
                at = max(at, off + size)
            offsets[name] = at
            live.append((at, nbytes, last[name]))
            top = max(top, at + nbytes)
        self.offsets = offsets
        self.arena = self.device.alloc(
            max(top, _ALIGN), np.uint8, stream=self.stream, name=f"arena:{tag}"
        )

    def buffer(self, name: str) -> Buffer:
        """The buffer a kernel gets for value ``name`` (a view from its start to its base's end)."""
        if name == self.program.output:
            return self.logits
        name = self.aliases.get(name, name)
        v = self.values.get(name)
        if v is None:
            return self._weight(name)
        if v.base == "input_ids":
            return self.input_ids
        if v.base == "positions":
            return self.positions
        base = self.values[v.base]
        count = max(base.size, base.storage) - v.offset
        start = self.offsets[v.base] + v.offset * v.dtype.itemsize
        return self.arena.view(v.dtype, (count,), offset=start, name=f"{self.arena.name}:{name}")

    def _weight(self, name: str) -> Any:
        """A fixed weight's buffer (bound now), else a `_Deferred` the call fetches each time."""
        name = self.aliases.get(name, name)
        fixed = getattr(self.weights, "fixed", None)
        found = fixed(name, stream=self.stream) if fixed is not None else None
        if found is not None:
            self.bound_weights.append(name)
            return found
        array = self.program.arrays.get(name)
        if array is None:
            raise ModelError(
                f"the graph reads weight {name!r}, which the model does not hold; the model "
                "file is incomplete (rebuild or re-export it)"
            )
        return _Deferred(name, tuple(int(d) for d in array.shape))

    def _contiguous(self, node: Node, name: str) -> _Value:
        v = self.values[name]
        if v.tok != v.per_token():
            raise ModelError(
                f"{node.name}: input {name!r} is a strided view; the native executor needs it "
                "contiguous here"
            )
        return v

    # --- binding -------------------------------------------------------------------------------

    def bind(self, kv: KVBinding) -> list[Callable[[], object]]:
        """Every node as a call with its buffers fixed (run in order: one decode/prefill step).

        Weights that are not fixed are fetched by their call (see the module docstring);
        `bound_weights` lists the ones bound here, once per read.
        """
        self.bound_weights = []
        calls: list[Callable[[], object]] = []
        self.call_names = []
        pairs = self._rotary_pairs()
        joined = {k.name for k in pairs.values()}
        nodes = self.program.nodes
        fused_at = {nodes[f.first].name: f for f in self._all_fusions}
        absorbed = {n.name for f in self._all_fusions for n in f.nodes} - set(fused_at)
        for node in nodes:
            if node.op in _VIEWS or node.name in joined or node.name in absorbed:
                continue
            fusion = fused_at.get(node.name)
            if isinstance(fusion, _SwigluFusion):
                call: Callable[[], object] = self._bind_matmul(node, fusion.swiglu)
                name = f"{node.op}+SwiGLUPacked:{node.name}"
            elif fusion is not None and fusion.projection is not None:
                call = self._bind_matmul(node, rope=self._commit_kwargs(fusion, kv))
                name = f"{node.op}+QKVRotaryCommit:{fusion.commit.name}"
            elif fusion is not None:
                call = self._bind_fusion(fusion, kv)
                name = f"QKVRotaryCommit:{fusion.commit.name}"
            else:
                call = self._bind_node(node, kv, pairs.get(node.name))
                name = f"{node.op}:{node.name}"
            if isinstance(call, functools.partial) and any(
                isinstance(a, _Deferred) for a in (*call.args, *call.keywords.values())
            ):
                call = _FetchingCall(call, self.weights, self.stream)
            calls.append(call)
            self.call_names.append(name)
        return calls

    def _rotary_pairs(self) -> dict[str, Node]:
        """Rotary nodes that run as one launch with the next one (q's rotation takes k's along):
        same op, positions, tables and attributes, k's input computed before q's rotation, and
        only views between them (k is written early: nothing in between may use its bytes).

        Storage, not names, is compared: in an fp16/bf16 graph each rotation reads and writes
        through its own BitCast carriers, which are views of the same values."""
        nodes = self.program.nodes
        made = {out: i for i, n in enumerate(nodes) for out in n.outputs}
        pairs: dict[str, Node] = {}
        rotary = [i for i, n in enumerate(nodes) if n.op in ("Rotary", "RotaryTheta")]
        taken: set[str] = set()  # the k of a pair: not also the q of the next one
        for i, j in itertools.pairwise(rotary):
            q, k = nodes[i], nodes[j]
            if q.name in taken:
                continue
            qx, kx = self.values[q.inputs[0]], self.values[k.inputs[0]]
            if (
                q.op == k.op
                and self._resolved(q.inputs[1:]) == self._resolved(k.inputs[1:])
                and _math_attrs(q) == _math_attrs(k)
                and qx.shape[-1] == kx.shape[-1]
                and made.get(kx.base, -1) < i
                and self.values[q.outputs[0]].base != kx.base
                and all(nodes[n].op in _VIEWS for n in range(i + 1, j))
            ):
                pairs[q.name] = k
                taken.add(k.name)
        return pairs

    def _resolved(self, names: tuple[str, ...]) -> tuple[str, ...]:
        """``names`` with BitCast/Identity carriers of initializers read as the initializers."""
        return tuple(self.aliases.get(n, n) for n in names)

    def _readers(self) -> dict[str, list[tuple[int, int]]]:
        """Storage -> the (node index, input slot) pairs of the working nodes that read it."""
        readers: dict[str, list[tuple[int, int]]] = {}
        for i, node in enumerate(self.program.nodes):
            if node.op in _VIEWS:
                continue
            for slot, name in enumerate(node.inputs):
                v = self.values.get(name)
                if v is not None:
                    readers.setdefault(v.base, []).append((i, slot))
        return readers

    @property
    def _all_fusions(self) -> tuple[_QKVFusion | _SwigluFusion, ...]:
        return (*self.fusions, *self.mlp_fusions)

    def _qkv_fusions(self, with_projection: bool) -> list[_QKVFusion]:
        """Every layer whose [bias Add ->] rotation pair -> KVCommit chain runs as one call.

        Per rotation pair (same op, positions, tables and attributes: `_rotary_pairs`): the
        rotated k is read by one KVCommit only, as its K, and is not the graph's output; that
        commit takes the rotations' positions; q, k and v have one dtype, k and v one shape; no
        other working node runs between the chain's first and last node; and what the chain
        reads is made before it starts. The bias Add joins when q, k and v are views of its sum,
        which nothing else reads, and its bias is a 1-D initializer over the last axis. With
        ``with_projection`` the packed projection joins where it can (`_with_projection`).
        """
        nodes = self.program.nodes
        index = {n.name: i for i, n in enumerate(nodes)}
        made = {out: i for i, n in enumerate(nodes) for out in n.outputs}
        readers = self._readers()
        output = self.values[self.program.output].base
        found: list[_QKVFusion] = []
        for q_name, k in self._rotary_pairs().items():
            fusion = self._qkv_fusion(
                index[q_name], index[k.name], readers=readers, made=made, output=output
            )
            if fusion is not None and with_projection:
                fusion = self._with_projection(fusion, index=index, readers=readers, made=made)
            if fusion is not None:
                found.append(fusion)
        return found

    def _with_projection(
        self,
        fusion: _QKVFusion,
        *,
        index: dict[str, int],
        readers: dict[str, list[tuple[int, int]]],
        made: dict[str, int],
    ) -> _QKVFusion:
        """``fusion`` run as its packed QKV projection's GEMV with the chain as the epilogue
        (`ep.kernels.attention.rope_epilogue`) where that is bitwise the two calls, else
        ``fusion`` as it was: q, k and v are the projection's [q | k | v] columns in that order
        (through the bias Add when it joined), which nothing else reads, with only views between
        the projection and the chain; head_dim is a multiple of 16; the projection takes a
        GEMV epilogue at this plan's rows (`_epilogue_gemv`); and neither its weights nor the
        bias are streamed (the offload store's slots hold one node's weights at once)."""
        nodes, values = self.program.nodes, self.values
        q, k, commit, add = fusion.q, fusion.k, fusion.commit, fusion.add
        qx, kx, vx = (values[n] for n in (q.inputs[0], k.inputs[0], commit.inputs[1]))
        source = values[add.inputs[0]].base if add is not None else qx.base
        if add is None:
            chain = [(index[q.name], 0), (index[k.name], 0), (fusion.last, 1)]
        else:
            chain = [(fusion.first, 0)]
        p = made.get(source, -1)
        heads, kv_heads, dim = qx.shape[2], kx.shape[2], qx.shape[3]
        if (
            p < 0
            or nodes[p].outputs[0] != source
            or kx.base != qx.base
            or vx.base != qx.base
            or sorted(readers.get(source, [])) != sorted(chain)
            or any(nodes[n].op not in _VIEWS for n in range(p + 1, fusion.first))
        ):
            return fusion
        projection = nodes[p]
        bias = () if add is None else (add.inputs[1],)
        width = (heads + 2 * kv_heads) * dim
        offsets = (qx.offset, kx.offset, vx.offset)
        if (
            dim % 16
            or int(projection.attrs.get("N", -1)) != width
            or offsets != (0, heads * dim, (heads + kv_heads) * dim)
            or not qx.tok == kx.tok == vx.tok == width
            or self._epilogue_gemv(projection) is None
            or any(self._streamed(n) for n in (*projection.inputs[1:], *bias))
        ):
            return fusion
        return dataclasses.replace(fusion, projection=projection, first=p)

    def _epilogue_gemv(self, node: Node) -> tuple[int, int] | None:
        """(M, N) of a MatMul / 4-bit MatMulNBits(ZP) that may run a GEMV epilogue here, else
        None: a whole (not pieced) [N, K] or 4-bit weight, contiguous x, and at this plan's M
        its plain plan the split-K GEMV (the epilogue kernels have its K split; a v2, streaming
        or GEMM plan is left unfused)."""
        from ep.kernels import matmul

        if node.op not in ("MatMul", "MatMulNBits", "MatMulNBitsZP"):
            return None
        x = self.values[node.inputs[0]]
        a = node.attrs
        if x.tok != x.per_token():
            return None
        fmt: matmul.Format
        if node.op == "MatMul":
            fmt, k, block = "nk", x.shape[-1], 32
            if int(a["transpose_b"]) != 1 or self._split(str(a["weight"])) is not None:
                return None
        else:
            fmt, k, block = "q4", int(a["K"]), int(a["block_size"])
            weights = node.inputs[1 : 4 if node.op == "MatMulNBitsZP" else 3]
            if int(a["bits"]) != 4 or any(self._split(w) is not None for w in weights):
                return None
        n, m = int(a["N"]), x.size // k
        if m > matmul.GEMV_MAX_ROWS:
            return None
        plain = matmul.plan_matmul(
            fmt, x.dtype, M=m, N=n, K=k, block_size=block, workspace=self.matmul_workspace,
            sm_count=matmul.sm_count(self.device),
            max_shared=int(self.device.limits["max_shared_mem"]),
        )  # fmt: skip
        return (m, n) if matmul.split_k_gemv(plain) else None

    def _qkv_fusion(
        self,
        i: int,
        j: int,
        *,
        readers: dict[str, list[tuple[int, int]]],
        made: dict[str, int],
        output: str,
    ) -> _QKVFusion | None:
        """The fusion of the rotation pair at nodes ``i`` (q) and ``j`` (k), or None."""
        nodes, values = self.program.nodes, self.values
        q, k = nodes[i], nodes[j]
        rotated = values[k.outputs[0]].base
        use = readers.get(rotated, [])
        if rotated == output or len(use) != 1 or use[0][1] != 0:
            return None
        c = use[0][0]
        commit = nodes[c]
        if commit.op not in _COMMITS or c < j:
            return None
        if self._resolved(commit.inputs[2:3]) != self._resolved(q.inputs[1:2]):
            return None  # one positions buffer for the rotation and the commit
        xs = [values.get(n) for n in (q.inputs[0], k.inputs[0], commit.inputs[1])]
        if any(x is None or len(x.shape) != 4 for x in xs):
            return None
        qx, kx, vx = xs
        assert qx is not None and kx is not None and vx is not None
        if (
            kx.shape != vx.shape
            or qx.shape[:2] != kx.shape[:2]
            or qx.shape[3] != kx.shape[3]
            or not qx.dtype == kx.dtype == vx.dtype
        ):
            return None
        add, first = None, i
        source = qx.base
        producer = made.get(source, -1)
        if (
            kx.base == source
            and vx.base == source
            and source != output
            and producer >= 0
            and nodes[producer].op == "Add"
            and sorted(readers.get(source, [])) == sorted([(i, 0), (j, 0), (c, 1)])
            and self._bias_ok(nodes[producer])
        ):
            add, first = nodes[producer], producer
        members = {first, i, j, c}
        if any(nodes[n].op not in _VIEWS for n in range(first, c + 1) if n not in members):
            return None  # another node runs inside the chain
        inside = {values[add.outputs[0]].base} if add is not None else set()
        if any(made.get(x.base, -1) >= first and x.base not in inside for x in (qx, kx, vx)):
            return None  # q, k or v is made inside the chain (by the chain itself)
        return _QKVFusion(add, q, k, commit, first, c)

    def _swiglu_fusions(self) -> list[_SwigluFusion]:
        """Every MatMul / 4-bit MatMulNBits whose output only a SwiGLUPacked reads, run as one
        GEMV with a SwiGLU epilogue where that is bitwise the two calls: the SwiGLUPacked is the
        next working node and the projection takes a GEMV epilogue (`_epilogue_gemv`) with N %
        16 == 0. At every M of the GEMV: since the gate/up GEMV runs in one wave
        (`ep.kernels.matmul.plan_matmul`) the epilogue is the faster form at batch 1 too (H200,
        0.5B decode graph, ms a step, epilogue / GEMV then SwiGLUPacked: batch 1 0.684 / 0.693,
        4 0.681 / 0.702; before, with 1216 blocks of the GEMV, from 8 rows only)."""
        nodes, values = self.program.nodes, self.values
        output = values[self.program.output].base
        readers = self._readers()
        found: list[_SwigluFusion] = []
        for i, node in enumerate(nodes):
            if node.op not in ("MatMul", "MatMulNBits", "MatMulNBitsZP"):
                continue
            packed = values[node.outputs[0]]
            use = readers.get(packed.base, [])
            if packed.base == output or packed.base != node.outputs[0] or len(use) != 1:
                continue
            j = use[0][0]
            act = nodes[j]
            if (
                act.op != "SwiGLUPacked"
                or values[act.inputs[0]].base != packed.base
                or values[act.inputs[0]].shape != packed.shape
                or any(nodes[n].op not in _VIEWS for n in range(i + 1, j))
            ):
                continue
            sizes = self._epilogue_gemv(node)
            if sizes is not None and sizes[1] % 16 == 0:
                found.append(_SwigluFusion(node, act, i, j))
        return found

    def _unwritten(self, fusion: _QKVFusion | _SwigluFusion) -> list[str]:
        """The storage a fusion never writes: the packed gate/up product; the rotated k, the
        biased sum when fused, and the packed QKV product when the projection joined."""
        if isinstance(fusion, _SwigluFusion):
            return [self.values[fusion.matmul.outputs[0]].base]
        names = [self.values[fusion.k.outputs[0]].base]
        if fusion.add is not None:
            names.append(self.values[fusion.add.outputs[0]].base)
        if fusion.projection is not None:
            names.append(self.values[fusion.projection.outputs[0]].base)
        return names

    def _bias_ok(self, node: Node) -> bool:
        """An Add of a 1-D bias initializer over x's last axis (all the native Add does)."""
        x = self.values.get(node.inputs[0])
        bias = self.program.arrays.get(self.aliases.get(node.inputs[1], node.inputs[1]))
        return (
            x is not None and bias is not None and bias.ndim == 1 and bias.shape[0] == x.shape[-1]
        )

    def _rotary_args(self, node: Node) -> dict[str, Any]:
        """The table arguments of a Rotary / RotaryTheta node's kernel (caches, or theta)."""
        from ep.kernels import rotary

        a = node.attrs
        interleaved = int(a["interleaved"])
        if node.op == "Rotary":
            cos = self.buffer(node.inputs[2])
            return dict(
                cos_cache=cos, sin_cache=self.buffer(node.inputs[3]),
                max_positions=int(cos.shape[0]), rotary_dim=2 * int(cos.shape[1]),
                interleaved=interleaved,
            )  # fmt: skip
        rot = int(a["rotary_dim"]) or self.values[node.inputs[0]].shape[-1]
        key = (float(a["theta"]), rot)
        if key not in self.inv_freq:
            self.inv_freq[key] = rotary.rotary_inv_freq(
                self.device, key[0], rot, stream=self.stream
            )
        return dict(
            inv_freq=self.inv_freq[key], theta=key[0], rotary_dim=rot, interleaved=interleaved
        )

    def _commit_kwargs(self, fusion: _QKVFusion, kv: KVBinding) -> dict[str, Any]:
        """What both forms of a fused QKV commit take (`ep.kernels.attention.kv_commit_rotary`
        and `rope_epilogue`): the layer's caches, lengths, q's output, positions, shapes, the
        bias when the Add joined, then the rotation's cos/sin tables (the unfused fetch order)."""
        buf, values = self.buffer, self.values
        q, k, commit, add = fusion.q, fusion.k, fusion.commit, fusion.add
        qx, kx = values[q.inputs[0]], values[k.inputs[0]]
        layer = int(commit.attrs["layer"])
        return dict(
            key_cache=kv.keys[layer], value_cache=kv.values[layer],
            lengths=buf(commit.outputs[0]), q_out=buf(q.outputs[0]),
            positions=buf(commit.inputs[2]), batch=self.batch, seq=self.seq, heads=qx.shape[2],
            kv_heads=kx.shape[2], head_dim=qx.shape[3], strides=kv.strides,
            capacity=kv.capacity, bias=None if add is None else buf(add.inputs[1]),
            **self._rotary_args(q), q_out_token_stride=values[q.outputs[0]].tok,
            block_table=kv.block_table, table_cols=kv.table_cols, status=self.status,
        )  # fmt: skip

    def _bind_fusion(self, fusion: _QKVFusion, kv: KVBinding) -> Callable[[], object]:
        """``fusion`` as one `ep.kernels.attention.kv_commit_rotary` call (it fetches its
        weights in the unfused order: the bias, then the rotation's cos/sin tables)."""
        from ep.kernels import attention

        buf, values = self.buffer, self.values
        q, k, commit, add = fusion.q, fusion.k, fusion.commit, fusion.add
        names = (q.inputs[0], k.inputs[0], commit.inputs[1])
        qx, kx, vx = (values[n] for n in names)
        if add is None:
            q_src, k_src, v_src = (buf(n) for n in names)
            offsets = (0, 0, 0)
        else:
            # The views' places in the Add's sum are their places in its unbiased input (same
            # shape, contiguous: `_bind_node` checks the Add the same way).
            packed_name = add.inputs[0]
            self._contiguous(add, packed_name)
            packed = buf(packed_name)
            item = packed.dtype.itemsize
            offsets = (qx.offset, kx.offset, vx.offset)
            q_src, k_src, v_src = (
                packed.view(packed.dtype, offset=o * item, name=f"{packed.name}+{o}")
                for o in offsets
            )
        return functools.partial(
            attention.kv_commit_rotary, self.device, q=q_src, k=k_src, v=v_src,
            **self._commit_kwargs(fusion, kv), bias_offsets=offsets, q_token_stride=qx.tok,
            k_token_stride=kx.tok, v_token_stride=vx.tok, stream=self.stream,
        )  # fmt: skip

    def _bind_matmul(
        self, node: Node, swiglu: Node | None = None, rope: dict[str, Any] | None = None
    ) -> Callable[[], object]:
        """A MatMul / MatMulNBits(ZP) call; with ``swiglu`` (a `_SwigluFusion`'s SwiGLUPacked)
        it writes that node's output through the GEMV's SwiGLU epilogue instead, with ``rope``
        (`_commit_kwargs`) the fused QKV commit through its rotary/KV-commit epilogue."""
        from ep.kernels import matmul

        a, ins, buf = node.attrs, node.inputs, self.buffer
        x = self._contiguous(node, ins[0])
        out = rope["q_out"] if rope is not None else buf((swiglu or node).outputs[0])
        epilogue = None if swiglu is None else int(swiglu.attrs["interleaved"])
        common: dict[str, Any] = dict(
            N=int(a["N"]), stream=self.stream, workspace=self.matmul_workspace, swiglu=epilogue
        )
        if rope is not None:  # built once: the plan joins only weights bound once (not fetched)
            from ep.kernels import attention

            common["rope"] = attention.rope_epilogue(**rope)
        # A weight bound once is resident: no kernel writes it, so the GEMV may load it before
        # it waits for the previous kernel (`ep.kernels.matmul`, "Resident weights").
        if node.op == "MatMul":
            k = x.shape[-1]
            w = self._weight(str(a["weight"]))
            return functools.partial(
                matmul.gemm, self.device, out, buf(ins[0]), w, M=x.size // k, K=k,
                transpose_b=int(a["transpose_b"]),
                resident=self.early and not isinstance(w, _Deferred), **common,
            )  # fmt: skip
        zp = buf(ins[3]) if node.op == "MatMulNBitsZP" else None
        packed, scales = buf(ins[1]), buf(ins[2])
        fetched = any(isinstance(w, _Deferred) for w in (packed, scales, zp))
        return functools.partial(
            matmul.gemm_nbits, self.device, out, buf(ins[0]), packed, scales, zp,
            M=x.size // int(a["K"]), K=int(a["K"]), block_size=int(a["block_size"]),
            bits=int(a["bits"]), resident=self.early and not fetched, **common,
        )  # fmt: skip

    def _streamed(self, name: str) -> bool:
        streamed = getattr(self.weights, "streamed", None)
        return streamed is not None and streamed(self.aliases.get(name, name))

    def _split(self, name: str) -> SplitWeight | None:
        split = getattr(self.weights, "split", None)
        return None if split is None else split(self.aliases.get(name, name))

    def _scratch(self, dtype: np.dtype[Any], elements: int) -> Buffer:
        """A [M, n] buffer for MatMul pieces (one per dtype and size, kept with the plan)."""
        key = (dtype.str, elements)
        found = self._piece_scratch.get(key)
        if found is None:
            found = self.device.alloc(
                elements, dtype, stream=self.stream,
                name=f"piece-scratch:{self.arena.name}:{dtype}:{elements}",
            )  # fmt: skip
            self._piece_scratch[key] = found
        return found

    def _bind_pieces(self, node: Node) -> _PieceCall | None:
        """``node`` as one call per piece when its weight is held in pieces, else None."""
        from ep.kernels import embed, matmul

        dev, st, a, ins, outs = self.device, self.stream, node.attrs, node.inputs, node.outputs
        if node.op == "Gather":
            split = self._split(ins[0])
            if split is None:
                return None
            out, ids, hidden = self.buffer(outs[0]), self.buffer(ins[1]), int(split.shape[1])
            gather = functools.partial(
                embed.embed, dev, out, ids=ids, count=self.batch * self.seq, vocab=split.size,
                hidden=hidden, status=self.status, stream=st,
            )  # fmt: skip
            rows: list[tuple[tuple[str, ...], Callable[[list[Buffer]], None]]] = [
                ((p.name,), functools.partial(_gather_piece, gather, p.start, p.stop))
                for p in split.pieces
            ]
            return _PieceCall(rows, self.weights, st)
        if node.op == "GatherBlockQuantized":
            return self._bind_gbq_pieces(node)
        if node.op == "MatMul":
            group = [self._split(str(a["weight"]))]
        elif node.op in ("MatMulNBits", "MatMulNBitsZP"):
            group = [self._split(n) for n in ins[1 : 4 if node.op == "MatMulNBitsZP" else 3]]
        else:
            return None
        found = _same_pieces(node, group)
        if found is None:
            return None
        splits, bounds = found
        x = self._contiguous(node, ins[0])
        k = int(a["K"]) if node.op != "MatMul" else x.shape[-1]
        m, n_all = x.size // k, int(a["N"])
        out = self.buffer(outs[0])
        item = out.dtype.itemsize
        widest = max(stop - start for start, stop in bounds)
        scratch = self._scratch(out.dtype, m * widest) if m > 1 else None
        if node.op == "MatMul":
            kernel = functools.partial(
                matmul.gemm, dev, x=self.buffer(ins[0]), M=m, K=k,
                transpose_b=int(a["transpose_b"]), stream=st, workspace=self.matmul_workspace,
                split_n=n_all,
            )  # fmt: skip
        else:
            kernel = functools.partial(
                matmul.gemm_nbits, dev, x=self.buffer(ins[0]), M=m, K=k,
                block_size=int(a["block_size"]), bits=int(a["bits"]), stream=st,
                workspace=self.matmul_workspace, split_n=n_all,
            )  # fmt: skip
        parts: list[tuple[tuple[str, ...], Callable[[list[Buffer]], None]]] = []
        for i, (start, stop) in enumerate(bounds):
            n = stop - start
            if scratch is None:  # one row: the piece's columns are contiguous in the output
                target = out.view(out.dtype, (n,), offset=start * item, name=f"{out.name}:{start}")
                place = None
            else:
                target = scratch
                place = functools.partial(
                    dev.copy_2d, out, scratch, width=n * item, height=m, dst_pitch=n_all * item,
                    src_pitch=n * item, dst_offset=start * item, stream=st,
                )  # fmt: skip
            run = functools.partial(_matmul_piece, kernel, target, n, node.op != "MatMul", place)
            parts.append((tuple(g.pieces[i].name for g in splits), run))
        return _PieceCall(parts, self.weights, st)

    def _gbq_call(self, node: Node, **weights: Any) -> functools.partial[Any]:
        """The 4-bit gather of ``node`` (see `_infer_gbq`); ``weights``: the buffers bound now
        (table, scales, zero_points), the rest are passed per piece."""
        from ep.kernels import embed

        data = self._weight_shape(node.inputs[0])
        return functools.partial(
            embed.embed_q4, self.device, self.buffer(node.outputs[0]),
            ids=self.buffer(node.inputs[1]), count=self.batch * self.seq, vocab=data[0],
            hidden=2 * data[1], block_size=int(node.attrs.get("block_size", 128)),
            row_bytes=data[1], status=self.status, stream=self.stream, **weights,
        )  # fmt: skip

    def _gbq_weights(self, node: Node) -> list[str]:
        ins = node.inputs
        return [ins[0], ins[2], *([ins[3]] if len(ins) > 3 and ins[3] else [])]

    def _bind_gbq_pieces(self, node: Node) -> _PieceCall | None:
        """GatherBlockQuantized over data/scales/zero points held in pieces of vocabulary rows:
        per piece, the rows of the ids inside it (bad ids answered by the piece at row 0)."""
        found = _same_pieces(node, [self._split(n) for n in self._gbq_weights(node)])
        if found is None:
            return None
        splits, bounds = found
        gather = self._gbq_call(node)
        parts: list[tuple[tuple[str, ...], Callable[[list[Buffer]], None]]] = [
            (
                tuple(g.pieces[i].name for g in splits),
                functools.partial(_gather_q4_piece, gather, start, stop),
            )
            for i, (start, stop) in enumerate(bounds)
        ]
        return _PieceCall(parts, self.weights, self.stream)

    def _bind_node(
        self, node: Node, kv: KVBinding, joined: Node | None = None
    ) -> Callable[[], object]:
        from ep.kernels import attention, embed, mlp, norm, rotary

        dev, st, a = self.device, self.stream, node.attrs
        ins, outs, buf = node.inputs, node.outputs, self.buffer
        op = node.op
        b, s = self.batch, self.seq
        pieces = self._bind_pieces(node)
        if pieces is not None:
            return pieces
        if op == "Gather":
            table = buf(ins[0])
            return functools.partial(
                embed.embed, dev, buf(outs[0]), table, buf(ins[1]), count=b * s,
                vocab=int(table.shape[0]), hidden=int(table.shape[1]), status=self.status,
                stream=st,
            )  # fmt: skip
        if op == "GatherBlockQuantized":
            names = self._gbq_weights(node)
            zp = buf(names[2]) if len(names) > 2 else None
            return self._gbq_call(node, table=buf(names[0]), scales=buf(names[1]), zero_points=zp)
        if op == "RMSNorm":
            x = self._contiguous(node, ins[0])
            return functools.partial(
                norm.rms_norm, dev, buf(outs[0]), buf(ins[0]), buf(ins[1]),
                rows=x.size // x.shape[-1], hidden=x.shape[-1], epsilon=float(a["epsilon"]),
                stream=st,
            )  # fmt: skip
        if op == "SkipRMSNorm":
            x = self._contiguous(node, ins[0])
            self._contiguous(node, ins[1])
            return functools.partial(
                norm.skip_rms_norm, dev, buf(outs[0]), buf(outs[1]), buf(ins[0]), buf(ins[1]),
                buf(ins[2]), rows=x.size // x.shape[-1], hidden=x.shape[-1],
                epsilon=float(a["epsilon"]), stream=st,
            )  # fmt: skip
        if op in ("MatMul", "MatMulNBits", "MatMulNBitsZP"):
            return self._bind_matmul(node)
        if op == "Add":
            x = self._contiguous(node, ins[0])
            if not self._bias_ok(node):
                raise ModelError(
                    f"{node.name}: the native executor adds a 1-D bias initializer of "
                    f"{x.shape[-1]} to the last axis only"
                )
            return functools.partial(
                nk.add_bias, dev, buf(outs[0]), buf(ins[0]), buf(ins[1]),
                rows=x.size // x.shape[-1], cols=x.shape[-1], stream=st,
            )  # fmt: skip
        if op == "Int8Activations":
            x = self._contiguous(node, ins[0])
            return functools.partial(
                nk.int8_blocks, dev, buf(outs[0]), buf(ins[0]), rows=x.size // x.shape[-1],
                cols=x.shape[-1], block_size=int(a["block_size"]), stream=st,
            )  # fmt: skip
        if op == "Cast":
            x = self._contiguous(node, ins[0])
            return functools.partial(
                nk.cast_f32, dev, buf(outs[0]), buf(ins[0]), n=x.size, stream=st
            )
        if op in ("Rotary", "RotaryTheta"):
            x = self.values[ins[0]]
            _, _, heads, head_dim = x.shape
            common: dict[str, Any] = dict(
                batch=b, seq=s, heads=heads, head_dim=head_dim,
                x_token_stride=x.tok, out_token_stride=self.values[outs[0]].tok,
                status=self.status, stream=st,
            )  # fmt: skip
            if joined is not None:  # k rotated by the same launch
                kx = self.values[joined.inputs[0]]
                common.update(
                    k_out=buf(joined.outputs[0]), k=buf(joined.inputs[0]), kv_heads=kx.shape[2],
                    k_token_stride=kx.tok, k_out_token_stride=self.values[joined.outputs[0]].tok,
                )  # fmt: skip
            kernel = rotary.rotary if op == "Rotary" else rotary.rotary_theta
            return functools.partial(
                kernel, dev, buf(outs[0]), buf(ins[0]), buf(ins[1]), **self._rotary_args(node),
                **common,
            )  # fmt: skip
        if op in ("KVCommit", "KVCommitPaged"):
            kv_k, kv_v = self.values[ins[0]], self.values[ins[1]]
            if kv_k.tok != kv_v.tok:
                raise ModelError(f"{node.name}: K and V views have different token strides")
            layer = int(a["layer"])
            return functools.partial(
                attention.kv_commit, dev, kv.keys[layer], kv.values[layer], buf(outs[0]),
                buf(ins[0]), buf(ins[1]), buf(ins[2]), batch=b, seq=s, kv_heads=kv_k.shape[2],
                head_dim=kv_k.shape[3], strides=kv.strides, capacity=kv.capacity,
                block_table=kv.block_table, table_cols=kv.table_cols, src_token_stride=kv_k.tok,
                status=self.status, stream=st,
            )  # fmt: skip
        if op in ("KVAttention", "KVAttentionPaged"):
            q = self.values[ins[0]]
            layer = int(a["layer"])
            _, _, heads, head_dim = q.shape
            kv_heads = int(a["kv_heads"])
            plan = attention.attention_plan(
                batch=b, seq=s, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                capacity=kv.capacity, max_context=kv.capacity, split=self.split_attention,
            )  # fmt: skip
            workspace = None
            # one per plan: the split merge's counters sit at a place the plan decides
            if plan not in self._attn_workspaces:
                self._attn_workspaces[plan] = attention.attention_workspace(
                    dev, plan, stream=st, name=f"attn-ws:{self.arena.name}:{plan.workspace_elems}"
                )
            workspace = self._attn_workspaces[plan]
            return functools.partial(
                attention.kv_attention, dev, buf(outs[0]), buf(ins[0]), buf(ins[1]), buf(ins[2]),
                kv.keys[layer], kv.values[layer], batch=b, seq=s, heads=heads, kv_heads=kv_heads,
                head_dim=head_dim, strides=kv.strides, capacity=kv.capacity,
                scale=float(a["scale"]), block_table=kv.block_table, table_cols=kv.table_cols,
                query_token_stride=q.tok, workspace=workspace, plan=plan, status=self.status,
                stream=st,
            )  # fmt: skip
        if op == "SwiGLUPacked":
            x = self._contiguous(node, ins[0])
            return functools.partial(
                mlp.swiglu_packed, dev, buf(outs[0]), buf(ins[0]), rows=x.size // x.shape[-1],
                inter=x.shape[-1] // 2, interleaved=int(a["interleaved"]), stream=st,
            )  # fmt: skip
        if op == "SwiGLU":
            g, u = self.values[ins[0]], self.values[ins[1]]
            return functools.partial(
                mlp.swiglu, dev, buf(outs[0]), buf(ins[0]), buf(ins[1]),
                rows=g.size // g.shape[-1], inter=g.shape[-1],
                gate_row_stride=g.tok if g.tok != g.per_token() else 0,
                up_row_stride=u.tok if u.tok != u.per_token() else 0, stream=st,
            )  # fmt: skip
        raise ModelError(f"{node.name}: op {op} has no native implementation")


def _gather_piece(
    gather: Callable[..., None], start: int, stop: int, buffers: list[Buffer]
) -> None:
    gather(table=buffers[0], first_row=start, rows=stop - start)


def _gather_q4_piece(
    gather: Callable[..., None], start: int, stop: int, buffers: list[Buffer]
) -> None:
    zero_points = buffers[2] if len(buffers) > 2 else None
    gather(table=buffers[0], scales=buffers[1], zero_points=zero_points, first_row=start,
           rows=stop - start)  # fmt: skip


def _same_pieces(
    node: Node, group: list[SplitWeight | None]
) -> tuple[list[SplitWeight], list[tuple[int, int]]] | None:
    """The pieces of one node's weights that share output boundaries; None when all are whole."""
    if all(g is None for g in group):
        return None
    splits = [g for g in group if g is not None]
    bounds = [(p.start, p.stop) for p in splits[0].pieces]
    if len(splits) != len(group) or any(
        [(p.start, p.stop) for p in g.pieces] != bounds for g in splits
    ):
        raise ModelError(
            f"{node.name}: the weights of one {node.op} must be held in pieces with the same "
            f"output boundaries (or all whole); got {[g and len(g.pieces) for g in group]}"
        )
    return splits, bounds


def _matmul_piece(
    kernel: Callable[..., object],
    target: Buffer,
    n: int,
    nbits: bool,
    place: Callable[[], None] | None,
    buffers: list[Buffer],
) -> None:
    """One MatMul piece: its n output columns into ``target``, then ``place`` them (2-D copy)."""
    if nbits:
        zero_points = buffers[2] if len(buffers) > 2 else None
        kernel(out=target, b=buffers[0], scales=buffers[1], zero_points=zero_points, N=n)
    else:
        kernel(out=target, w=buffers[0], N=n)
    if place is not None:
        place()
