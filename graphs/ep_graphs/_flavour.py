"""The decoder skeleton every flavour shares, and the registry a new flavour plugs into.

`DecoderEmitter.emit` walks the Llama block structure once (embed → per layer: norm, attention,
residual norm, MLP → final norm → LM head) and calls small per-flavour methods for each piece.
A flavour subclasses `DecoderEmitter`, overrides the pieces that differ (`declare_io`, `prepare`,
`embed`, `norm`, `attention`, `linear`, `lm_head`), and registers itself with `register_flavour`.
Weight handling (HF names, orientation, dtype casts, int4 quantization) lives here, shared.
"""

from __future__ import annotations

import difflib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from onnx import TensorProto

from ep.errors import ConfigError

from ._graph import ONNX_DTYPES, GraphBuilder
from ._quant import Int4Options, Int4Weight, quantize_int4
from ._spec import ModelSpec
from ._weights import numpy_dtype

__all__ = [
    "FLAVOURS",
    "DecoderEmitter",
    "Linear",
    "WeightSource",
    "get_flavour",
    "register_flavour",
]


class WeightSource:
    """Hugging Face tensors → arrays ready for a graph: float32 master copies, cast on demand."""

    def __init__(self, spec: ModelSpec, weights: Mapping[str, Any]) -> None:
        self.spec = spec
        self._weights = weights
        self.dtype = numpy_dtype(spec.dtype)

    def has(self, hf_name: str) -> bool:
        return hf_name in self._weights

    def f32(self, hf_name: str) -> np.ndarray:
        """The tensor as float32 (bfloat16 and float16 widen exactly)."""
        return np.asarray(self._weights[hf_name]).astype(np.float32, copy=False)

    def cast(self, array: np.ndarray) -> np.ndarray:
        """Cast a float32 array to the model dtype (round to nearest even for fp16 and bf16)."""
        return np.asarray(array, dtype=np.float32).astype(self.dtype, copy=False)

    def stacked_out_in(self, hf_names: list[str]) -> np.ndarray:
        """Several [out, in] matrices stacked along `out` (packed QKV), float32."""
        return np.concatenate([self.f32(name) for name in hf_names], axis=0)


@dataclass(frozen=True)
class Linear:
    """One projection as a flavour emits it.

    `label` is the node name (``/model/layers.0/attn/qkv_proj/MatMul``), `stem` the initializer
    stem (``model.layers.0.attn.qkv_proj``), `hf_weights` the Hugging Face [out, in] matrices
    stacked along out (packed QKV), `hf_biases` their biases (empty: none).
    """

    label: str
    stem: str
    hf_weights: list[str]
    hf_biases: list[str] | None = None


class DecoderEmitter(ABC):
    """Emits one decoder graph into a `GraphBuilder`. Subclass per flavour.

    Attributes set for subclasses: `g` (the builder), `spec`, `w` (a `WeightSource`), `quant`
    (`Int4Options` or None), `elem` (the ONNX element type of the model dtype).
    """

    name: ClassVar[str]
    #: opset imports the graph needs
    opsets: ClassVar[dict[str, int]] = {"": 22}
    #: whether genai_config.json lists a position_ids input
    has_position_ids: ClassVar[bool] = True
    #: genai_config's search.past_present_share_buffer: can present live in the past's buffer
    #: (a fixed max_length cache written in place) or does it grow (Concat)?
    past_present_share_buffer: ClassVar[bool] = False
    #: quantization schemes the flavour can emit (checked before anything is written)
    supported_quant: ClassVar[tuple[str, ...]] = ()
    #: whether onnx.checker accepts the graph (it rejects ONNX Runtime ops in the ONNX domain)
    onnx_checkable: ClassVar[bool] = True

    @classmethod
    def adjust_genai_config(cls, config: dict[str, Any]) -> dict[str, Any]:
        """The flavour's own changes to the genai_config.json `build_model` writes (none here)."""
        return config

    def __init__(
        self,
        g: GraphBuilder,
        spec: ModelSpec,
        weights: WeightSource,
        quant: Int4Options | None,
    ) -> None:
        self.g = g
        self.spec = spec
        self.w = weights
        self.quant = quant
        self.elem = ONNX_DTYPES[spec.dtype]

    @classmethod
    def check_quant(cls, quant: Int4Options | None) -> None:
        """Refuse a quantization the flavour cannot emit (cheap: called before loading weights)."""
        if quant is not None and "int4" not in cls.supported_quant:
            raise ConfigError(
                f"flavour {cls.name!r} does not support quant='int4' (it needs com.microsoft "
                f"MatMulNBits); use flavour 'contrib' or drop the quantization"
            )

    @classmethod
    def check_options(cls, spec: ModelSpec, quant: Int4Options | None) -> None:
        """Refuse combinations the flavour cannot emit, before any file is written."""
        cls.check_quant(quant)

    # --- the shared skeleton ---------------------------------------------------------------

    def emit(self, on_layer: Callable[[], object] | None = None) -> None:
        """Emit the whole graph; `on_layer` is called after each layer (progress bars)."""
        spec = self.spec
        self.declare_io()
        self.prepare()
        hidden = self.embed()
        normed, residual = self.norm(
            "model.layers.0.input_layernorm.weight",
            "model.layers.0.input_layernorm.weight",
            residual=hidden,
            delta=None,
            label="/model/layers.0/input_layernorm",
        )
        for layer in range(spec.num_layers):
            prefix = f"model.layers.{layer}."
            attn = self.attention(layer, normed)
            normed, residual = self.norm(
                prefix + "post_attention_layernorm.weight",
                prefix + "post_attention_layernorm.weight",
                residual=residual,
                delta=attn,
                label=f"/model/layers.{layer}/post_attention_layernorm",
            )
            mlp = self.mlp(layer, normed)
            if layer + 1 < spec.num_layers:
                nxt = f"model.layers.{layer + 1}.input_layernorm.weight"
                normed, residual = self.norm(
                    nxt,
                    nxt,
                    residual=residual,
                    delta=mlp,
                    label=f"/model/layers.{layer + 1}/input_layernorm",
                )
            else:
                normed, _ = self.norm(
                    "model.norm.weight",
                    f"model.layers.{spec.num_layers}.final_norm_layernorm.weight",
                    residual=residual,
                    delta=mlp,
                    label=f"/model/layers.{spec.num_layers}/final_norm_layernorm",
                    final=True,
                )
            if on_layer is not None:
                on_layer()
        self.lm_head(normed)

    # --- pieces every flavour provides -----------------------------------------------------

    @abstractmethod
    def declare_io(self) -> None:
        """Declare graph inputs and outputs (names per the genai conventions)."""

    @abstractmethod
    def prepare(self) -> None:
        """Emit what the layers share: masks, positions, rotary tables."""

    @abstractmethod
    def embed(self) -> str:
        """Token embedding; returns the hidden-state tensor name [B, S, H]."""

    @abstractmethod
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
        """RMS norm of ``residual + delta`` (or of ``residual`` when delta is None).

        Returns (normed, new residual). With ``final`` the residual output is not needed.
        """

    @abstractmethod
    def attention(self, layer: int, x: str) -> str:
        """Self-attention of one layer incl. its o_proj; writes present.<layer>.key/value."""

    @abstractmethod
    def lm_head(self, x: str) -> None:
        """Final projection to the float32 ``logits`` output."""

    # --- shared pieces (override where a flavour differs) ----------------------------------

    def mlp(self, layer: int, x: str) -> str:
        """SwiGLU: down(silu(gate(x)) * up(x)), with silu as x * Sigmoid(x)."""
        p = f"model.layers.{layer}.mlp."
        base = f"/model/layers.{layer}/mlp"
        gate = self.linear(
            x, Linear(f"{base}/gate_proj/MatMul", p[:-1] + ".gate_proj", [p + "gate_proj.weight"])
        )
        up = self.linear(
            x, Linear(f"{base}/up_proj/MatMul", p[:-1] + ".up_proj", [p + "up_proj.weight"])
        )
        sig = self.g.op("Sigmoid", [gate], name=f"{base}/act_fn/Sigmoid")
        act = self.g.op("Mul", [gate, sig], name=f"{base}/act_fn/Mul")
        prod = self.g.op("Mul", [act, up], name=f"{base}/Mul")
        return self.linear(
            prod,
            Linear(f"{base}/down_proj/MatMul", p[:-1] + ".down_proj", [p + "down_proj.weight"]),
        )

    def linear(self, x: str, lin: Linear, *, output: str | None = None) -> str:
        """x @ W^T (+ b) into `output` (or a fresh name). Float MatMul with the [in, out] weight;
        with int4 options it goes to `linear_int4`."""
        matmul_out = None if lin.hf_biases else output
        if self.quant is not None:
            out = self.linear_int4(x, lin, self.quantized(lin), output=matmul_out)
        else:
            weight = self.w.cast(self.w.stacked_out_in(lin.hf_weights).T)
            init = self.g.initializer(f"{lin.stem}.MatMul.weight", weight)
            out = self.g.node(
                "MatMul", [x, init], name=lin.label, outputs=[matmul_out] if matmul_out else None
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

    def quantized(self, lin: Linear) -> Int4Weight:
        """The projection's packed [out, in] matrix, quantized with this build's options."""
        assert self.quant is not None
        return quantize_int4(self.w.stacked_out_in(lin.hf_weights), self.quant, self.w.dtype)

    def linear_int4(self, x: str, lin: Linear, q: Int4Weight, *, output: str | None) -> str:
        """A 4-bit projection; only flavours with a quantized MatMul implement it."""
        raise ConfigError(f"flavour {self.name!r} cannot emit int4 projections")

    @property
    def low_precision(self) -> bool:
        return self.elem != TensorProto.FLOAT


# --- registry -----------------------------------------------------------------------------

FLAVOURS: dict[str, type[DecoderEmitter]] = {}


def register_flavour(cls: type[DecoderEmitter]) -> type[DecoderEmitter]:
    """Class decorator: make `cls` available as ``build_model(..., flavour=cls.name)``."""
    existing = FLAVOURS.get(cls.name)
    if existing is not None and existing is not cls:
        raise ConfigError(
            f"flavour {cls.name!r} is already registered by {existing.__module__}."
            f"{existing.__qualname__}; pick another name for {cls.__module__}.{cls.__qualname__}"
        )
    FLAVOURS[cls.name] = cls
    return cls


def get_flavour(name: str) -> type[DecoderEmitter]:
    try:
        return FLAVOURS[name]
    except KeyError:
        close = difflib.get_close_matches(name, list(FLAVOURS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(
            f"unknown graph flavour {name!r}{hint} (available: {', '.join(sorted(FLAVOURS))})"
        ) from None
