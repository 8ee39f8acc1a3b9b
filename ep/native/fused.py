"""The native executor's decode step as one persistent kernel (`ep.kernels.stack`) where the
model and the device allow it (``decode.fused``: ``auto``, ``on``, ``off``).

`match_stack` reads an ep `Program` as a Llama/Qwen2-style bf16 decoder: the embedding Gather;
per layer the (Skip)RMSNorm, the packed QKV MatMul (with or without its bias Add), the Split into
q/k/v, RotaryTheta on q and k, KVCommit and KVAttention, the O MatMul, the SkipRMSNorm, the packed
gate/up MatMul, SwiGLUPacked, the down MatMul; then the final SkipRMSNorm, the head MatMul and its
Cast to float32. Every edge between them is checked through the graph's aliases (BitCast,
Identity, Reshape), so a graph that computes anything else is refused, with the first node
that differs and what was expected there.

`FusedDecode` binds the kernel to a backend: it packs the layers' weights into the blocks'
streams once (a second copy of the layer weights on the device: the op-per-launch plan keeps its
own for prefill), takes the head and the embedding table from the backend's weights (one copy),
and runs a batch-1 decode step on the plan's own buffers: its input ids, positions, float32
logits, and the KV cache's layer buffers through the layout's strides (`StackIO`). Prefill, and
steps the kernel cannot take (a position from `StackStep.positions` on: 2048, or 2048 a block
of a split attention; a paged layout; another batch), stay with the plan.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from ep.device import Buffer, Device, Stream
from ep.errors import OffloadError
from ep.native.plan import KVBinding
from ep.native.program import Node, Program
from ep.seams import KVStrides

if TYPE_CHECKING:
    from ep.kernels.stack import StackIO, StackShape

__all__ = [
    "FUSED_MODES",
    "FusedDecode",
    "StackMatch",
    "fused_kernel_refusal",
    "fused_refusal",
    "match_stack",
    "stack_layers",
]

FUSED_MODES = ("auto", "on", "off")
BF16 = np.dtype(ml_dtypes.bfloat16)
_ALIASES = frozenset({"BitCast", "Identity", "Reshape"})
_LAYER_WEIGHTS = ("input_norm", "qkv", "qkv_bias", "o", "post_norm", "gate_up", "down")


@dataclass(frozen=True)
class StackMatch:
    """What `match_stack` found: the shape, the rotary theta, and initializer names."""

    shape: StackShape
    theta: float
    embed: str  # [vocab, hidden]
    head: str
    final_norm: str
    layers: tuple[dict[str, str], ...]  # per layer: _LAYER_WEIGHTS -> name ("" : no QKV bias)
    rows: frozenset[str]  # MatMul weights stored [N, K] (transpose_b = 1), not [K, N]


class _Mismatch(Exception):
    pass


class _Walk:
    """The program's working nodes in order, each input followed through aliases to the value
    (a graph input, an initializer or a working node's output) it is."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self.alias: dict[str, str] = {}
        self.nodes: list[Node] = []
        for node in program.nodes:
            if node.op in _ALIASES:
                self.alias[node.outputs[0]] = self.source(node.inputs[0])
            else:
                self.nodes.append(node)
        self.at = 0
        self.rows: set[str] = set()

    def source(self, name: str) -> str:
        return self.alias.get(name, name)

    def take(self, op: str, what: str) -> Node:
        if self.at >= len(self.nodes):
            raise _Mismatch(f"the graph ends where {what} ({op}) was expected")
        node = self.nodes[self.at]
        if node.op != op:
            raise _Mismatch(f"node {node.name!r} is {node.op}; expected {what} ({op})")
        self.at += 1
        return node

    def peek(self) -> str:
        return self.nodes[self.at].op if self.at < len(self.nodes) else ""

    def reads(self, node: Node, index: int, value: str, what: str) -> None:
        got = self.source(node.inputs[index]) if index < len(node.inputs) else ""
        if got != value:
            raise _Mismatch(f"node {node.name!r} input {index} is {got!r}; expected {what}")

    def weight(self, node: Node, index: int, what: str, ndim: int) -> str:
        name = self.source(node.inputs[index]) if index < len(node.inputs) else ""
        array = self.program.arrays.get(name)
        if array is None:
            raise _Mismatch(f"node {node.name!r} input {index} ({what}) is not an initializer")
        if array.dtype != BF16 or array.ndim != ndim:
            raise _Mismatch(
                f"{what} {name!r} is {array.dtype} {list(array.shape)}; the fused step needs "
                f"bf16 with {ndim} dimension(s)"
            )
        return name

    def matmul(self, node: Node, x: str, what: str, k: int, n: int | None) -> tuple[str, int]:
        """The MatMul's weight name and N, after checking it reads ``x`` and is [K, N] (or [N,
        K] with ``transpose_b = 1``: then its name joins ``rows``)."""
        self.reads(node, 0, x, f"{what}'s input")
        name = str(node.attrs.get("weight", ""))
        array = self.program.arrays.get(name)
        if array is None or array.dtype != BF16 or array.ndim != 2:
            raise _Mismatch(f"{what} {node.name!r} does not read a bf16 matrix initializer")
        rows = int(node.attrs.get("transpose_b", 0)) == 1
        if rows:
            self.rows.add(name)
        kk, nn = (array.shape[1], array.shape[0]) if rows else array.shape
        if kk != k or (n is not None and nn != n) or len(node.inputs) > 1:
            raise _Mismatch(
                f"{what} {node.name!r} is [{kk}, {nn}] with {len(node.inputs) - 1} extra "
                f"input(s); expected [{k}, {n if n is not None else 'N'}] and none"
            )
        return name, int(nn)


def match_stack(program: Program) -> StackMatch:
    """``program`` as the fused kernel's decoder, or `ValueError` naming the first difference."""
    try:
        return _match(_Walk(program))
    except _Mismatch as exc:
        raise ValueError(str(exc)) from None


def _match(w: _Walk) -> StackMatch:
    from ep.kernels.stack import StackShape

    gather = w.take("Gather", "the embedding lookup")
    embed = w.weight(gather, 0, "the embedding table", 2)
    w.reads(gather, 1, "input_ids", "the graph input 'input_ids'")
    hidden = int(w.program.arrays[embed].shape[1])
    residual, skip = w.source(gather.outputs[0]), ""
    layers: list[dict[str, str]] = []
    found: dict[str, Any] = {}
    eps: set[float] = set()

    def norm(what: str) -> tuple[Node, str, str]:
        """The layer's first norm (RMSNorm of the embedding, else the SkipRMSNorm adding the
        last down projection), the residual after it, and its weight."""
        if not skip:
            node = w.take("RMSNorm", what)
            w.reads(node, 0, residual, "the embedding")
            weight_at, out_sum = 1, residual
        else:
            node = w.take("SkipRMSNorm", what)
            w.reads(node, 0, residual, "the residual stream")
            w.reads(node, 1, skip, "the down projection's output")
            weight_at, out_sum = 2, w.source(node.outputs[1])
        eps.add(float(node.attrs.get("epsilon", 1e-5)))
        return node, out_sum, w.weight(node, weight_at, f"{what}'s weight", 1)

    while w.peek() in ("RMSNorm", "SkipRMSNorm") and _is_layer(w):
        li = len(layers)
        names: dict[str, str] = {}
        node, residual, names["input_norm"] = norm(f"layer {li}'s input norm")
        qkv = w.take("MatMul", f"layer {li}'s QKV projection")
        names["qkv"], n_qkv = w.matmul(qkv, w.source(node.outputs[0]), "the QKV projection",
                                       hidden, None)  # fmt: skip
        packed = w.source(qkv.outputs[0])
        names["qkv_bias"] = ""
        if w.peek() == "Add":
            add = w.take("Add", f"layer {li}'s QKV bias")
            w.reads(add, 0, packed, "the QKV projection")
            names["qkv_bias"] = w.weight(add, 1, "the QKV bias", 1)
            packed = w.source(add.outputs[0])
        split = w.take("Split", f"layer {li}'s q/k/v split")
        w.reads(split, 0, packed, "the QKV projection")
        sizes = w.program.arrays.get(split.inputs[1]) if len(split.inputs) > 1 else None
        if sizes is None or len(split.outputs) != 3 or int(split.attrs.get("axis", -1)) != -1:
            raise _Mismatch(f"split {split.name!r} is not a q/k/v split along the last axis")
        q_out, k_out, v_out = (w.source(o) for o in split.outputs)
        q_size, k_size, v_size = (int(v) for v in np.asarray(sizes).reshape(-1))
        rotated: dict[str, str] = {}
        for _ in range(2):
            rot = w.take("RotaryTheta", f"layer {li}'s rotary embedding of q and k")
            src = w.source(rot.inputs[0])
            which = "q" if src == q_out else "k" if src == k_out else ""
            if not which or which in rotated:
                raise _Mismatch(f"rotary {rot.name!r} does not rotate q or k of {split.name!r}")
            w.reads(rot, 1, "positions", "the graph input 'positions'")
            if int(rot.attrs.get("interleaved", 0)) or int(rot.attrs.get("rotary_dim", 0)):
                raise _Mismatch(f"rotary {rot.name!r} is interleaved or partial")
            found.setdefault("theta", float(rot.attrs["theta"]))
            if float(rot.attrs["theta"]) != found["theta"]:
                raise _Mismatch(f"rotary {rot.name!r} has another theta")
            rotated[which] = w.source(rot.outputs[0])
        commit = w.take("KVCommit", f"layer {li}'s KV commit")
        w.reads(commit, 0, rotated["k"], "the rotated k")
        w.reads(commit, 1, v_out, "v")
        attend = w.take("KVAttention", f"layer {li}'s attention")
        w.reads(attend, 0, rotated["q"], "the rotated q")
        w.reads(attend, 2, w.source(commit.outputs[0]), "the KV commit")
        for node_ in (commit, attend):
            if int(node_.attrs.get("layer", -1)) != li:
                raise _Mismatch(f"{node_.name!r} is for layer {node_.attrs.get('layer')}, not {li}")
        kv_heads = int(attend.attrs.get("kv_heads", 0))
        if kv_heads < 1 or k_size != v_size or k_size % kv_heads:
            raise _Mismatch(f"k and v of {split.name!r} ({k_size}, {v_size}) are not "
                            f"{kv_heads} KV heads each")  # fmt: skip
        head_dim = k_size // kv_heads
        found.setdefault("scale", float(attend.attrs.get("scale", 0.0)))
        o = w.take("MatMul", f"layer {li}'s O projection")
        names["o"], _ = w.matmul(o, w.source(attend.outputs[0]), "the O projection",
                                 q_size, hidden)  # fmt: skip
        post = w.take("SkipRMSNorm", f"layer {li}'s post-attention norm")
        w.reads(post, 0, residual, "the residual stream")
        w.reads(post, 1, w.source(o.outputs[0]), "the O projection")
        names["post_norm"] = w.weight(post, 2, "the post-attention norm's weight", 1)
        eps.add(float(post.attrs.get("epsilon", 1e-5)))
        residual = w.source(post.outputs[1])
        gate_up = w.take("MatMul", f"layer {li}'s gate/up projection")
        names["gate_up"], n_gu = w.matmul(gate_up, w.source(post.outputs[0]),
                                          "the gate/up projection", hidden, None)  # fmt: skip
        swiglu = w.take("SwiGLUPacked", f"layer {li}'s SwiGLU")
        w.reads(swiglu, 0, w.source(gate_up.outputs[0]), "the gate/up projection")
        if int(swiglu.attrs.get("interleaved", 0)):
            raise _Mismatch(f"SwiGLU {swiglu.name!r} is interleaved (gate and up alternate)")
        down = w.take("MatMul", f"layer {li}'s down projection")
        names["down"], _ = w.matmul(down, w.source(swiglu.outputs[0]), "the down projection",
                                    n_gu // 2, hidden)  # fmt: skip
        skip = w.source(down.outputs[0])
        dims = (q_size // head_dim, kv_heads, head_dim, n_gu // 2, n_qkv)
        found.setdefault("dims", dims)
        if dims != found["dims"] or q_size % head_dim or n_qkv != q_size + 2 * k_size:
            raise _Mismatch(f"layer {li}'s q/k/v sizes {[q_size, k_size, v_size]} differ from "
                            "the first layer's or from its QKV projection")  # fmt: skip
        layers.append(names)
    if not layers:
        raise _Mismatch("no decoder layer (RMSNorm, QKV MatMul, ...) after the embedding")
    final = w.take("SkipRMSNorm", "the final norm")
    w.reads(final, 0, residual, "the residual stream")
    w.reads(final, 1, skip, "the last down projection")
    final_norm = w.weight(final, 2, "the final norm's weight", 1)
    eps.add(float(final.attrs.get("epsilon", 1e-5)))
    head = w.take("MatMul", "the LM head")
    head_name, vocab = w.matmul(head, w.source(final.outputs[0]), "the LM head", hidden, None)
    cast = w.take("Cast", "the logits' Cast to float32")
    w.reads(cast, 0, w.source(head.outputs[0]), "the LM head")
    if int(cast.attrs.get("to", 0)) != 1 or cast.outputs[0] != w.program.output:
        raise _Mismatch(f"{cast.name!r} is not the Cast of the head to the float32 logits")
    if w.at != len(w.nodes):
        raise _Mismatch(f"node {w.nodes[w.at].name!r} ({w.nodes[w.at].op}) follows the logits")
    if len(eps) != 1:
        raise _Mismatch(f"the norms use different epsilons {sorted(eps)}")
    heads, kv_heads, head_dim, inter, _ = found["dims"]
    shape = StackShape(hidden, heads, kv_heads, head_dim, inter, len(layers), eps.pop(),
                       found["scale"])  # fmt: skip
    if w.program.arrays[embed].shape[0] < vocab:
        raise _Mismatch(f"the embedding has fewer rows than the head's {vocab} logits")
    return StackMatch(
        shape=shape,
        theta=found["theta"],
        embed=embed,
        head=head_name,
        final_norm=final_norm,
        layers=tuple(layers),
        rows=frozenset(w.rows),
    )


def _is_layer(w: _Walk) -> bool:
    """Whether the norm at the walk's position starts a layer (a MatMul follows), not the
    final norm (the head follows, then the Cast)."""
    rest = w.nodes[w.at + 1 : w.at + 3]
    return len(rest) == 2 and rest[0].op == "MatMul" and rest[1].op != "Cast"


def fused_kernel_refusal(device: Device, shape: StackShape) -> str:
    """Why the fused kernel cannot run ``shape`` on ``device`` ("" when it can)."""
    from ep.device import kernel_target
    from ep.errors import KernelArgumentError
    from ep.kernels.matmul import sm_count
    from ep.kernels.stack import stack_kernel

    try:
        source = stack_kernel(shape, sm_count(device))
    except KernelArgumentError as exc:
        return str(exc)
    if device.kind != "cpu" and kernel_target(source, device.arch or "") is None:
        return (f"the fused kernel needs sm_90a (bulk copies, mbarriers, a cooperative launch); "
                f"this GPU is {device.arch}")  # fmt: skip
    return ""


def fused_refusal(batch: int, strides: KVStrides | None) -> str:
    """Why a step at ``batch`` on a cache of ``strides`` cannot be the fused kernel's ("" when
    it can)."""
    if batch != 1:
        return f"batch {batch}: the fused step decodes one sequence"
    if strides is not None:
        s = strides
        if s.page_size:
            return "a paged KV layout: the fused step reads contiguous per-layer caches"
        if s.dim != 1 or s.token % 8 or s.head % 8:
            return (f"KV strides token {s.token}, head {s.head}, dim {s.dim}: the fused step "
                    "needs dim 1 and 16-byte rows")  # fmt: skip
    return ""


def stack_layers(
    program: Program, match: StackMatch
) -> tuple[list[dict[str, np.ndarray]], np.ndarray]:
    """``match``'s layers as `ep.kernels.stack.pack_stack` and `reference_step` take them
    (projections [K, N], zero biases where the graph has no Add), and the final norm's weight."""
    arrays = program.arrays
    layers = []
    for names in match.layers:
        layer = {}
        for key in _LAYER_WEIGHTS:
            name = names[key]
            if key == "qkv_bias" and not name:
                layer[key] = np.zeros(match.shape.qkv, BF16)
            else:  # a prepacked MatMul weight is [N, K]
                layer[key] = arrays[name].T if name in match.rows else arrays[name]
        layers.append(layer)
    return layers, arrays[match.final_norm]


class FusedDecode:
    """`ep.kernels.stack.StackStep` for ``match`` on ``device``, fed by the backend's buffers."""

    def __init__(
        self, device: Device, program: Program, match: StackMatch, weights: Any, *,
        stream: Stream, status: Buffer,
    ) -> None:  # fmt: skip
        from ep.kernels.stack import PICK_MASK, StackStep
        from ep.ops.rotary import _inv_freq

        arrays = program.arrays
        layers, final_norm = stack_layers(program, match)

        def table(name: str, rows: bool) -> Buffer:
            """The backend's buffer of a [rows, hidden] table, or a copy of our own where the
            backend has none whole (an offload store's pieces) or holds it [hidden, rows]."""
            if rows:
                try:
                    found = weights.fixed(name, stream=stream)
                except OffloadError:
                    found = None
                if found is not None:
                    return found
            array = arrays[name] if rows else arrays[name].T
            return device.to_device(np.ascontiguousarray(array), stream=stream,
                                    name=f"fused:{name}")  # fmt: skip

        head_rows = match.head in match.rows
        head = table(match.head, head_rows)
        embed = head if match.embed == match.head and head_rows else table(match.embed, True)
        self.match = match
        self.stream = stream
        self.step = StackStep(
            device, match.shape, layers, final_norm,
            _inv_freq(match.theta, match.shape.head_dim),
            head, None, stream=stream, embed=embed, status=status,
        )  # fmt: skip
        self._kv = device.alloc(2 * match.shape.layers, np.uint64, stream=stream, name="fused.kv")
        self._kv_for: tuple[int, ...] = ()
        # a picking launch's token for position p + 1 lands in tokens[p + 1]; _picking holds
        # whether launches pick and the ids they mask (StackIO), as set_picking last wrote it
        self.tokens = device.alloc(
            self.step.positions + 1, np.int64, stream=stream, name="fused.tokens"
        )
        self._picking = device.alloc(1 + PICK_MASK, np.int64, stream=stream, name="fused.picking")
        device.fill(self._picking, 0, stream=stream)
        self.picking: tuple[int, ...] = (0,)

    def io(self, plan: Any, binding: KVBinding) -> StackIO:
        """The `StackIO` of ``plan``'s buffers and ``binding``'s cache (its addresses written to
        the kernel's table when they changed; a captured launch reads them from there), and of
        this object's ``tokens`` and picking flag (`set_picking`)."""
        from ep.kernels.stack import StackIO, kv_addresses

        addresses = kv_addresses(list(binding.keys), list(binding.values))
        now = tuple(addresses.tolist())
        if now != self._kv_for:
            self._kv.copy_from_host(addresses, stream=self.stream)
            self._kv_for = now
        io = StackIO(
            ids=plan.input_ids, pos=plan.positions, logits=plan.logits, kv=self._kv,
            token_stride=binding.strides.token, head_stride=binding.strides.head,
            capacity=binding.capacity, tokens=self.tokens, picking=self._picking,
        )  # fmt: skip
        self.step.check_io(io)
        return io

    def call(self, io: StackIO) -> Callable[[], None]:
        """The step's one call (what the capture manager runs, captures and replays)."""
        step, stream = self.step, self.stream

        def fused_step() -> None:
            step.launch(stream=stream, io=io)

        return fused_step

    def set_picking(self, on: bool, mask: np.ndarray | tuple[int, ...] = ()) -> None:
        """Whether the next launches take the greedy pick, with the ids in ``mask`` (at most
        `ep.kernels.stack.PICK_MASK`) masked: values on the device, written only when they
        change (the launch, and its graph, stay the same every way)."""
        now = (1 + len(mask), *(int(i) for i in mask)) if on else (0,)
        if now != self.picking:
            self._picking.view(shape=len(now)).copy_from_host(np.array(now, np.int64),
                                                              stream=self.stream)  # fmt: skip
            self.picking = now

    def signature(self) -> tuple[str, int, tuple[Any, ...], str]:
        """A binding-signature entry telling the fused step's graphs from the plan's."""
        s = self.match.shape
        return ("fused.stack", self.step.ws.ptr, (s.hidden, s.layers, s.inter), "stack")
