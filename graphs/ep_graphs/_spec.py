"""`ModelSpec`: the shape and numerics of a Llama / Qwen2 decoder, validated on construction."""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, cast

from ep.errors import ConfigError, ModelError

__all__ = ["DTYPES", "MODEL_TYPES", "DType", "ModelSpec"]

DType = Literal["fp32", "fp16", "bf16"]
DTYPES: tuple[DType, ...] = ("fp32", "fp16", "bf16")
MODEL_TYPES: tuple[str, ...] = ("llama", "qwen2")

# Hugging Face `torch_dtype` / `dtype` spellings → ours.
_HF_DTYPES: dict[str, DType] = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def _spec_keys() -> dict[str, str]:
    """Every key `ModelSpec.parse` accepts (full field names and short aliases) → field name."""
    aliases = {
        "hidden": "hidden_size",
        "layers": "num_layers",
        "heads": "num_heads",
        "kv_heads": "num_kv_heads",
        "kv": "num_kv_heads",
        "intermediate": "intermediate_size",
        "ffn": "intermediate_size",
        "vocab": "vocab_size",
        "theta": "rope_theta",
        "rope": "rope_theta",
        "eps": "rms_norm_eps",
        "tie": "tie_embeddings",
        "tied": "tie_embeddings",
        "bias": "qkv_bias",
        "context": "context_length",
        "ctx": "context_length",
        "bos": "bos_token_id",
        "eos": "eos_token_id",
        "pad": "pad_token_id",
        "type": "model_type",
    }
    keys = {f.name: f.name for f in dataclasses.fields(ModelSpec)}
    keys.update(aliases)
    return keys


def _parse_bool(key: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"model spec: {key}={text!r} is not a boolean; use true/false (or 1/0)")


@dataclass(frozen=True)
class ModelSpec:
    """Sizes and numerics of a Llama-family decoder (Llama, Qwen2).

    `head_dim` 0 means `hidden_size // num_heads`; `num_kv_heads` 0 means `num_heads` (no GQA);
    `intermediate_size` 0 means `4 * hidden_size`. Construction validates every field and raises
    `ConfigError` naming the field, the value and what is allowed.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    num_kv_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    tie_embeddings: bool = False
    qkv_bias: bool = False
    dtype: DType = "fp32"
    context_length: int = 2048
    bos_token_id: int = 1
    eos_token_id: int | tuple[int, ...] = 2
    pad_token_id: int = 0
    model_type: str = "llama"

    _REQUIRED: ClassVar[tuple[str, ...]] = ("hidden_size", "num_layers", "num_heads", "vocab_size")

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "vocab_size", "context_length"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(f"model spec: {name}={value!r}; expected a positive integer")
        for name in ("num_kv_heads", "head_dim", "intermediate_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigError(
                    f"model spec: {name}={value!r}; expected a positive integer (or 0 for the "
                    "default derived from the other sizes)"
                )
        # Frozen: fill the derived defaults through object.__setattr__ once, here.
        if self.num_kv_heads == 0:
            object.__setattr__(self, "num_kv_heads", self.num_heads)
        if self.head_dim == 0:
            if self.hidden_size % self.num_heads:
                raise ConfigError(
                    f"model spec: hidden_size={self.hidden_size} is not divisible by "
                    f"num_heads={self.num_heads}, so head_dim cannot be derived; give head_dim "
                    "explicitly or change the sizes"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
        if self.intermediate_size == 0:
            object.__setattr__(self, "intermediate_size", 4 * self.hidden_size)
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model spec: num_heads={self.num_heads} is not divisible by "
                f"num_kv_heads={self.num_kv_heads}; grouped-query attention needs every KV head "
                "to serve the same number of query heads (e.g. heads=8, kv_heads=2)"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"model spec: head_dim={self.head_dim} is odd; rotary embeddings rotate pairs, "
                "so head_dim must be even"
            )
        if self.dtype not in DTYPES:
            raise ConfigError(f"model spec: dtype={self.dtype!r}; expected one of {DTYPES}")
        if self.model_type not in MODEL_TYPES:
            raise ConfigError(
                f"model spec: model_type={self.model_type!r}; expected one of {MODEL_TYPES}"
            )
        for name in ("rope_theta", "rms_norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ConfigError(f"model spec: {name}={value!r}; expected a positive number")
        object.__setattr__(self, "rope_theta", float(self.rope_theta))
        object.__setattr__(self, "rms_norm_eps", float(self.rms_norm_eps))
        for name in ("tie_embeddings", "qkv_bias"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"model spec: {name}={getattr(self, name)!r}; expected a bool")
        for name, ids in (
            ("bos_token_id", (self.bos_token_id,)),
            ("eos_token_id", self.eos_token_ids),
            ("pad_token_id", (self.pad_token_id,)),
        ):
            for token in ids:
                if isinstance(token, bool) or not isinstance(token, int):
                    raise ConfigError(f"model spec: {name}={token!r}; expected an integer id")
                if not 0 <= token < self.vocab_size:
                    raise ConfigError(
                        f"model spec: {name}={token} is outside the vocabulary "
                        f"[0, {self.vocab_size}); give an id below vocab_size"
                    )

    # --- derived values --------------------------------------------------------------------

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """Every end-of-sequence id (Hugging Face configs may list several)."""
        eos = self.eos_token_id
        return eos if isinstance(eos, tuple) else (eos,)

    @property
    def q_size(self) -> int:
        """Width of the query projection: num_heads * head_dim."""
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        """Width of the key (and value) projection: num_kv_heads * head_dim."""
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        """Plain fields, JSON-ready."""
        out = dataclasses.asdict(self)
        if isinstance(self.eos_token_id, tuple):
            out["eos_token_id"] = list(self.eos_token_id)
        return out

    # --- constructors ----------------------------------------------------------------------

    @classmethod
    def parse(cls, text: str) -> ModelSpec:
        """Build from a compact string, e.g. ``"hidden=64,layers=2,heads=4,kv_heads=2,vocab=512"``.

        Keys are the field names or short aliases (hidden, layers, heads, kv_heads, head_dim,
        intermediate, vocab, theta, eps, tie, bias, dtype, context, bos, eos, pad, type).
        """
        keys = _spec_keys()
        values: dict[str, Any] = {}
        seen_as: dict[str, str] = {}
        for raw in text.split(","):
            item = raw.strip()
            if not item:
                continue
            if "=" not in item:
                raise ConfigError(
                    f"model spec: {item!r} has no '='; write key=value pairs separated by commas, "
                    "e.g. 'hidden=64,layers=2,heads=4,vocab=512'"
                )
            key, _, value = (part.strip() for part in item.partition("="))
            field = keys.get(key.lower())
            if field is None:
                close = difflib.get_close_matches(key.lower(), list(keys), n=3, cutoff=0.6)
                hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
                raise ConfigError(
                    f"model spec: unknown key {key!r}{hint} (known keys: {', '.join(sorted(keys))})"
                )
            if field in values:
                raise ConfigError(
                    f"model spec: {field} given twice (as {seen_as[field]!r} and {key!r}); "
                    "give it once"
                )
            seen_as[field] = key
            values[field] = cls._convert(field, key, value)
        missing = [name for name in cls._REQUIRED if name not in values]
        if missing:
            raise ConfigError(
                f"model spec {text!r} is missing {', '.join(missing)}; at least hidden, layers, "
                "heads and vocab are needed, e.g. 'hidden=64,layers=2,heads=4,vocab=512'"
            )
        return cls(**values)

    @staticmethod
    def _convert(field: str, key: str, value: str) -> Any:
        if field in ("tie_embeddings", "qkv_bias"):
            return _parse_bool(key, value)
        if field in ("dtype", "model_type"):
            return value.lower()
        if field in ("rope_theta", "rms_norm_eps"):
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"model spec: {key}={value!r} is not a number") from None
        if field == "eos_token_id" and ("|" in value or ";" in value):
            parts = value.replace(";", "|").split("|")
            try:
                return tuple(int(p) for p in parts)
            except ValueError:
                raise ConfigError(
                    f"model spec: {key}={value!r}; expected token ids separated by '|'"
                ) from None
        try:
            return int(value)
        except ValueError:
            raise ConfigError(f"model spec: {key}={value!r} is not an integer") from None

    @classmethod
    def from_hf_config(cls, path_or_dict: str | Path | Mapping[str, Any]) -> ModelSpec:
        """Read a Hugging Face ``config.json`` (a folder holding one, the file, or its dict).

        Supports ``model_type`` llama and qwen2. Features this builder does not implement
        (rope scaling, o_proj/MLP biases, sliding windows, activations other than SiLU) are
        refused with a `ConfigError` rather than silently ignored.
        """
        if isinstance(path_or_dict, Mapping):
            config: Mapping[str, Any] = path_or_dict
            where = "config"
        else:
            path = Path(path_or_dict)
            if path.is_dir():
                path = path / "config.json"
            if not path.is_file():
                raise ModelError(
                    f"no Hugging Face config at {path}: expected a config.json file (or a "
                    "checkpoint folder holding one)"
                )
            try:
                config = json.loads(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
                raise ModelError(f"cannot read {path}: {exc}; expected a JSON object") from None
            if not isinstance(config, Mapping):
                raise ModelError(f"{path} holds {type(config).__name__}; expected a JSON object")
            where = str(path)
        return cls._from_config_mapping(config, where)

    @classmethod
    def _from_config_mapping(cls, config: Mapping[str, Any], where: str) -> ModelSpec:
        model_type = config.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(
                f"{where}: model_type={model_type!r} is not supported; expected one of "
                f"{MODEL_TYPES} (Llama-family decoders)"
            )

        def need(name: str) -> Any:
            if name not in config:
                raise ConfigError(f"{where}: required key {name!r} is missing")
            return config[name]

        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"{where}: hidden_act={act!r}; only 'silu' (SwiGLU) is supported")
        if config.get("mlp_bias"):
            raise ConfigError(f"{where}: mlp_bias=true is not supported (MLP without biases)")
        if model_type == "llama" and config.get("attention_bias"):
            raise ConfigError(
                f"{where}: attention_bias=true puts a bias on o_proj as well, which is not "
                "supported; only q/k/v biases (Qwen2) are"
            )
        if model_type == "qwen2" and config.get("use_sliding_window"):
            raise ConfigError(f"{where}: use_sliding_window=true is not supported")

        def number(name: str, value: Any, kind: type[int] | type[float]) -> Any:
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ConfigError(f"{where}: {name}={value!r}; expected a number")
            if kind is int and value != int(value):
                raise ConfigError(f"{where}: {name}={value!r}; expected an integer")
            return kind(value)

        def integer(name: str, default: Any = None) -> int:
            value = config.get(name, default) if default is not None else need(name)
            return int(number(name, value, int))

        rope_params = config.get("rope_parameters") or {}
        rope_scaling = config.get("rope_scaling") or {}
        for key, source in (("rope_parameters", rope_params), ("rope_scaling", rope_scaling)):
            if not isinstance(source, Mapping):
                raise ConfigError(f"{where}: {key}={source!r}; expected an object")
            rope_type = source.get("rope_type", source.get("type", "default"))
            if rope_type != "default":
                raise ConfigError(
                    f"{where}: rope type {rope_type!r} is not supported; only the default "
                    "(unscaled) rotary embedding is"
                )
        # transformers 5 moved rope_theta into rope_parameters
        rope_theta = config.get("rope_theta", rope_params.get("rope_theta", 10000.0))

        raw_dtype = config.get("torch_dtype", config.get("dtype", "float32"))
        dtype = _HF_DTYPES.get(str(raw_dtype))
        if dtype is None:
            raise ConfigError(
                f"{where}: dtype {raw_dtype!r} is not supported; expected one of {list(_HF_DTYPES)}"
            )
        heads = integer("num_attention_heads")
        eos = config.get("eos_token_id", 2)
        eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
        eos_ids = tuple(int(number("eos_token_id", e, int)) for e in eos_ids)
        if not eos_ids:
            raise ConfigError(f"{where}: eos_token_id is an empty list; expected an id")
        # Llama 3 and others ship without a pad (or bos) id; fall back to eos, as genai does.
        pad = config.get("pad_token_id")
        bos = config.get("bos_token_id")
        return cls(
            hidden_size=integer("hidden_size"),
            num_layers=integer("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=int(
                number("num_key_value_heads", config.get("num_key_value_heads") or heads, int)
            ),
            head_dim=int(number("head_dim", config.get("head_dim") or 0, int)),
            intermediate_size=integer("intermediate_size"),
            vocab_size=integer("vocab_size"),
            rope_theta=number("rope_theta", rope_theta, float),
            rms_norm_eps=number("rms_norm_eps", config.get("rms_norm_eps", 1e-6), float),
            # transformers' Llama and Qwen2 configs default to an untied head
            tie_embeddings=bool(config.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2",  # Qwen2 always has q/k/v biases
            dtype=cast(DType, dtype),
            context_length=integer("max_position_embeddings", 2048),
            bos_token_id=eos_ids[0] if bos is None else int(number("bos_token_id", bos, int)),
            eos_token_id=eos_ids if len(eos_ids) > 1 else eos_ids[0],
            pad_token_id=eos_ids[0] if pad is None else int(number("pad_token_id", pad, int)),
            model_type=str(model_type),
        )
