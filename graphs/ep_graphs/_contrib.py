"""The `contrib` flavour: the graph the onnxruntime-genai model builder (0.18, CPU) writes.

Node types, names and initializer names follow tests/data/genai-llama-tiny/genai-fp32/model.onnx:
``seqlens_k = ReduceSum(attention_mask) - 1`` and ``total_sequence_length = Shape(mask)[1]``
(int32), cos/sin caches as initializers, SimplifiedLayerNormalization then a chain of
SkipSimplifiedLayerNormalization, packed QKV MatMul into com.microsoft GroupQueryAttention with
``do_rotary=1`` (no position_ids input), SwiGLU, and MatMulNBits (+ GatherBlockQuantized for a tied
embedding) with ``quant="int4"``.

GroupQueryAttention reads ``attention_mask`` only as a count of real tokens per row: a row's
tokens must sit first in the sequence and in the KV cache (right padding, as onnxruntime-genai
feeds it). Left-padded rows get wrong positions and attend to padding.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from onnx import TensorProto

from ._flavour import DecoderEmitter, Linear, register_flavour
from ._quant import Int4Weight

__all__ = ["ContribEmitter", "rotary_caches"]


def rotary_caches(theta: float, head_dim: int, positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin caches [positions, head_dim/2] in float32, computed as the genai builder does."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv_freq = (np.float32(1.0) / (np.float32(theta) ** exponents)).astype(np.float32)
    freqs = np.outer(np.arange(positions, dtype=np.float32), inv_freq).astype(np.float32)
    return np.cos(freqs), np.sin(freqs)


@register_flavour
class ContribEmitter(DecoderEmitter):
    """onnxruntime-genai format: inputs input_ids, attention_mask, past_key_values.*."""

    name = "contrib"
    opsets: ClassVar[dict[str, int]] = {"": 22, "com.microsoft": 1}
    has_position_ids = False
    past_present_share_buffer = True  # GroupQueryAttention writes new K/V at seqlens_k in place
    supported_quant = ("int4",)
    # SimplifiedLayerNormalization is an ONNX Runtime op in the ONNX domain, as genai writes it.
    onnx_checkable = False

    def declare_io(self) -> None:
        g, s = self.g, self.spec
        g.add_input("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"])
        g.add_input("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"])
        kv_past: list[int | str] = [
            "batch_size",
            s.num_kv_heads,
            "past_sequence_length",
            s.head_dim,
        ]
        kv_present: list[int | str] = [
            "batch_size",
            s.num_kv_heads,
            "total_sequence_length",
            s.head_dim,
        ]
        # The genai builder lists every layer's key, then every layer's value.
        for kind in ("key", "value"):
            for i in range(s.num_layers):
                g.add_input(f"past_key_values.{i}.{kind}", self.elem, kv_past)
        g.add_output("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", s.vocab_size])
        for kind in ("key", "value"):
            for i in range(s.num_layers):
                g.add_output(f"present.{i}.{kind}", self.elem, kv_present)

    def prepare(self) -> None:
        g, s = self.g, self.spec
        b = "/model/attn_mask_reformat/attn_mask_subgraph"
        ones = g.const_i64([1])
        total_real = g.op("ReduceSum", ["attention_mask", ones], name=f"{b}/ReduceSum", keepdims=0)
        last = g.op("Sub", [total_real, ones], name=f"{b}/Sub")
        self.seqlens_k = g.op("Cast", [last], name=f"{b}/Sub/Cast", to=TensorProto.INT32)
        shape = g.op("Shape", ["attention_mask"], name=f"{b}/Shape")
        total = g.op("Gather", [shape, g.const_i64(1)], name=f"{b}/Gather", axis=0)
        self.total_len = g.op("Cast", [total], name=f"{b}/Gather/Cast", to=TensorProto.INT32)
        cos, sin = rotary_caches(s.rope_theta, s.head_dim, s.context_length)
        self.cos_cache = g.initializer("cos_cache", self.w.cast(cos))
        self.sin_cache = g.initializer("sin_cache", self.w.cast(sin))

    # --- embedding and head ----------------------------------------------------------------

    def _tied_int4(self) -> bool:
        # GatherBlockQuantized needs whole blocks along the hidden axis.
        return (
            self.spec.tie_embeddings
            and self.quant is not None
            and self.spec.hidden_size % self.quant.block_size == 0
        )

    def embed(self) -> str:
        g, s = self.g, self.spec
        if self._tied_int4():
            assert self.quant is not None
            head = Linear("/lm_head/MatMul", "lm_head", ["model.embed_tokens.weight"])
            self.head_q4 = self.quantized(head)
            q4, scales, zps = self._int4_initializers(head, self.head_q4)
            flat = g.op(
                "Reshape",
                [q4, g.const_i64([s.vocab_size, s.hidden_size // 2])],
                name="/model/embed_tokens/Reshape",
            )
            inputs = [flat, "input_ids", scales] + ([zps] if zps else [])
            return g.op(
                "GatherBlockQuantized",
                inputs,
                name="/model/embed_tokens/GatherBlockQuantized",
                domain="com.microsoft",
                bits=4,
                block_size=self.quant.block_size,
                gather_axis=0,
                quantize_axis=1,
            )
        if s.tie_embeddings and self.quant is None:
            # One [H, V] head matrix; the embedding gathers from its transpose (as genai does).
            head_matrix = self.w.cast(self.w.f32("model.embed_tokens.weight").T)
            self.head_weight = g.initializer("lm_head.MatMul.weight", head_matrix)
            table = g.op(
                "Transpose", [self.head_weight], name="/model/embed_tokens/Transpose", perm=[1, 0]
            )
        else:
            table = g.initializer(
                "model.embed_tokens.weight", self.w.cast(self.w.f32("model.embed_tokens.weight"))
            )
        return g.op("Gather", [table, "input_ids"], name="/model/embed_tokens/Gather")

    def lm_head(self, x: str) -> None:
        g, s = self.g, self.spec
        target = None if self.low_precision else "logits"
        outputs = [target] if target else None
        if self._tied_int4():
            logits = self._matmul_nbits(x, "/lm_head/MatMul", "lm_head", self.head_q4, outputs)
        elif s.tie_embeddings and self.quant is None:
            logits = g.node(
                "MatMul", [x, self.head_weight], name="/lm_head/MatMul", outputs=outputs
            )[0]
        else:
            hf = "model.embed_tokens.weight" if s.tie_embeddings else "lm_head.weight"
            logits = self.linear(x, Linear("/lm_head/MatMul", "lm_head", [hf]), output=target)
        if self.low_precision:
            g.node("Cast", [logits], name="/lm_head/Cast", outputs=["logits"], to=TensorProto.FLOAT)

    # --- norms, attention, int4 ------------------------------------------------------------

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
        g = self.g
        weight = g.initializer(onnx_weight, self.w.cast(self.w.f32(hf_weight)))
        eps = self.spec.rms_norm_eps
        if delta is None:
            normed = g.node(
                "SimplifiedLayerNormalization",
                [residual, weight],
                name=f"{label}/LayerNorm",
                outputs=[g.fresh(f"{label}/output_0")],
                axis=-1,
                epsilon=eps,
                stash_type=1,
            )[0]
            return normed, residual
        outputs = [g.fresh(f"{label}/output_0")]
        if not final:
            outputs += ["", "", g.fresh(f"{label}/output_3")]  # output 3: input + skip
        outs = g.node(
            "SkipSimplifiedLayerNormalization",
            [residual, delta, weight],
            name=f"{label}/SkipLayerNorm",
            outputs=outputs,
            domain="com.microsoft",
            epsilon=eps,
        )
        return outs[0], (outs[3] if not final else outs[0])

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
        attn = g.node(
            "GroupQueryAttention",
            [
                qkv,
                "",
                "",
                f"past_key_values.{layer}.key",
                f"past_key_values.{layer}.value",
                self.seqlens_k,
                self.total_len,
                self.cos_cache,
                self.sin_cache,
                "",  # position_ids, attention_bias, head_sink: unused, listed as genai does
                "",
                "",
            ],
            name=f"{base}/GroupQueryAttention",
            outputs=[
                g.fresh(f"{base}/GroupQueryAttention/output_0"),
                f"present.{layer}.key",
                f"present.{layer}.value",
            ],
            domain="com.microsoft",
            do_rotary=1,
            kv_num_heads=s.num_kv_heads,
            local_window_size=-1,
            num_heads=s.num_heads,
            rotary_interleaved=0,
            scale=1.0 / float(np.sqrt(s.head_dim)),
            softcap=0.0,
        )[0]
        return self.linear(
            attn, Linear(f"{base}/o_proj/MatMul", f"{stem}.o_proj", [f"{p}o_proj.weight"])
        )

    def _int4_initializers(self, lin: Linear, q: Int4Weight) -> tuple[str, str, str | None]:
        g = self.g
        q4 = g.initializer(f"{lin.stem}.MatMul.weight_Q4", q.packed)
        scales = g.initializer(f"{lin.stem}.MatMul.weight_scales", q.scales)
        zps = None
        if q.zero_points is not None:
            zps = g.initializer(f"{lin.stem}.MatMul.weight_zero_points", q.zero_points)
        return q4, scales, zps

    def _matmul_nbits(
        self, x: str, label: str, stem: str, q: Int4Weight, outputs: list[str] | None
    ) -> str:
        assert self.quant is not None
        # The tied head's initializers were written by `embed`; reuse them by name.
        inputs = [x, f"{stem}.MatMul.weight_Q4", f"{stem}.MatMul.weight_scales"]
        if q.zero_points is not None:
            inputs.append(f"{stem}.MatMul.weight_zero_points")
        # genai names the node <label>_Q4 but its output <label>/output_0
        return self.g.node(
            "MatMulNBits",
            inputs,
            name=f"{label}_Q4",
            outputs=outputs or [self.g.fresh(f"{label}/output_0")],
            domain="com.microsoft",
            K=q.k,
            N=q.n,
            accuracy_level=self.quant.accuracy_level,
            bits=4,
            block_size=q.block_size,
        )[0]

    def linear_int4(self, x: str, lin: Linear, q: Int4Weight, *, output: str | None) -> str:
        self._int4_initializers(lin, q)
        return self._matmul_nbits(x, lin.label, lin.stem, q, [output] if output else None)
