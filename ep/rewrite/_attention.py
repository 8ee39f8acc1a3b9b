"""Attention: GroupQueryAttention or the standard concat-past attention -> KVCommit + KVAttention.

Moving attention onto the runtime-owned cache changes the graph's I/O (past/present go, the
``positions``/``kv_cache``/``kv_geometry`` inputs come), so it is all or nothing: every layer is
matched first, and only when every layer can move does any move. Otherwise each attention node
is left alone with its reason and the past/present I/O stays as it was.

Standard attention is matched structurally (rotate_half rotary over ``cos(position * inv_freq)``
or gathered cos/sin tables, Concat(past, new) presents, MatMul / scale / mask / Softmax / MatMul)
and its mask is *evaluated* (onnx.reference) on probes — left padding, a past, 300 cached tokens —
against causal-and-padding, so a sliding-window or prefix mask is refused rather than changed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from ep.errors import ModelError
from ep.model import DecoderModel
from ep.ops import float_attr_exact
from ep.rewrite._graph import ELEM_DTYPES, Graph
from ep.rewrite._patterns import Rewrite, attrs_of
from ep.rewrite._types import LeftAlone

__all__ = ["KVInputs", "attention", "move_kv_io"]

_MS = "com.microsoft"
_SHAPE_OPS = ("Reshape", "Transpose", "Unsqueeze", "Expand", "Squeeze", "Identity")
_SCORE_OPS = ("Cast", "Mul", "Div", "Where", "Add")

Apply = Callable[[], None]


@dataclass(frozen=True)
class KVInputs:
    """Names of the inputs the rewritten graph reads the runtime's cache through."""

    positions: str
    kv_cache: str
    kv_geometry: str


def _np_dtype(dtype: str) -> Any:
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


def _scale_attr(scale: float, head_dim: int) -> float | str:
    """KVAttention's scale attribute for a softmax scale (0 = exactly 1/sqrt(head_dim))."""
    if scale == 0 or np.float32(scale) == np.float32(1.0 / math.sqrt(head_dim)):
        return 0.0
    if float_attr_exact(scale):
        return float(np.float32(scale))
    return (
        f"softmax scale {scale!r} is neither 1/sqrt(head_dim) nor a value with 6 significant "
        "digits, so it cannot reach KVAttention exactly"
    )


class _Attention:
    def __init__(self, rw: Rewrite, decoder: DecoderModel, names: KVInputs) -> None:
        self.rw = rw
        self.g: Graph = rw.g
        self.decoder = decoder
        self.names = names
        io = decoder.io
        self.layer_of: dict[str, tuple[int, str]] = {}
        for i in range(decoder.num_layers):
            self.layer_of[io.past_keys[i]] = (i, "past key")
            self.layer_of[io.past_values[i]] = (i, "past value")
            self.layer_of[io.present_keys[i]] = (i, "present key")
            self.layer_of[io.present_values[i]] = (i, "present value")
        self._tables: dict[tuple[Any, ...], tuple[str, str]] = {}

    # --- pieces shared by both patterns ------------------------------------------------------

    def _emit(
        self,
        base: str,
        layer: int,
        q: str,
        k: str,
        v: str,
        *,
        heads: int,
        kv_heads: int,
        head_dim: int,
        rotary: tuple[str, str, int] | None,
        scale: float,
        output: str,
        dtype: str,
    ) -> None:
        """Reshape q/k/v [B, S, N*D] to heads, rotate, commit, attend, flatten into ``output``."""
        g, n = self.g, self.names
        q4 = g.onnx_op(
            "Reshape",
            [q, g.const_i64([0, 0, heads, head_dim], f"{base}/q_shape")],
            name=f"{base}/q_heads",
        )[0]
        kv_shape = g.const_i64([0, 0, kv_heads, head_dim], f"{base}/kv_shape")
        k4 = g.onnx_op("Reshape", [k, kv_shape], name=f"{base}/k_heads")[0]
        v4 = g.onnx_op("Reshape", [v, kv_shape], name=f"{base}/v_heads")[0]
        if rotary is not None:
            cos, sin, interleaved = rotary
            q4 = g.op(
                "Rotary",
                [q4, n.positions, cos, sin],
                name=f"{base}/q_rotary",
                dtype=dtype,
                interleaved=interleaved,
            )[0]
            k4 = g.op(
                "Rotary",
                [k4, n.positions, cos, sin],
                name=f"{base}/k_rotary",
                dtype=dtype,
                interleaved=interleaved,
            )[0]
        lengths = g.op(
            "KVCommit",
            [k4, v4, n.positions, n.kv_geometry, n.kv_cache],
            name=f"{base}/KVCommit",
            dtype=dtype,
            layer=layer,
        )[0]
        ctx = g.op(
            "KVAttention",
            [q4, n.positions, lengths, n.kv_geometry, n.kv_cache],
            name=f"{base}/KVAttention",
            dtype=dtype,
            layer=layer,
            kv_heads=kv_heads,
            scale=scale,
        )[0]
        flat = g.const_i64([0, 0, heads * head_dim], f"{base}/flat_shape")
        g.onnx_op("Reshape", [ctx, flat], [output], name=f"{base}/context")

    def _layer(self, past_k: str, past_v: str, present_k: str, present_v: str) -> int | str:
        found = [self.layer_of.get(x) for x in (past_k, past_v, present_k, present_v)]
        want = ("past key", "past value", "present key", "present value")
        if any(f is None or f[1] != w for f, w in zip(found, want, strict=True)):
            return (
                f"its cache tensors ({past_k!r}, {past_v!r} -> {present_k!r}, {present_v!r}) "
                "are not the graph's past/present key and value of one layer"
            )
        layers = {f[0] for f in found if f is not None}
        if len(layers) != 1:
            return f"its cache tensors belong to different layers {sorted(layers)}"
        return layers.pop()

    # --- GroupQueryAttention ----------------------------------------------------------------

    def gqa(self, node: onnx.NodeProto) -> tuple[int, Apply] | str:
        g, d = self.g, self.decoder
        a = attrs_of(node)
        inp = list(node.input) + [""] * (12 - len(node.input))
        outs = list(node.output) + [""] * (3 - len(node.output))
        q_in, k_in, v_in, past_k, past_v = inp[:5]
        cos, sin, pos_ids, bias, sink = inp[7], inp[8], inp[9], inp[10], inp[11]
        heads, kv_heads = int(a.get("num_heads", 0)), int(a.get("kv_num_heads", 0))
        window = int(a.get("local_window_size", -1))
        softcap = float(a.get("softcap", 0.0))
        do_rotary = int(a.get("do_rotary", 0))
        if window != -1:
            return f"local_window_size={window} (sliding window) is not supported by KVAttention"
        if softcap != 0.0:
            return f"softcap={softcap:g} (logit soft-capping) is not supported by KVAttention"
        if int(a.get("smooth_softmax", 0)) or sink:
            return "smooth softmax / head_sink (an extra softmax term) is not supported"
        if bias:
            return "an attention_bias input is not supported by KVAttention (causal only)"
        if int(a.get("qk_output", 0)) or any(o for o in outs[3:]):
            return "it outputs its QK scores, which KVAttention does not produce"
        if bool(k_in) != bool(v_in):
            return "it has only one of the separate key/value inputs"
        layer = self._layer(past_k, past_v, outs[1], outs[2])
        if isinstance(layer, str):
            return layer
        if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
            return f"num_heads={heads}, kv_num_heads={kv_heads}: need kv heads dividing heads"
        if kv_heads != d.kv_heads:
            return f"kv_num_heads={kv_heads} but the past tensors have {d.kv_heads} KV heads"
        dtype = ELEM_DTYPES.get(g.elem_type(past_k) or -1)
        if dtype is None or dtype != self.rw.dtype:
            return f"its cache dtype ({dtype}) is not the activations' ({self.rw.dtype})"
        scale = _scale_attr(float(a.get("scale", 0.0)), d.head_dim)
        if isinstance(scale, str):
            return scale
        rotary: tuple[str, str, int] | None = None
        if do_rotary:
            if not cos or not sin:
                return "do_rotary=1 without cos/sin caches"
            if pos_ids and pos_ids not in g.inputs:
                return f"its position_ids {pos_ids!r} are computed, not the graph's input"
            dims = list(g.initializers[cos].dims) if cos in g.initializers else None
            if dims is not None and (len(dims) != 2 or not 0 < 2 * dims[1] <= d.head_dim):
                return f"its cos cache has shape {dims}; Rotary needs [P, R/2], R <= head_dim"
            rotary = (cos, sin, int(a.get("rotary_interleaved", 0)))
        elif pos_ids:
            return "position_ids given with do_rotary=0"
        base = node.name or f"/model/layers.{layer}/attn"
        hd = d.head_dim

        def apply() -> None:
            g.remove([node])
            q, k, v = q_in, k_in, v_in
            if not k_in:
                sizes = g.const_i64([heads * hd, kv_heads * hd, kv_heads * hd], f"{base}/qkv_sizes")
                q, k, v = g.onnx_op(
                    "Split", [q_in, sizes], name=f"{base}/qkv_split", n_outputs=3, axis=-1
                )
            self._emit(
                base,
                layer,
                q,
                k,
                v,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=hd,
                rotary=rotary,
                scale=scale,
                output=outs[0],
                dtype=self.rw.dtype,
            )

        return layer, apply

    # --- standard (concat past) attention ------------------------------------------------------

    def concat(
        self, layer: int
    ) -> tuple[onnx.NodeProto, Apply] | tuple[onnx.NodeProto | None, str]:
        g, d = self.g, self.decoder
        io = d.io
        ck = g.producer.get(io.present_keys[layer])
        cv = g.producer.get(io.present_values[layer])
        for node, past in ((ck, io.past_keys[layer]), (cv, io.past_values[layer])):
            if node is None or node.op_type != "Concat" or list(node.input[:1]) != [past]:
                what = f"{node.op_type} node {node.name!r}" if node else "no node"
                return node, f"layer {layer}: the present comes from {what}, not Concat(past, new)"
            if int(attrs_of(node).get("axis", 0)) not in (2, -2) or len(node.input) != 2:
                return (
                    node,
                    f"layer {layer}: Concat {node.name!r} does not append along the "
                    "sequence axis of [B, H, T, D]",
                )
        assert ck is not None and cv is not None
        scores = self._down_to_matmul(io.present_keys[layer], operand=1)
        context = self._down_to_matmul(io.present_values[layer], operand=1)
        if scores is None or context is None:
            return (
                ck,
                f"layer {layer}: the presents do not feed the score and context MatMuls "
                "through shape ops only",
            )
        chain = self._score_chain(scores, context)
        if isinstance(chain, str):
            return scores, f"layer {layer}: {chain}"
        scale, mask_cond, masked_is_true = chain
        q_side = self._rotated_heads(scores.input[0], "query")
        k_side = self._rotated_heads(ck.input[1], "key")
        v_side = self._heads(cv.input[1])
        for side, what in ((q_side, "query"), (k_side, "key")):
            if isinstance(side, str):
                return scores, f"layer {layer}: the {what} is not the rotate_half pattern ({side})"
        if v_side is None:
            return cv, f"layer {layer}: the new value is not Transpose(Reshape(v, [.., .., H, D]))"
        assert not isinstance(q_side, str) and not isinstance(k_side, str)
        (q_flat, heads, qd), cos_q, sin_q = q_side
        (k_flat, kv_heads, kd), cos_k, sin_k = k_side
        v_flat, v_heads, vd = v_side
        if len({qd, kd, vd, d.head_dim}) != 1 or {kv_heads, v_heads} != {d.kv_heads}:
            return (
                scores,
                f"layer {layer}: head sizes q {qd}, k {kd}, v {vd} / KV heads "
                f"{kv_heads}, {v_heads} disagree with the past ({d.kv_heads} x {d.head_dim})",
            )
        if heads % kv_heads:
            return scores, f"layer {layer}: {heads} query heads for {kv_heads} KV heads"
        if (cos_q, sin_q) != (cos_k, sin_k):
            return scores, f"layer {layer}: query and key rotate with different tables"
        tables = self._rotary_tables(cos_q, sin_q)
        if isinstance(tables, str):
            return scores, f"layer {layer}: {tables}"
        probe = self._probe_mask(mask_cond, masked_is_true)
        if probe is not None:
            return scores, f"layer {layer}: {probe}"
        kv_scale = _scale_attr(scale, d.head_dim)
        if isinstance(kv_scale, str):
            return scores, f"layer {layer}: {kv_scale}"
        ctx_flat, last = self._flatten_down(context)
        if last is None:
            return context, f"layer {layer}: the context is not flattened back to [B, S, H*D]"
        base = f"/model/layers.{layer}/attn"
        hd = d.head_dim

        def apply() -> None:
            g.remove([last])
            self._emit(
                base,
                layer,
                q_flat,
                k_flat,
                v_flat,
                heads=heads,
                kv_heads=kv_heads,
                head_dim=hd,
                rotary=(*tables, 0),
                scale=kv_scale,
                output=ctx_flat,
                dtype=self.rw.dtype,
            )

        return scores, apply

    def _down_to_matmul(self, name: str, *, operand: int) -> onnx.NodeProto | None:
        """The MatMul that reads ``name`` (through shape ops, one reader each) as ``operand``."""
        g = self.g
        current = name
        for _ in range(8):
            readers = g.readers(current)
            if len(readers) != 1:
                return None
            node = readers[0]
            if node.op_type == "MatMul":
                return node if node.input[operand] == current else None
            if node.op_type not in _SHAPE_OPS or node.input[0] != current:
                return None
            current = node.output[0]
        return None

    def _score_chain(
        self, scores: onnx.NodeProto, context: onnx.NodeProto
    ) -> tuple[float, str | None, bool] | str:
        """(scale, mask condition, whether True means attend) from scores to the context."""
        g = self.g
        scale, cond, cond_true = 1.0, None, True
        current = scores.output[0]
        seen_softmax = False
        for _ in range(12):
            readers = g.readers(current)
            if len(readers) != 1:
                return f"the scores {current!r} are read {len(readers)} times"
            node = readers[0]
            if node is context:
                if not seen_softmax or node.input[0] != current:
                    return "no softmax between the score and context MatMuls"
                return scale, cond, cond_true
            if node.op_type == "Softmax":
                axis = int(attrs_of(node).get("axis", -1))
                if seen_softmax or axis != -1:
                    return f"Softmax {node.name!r} (axis {axis}) is not one softmax over keys"
                seen_softmax = True
            elif seen_softmax and node.op_type != "Cast":
                return f"{node.op_type} node {node.name!r} after the softmax"
            elif node.op_type not in _SCORE_OPS:
                return f"{node.op_type} node {node.name!r} on the scores is not supported"
            elif node.op_type in ("Mul", "Div"):
                other = node.input[1] if node.input[0] == current else node.input[0]
                c = g.const_float(other)
                if c is None or (node.op_type == "Div" and node.input[1] != other):
                    return f"{node.op_type} node {node.name!r} does not scale by a constant"
                scale = scale * c if node.op_type == "Mul" else scale / c
            elif node.op_type == "Where":
                if cond is not None:
                    return "two masks on the scores"
                if node.input[1] == current:
                    cond, cond_true = node.input[0], True
                elif node.input[2] == current:
                    cond, cond_true = node.input[0], False
                else:
                    return f"Where {node.name!r} does not select the scores"
            elif node.op_type == "Add":
                if cond is not None:
                    return "two masks on the scores"
                cond = node.input[1] if node.input[0] == current else node.input[0]
                cond_true = False  # an additive mask: see _probe_mask
                cond = "+" + cond
            current = node.output[0]
        return "the score chain is too long to be plain scaled softmax attention"

    def _heads(self, name: str) -> tuple[str, int, int] | None:
        """(flat, heads, head_dim) of Transpose(Reshape(flat, [.., .., N, D]), perm 0,2,1,3)."""
        g = self.g
        tr = g.producer.get(name)
        if (
            tr is None
            or tr.op_type != "Transpose"
            or list(attrs_of(tr).get("perm", []))
            != [
                0,
                2,
                1,
                3,
            ]
        ):
            return None
        rs = g.producer.get(tr.input[0])
        shape = g.const_ints(rs.input[1]) if rs is not None and rs.op_type == "Reshape" else None
        if rs is None or shape is None or len(shape) != 4 or min(shape[2:]) <= 0:
            return None
        return rs.input[0], shape[2], shape[3]

    def _rotated_heads(self, name: str, what: str) -> tuple[tuple[str, int, int], str, str] | str:
        """((flat, heads, head_dim), cos, sin) of rotate_half rotary over _heads()."""
        g = self.g
        current = name
        node = g.producer.get(current)
        for _ in range(6):  # the query may be regrouped (Reshape) before the score MatMul
            if node is None or node.op_type != "Reshape":
                break
            current = node.input[0]
            node = g.producer.get(current)
        if node is None or node.op_type != "Add":
            return f"its {what} does not come from an Add of the cos and sin terms"
        terms = [g.producer.get(i) for i in node.input]
        if any(t is None or t.op_type != "Mul" for t in terms):
            return "the rotary Add does not add two products"
        for cos_mul, sin_mul in ((terms[0], terms[1]), (terms[1], terms[0])):
            assert cos_mul is not None and sin_mul is not None
            for x, cos in (
                (cos_mul.input[0], cos_mul.input[1]),
                (cos_mul.input[1], cos_mul.input[0]),
            ):
                heads = self._heads(x)
                if heads is None:
                    continue
                for r, sin in (
                    (sin_mul.input[0], sin_mul.input[1]),
                    (sin_mul.input[1], sin_mul.input[0]),
                ):
                    if self._is_rotate_half(r, x, heads[2]):
                        return heads, cos, sin
        return "no rotate_half(x) * sin + x * cos found"

    def _is_rotate_half(self, r: str, x: str, head_dim: int) -> bool:
        """r == Concat(-x[..., D/2:], x[..., :D/2]) via Split or Slice."""
        g = self.g
        cat = g.producer.get(r)
        if cat is None or cat.op_type != "Concat" or len(cat.input) != 2:
            return False
        if int(attrs_of(cat).get("axis", 0)) not in (-1, 3):
            return False
        neg = g.producer.get(cat.input[0])
        if neg is None or neg.op_type != "Neg":
            return False
        second, first = neg.input[0], cat.input[1]
        split = g.producer.get(first)
        if split is not None and split.op_type == "Split" and split.input[0] == x:
            a = attrs_of(split)
            sizes = (
                g.const_ints(split.input[1]) if len(split.input) > 1 and split.input[1] else None
            )
            halves = sizes in (None, [head_dim // 2, head_dim // 2])
            return (
                halves
                and int(a.get("axis", 0)) in (-1, 3)
                and list(split.output[:2]) == [first, second]
            )
        half = head_dim // 2
        return self._slice_of(first, x, 0, half) and self._slice_of(second, x, half, head_dim)

    def _slice_of(self, name: str, x: str, start: int, end: int) -> bool:
        g = self.g
        node = g.producer.get(name)
        if node is None or node.op_type != "Slice" or node.input[0] != x:
            return False
        starts, ends = g.const_ints(node.input[1]), g.const_ints(node.input[2])
        axes = g.const_ints(node.input[3]) if len(node.input) > 3 and node.input[3] else None
        big = ends is not None and len(ends) == 1 and ends[0] >= end
        return starts == [start] and (ends == [end] or big) and axes in ([-1], [3])

    def _rotary_tables(self, cos: str, sin: str) -> tuple[str, str] | str:
        """cos/sin caches [context, D/2] for Rotary, equal to what the graph computes."""
        g, d = self.g, self.decoder
        found = []
        for name in (cos, sin):
            elem = None
            node = g.producer.get(name)
            if node is not None and node.op_type == "Cast":
                elem = attrs_of(node).get("to")
                node = g.producer.get(node.input[0])
            if node is not None and node.op_type == "Unsqueeze":
                node = g.producer.get(node.input[0])
            if node is None:
                return f"the rotary table {name!r} is not computed from positions"
            found.append((elem, node))
        (cos_elem, cos_node), (sin_elem, sin_node) = found
        dtype = ELEM_DTYPES.get(cos_elem) if cos_elem is not None else "float32"
        if cos_elem != sin_elem or dtype is None:
            return "the cos and sin tables are cast differently"
        if cos_node.op_type == "Cos" and sin_node.op_type == "Sin":
            if cos_node.input[0] != sin_node.input[0]:
                return "cos and sin are taken of different angles"
            inv = self._inv_freq(cos_node.input[0])
            if isinstance(inv, str):
                return inv
            key: tuple[Any, ...] = ("inv", inv.tobytes(), dtype)
            if key not in self._tables:
                angles = np.arange(d.context_length, dtype=np.float32)[:, None] * inv[None, :]
                # cos/sin of the float32 angles, as the graph computes them, then its cast
                tables = (np.cos(angles), np.sin(angles))
                self._tables[key] = self._store(tables, dtype)
            return self._tables[key]
        if cos_node.op_type == "Gather" and sin_node.op_type == "Gather":
            out = []
            for node in (cos_node, sin_node):
                if node.input[0] not in g.initializers or node.input[1] not in g.inputs:
                    return "the gathered rotary tables are not initializers indexed by positions"
                table = g.array(node.input[0]).astype(np.float32)
                half = table.shape[-1] // 2
                if table.ndim != 2 or not np.array_equal(table[:, :half], table[:, half:]):
                    return "the gathered rotary table is not [P, D] with repeated halves"
                out.append(table[:, :half])
            return self._store((out[0], out[1]), dtype)
        return f"the rotary tables come from {cos_node.op_type}/{sin_node.op_type}, not Cos/Sin"

    def _inv_freq(self, angles: str) -> np.ndarray | str:
        """inv_freq [D/2] of angles = Concat(f, f) with f = Unsqueeze(Cast(positions)) * inv."""
        g = self.g
        cat = g.producer.get(angles)
        if cat is None or cat.op_type != "Concat" or len(set(cat.input)) != 1:
            return "the rotary angles are not Concat(freqs, freqs)"
        mul = g.producer.get(cat.input[0])
        if mul is None or mul.op_type != "Mul":
            return "the rotary frequencies are not positions * inv_freq"
        inv_name = next((i for i in mul.input if i in g.initializers), None)
        pos = next((i for i in mul.input if i != inv_name), None)
        if inv_name is None or pos is None or g.rank(inv_name) != 1:
            return "the rotary frequencies do not multiply by an inv_freq initializer"
        node = g.producer.get(pos)
        while node is not None and node.op_type in ("Unsqueeze", "Cast"):
            pos = node.input[0]
            node = g.producer.get(pos)
        if pos not in g.inputs:
            return f"the rotary positions come from {pos!r}, not a graph input"
        return g.array(inv_name).astype(np.float32)

    def _store(self, tables: tuple[np.ndarray, np.ndarray], dtype: str) -> tuple[str, str]:
        np_dtype = _np_dtype(dtype)
        cos = self.g.add_initializer("genai_ep.cos_cache", tables[0].astype(np_dtype))
        sin = self.g.add_initializer("genai_ep.sin_cache", tables[1].astype(np_dtype))
        return cos, sin

    def _flatten_down(self, context: onnx.NodeProto) -> tuple[str, onnx.NodeProto | None]:
        """The [B, S, H*D] tensor the context becomes through Transpose/Reshape, and the node
        producing it."""
        g = self.g
        current, last = context.output[0], None
        for _ in range(6):
            readers = g.readers(current)
            if len(readers) != 1 or readers[0].op_type not in ("Transpose", "Reshape"):
                break
            last = readers[0]
            current = last.output[0]
        if last is None or last.op_type != "Reshape":
            return current, None
        shape = g.const_ints(last.input[1])
        if shape is None or len(shape) != 3:
            return current, None
        return current, last

    # --- the mask, evaluated -----------------------------------------------------------------

    def _probe_mask(self, cond: str | None, true_attends: bool) -> str | None:
        """None when the mask is causal AND padding on every probe; else why not."""
        if cond is None:
            return "there is no mask on the scores (not causal)"
        g, d = self.g, self.decoder
        additive = cond.startswith("+")
        cond = cond.lstrip("+")
        nodes: list[onnx.NodeProto] = []
        sources: set[str] = set()
        stack, seen = [cond], set()
        while stack:
            name = stack.pop()
            if name in seen or not name:
                continue
            seen.add(name)
            node = g.producer.get(name)
            if node is None:
                if name in g.inputs:
                    sources.add(name)
                elif name not in g.initializers:
                    return f"the mask reads {name!r}, which is neither an input nor a constant"
                continue
            if node.domain not in ("", "ai.onnx"):
                return f"the mask uses {node.domain}::{node.op_type}"
            nodes.append(node)
            stack.extend(node.input)
        io = d.io
        allowed_sources = {
            io.input_ids,
            io.attention_mask,
            io.position_ids,
            *io.past_keys,
            *io.past_values,
        }
        if not sources <= allowed_sources:
            return f"the mask reads {sorted(sources - allowed_sources)}"
        order = [n for n in g.nodes if n in nodes]  # original (topological) order
        inits = [g.initializers[i] for n in order for i in n.input if i in g.initializers]
        sub = helper.make_graph(
            order,
            "mask_probe",
            [g.inputs[s] for s in sorted(sources)],
            [helper.make_empty_tensor_value_info(cond)],
            initializer=list({t.name: t for t in inits}.values()),
        )
        model = helper.make_model(sub, opset_imports=list(g.model.opset_import))
        try:
            from onnx.reference import ReferenceEvaluator

            evaluator = ReferenceEvaluator(model)
            for past, mask in _PROBES:
                feeds = self._probe_feeds(sources, past, mask)
                (value,) = evaluator.run(None, feeds)
                got = _as_allowed(np.asarray(value), additive, true_attends, mask, past)
                if got is None:
                    return "the mask has a shape that is not [B, .., S, T]"
                want = _causal_padding(mask, past)
                if not np.array_equal(got, want):
                    return (
                        "the mask is not causal+padding (a sliding window, prefix or custom "
                        f"mask; probe with {past} cached tokens differs); KVAttention attends "
                        "to every earlier token of the row"
                    )
        except Exception as exc:  # the reference evaluator raises many types
            return f"the mask could not be evaluated to check it ({type(exc).__name__}: {exc})"
        return None

    def _probe_feeds(self, sources: set[str], past: int, mask: np.ndarray) -> dict[str, Any]:
        d, io = self.decoder, self.decoder.io
        batch, total = mask.shape
        seq = total - past
        feeds: dict[str, Any] = {}
        for name in sources:
            if name == io.input_ids:
                feeds[name] = np.zeros((batch, seq), dtype=np.dtype(io.input_ids_dtype))
            elif name == io.attention_mask:
                feeds[name] = mask.astype(np.dtype(io.attention_mask_dtype))
            elif name == io.position_ids:
                pos = np.maximum(np.cumsum(mask, axis=1) - 1, 0)[:, past:]
                feeds[name] = pos.astype(np.dtype(io.position_ids_dtype))
            else:
                feeds[name] = np.zeros((batch, d.kv_heads, past, d.head_dim), np.float32).astype(
                    _np_dtype(d.kv_dtype)
                )
        return feeds


def _left_padded(lengths: list[int], total: int) -> np.ndarray:
    return np.array([[0] * (total - n) + [1] * n for n in lengths], dtype=np.int64)


# (tokens already cached, attention mask over cached + new tokens): left padding, a chunk with a
# past, one decode step far into the context (a sliding window shows there).
_PROBES: tuple[tuple[int, np.ndarray], ...] = (
    (0, _left_padded([6, 4], 6)),
    (3, _left_padded([7, 5], 7)),
    (300, _left_padded([301, 290], 301)),
)


def _causal_padding(mask: np.ndarray, past: int) -> np.ndarray:
    total = mask.shape[1]
    seq = total - past
    causal = np.arange(total)[None, :] <= (past + np.arange(seq))[:, None]  # [S, T]
    return causal[None] & (mask[:, None, :] == 1)


def _as_allowed(
    value: np.ndarray, additive: bool, true_attends: bool, mask: np.ndarray, past: int
) -> np.ndarray | None:
    """The probe's mask as bool [B, S, T] (True: attend), padding query rows ignored."""
    batch, total = mask.shape
    seq = total - past
    if value.ndim < 2 or value.shape[-1] != total or value.shape[-2] not in (1, seq):
        return None
    if additive:
        allowed = value.astype(np.float64) > -1e4  # additive masks use -inf or the dtype minimum
    else:
        allowed = value.astype(bool) if true_attends else ~value.astype(bool)
    flat = allowed.reshape(allowed.shape[0] if allowed.ndim > 2 else 1, -1, seq, total)
    if flat.shape[1] != 1 and not (flat == flat[:, :1]).all():
        return None  # differs per head: not a plain causal mask
    out = np.broadcast_to(flat[:, 0], (batch, seq, total)).copy()
    # A padding query's row is never read: compare it as the reference computes it.
    pad_query = mask[:, past:] == 0
    out[pad_query] = _causal_padding(mask, past)[pad_query]
    return out


def attention(rw: Rewrite, decoder: DecoderModel, names: KVInputs) -> bool:
    """Move every layer's attention onto the runtime cache, or none; True when it moved."""
    g = rw.g
    att = _Attention(rw, decoder, names)
    gqa_nodes = rw.nodes("GroupQueryAttention", (_MS,))
    plans: dict[int, Apply] = {}
    refusals: list[tuple[str, onnx.NodeProto | None, str]] = []  # (pattern, node, reason)
    candidates: list[tuple[str, onnx.NodeProto]] = []
    if gqa_nodes:
        pattern = "gqa_attention"
        for node in gqa_nodes:
            result = att.gqa(node)
            if isinstance(result, str):
                refusals.append((pattern, node, result))
                continue
            layer, apply = result
            if layer in plans:
                refusals.append((pattern, node, f"a second attention node for layer {layer}"))
                continue
            plans[layer] = apply
            candidates.append((pattern, node))
    else:
        pattern = "concat_attention"
        for layer in range(decoder.num_layers):
            anchor, outcome = att.concat(layer)
            if isinstance(outcome, str):
                refusals.append((pattern, anchor, outcome))
            else:
                assert anchor is not None
                plans[layer] = outcome
                candidates.append((pattern, anchor))
    missing = sorted(set(range(decoder.num_layers)) - set(plans))
    if missing and not refusals:
        refusals.append((pattern, None, f"no attention found for layer(s) {missing}"))
    if refusals:
        for pat, refused, reason in refusals:
            if refused is None:
                rw.left.append(LeftAlone(pat, "(graph)", "-", reason))
            else:
                rw.leave(pat, refused, reason)
        failed = len({r[2] for r in refusals})
        for pat, node in candidates:
            rw.leave(
                pat,
                node,
                "rewritable, but kept with the others: the KV cache moves into the runtime for "
                f"every layer at once and {failed} attention pattern(s) cannot move",
            )
        return False
    for layer in sorted(plans):
        plans[layer]()
    rw.done(pattern, len(plans))
    io = decoder.io
    presents = {*io.present_keys, *io.present_values}
    g.set_outputs([v for v in g.graph.output if v.name not in presents])
    g.reindex()
    return True


def move_kv_io(rw: Rewrite, decoder: DecoderModel, names: KVInputs) -> None:
    """After the attention moved and dead nodes went (`Graph.finish`): drop the past and the mask
    inputs, add positions/kv_cache/kv_geometry; a ModelError when something still needs them."""
    g, io = rw.g, decoder.io
    cache = {*io.past_keys, *io.past_values}
    ids = g.inputs[io.input_ids]
    dims: list[str | int] = [
        d.dim_param or d.dim_value for d in ids.type.tensor_type.shape.dim
    ] or ["batch_size", "sequence_length"]
    # Rotary of rewritten RotaryEmbedding / GQA nodes read the old position_ids: same values for
    # real tokens, and padding's negative positions pass through.
    if io.position_ids and g.readers(io.position_ids):
        for node in g.readers(io.position_ids):
            for i, name in enumerate(node.input):
                if name == io.position_ids:
                    node.input[i] = names.positions
        g.reindex()
    for name in (*cache, io.attention_mask):
        readers = g.readers(name)
        if readers:
            raise ModelError(
                f"the attention moved onto the runtime-owned KV cache, but node "
                f"{readers[0].name!r} ({readers[0].op_type}) still reads {name!r}, which an "
                "ep graph does not have (positions carry the padding, the cache is the "
                "runtime's); this graph cannot be rewritten. Keep its attention: it is left "
                "alone only as a whole"
            )
    dropped = cache | {io.attention_mask, io.position_ids or ""}
    kept = [v for v in g.graph.input if v.name not in dropped]
    kept += [
        helper.make_tensor_value_info(names.positions, TensorProto.INT64, dims),
        helper.make_tensor_value_info(names.kv_cache, TensorProto.INT64, [1]),
        helper.make_tensor_value_info(names.kv_geometry, TensorProto.INT64, [7]),
    ]
    g.set_inputs(kept)
