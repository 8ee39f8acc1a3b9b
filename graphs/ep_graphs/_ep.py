"""The `ep` flavour: the decoder made of this project's ops (domain ``ai.genai_ep``).

The KV cache is not graph I/O: it lives in the runtime, and KVCommit / KVAttention reach it
through an int64 handle (`ep.ops.KV_CACHES`) plus the layout's geometry. Graph I/O:

| name | dtype, shape | meaning |
| --- | --- | --- |
| ``input_ids`` | int64 [batch, seq] | token ids (padding: any id, e.g. pad_token_id) |
| ``positions`` | int64 [batch, seq] | each token's absolute position = cache slot; < 0: padding |
| ``kv_cache`` | int64 [1] | handle from ``ep.ops.KV_CACHES.bind([(key, value) per layer])`` |
| ``kv_geometry`` | int64 [7] | ``ep.ops.kv_geometry(layout geometry)``: strides + capacity |
| ``logits`` (out) | float32 [batch, seq, vocab] | padding rows hold finite junk |

There is no attention mask: a query at position p attends to its row's slots 0..p, and padding
(negative positions) is neither written nor attended, so left- and right-padded batches both work.
The graph is layout-neutral: every contiguous KV layout works through ``kv_geometry``, and for a
paged layout the ort backend loads it with KVCommit / KVAttention swapped for their ``...Paged``
variants plus a ``kv_block_table`` input (`ep.ort.backend.paged_graph`), so one file serves all.
Pieces: RMSNorm / SkipRMSNorm, packed-QKV MatMul, Split + Reshape, RotaryTheta (or Rotary over
cos/sin caches when theta has more than 6 significant digits), KVCommit + KVAttention, SwiGLUPacked
over one packed gate/up projection, and for the dense projections MatMul on a *named* weight: the
weight stays an initializer of the model (no node consumes it) and the runtime resolves the node's
``weight`` attribute through `ep.ops.set_weight_resolver` (later an offload policy places it).
With ``quant="int4"`` the projections are ``MatMulNBits`` (weights as inputs; float32 arithmetic,
so MatMulNBits' ``accuracy_level`` does not apply) and a tied embedding is gathered from the
dequantized head, as GatherBlockQuantized would.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np
from onnx import TensorProto

from ep.errors import ConfigError
from ep.ops import BITCAST_OPSET, DOMAIN, float_attr_exact, make_nodes

from ._contrib import rotary_caches
from ._flavour import DecoderEmitter, Linear, register_flavour
from ._quant import Int4Options, Int4Weight
from ._spec import ModelSpec

__all__ = ["EP_INPUTS", "EpEmitter", "ep_genai_config"]

#: graph input names of an ep decoder, in order
EP_INPUTS = ("input_ids", "positions", "kv_cache", "kv_geometry")
_OP_DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def ep_genai_config(
    config: dict[str, Any], *, names: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """``config`` (a genai_config.json dict) with the ep graph's I/O names and the ep marker.

    ``names`` maps the roles in `EP_INPUTS` to the graph's names where they differ. The marker
    is ``model.decoder.genai_ep`` = {"flavour": "ep", ...}; loaders detect the flavour from the
    graph (nodes in ``ai.genai_ep``), so a missing marker is harmless.
    """
    out = dict(config)
    model = dict(out.get("model", {}))
    decoder = dict(model.get("decoder", {}))
    decoder["inputs"] = {role: (names or {}).get(role, role) for role in EP_INPUTS}
    decoder["outputs"] = {"logits": "logits"}
    decoder["genai_ep"] = {
        "flavour": "ep",
        "ops_domain": DOMAIN,
        "kv_cache": "runtime-owned: feed a KV_CACHES handle and the layout geometry",
        "positions": "absolute position per token; negative marks padding",
    }
    model["decoder"] = decoder
    out["model"] = model
    search = dict(out.get("search", {}))
    if search:
        search["past_present_share_buffer"] = True
        out["search"] = search
    return out


@register_flavour
class EpEmitter(DecoderEmitter):
    """This project's ops over a runtime-owned KV cache: inputs input_ids, positions, kv_cache,
    kv_geometry; output logits."""

    name = "ep"
    opsets: ClassVar[dict[str, int]] = {"": BITCAST_OPSET, DOMAIN: 1}
    has_position_ids = False
    # The cache is written in place at fixed capacity (by KVCommit, in the runtime's buffers).
    past_present_share_buffer = True
    supported_quant = ("int4",)
    # onnx.checker skips domains it has no schemas for (ai.genai_ep) and checks the rest.
    onnx_checkable = True

    @classmethod
    def check_options(cls, spec: ModelSpec, quant: Int4Options | None) -> None:
        super().check_options(spec, quant)
        if not float_attr_exact(spec.rms_norm_eps):
            raise ConfigError(
                f"flavour 'ep': rms_norm_eps={spec.rms_norm_eps!r} has more than 6 significant "
                "digits and would reach the RMSNorm op rounded (onnxruntime-extensions passes "
                "float attributes with 6 digits); use a value such as 1e-05 or 1e-06"
            )

    @classmethod
    def adjust_genai_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The generic genai_config.json made this graph's: ep I/O names and the ep marker.

        For build_model to call on the config it writes (a one-line hook there).
        """
        return ep_genai_config(config)

    # --- helpers ---------------------------------------------------------------------------

    @property
    def _dtype(self) -> str:
        return _OP_DTYPES[self.spec.dtype]

    def _op(
        self,
        op: str,
        inputs: list[str],
        *,
        name: str,
        n_outputs: int = 1,
        outputs: list[str] | None = None,
        **attrs: Any,
    ) -> list[str]:
        """Append one ai.genai_ep op (with BitCast carriers for fp16/bf16); its output names."""
        g = self.g
        node_name = g.fresh(name)
        if outputs is None:
            outputs = [g.fresh(f"{node_name}/output_{i}") for i in range(n_outputs)]
        else:
            for out in outputs:
                g.fresh(out)
        g.nodes.extend(make_nodes(op, inputs, outputs, name=node_name, dtype=self._dtype, **attrs))
        return outputs

    # --- I/O and shared tensors ------------------------------------------------------------

    def declare_io(self) -> None:
        g, s = self.g, self.spec
        g.add_input("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"])
        g.add_input("positions", TensorProto.INT64, ["batch_size", "sequence_length"])
        g.add_input("kv_cache", TensorProto.INT64, [1])
        g.add_input("kv_geometry", TensorProto.INT64, [7])
        g.add_output("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", s.vocab_size])

    def prepare(self) -> None:
        s = self.spec
        self.cos_cache: str | None = None
        self.sin_cache: str | None = None
        if not float_attr_exact(s.rope_theta):
            # RotaryTheta would see a rounded theta: carry the exact tables instead.
            cos, sin = rotary_caches(s.rope_theta, s.head_dim, s.context_length)
            self.cos_cache = self.g.initializer("cos_cache", self.w.cast(cos))
            self.sin_cache = self.g.initializer("sin_cache", self.w.cast(sin))

    def _rotary(self, x: str, label: str) -> str:
        if self.cos_cache is not None and self.sin_cache is not None:
            return self._op(
                "Rotary",
                [x, "positions", self.cos_cache, self.sin_cache],
                name=label,
                interleaved=0,
            )[0]
        return self._op(
            "RotaryTheta",
            [x, "positions"],
            name=label,
            theta=self.spec.rope_theta,
            rotary_dim=0,
            interleaved=0,
        )[0]

    # --- embedding and head ----------------------------------------------------------------

    def _tied_int4(self) -> bool:
        return self.spec.tie_embeddings and self.quant is not None

    def embed(self) -> str:
        g = self.g
        if self._tied_int4():
            # The contrib flavour gathers the head's 4-bit blocks (GatherBlockQuantized); the
            # same numbers come from gathering the dequantized head.
            self.head_q4 = self.quantized(Linear("/lm_head/MatMul", "lm_head", _EMBED))
            table = self.w.cast(self.head_q4.dequantize())
        else:
            table = self.w.cast(self.w.f32(_EMBED[0]))
        self.embed_table = g.initializer(_EMBED[0], table)
        return g.op("Gather", [self.embed_table, "input_ids"], name="/model/embed_tokens/Gather")

    def lm_head(self, x: str) -> None:
        g, s = self.g, self.spec
        target = None if self.low_precision else "logits"
        outputs = [target] if target else None
        if self._tied_int4():
            logits = self._matmul_nbits(x, "/lm_head/MatMul", "lm_head", self.head_q4, outputs)
        elif s.tie_embeddings and self.quant is None:
            # The [V, H] embedding table is the head's weight, read transposed: no second copy.
            logits = self._op(
                "MatMul",
                [x],
                name="/lm_head/MatMul",
                outputs=outputs,
                weight=self.embed_table,
                N=s.vocab_size,
                transpose_b=1,
            )[0]
        else:
            hf = _EMBED if s.tie_embeddings else ["lm_head.weight"]
            logits = self.linear(x, Linear("/lm_head/MatMul", "lm_head", hf), output=target)
        if self.low_precision:
            g.node("Cast", [logits], name="/lm_head/Cast", outputs=["logits"], to=TensorProto.FLOAT)

    # --- norms, attention, MLP ---------------------------------------------------------------

    def norm(
        self,
        hf_weight: str,
        onnx_weight: str,
        *,
        residual: str,
        delta: str | None,
        label: str,
        final: bool = False,
    ) -> tuple[str, str]:
        weight = self.g.initializer(onnx_weight, self.w.cast(self.w.f32(hf_weight)))
        eps = self.spec.rms_norm_eps
        if delta is None:
            (out,) = self._op("RMSNorm", [residual, weight], name=f"{label}/RMSNorm", epsilon=eps)
            return out, residual
        # The op has no optional outputs: the final norm's sum is computed and left unused.
        normed, total = self._op(
            "SkipRMSNorm",
            [residual, delta, weight],
            name=f"{label}/SkipRMSNorm",
            n_outputs=2,
            epsilon=eps,
        )
        return normed, total

    def attention(self, layer: int, x: str) -> str:
        g, s = self.g, self.spec
        base = f"/model/layers.{layer}/attn"
        p = f"model.layers.{layer}.self_attn."
        stem = f"model.layers.{layer}.attn"
        qkv = self.linear(
            x,
            Linear(
                f"{base}/qkv_proj/MatMul",
                f"{stem}.qkv_proj",
                [f"{p}q_proj.weight", f"{p}k_proj.weight", f"{p}v_proj.weight"],
                [f"{p}q_proj.bias", f"{p}k_proj.bias", f"{p}v_proj.bias"] if s.qkv_bias else None,
            ),
        )
        sizes = g.const_i64([s.q_size, s.kv_size, s.kv_size])
        q, k, v = g.node("Split", [qkv, sizes], name=f"{base}/qkv_split", n_outputs=3, axis=-1)
        q = g.op("Reshape", [q, g.const_i64([0, 0, s.num_heads, s.head_dim])], name=f"{base}/q")
        kv_shape = g.const_i64([0, 0, s.num_kv_heads, s.head_dim])
        k = g.op("Reshape", [k, kv_shape], name=f"{base}/k")
        v = g.op("Reshape", [v, kv_shape], name=f"{base}/v")
        q = self._rotary(q, f"{base}/q_rotary")
        k = self._rotary(k, f"{base}/k_rotary")
        lengths = self._op(
            "KVCommit",
            [k, v, "positions", "kv_geometry", "kv_cache"],
            name=f"{base}/KVCommit",
            layer=layer,
        )[0]
        ctx = self._op(
            "KVAttention",
            [q, "positions", lengths, "kv_geometry", "kv_cache"],
            name=f"{base}/KVAttention",
            layer=layer,
            kv_heads=s.num_kv_heads,
            scale=0.0,  # exactly 1/sqrt(head_dim)
        )[0]
        flat = g.op("Reshape", [ctx, g.const_i64([0, 0, s.q_size])], name=f"{base}/context")
        return self.linear(
            flat, Linear(f"{base}/o_proj/MatMul", f"{stem}.o_proj", [f"{p}o_proj.weight"])
        )

    def mlp(self, layer: int, x: str) -> str:
        """down(SwiGLUPacked(x @ [gate | up])): one projection for gate and up."""
        p = f"model.layers.{layer}.mlp."
        base = f"/model/layers.{layer}/mlp"
        gate_up = self.linear(
            x,
            Linear(
                f"{base}/gate_up_proj/MatMul",
                f"model.layers.{layer}.mlp.gate_up_proj",
                [p + "gate_proj.weight", p + "up_proj.weight"],
            ),
        )
        act = self._op("SwiGLUPacked", [gate_up], name=f"{base}/SwiGLU", interleaved=0)[0]
        return self.linear(
            act,
            Linear(f"{base}/down_proj/MatMul", p[:-1] + ".down_proj", [p + "down_proj.weight"]),
        )

    # --- projections ---------------------------------------------------------------------

    def linear(self, x: str, lin: Linear, *, output: str | None = None) -> str:
        """x @ W^T (+ b): MatMul on the named [K, N] weight, or MatMulNBits with int4."""
        matmul_out = None if lin.hf_biases else output
        outputs = [matmul_out] if matmul_out else None
        if self.quant is not None:
            q = self.quantized(lin)
            out = self._matmul_nbits(x, lin.label, lin.stem, q, outputs)
        else:
            weight = self.w.cast(self.w.stacked_out_in(lin.hf_weights).T)
            init = self.g.initializer(f"{lin.stem}.MatMul.weight", weight)
            out = self._op(
                "MatMul",
                [x],
                name=lin.label,
                outputs=outputs,
                weight=init,
                N=int(weight.shape[1]),
                transpose_b=0,
            )[0]
        if lin.hf_biases:
            bias = np.concatenate([self.w.f32(name) for name in lin.hf_biases])
            b = self.g.initializer(f"{lin.stem}.Add.bias", self.w.cast(bias))
            out = self.g.node(
                "Add",
                [out, b],
                name=lin.label.rsplit("/", 1)[0] + "/Add",
                outputs=[output] if output else None,
            )[0]
        return out

    def _matmul_nbits(
        self,
        x: str,
        label: str,
        stem: str,
        q: Int4Weight,
        outputs: list[str] | None,
    ) -> str:
        # Initializer names follow the contrib flavour's, so tools that decode one decode both.
        g = self.g
        inputs = [
            x,
            g.initializer(f"{stem}.MatMul.weight_Q4", q.packed),
            g.initializer(f"{stem}.MatMul.weight_scales", q.scales),
        ]
        op = "MatMulNBits"
        if q.zero_points is not None:
            inputs.append(g.initializer(f"{stem}.MatMul.weight_zero_points", q.zero_points))
            op = "MatMulNBitsZP"
        return self._op(
            op,
            inputs,
            name=f"{label}_Q4",
            outputs=outputs,
            K=q.k,
            N=q.n,
            bits=4,
            block_size=q.block_size,
        )[0]


_EMBED = ["model.embed_tokens.weight"]
