"""Local patterns: norms, SwiGLU, MatMul on a weight, MatMulNBits, RotaryEmbedding.

Each pattern walks the live nodes, checks every condition its replacement needs and either
replaces the node(s) — the new nodes produce the old output names, so readers need no change — or
records a `LeftAlone` with the reason. Replaced nodes' helpers (a Sigmoid, a Pow...) are dropped
later by `Graph.finish` when nothing reads them any more.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ep.ops import float_attr_exact
from ep.rewrite._graph import ELEM_DTYPES, Graph
from ep.rewrite._types import LeftAlone, RewriteOptions

__all__ = ["Rewrite", "attrs_of", "local_patterns"]

_ONNX = ("", "ai.onnx")
_MS = "com.microsoft"


def attrs_of(node: onnx.NodeProto) -> dict[str, Any]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


class Rewrite:
    """One rewrite in progress: the graph, the options, the counts and the reasons."""

    def __init__(self, g: Graph, options: RewriteOptions, dtype: str) -> None:
        self.g = g
        self.options = options
        self.dtype = dtype  # the activations' dtype (the KV dtype of a decoder)
        self.counts: Counter[str] = Counter()
        self.left: list[LeftAlone] = []

    def done(self, pattern: str, count: int = 1) -> None:
        self.counts[pattern] += count

    def leave(self, pattern: str, node: onnx.NodeProto, reason: str) -> None:
        self.left.append(LeftAlone(pattern, node.name or "(unnamed)", node.op_type, reason))

    def nodes(self, op_type: str, domains: tuple[str, ...] = _ONNX) -> list[onnx.NodeProto]:
        return [
            n
            for n in self.g.nodes
            if self.g.live(n) and n.op_type == op_type and n.domain in domains
        ]

    def weight_dtype(self, name: str) -> str | None:
        elem = self.g.elem_type(name)
        return ELEM_DTYPES.get(elem) if elem is not None else None

    def exact(self, value: float) -> bool:
        return float_attr_exact(value)


def local_patterns(rw: Rewrite) -> None:
    """Every local pattern, in an order where none hides another's match."""
    simplified_layer_norm(rw)
    skip_simplified_layer_norm(rw)
    rms_norm_subgraph(rw)
    swiglu(rw)
    rotary_embedding(rw)
    matmul_nbits(rw)
    matmul_named_weight(rw)


# --- norms -----------------------------------------------------------------------------------


def _inexact_eps(eps: float) -> str:
    return (
        f"epsilon={eps!r} has more than 6 significant digits and would reach RMSNorm rounded "
        "(onnxruntime-extensions passes float attributes with 6 digits)"
    )


def simplified_layer_norm(rw: Rewrite) -> None:
    pattern = "simplified_layer_norm"
    for node in rw.nodes("SimplifiedLayerNormalization", (*_ONNX, _MS)):
        a = attrs_of(node)
        eps = float(a.get("epsilon", 1e-5))
        axis = int(a.get("axis", -1))
        rank = rw.g.rank(node.input[0])
        dtype = rw.weight_dtype(node.input[1])
        if axis != -1 and (rank is None or axis != rank - 1):
            rw.leave(pattern, node, f"axis={axis}: RMSNorm normalizes the last axis only")
        elif int(a.get("stash_type", 1)) != 1:
            rw.leave(pattern, node, "stash_type is not 1: RMSNorm computes in float32")
        elif not rw.exact(eps):
            rw.leave(pattern, node, _inexact_eps(eps))
        elif any(rw.g.used(out) for out in node.output[1:] if out):
            rw.leave(pattern, node, "its inv_std_var output is read; RMSNorm has no such output")
        elif dtype is None or dtype != rw.dtype:
            rw.leave(
                pattern,
                node,
                f"its scale is {dtype or 'not a float initializer'}; the "
                f"activations are {rw.dtype}",
            )
        else:
            rw.g.remove([node])
            rw.g.op(
                "RMSNorm",
                node.input[:2],
                [node.output[0]],
                name=node.name,
                keep_name=True,
                dtype=dtype,
                epsilon=eps,
            )
            rw.done(pattern)


def skip_simplified_layer_norm(rw: Rewrite) -> None:
    pattern = "skip_simplified_layer_norm"
    for node in rw.nodes("SkipSimplifiedLayerNormalization", (_MS,)):
        eps = float(attrs_of(node).get("epsilon", 1e-5))
        dtype = rw.weight_dtype(node.input[2])
        outs = list(node.output) + [""] * (4 - len(node.output))
        if len(node.input) > 3 and node.input[3]:
            rw.leave(pattern, node, "it adds a bias input; SkipRMSNorm has none")
        elif any(rw.g.used(o) for o in outs[1:3] if o):
            rw.leave(pattern, node, "its mean/inv_std_var outputs are read")
        elif not rw.exact(eps):
            rw.leave(pattern, node, _inexact_eps(eps))
        elif dtype is None or dtype != rw.dtype:
            rw.leave(
                pattern,
                node,
                f"its gamma is {dtype or 'not a float initializer'}; the "
                f"activations are {rw.dtype}",
            )
        else:
            rw.g.remove([node])
            total = outs[3] or rw.g.fresh(f"{node.name}/sum")  # every output must be connected
            rw.g.op(
                "SkipRMSNorm",
                node.input[:3],
                [outs[0], total],
                name=node.name,
                keep_name=True,
                dtype=dtype,
                epsilon=eps,
            )
            rw.done(pattern)


def _cast_to(g: Graph, name: str, elem: int) -> str | None:
    """The input of a Cast(to=elem) producing ``name``, else None."""
    node = g.producer.get(name)
    if node is not None and node.op_type == "Cast" and attrs_of(node).get("to") == elem:
        return node.input[0]
    return None


def rms_norm_subgraph(rw: Rewrite) -> None:
    """x / sqrt(mean(x^2) + eps) * w (optionally computed in float32 between Casts)."""
    g = rw.g
    for sqrt in rw.nodes("Sqrt"):
        if not g.live(sqrt):
            continue
        match = _match_rms(rw, sqrt)
        if match is None:
            continue
        x, weight, eps, mul, removed = match
        dtype = rw.weight_dtype(weight)
        if not rw.exact(eps):
            rw.leave("rms_norm_subgraph", mul, _inexact_eps(eps))
            continue
        if dtype != rw.dtype:
            rw.leave("rms_norm_subgraph", mul, f"its weight is {dtype}; activations {rw.dtype}")
            continue
        add = g.producer.get(x)
        skip = (
            add is not None
            and add.op_type == "Add"
            and add.domain in _ONNX
            and len(add.input) == 2
            and all(g.const(i) is None and i not in g.initializers for i in add.input)
        )
        g.remove([mul, *removed])
        if skip:
            assert add is not None
            g.remove([add])
            g.op(
                "SkipRMSNorm",
                [add.input[0], add.input[1], weight],
                [mul.output[0], x],
                name=f"{mul.name}/SkipRMSNorm",
                dtype=dtype,
                epsilon=eps,
            )
            rw.done("skip_rms_norm_subgraph")
        else:
            g.op(
                "RMSNorm",
                [x, weight],
                [mul.output[0]],
                name=f"{mul.name}/RMSNorm",
                dtype=dtype,
                epsilon=eps,
            )
            rw.done("rms_norm_subgraph")
        g.reindex()


def _only_reader(g: Graph, name: str, op_type: str) -> onnx.NodeProto | None:
    readers = g.readers(name)
    if len(readers) == 1 and readers[0].op_type == op_type and readers[0].domain in _ONNX:
        return readers[0]
    return None


def _match_rms(
    rw: Rewrite, sqrt: onnx.NodeProto
) -> tuple[str, str, float, onnx.NodeProto, list[onnx.NodeProto]] | None:
    """(x, weight, eps, the final Mul, nodes replaced) of an RMS norm around ``sqrt``."""
    g = rw.g
    add_eps = g.producer.get(sqrt.input[0])
    if add_eps is None or add_eps.op_type != "Add":
        return None
    eps_in = [i for i in add_eps.input if g.const(i) is not None]
    mean_in = [i for i in add_eps.input if g.const(i) is None]
    if len(eps_in) != 1 or len(mean_in) != 1:
        return None
    eps = g.const_float(eps_in[0])
    mean = g.producer.get(mean_in[0])
    if eps is None or mean is None or mean.op_type != "ReduceMean":
        return None
    a = attrs_of(mean)
    axes = a.get("axes") or (g.const_ints(mean.input[1]) if len(mean.input) > 1 else None)
    if list(axes or []) != [-1] or int(a.get("keepdims", 1)) != 1:
        return None
    square = g.producer.get(mean.input[0])
    if square is None:
        return None
    squares = square.op_type == "Pow" and g.const_float(square.input[1]) == 2.0
    if not squares and not (square.op_type == "Mul" and square.input[0] == square.input[1]):
        return None
    xf = square.input[0]
    # x / sqrt(...) or x * Reciprocal(sqrt(...))
    div = _only_reader(g, sqrt.output[0], "Div")
    removed = [sqrt, add_eps, mean, square]
    if div is not None and div.input[0] == xf:
        normed = div.output[0]
        removed.append(div)
    else:
        recip = _only_reader(g, sqrt.output[0], "Reciprocal")
        scale = _only_reader(g, recip.output[0], "Mul") if recip else None
        if recip is None or scale is None or xf not in scale.input:
            return None
        normed = scale.output[0]
        removed += [recip, scale]
    x = _cast_to(g, xf, TensorProto.FLOAT) or xf
    down = _only_reader(g, normed, "Cast")
    if down is not None:
        normed = down.output[0]
        removed.append(down)
    mul = _only_reader(g, normed, "Mul")
    if mul is None:
        return None
    weight = next((i for i in mul.input if i != normed), None)
    if weight is None or weight not in g.initializers or g.rank(weight) != 1:
        return None
    return x, weight, eps, mul, removed


# --- SwiGLU ----------------------------------------------------------------------------------


def swiglu(rw: Rewrite) -> None:
    """Mul(Mul(g, Sigmoid(g)), up) in any operand order -> SwiGLU(g, up)."""
    g = rw.g
    for outer in rw.nodes("Mul"):
        if not g.live(outer):
            continue
        for act_name, up in ((outer.input[0], outer.input[1]), (outer.input[1], outer.input[0])):
            act = g.producer.get(act_name)
            if act is None or act.op_type != "Mul" or not g.live(act) or act is outer:
                continue
            gate = None
            for x, s in ((act.input[0], act.input[1]), (act.input[1], act.input[0])):
                sig = g.producer.get(s)
                if sig is not None and sig.op_type == "Sigmoid" and sig.input[0] == x:
                    gate = x
            if gate is None or g.const(up) is not None:
                continue
            g.remove([outer])
            g.op(
                "SwiGLU",
                [gate, up],
                [outer.output[0]],
                name=outer.name,
                keep_name=True,
                dtype=rw.dtype,
            )
            rw.done("swiglu")
            break
    g.reindex()


# --- MatMul ------------------------------------------------------------------------------------


def matmul_named_weight(rw: Rewrite) -> None:
    pattern = "matmul_named_weight"
    g = rw.g
    for node in rw.nodes("MatMul"):
        b = node.input[1]
        weight, transpose = b, 0
        producer = g.producer.get(b)
        if b not in g.initializers and producer is not None and producer.op_type == "Transpose":
            perm = attrs_of(producer).get("perm")
            if list(perm or []) == [1, 0] and producer.input[0] in g.initializers:
                weight, transpose = producer.input[0], 1
        if weight not in g.initializers:
            what = f"{producer.op_type} node {producer.name!r}" if producer else "a graph input"
            rw.leave(pattern, node, f"its B is computed by {what}, not a weight initializer")
            continue
        dims = list(g.initializers[weight].dims)
        dtype = rw.weight_dtype(weight)
        if not rw.options.named_weights:
            rw.leave(pattern, node, "named weights are off (--keep-matmul): ONNX MatMul kept")
        elif len(dims) != 2:
            rw.leave(pattern, node, f"its weight {weight!r} has shape {dims}; expected 2-D")
        elif dtype != rw.dtype:
            rw.leave(pattern, node, f"its weight is {dtype}; the activations are {rw.dtype}")
        else:
            g.remove([node])
            g.op(
                "MatMul",
                [node.input[0]],
                [node.output[0]],
                name=node.name,
                keep_name=True,
                dtype=dtype,
                weight=weight,
                N=int(dims[0] if transpose else dims[1]),
                transpose_b=transpose,
            )
            g.named_weights.add(weight)
            rw.done(pattern)


_FLOAT_ACCURACY = (0, 1)  # unset / fp32: MatMulNBits' float arithmetic, as the op computes


def matmul_nbits(rw: Rewrite) -> None:
    pattern = "matmul_nbits"
    g = rw.g
    for node in rw.nodes("MatMulNBits", (_MS,)):
        a = attrs_of(node)
        k, n = int(a.get("K", 0)), int(a.get("N", 0))
        bits, block = int(a.get("bits", 4)), int(a.get("block_size", 0))
        level = int(a.get("accuracy_level", 0))
        inputs = list(node.input) + [""] * (6 - len(node.input))
        zp = inputs[3]
        b_dims = list(g.initializers[inputs[1]].dims) if inputs[1] in g.initializers else None
        dtype = rw.weight_dtype(inputs[2])
        if bits != 4:
            rw.leave(pattern, node, f"bits={bits}; the op takes 4-bit weights only")
        elif block < 16 or block & (block - 1):
            rw.leave(pattern, node, f"block_size={block}; the op needs a power of two >= 16")
        elif inputs[4] or inputs[5]:
            rw.leave(pattern, node, "it has a g_idx or bias input, which the op does not take")
        elif zp and g.elem_type(zp) not in (TensorProto.UINT8, None):
            rw.leave(pattern, node, "its zero points are not packed uint8")
        elif b_dims is not None and b_dims != [n, -(-k // block), block // 2]:
            rw.leave(
                pattern,
                node,
                f"its B has shape {b_dims}; K={k}, N={n} need {[n, -(-k // block), block // 2]}",
            )
        elif dtype != rw.dtype:
            rw.leave(pattern, node, f"its scales are {dtype}; the activations are {rw.dtype}")
        elif level not in _FLOAT_ACCURACY and not rw.options.int4_float:
            rw.leave(
                pattern,
                node,
                f"accuracy_level={level}: ONNX Runtime computes it with "
                f"{'int8 activations' if level == 4 else 'reduced precision'}, ai.genai_ep "
                "MatMulNBits in float32, which changes the logits (and greedy tokens). Kept; "
                "--int4-float rewrites it anyway",
            )
        else:
            g.remove([node])
            op_inputs = inputs[:3] + ([zp] if zp else [])
            g.op(
                "MatMulNBitsZP" if zp else "MatMulNBits",
                op_inputs,
                [node.output[0]],
                name=node.name,
                keep_name=True,
                dtype=dtype,
                K=k,
                N=n,
                bits=4,
                block_size=block,
            )
            rw.done(pattern)


# --- RotaryEmbedding ---------------------------------------------------------------------------


def rotary_embedding(rw: Rewrite) -> None:
    """com.microsoft RotaryEmbedding (3-D [B, S, N*H] or 4-D [B, N, S, H] input) -> Rotary."""
    pattern = "rotary_embedding"
    g = rw.g
    for node in rw.nodes("RotaryEmbedding", (_MS,)):
        a = attrs_of(node)
        x, pos, cos, sin = node.input[:4]
        rank = g.rank(x)
        heads = int(a.get("num_heads", 0))
        rot_dim = int(a.get("rotary_embedding_dim", 0))
        cos_dims = list(g.initializers[cos].dims) if cos in g.initializers else None
        width = 2 * cos_dims[1] if cos_dims and len(cos_dims) == 2 else None
        if not math.isclose(float(a.get("scale", 1.0)), 1.0):
            rw.leave(pattern, node, f"scale={a['scale']}: Rotary does not scale positions")
        elif int(a.get("is_packed_batching", 0)):
            rw.leave(pattern, node, "is_packed_batching=1: Rotary takes [batch, seq] positions")
        elif g.rank(pos) == 1:
            rw.leave(pattern, node, "its position_ids are 1-D (an offset); Rotary takes [B, S]")
        elif rot_dim and width is not None and rot_dim != width:
            rw.leave(
                pattern, node, f"rotary_embedding_dim={rot_dim} but the cos cache gives {width}"
            )
        elif rank not in (3, 4) and not (rank is None and heads > 0):
            rw.leave(
                pattern,
                node,
                "the input's rank is unknown and num_heads is 0: cannot "
                "tell [B, S, N*H] from [B, N, S, H]",
            )
        elif rank != 4 and heads == 0 and width is None:
            rw.leave(
                pattern,
                node,
                "num_heads is 0 and the cos cache is not an initializer: the head size is unknown",
            )
        else:
            g.remove([node])
            base = node.name or "RotaryEmbedding"
            out = node.output[0]
            interleaved = int(a.get("interleaved", 0))
            if rank == 4:
                perm = [0, 2, 1, 3]
                bshd = g.onnx_op("Transpose", [x], name=f"{base}/to_bshd", perm=perm)[0]
                rot = g.op(
                    "Rotary",
                    [bshd, pos, cos, sin],
                    name=f"{base}/Rotary",
                    dtype=rw.dtype,
                    interleaved=interleaved,
                )[0]
                g.onnx_op("Transpose", [rot], [out], name=f"{base}/to_bnsh", perm=perm)
            else:
                split = [0, 0, heads, -1] if heads else [0, 0, -1, int(width or 0)]
                shape = g.const_i64(split, f"{base}/heads_shape")
                bshd = g.onnx_op("Reshape", [x, shape], name=f"{base}/heads")[0]
                rot = g.op(
                    "Rotary",
                    [bshd, pos, cos, sin],
                    name=f"{base}/Rotary",
                    dtype=rw.dtype,
                    interleaved=interleaved,
                )[0]
                flat = g.const_i64([0, 0, -1], f"{base}/flat_shape")
                g.onnx_op("Reshape", [rot, flat], [out], name=f"{base}/flat")
            rw.done(pattern)


def dominant_float_dtype(g: Graph) -> str:
    """The float dtype most initializer bytes have (the activations' dtype of a plain graph)."""
    sizes: Counter[str] = Counter()
    for init in g.initializers.values():
        dtype = ELEM_DTYPES.get(init.data_type)
        if dtype:
            sizes[dtype] += int(np.prod(init.dims))
    return sizes.most_common(1)[0][0] if sizes else "float32"
