"""The `standard` flavour: plain ONNX ops only, past and present joined by Concat.

Semantics follow transformers' Llama / Qwen2 eager path: RMS norm and softmax in float32 (cast up
and back for fp16/bf16), rotary half-split (``rotate_half``) from ``position_ids``, grouped-query
attention by broadcasting each KV head over its group of query heads (``repeat_kv`` without the
copy), a mask that is causal AND hides every key whose ``attention_mask`` is 0 (left or right
padding), SwiGLU MLP, tied or untied head.
"""

from __future__ import annotations

from typing import ClassVar

import numpy as np
from onnx import TensorProto

from ._flavour import DecoderEmitter, Linear, register_flavour

__all__ = ["StandardEmitter"]


@register_flavour
class StandardEmitter(DecoderEmitter):
    """Plain-op decoder: inputs input_ids, attention_mask, position_ids, past_key_values.*."""

    name = "standard"
    opsets: ClassVar[dict[str, int]] = {"": 22}
    has_position_ids = True

    def declare_io(self) -> None:
        g, s = self.g, self.spec
        g.add_input("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"])
        g.add_input("attention_mask", TensorProto.INT64, ["batch_size", "total_sequence_length"])
        g.add_input("position_ids", TensorProto.INT64, ["batch_size", "sequence_length"])
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
        g.add_output("logits", TensorProto.FLOAT, ["batch_size", "sequence_length", s.vocab_size])
        for i in range(s.num_layers):
            for kind in ("key", "value"):
                g.add_input(f"past_key_values.{i}.{kind}", self.elem, kv_past)
                g.add_output(f"present.{i}.{kind}", self.elem, kv_present)

    def prepare(self) -> None:
        g, s = self.g, self.spec
        b = "/model/attn_mask_subgraph"
        ids_shape = g.op("Shape", ["input_ids"], name=f"{b}/ids_shape")
        seq = g.op("Gather", [ids_shape, g.const_i64(1)], name=f"{b}/seq_len", axis=0)
        mask_shape = g.op("Shape", ["attention_mask"], name=f"{b}/mask_shape")
        total = g.op("Gather", [mask_shape, g.const_i64(1)], name=f"{b}/total_len", axis=0)
        past = g.op("Sub", [total, seq], name=f"{b}/past_len")
        one = g.const_i64(1)
        q_pos = g.op("Range", [past, total, one], name=f"{b}/query_positions")  # [S]
        k_pos = g.op("Range", [g.const_i64(0), total, one], name=f"{b}/key_positions")  # [T]
        q_col = g.op("Unsqueeze", [q_pos, g.const_i64([1])], name=f"{b}/query_column")
        k_row = g.op("Unsqueeze", [k_pos, g.const_i64([0])], name=f"{b}/key_row")
        causal = g.op("LessOrEqual", [k_row, q_col], name=f"{b}/causal")  # [S, T]
        keep = g.op("Cast", ["attention_mask"], name=f"{b}/padding", to=TensorProto.BOOL)
        # [B, 1, 1, 1, T]: broadcasts over (kv head, group, query) of the 5-D scores
        keep5 = g.op("Unsqueeze", [keep, g.const_i64([1, 2, 3])], name=f"{b}/padding_5d")
        self.allowed = g.op("And", [causal, keep5], name=f"{b}/allowed")  # [B, 1, 1, S, T]

        r = "/model/rotary_emb"
        exponents = np.arange(0, s.head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(
            s.head_dim
        )
        inv_freq = (np.float32(1.0) / (np.float32(s.rope_theta) ** exponents)).astype(np.float32)
        inv = g.initializer("model.rotary_emb.inv_freq", inv_freq)
        pos = g.op("Cast", ["position_ids"], name=f"{r}/positions", to=TensorProto.FLOAT)
        pos3 = g.op("Unsqueeze", [pos, g.const_i64([2])], name=f"{r}/positions_3d")
        freqs = g.op("Mul", [pos3, inv], name=f"{r}/freqs")  # [B, S, D/2]
        emb = g.op("Concat", [freqs, freqs], name=f"{r}/emb", axis=-1)  # [B, S, D]
        tables = []
        for fn in ("Cos", "Sin"):
            t = g.op(fn, [emb], name=f"{r}/{fn}")
            t = g.op("Unsqueeze", [t, g.const_i64([1])], name=f"{r}/{fn}_4d")  # [B, 1, S, D]
            if self.low_precision:
                t = g.op("Cast", [t], name=f"{r}/{fn}_cast", to=self.elem)
            tables.append(t)
        self.cos, self.sin = tables

    def embed(self) -> str:
        table = self.g.initializer(
            "model.embed_tokens.weight", self.w.cast(self.w.f32("model.embed_tokens.weight"))
        )
        self.embed_table = table
        return self.g.op("Gather", [table, "input_ids"], name="/model/embed_tokens/Gather")

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
        if delta is not None:
            residual = g.op("Add", [residual, delta], name=f"{label}/residual_add")
        x = residual
        if self.low_precision:
            x = g.op("Cast", [x], name=f"{label}/cast_up", to=TensorProto.FLOAT)
        sq = g.op("Pow", [x, g.const_f32(2.0)], name=f"{label}/Pow")
        mean = g.op("ReduceMean", [sq, g.const_i64([-1])], name=f"{label}/ReduceMean", keepdims=1)
        var = g.op("Add", [mean, g.const_f32(self.spec.rms_norm_eps)], name=f"{label}/Add_eps")
        rms = g.op("Sqrt", [var], name=f"{label}/Sqrt")
        normed = g.op("Div", [x, rms], name=f"{label}/Div")
        if self.low_precision:
            normed = g.op("Cast", [normed], name=f"{label}/cast_down", to=self.elem)
        weight = g.initializer(onnx_weight, self.w.cast(self.w.f32(hf_weight)))
        return g.op("Mul", [normed, weight], name=f"{label}/Mul_weight"), residual

    def _rotary(self, x: str, label: str) -> str:
        g = self.g
        first, second = g.node(
            "Split", [x], name=f"{label}/Split", n_outputs=2, num_outputs=2, axis=-1
        )
        neg = g.op("Neg", [second], name=f"{label}/Neg")
        rotated = g.op("Concat", [neg, first], name=f"{label}/rotate_half", axis=-1)
        a = g.op("Mul", [x, self.cos], name=f"{label}/Mul_cos")
        b = g.op("Mul", [rotated, self.sin], name=f"{label}/Mul_sin")
        return g.op("Add", [a, b], name=f"{label}/Add")

    def attention(self, layer: int, x: str) -> str:
        g, s = self.g, self.spec
        base = f"/model/layers.{layer}/attn"
        p = f"model.layers.{layer}.self_attn."
        stem = f"model.layers.{layer}.attn"
        group = s.num_heads // s.num_kv_heads

        def project(kind: str, heads: int) -> str:
            lin = Linear(
                f"{base}/{kind}_proj/MatMul",
                f"{stem}.{kind}_proj",
                [f"{p}{kind}_proj.weight"],
                [f"{p}{kind}_proj.bias"] if s.qkv_bias else None,
            )
            flat = self.linear(x, lin)
            split = g.op(
                "Reshape",
                [flat, g.const_i64([0, 0, heads, s.head_dim])],
                name=f"{base}/{kind}_heads",
            )
            return g.op("Transpose", [split], name=f"{base}/{kind}_bhsd", perm=[0, 2, 1, 3])

        q = self._rotary(project("q", s.num_heads), f"{base}/q_rotary")
        k = self._rotary(project("k", s.num_kv_heads), f"{base}/k_rotary")
        v = project("v", s.num_kv_heads)
        present_k, present_v = f"present.{layer}.key", f"present.{layer}.value"
        g.node(
            "Concat",
            [f"past_key_values.{layer}.key", k],
            name=f"{base}/concat_key",
            outputs=[present_k],
            axis=2,
        )
        g.node(
            "Concat",
            [f"past_key_values.{layer}.value", v],
            name=f"{base}/concat_value",
            outputs=[present_v],
            axis=2,
        )

        # [B, Hq, S, D] → [B, Hkv, group, S, D]; K/V [B, Hkv, T, D] → [B, Hkv, 1, T, D]: MatMul
        # broadcasting pairs query head h with KV head h // group, as repeat_kv does.
        q5 = g.op(
            "Reshape",
            [q, g.const_i64([0, s.num_kv_heads, group, -1, s.head_dim])],
            name=f"{base}/q_groups",
        )
        k5 = g.op("Unsqueeze", [present_k, g.const_i64([2])], name=f"{base}/k_groups")
        v5 = g.op("Unsqueeze", [present_v, g.const_i64([2])], name=f"{base}/v_groups")
        kt = g.op("Transpose", [k5], name=f"{base}/k_transposed", perm=[0, 1, 2, 4, 3])
        scores = g.op("MatMul", [q5, kt], name=f"{base}/scores")  # [B, Hkv, group, S, T]
        if self.low_precision:
            scores = g.op("Cast", [scores], name=f"{base}/scores_fp32", to=TensorProto.FLOAT)
        scaled = g.op(
            "Mul", [scores, g.const_f32(1.0 / float(np.sqrt(s.head_dim)))], name=f"{base}/scale"
        )
        # A finite minimum (not -inf) keeps a fully masked row (a padding query) finite.
        masked = g.op(
            "Where",
            [self.allowed, scaled, g.const_f32(float(np.finfo(np.float32).min))],
            name=f"{base}/mask",
        )
        probs = g.op("Softmax", [masked], name=f"{base}/Softmax", axis=-1)
        if self.low_precision:
            probs = g.op("Cast", [probs], name=f"{base}/probs_cast", to=self.elem)
        ctx = g.op("MatMul", [probs, v5], name=f"{base}/context")  # [B, Hkv, group, S, D]
        ctx = g.op(
            "Reshape",
            [ctx, g.const_i64([0, s.num_heads, -1, s.head_dim])],
            name=f"{base}/context_heads",
        )
        ctx = g.op("Transpose", [ctx], name=f"{base}/context_bshd", perm=[0, 2, 1, 3])
        ctx = g.op("Reshape", [ctx, g.const_i64([0, 0, s.q_size])], name=f"{base}/context_flat")
        return self.linear(
            ctx, Linear(f"{base}/o_proj/MatMul", f"{stem}.o_proj", [f"{p}o_proj.weight"])
        )

    def lm_head(self, x: str) -> None:
        g = self.g
        # fp32 models write logits straight from the head; lower precisions cast up to float32.
        target = None if self.low_precision else "logits"
        if self.spec.tie_embeddings:
            # Tied: one [V, H] table; ONNX Runtime folds this Transpose once at session start.
            weight = g.op("Transpose", [self.embed_table], name="/lm_head/Transpose", perm=[1, 0])
            logits = g.node(
                "MatMul", [x, weight], name="/lm_head/MatMul", outputs=[target] if target else None
            )[0]
        else:
            lin = Linear("/lm_head/MatMul", "lm_head", ["lm_head.weight"])
            logits = self.linear(x, lin, output=target)
        if self.low_precision:
            g.node("Cast", [logits], name="/lm_head/Cast", outputs=["logits"], to=TensorProto.FLOAT)
