"""Load a genai-style decoder: find its files, its I/O names and its KV geometry.

`load_model` accepts

- an onnxruntime-genai model folder (``genai_config.json`` and the model file it names);
- a bare decoder ``.onnx`` file, or a folder holding exactly one ``.onnx`` and no genai config;
- a Hugging Face checkpoint folder (``config.json`` + ``*.safetensors``);
- a builder spec string ``spec:hidden=64,layers=2,heads=4,vocab=512[,seed=0][,flavour=contrib]``.

The last two are converted by ``ep_graphs`` into a cache folder (``$GENAI_EP_CACHE/models/<hash>``,
default ``~/.cache/genai-ep/models/<hash>``), written atomically, and then loaded like the first.
Everything is found by inspecting the graph (names and shapes; weights are not read), never
assumed: the loader returns a frozen `DecoderModel` the backends drive without looking again.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from ep.errors import ModelError

__all__ = [
    "PAST_PATTERNS",
    "PRESENT_PATTERNS",
    "DecoderIO",
    "DecoderModel",
    "Flavour",
    "default_cache_dir",
    "load_model",
]

Flavour = Literal["contrib", "ep", "standard"]
SourceKind = Literal["genai", "onnx", "hf", "spec"]
Padding = Literal["left", "right"]

EP_DOMAIN = "ai.genai_ep"
MS_DOMAIN = "com.microsoft"

# Past/present name families we recognise (each with a `layer` and a `kind` group). A
# genai_config.json's own name patterns take precedence over these.
PAST_PATTERNS: tuple[str, ...] = (
    r"past_key_values\.(?P<layer>\d+)\.(?P<kind>key|value)",
    r"past\.(?P<layer>\d+)\.(?P<kind>key|value)",
    r"past_key_values_(?P<layer>\d+)_(?P<kind>key|value)",
    r"past_(?P<kind>key|value)_(?P<layer>\d+)",
)
PRESENT_PATTERNS: tuple[str, ...] = (
    r"present\.(?P<layer>\d+)\.(?P<kind>key|value)",
    r"present_key_values\.(?P<layer>\d+)\.(?P<kind>key|value)",
    r"present_(?P<layer>\d+)_(?P<kind>key|value)",
    r"present_(?P<kind>key|value)_(?P<layer>\d+)",
)

_ONNX_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 6: "int32", 7: "int64"}
_KV_DTYPES = ("float32", "float16", "bfloat16")
_EXPECTED_FOLDER = (
    "genai_config.json + the model file it names (onnxruntime-genai folder); "
    "exactly one .onnx file (bare decoder); "
    "config.json + *.safetensors (Hugging Face checkpoint)"
)


@dataclass(frozen=True)
class DecoderIO:
    """The graph's input and output names (and the integer inputs' dtypes)."""

    input_ids: str
    attention_mask: str
    position_ids: str | None
    logits: str
    past_keys: tuple[str, ...]
    past_values: tuple[str, ...]
    present_keys: tuple[str, ...]
    present_values: tuple[str, ...]
    input_ids_dtype: str = "int64"
    attention_mask_dtype: str = "int64"
    position_ids_dtype: str = "int64"
    logits_dtype: str = "float32"
    # Graphs whose KV cache the runtime owns (ep flavour, `runtime_kv`): no past/present and no
    # attention mask (``attention_mask`` is ""); ``positions`` [B, S] int64 gives each token's
    # cache slot (< 0: padding), ``kv_cache`` the KV_CACHES handle, ``kv_geometry`` the layout.
    positions: str | None = None
    kv_cache: str | None = None
    kv_geometry: str | None = None

    @property
    def runtime_kv(self) -> bool:
        """Whether the KV cache is reached through a handle instead of past/present tensors."""
        return self.kv_cache is not None


@dataclass(frozen=True)
class DecoderModel:
    """A decoder graph ready to drive: files, flavour, I/O names, KV geometry, special ids.

    ``share_buffer``: past and present may be bound to one fixed-capacity buffer (graphs with
    GroupQueryAttention); otherwise present is past with the new tokens concatenated.
    ``padding``: how a batch of prompts of different lengths is laid out for this graph (``right``
    for shared-buffer graphs, whose attention reads per-row lengths; ``left`` for the others).
    """

    source: str
    kind: SourceKind
    onnx_path: Path
    folder: Path
    genai_config: Path | None
    tokenizer_dir: Path | None
    flavour: Flavour
    io: DecoderIO
    num_layers: int
    kv_heads: int
    head_dim: int
    kv_dtype: str
    vocab_size: int
    context_length: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int
    share_buffer: bool
    padding: Padding
    num_heads: int | None = None

    @property
    def kv_numpy_dtype(self) -> np.dtype[Any]:
        if self.kv_dtype == "bfloat16":
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        return np.dtype(self.kv_dtype)

    @property
    def kv_itemsize(self) -> int:
        return 2 if self.kv_dtype in ("float16", "bfloat16") else 4

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one token's K and V occupy across all layers."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self.kv_itemsize

    def describe(self) -> str:
        return (
            f"{self.onnx_path} ({self.kind}, flavour {self.flavour}): {self.num_layers} layers, "
            f"{self.kv_heads} KV heads of {self.head_dim} ({self.kv_dtype}), vocab "
            f"{self.vocab_size}, context {self.context_length}, "
            + (
                "runtime-owned KV cache (handle + geometry inputs)"
                if self.io.runtime_kv
                else f"{'shared' if self.share_buffer else 'concatenated'} past/present"
            )
        )


# --- public entry ------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """Where converted models live: ``$GENAI_EP_CACHE/models`` or ``~/.cache/genai-ep/models``."""
    root = os.environ.get("GENAI_EP_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "genai-ep"
    return base / "models"


def load_model(
    source: str | os.PathLike[str],
    *,
    context_length: int | None = None,
    flavour: Flavour | None = None,
    dtype: str = "fp32",
    quant: str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
) -> DecoderModel:
    """Load a decoder from a genai folder, a bare ``.onnx``, an HF checkpoint or a ``spec:``.

    ``context_length`` overrides (or, for a bare graph without one, supplies) the context.
    ``flavour`` (default "contrib"), ``dtype`` (HF checkpoints; a spec carries its own) and
    ``quant`` (None or "int4") apply only to conversions; the flavour of a loaded graph is
    always detected. ``cache_dir`` overrides `default_cache_dir`.
    """
    if context_length is not None and (
        isinstance(context_length, bool)
        or not isinstance(context_length, int)
        or context_length < 2
    ):
        raise ModelError(f"context_length={context_length!r}; expected an integer >= 2")
    text = os.fspath(source)
    if text.startswith("spec:"):
        folder = _build_from_spec(text[len("spec:") :], flavour, quant, cache_dir)
        return _load_path(folder, text, "spec", context_length)
    path = Path(text).expanduser()
    if not path.exists():
        raise ModelError(
            f"model path {text!r} does not exist; expected a model folder, an .onnx file, a "
            "Hugging Face checkpoint folder or a 'spec:key=value,...' string"
        )
    if path.is_dir() and not (path / "genai_config.json").is_file() and _is_hf_checkpoint(path):
        folder = _convert_checkpoint(path, flavour, dtype, quant, cache_dir)
        return _load_path(folder, text, "hf", context_length)
    return _load_path(path, text, None, context_length)


# --- locating files ------------------------------------------------------------------------------


def _is_hf_checkpoint(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def _load_path(
    path: Path, source: str, kind: SourceKind | None, context_length: int | None
) -> DecoderModel:
    config_path: Path | None = None
    if path.is_file():
        if path.name == "genai_config.json":
            config_path, folder = path, path.parent
            onnx_path = _onnx_from_config(config_path)
        elif path.suffix == ".onnx":
            folder, onnx_path = path.parent, path
            # A genai_config beside the file describes it when it names this very file.
            beside = folder / "genai_config.json"
            if beside.is_file() and _onnx_from_config(beside) == onnx_path:
                config_path = beside
        else:
            raise ModelError(
                f"{path} is neither an .onnx file nor a genai_config.json; expected one of: "
                f"{_EXPECTED_FOLDER}"
            )
    else:
        folder = path
        if (folder / "genai_config.json").is_file():
            config_path = folder / "genai_config.json"
            onnx_path = _onnx_from_config(config_path)
        else:
            onnx_files = sorted(folder.glob("*.onnx"))
            if len(onnx_files) == 1:
                onnx_path = onnx_files[0]
            elif len(onnx_files) > 1:
                names = ", ".join(p.name for p in onnx_files)
                raise ModelError(
                    f"{folder} holds {len(onnx_files)} .onnx files ({names}) and no "
                    "genai_config.json; pass the decoder's .onnx file itself"
                )
            else:
                found = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
                raise ModelError(
                    f"{folder} holds no model we recognise; found: {found}; expected one of: "
                    f"{_EXPECTED_FOLDER}"
                )
    if kind is None:
        kind = "genai" if config_path is not None else "onnx"
    config = _read_json(config_path) if config_path is not None else {}
    return _inspect(source, kind, onnx_path, folder, config_path, config, context_length)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelError(f"cannot read {path}: {exc}; expected a JSON object") from None
    if not isinstance(data, dict):
        raise ModelError(f"{path} holds {type(data).__name__}; expected a JSON object")
    return data


def _onnx_from_config(config_path: Path) -> Path:
    config = _read_json(config_path)
    decoder = config.get("model", {}).get("decoder", {})
    filename = decoder.get("filename") if isinstance(decoder, dict) else None
    if not isinstance(filename, str) or not filename:
        raise ModelError(
            f"{config_path} has no model.decoder.filename; expected the name of the decoder's "
            '.onnx file, e.g. "filename": "model.onnx"'
        )
    onnx_path = config_path.parent / filename
    if not onnx_path.is_file():
        present = ", ".join(sorted(p.name for p in config_path.parent.glob("*.onnx"))) or "none"
        raise ModelError(
            f"{config_path} names the model file {filename!r}, which is missing from "
            f"{config_path.parent} (.onnx files there: {present}); fix model.decoder.filename "
            "or copy the model file there"
        )
    return onnx_path


# --- inspecting the graph ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Value:
    name: str
    dtype: str
    shape: tuple[int | str, ...]  # ints for fixed dims, symbols (or "?") for the others


def _values(items: Iterable[Any]) -> dict[str, _Value]:
    out = {}
    for vi in items:
        tt = vi.type.tensor_type
        dims: list[int | str] = []
        for d in tt.shape.dim:
            if d.HasField("dim_value"):
                dims.append(int(d.dim_value))
            else:
                dims.append(d.dim_param or "?")
        out[vi.name] = _Value(
            vi.name, _ONNX_DTYPES.get(tt.elem_type, f"onnx:{tt.elem_type}"), tuple(dims)
        )
    return out


def _load_graph(onnx_path: Path) -> Any:
    import onnx

    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception as exc:  # protobuf raises DecodeError, onnx raises several others
        raise ModelError(
            f"cannot parse {onnx_path} as an ONNX model ({type(exc).__name__}: {exc}); the file "
            "is damaged or not ONNX"
        ) from None
    if not model.graph.output:
        raise ModelError(f"{onnx_path} parsed but has no graph outputs; it is not a decoder")
    missing = set()
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            for entry in init.external_data:
                if entry.key == "location" and not (onnx_path.parent / entry.value).is_file():
                    missing.add(entry.value)
    if missing:
        raise ModelError(
            f"{onnx_path} keeps its weights in {', '.join(sorted(missing))}, which is missing "
            f"from {onnx_path.parent}; copy the data file beside the model"
        )
    return model


_KVPattern = tuple["re.Pattern[str]", str | None]  # (regex, fixed kind or None: from the match)


def _default_patterns(patterns: tuple[str, ...]) -> tuple[list[_KVPattern], str]:
    shown = ", ".join(
        p.replace(r"(?P<layer>\d+)", "%d")
        .replace("(?P<kind>key|value)", "{key,value}")
        .replace("\\", "")
        for p in patterns
    )
    return [(re.compile(p), None) for p in patterns], shown


def _config_patterns(keys: str, values: str) -> tuple[list[_KVPattern], str]:
    out: list[_KVPattern] = []
    for template, kind in ((keys, "key"), (values, "value")):
        parts = template.split("%d")
        if len(parts) != 2:
            raise ModelError(
                f"genai_config name pattern {template!r} must contain exactly one %d (the layer "
                "index), e.g. 'past_key_values.%d.key'"
            )
        regex = re.escape(parts[0]) + r"(?P<layer>\d+)" + re.escape(parts[1])
        out.append((re.compile(regex), kind))
    return out, f"{keys!r} and {values!r} (from genai_config.json)"


def _kv_patterns(names: Mapping[str, Any], prefix: str) -> tuple[list[_KVPattern], str]:
    keys = names.get(f"{prefix}_key_names")
    values = names.get(f"{prefix}_value_names")
    if isinstance(keys, str) and isinstance(values, str):
        return _config_patterns(keys, values)
    return _default_patterns(PAST_PATTERNS if prefix == "past" else PRESENT_PATTERNS)


def _match_kv(
    names: Iterable[str], patterns: list[_KVPattern], what: str
) -> dict[tuple[int, str], str]:
    found: dict[tuple[int, str], str] = {}
    for name in names:
        for regex, fixed_kind in patterns:
            m = regex.fullmatch(name)
            if not m:
                continue
            key = (int(m.group("layer")), fixed_kind or m.group("kind"))
            if key in found:
                raise ModelError(
                    f"two {what} tensors for layer {key[0]} {key[1]}: {found[key]!r} and "
                    f"{name!r}; a decoder has exactly one of each"
                )
            found[key] = name
            break
    return found


def _find(
    values: Mapping[str, _Value], name: str, what: str, where: str, *, side: str = "input"
) -> _Value:
    found = values.get(name)
    if found is None:
        listed = ", ".join(values) or "none"
        raise ModelError(
            f"{where} has no {side} named {name!r} ({what}); its {side}s are: {listed}. "
            "Expected genai-style I/O (input_ids, attention_mask, optional position_ids, "
            "past_key_values.%d.key/value in; logits, present.%d.key/value out)"
        )
    return found


def _check_int_input(value: _Value, where: str) -> str:
    if value.dtype not in ("int64", "int32"):
        raise ModelError(
            f"{where}: input {value.name!r} has dtype {value.dtype}; expected int64 or int32"
        )
    return value.dtype


def _layers(found: Mapping[tuple[int, str], str], kind: str) -> list[int]:
    return sorted(layer for layer, k in found if k == kind)


@dataclass(frozen=True)
class _GQA:
    num_heads: int
    kv_heads: int
    head_dim: int | None
    max_positions: int | None


def _gqa_info(graph: Any) -> _GQA | None:
    """Heads, head size and rotary table length from the first GroupQueryAttention node."""
    nodes = [n for n in graph.node if n.domain == MS_DOMAIN and n.op_type == "GroupQueryAttention"]
    if not nodes:
        return None
    node = nodes[0]
    attrs = {a.name: a for a in node.attribute}
    num_heads = int(attrs["num_heads"].i) if "num_heads" in attrs else 0
    kv_heads = int(attrs["kv_num_heads"].i) if "kv_num_heads" in attrs else 0
    dims = {init.name: list(init.dims) for init in graph.initializer}
    producers = {out: n for n in graph.node for out in n.output}

    def width(name: str, depth: int = 0) -> int | None:
        # The query (or packed QKV) width, from the projection that produces it.
        node_ = producers.get(name)
        if node_ is None or depth > 4:
            return None
        if node_.op_type == "BitCast":  # the float16/bfloat16 carrier of one of our ops
            return width(node_.input[0], depth + 1)
        if node_.op_type == "MatMul" and node_.domain != EP_DOMAIN and node_.input[1] in dims:
            return int(dims[node_.input[1]][-1])
        if node_.op_type == "MatMulNBits" or node_.domain == EP_DOMAIN:
            for a in node_.attribute:
                if a.name == "N":
                    return int(a.i)
        if node_.op_type == "Add":
            for inp in node_.input:
                if inp not in dims:
                    w = width(inp, depth + 1)
                    if w:
                        return w
        return None

    head_dim = None
    packed = len(node.input) < 2 or node.input[1] == ""
    w = width(node.input[0])
    per = num_heads + 2 * kv_heads if packed else num_heads
    if w and per and w % per == 0:
        head_dim = w // per
    max_positions = None
    if len(node.input) > 7 and node.input[7] in dims:
        max_positions = int(dims[node.input[7]][0])
    return _GQA(num_heads, kv_heads, head_dim, max_positions)


def _one_int(values: Iterable[int | str], what: str, where: str) -> int | None:
    ints = {v for v in values if isinstance(v, int)}
    if len(ints) > 1:
        raise ModelError(f"{where}: the past tensors disagree on {what}: {sorted(ints)}")
    return ints.pop() if ints else None


def _agree(graph_value: int | None, config_value: Any, what: str, where: str) -> int | None:
    if config_value is None:
        return graph_value
    if graph_value is not None and int(config_value) != graph_value:
        raise ModelError(
            f"{where}: the graph's past tensors have {what} = {graph_value} but genai_config.json "
            f"says {config_value}; fix the config (the graph is what runs)"
        )
    return int(config_value)


def _special_ids(
    config: Mapping[str, Any], folder: Path, vocab: int, where: str
) -> tuple[int | None, tuple[int, ...], int]:
    model = config.get("model", {}) if config else {}
    sources: list[Mapping[str, Any]] = [model] if model else []
    for name in ("generation_config.json", "config.json"):
        if not model and (folder / name).is_file():
            with contextlib.suppress(ModelError):  # an unreadable HF config only loses ids
                sources.append(_read_json(folder / name))

    def first(key: str) -> Any:
        for src in sources:
            if src.get(key) is not None:
                return src[key]
        return None

    bos, eos, pad = first("bos_token_id"), first("eos_token_id"), first("pad_token_id")
    eos_ids = (
        tuple(int(e) for e in eos)
        if isinstance(eos, list)
        else (() if eos is None else (int(eos),))
    )
    pad_id = int(pad) if pad is not None else (eos_ids[0] if eos_ids else 0)
    bos_id = int(bos) if bos is not None else None
    for name, ids in (
        ("bos", () if bos_id is None else (bos_id,)),
        ("eos", eos_ids),
        ("pad", (pad_id,)),
    ):
        for i in ids:
            if not 0 <= i < vocab:
                raise ModelError(
                    f"{where}: {name} token id {i} is outside the vocabulary [0, {vocab}); fix "
                    f"{name}_token_id in the model's config"
                )
    return bos_id, eos_ids, pad_id


def _inspect(
    source: str,
    kind: SourceKind,
    onnx_path: Path,
    folder: Path,
    config_path: Path | None,
    config: Mapping[str, Any],
    context_length: int | None,
) -> DecoderModel:
    where = str(onnx_path)
    model = _load_graph(onnx_path)
    graph = model.graph
    initializers = {i.name for i in graph.initializer}
    inputs = _values(i for i in graph.input if i.name not in initializers)
    outputs = _values(graph.output)
    mcfg = config.get("model", {}) if config else {}
    dcfg = mcfg.get("decoder", {}) if isinstance(mcfg, dict) else {}
    cfg_in = dcfg.get("inputs", {}) if isinstance(dcfg, dict) else {}
    cfg_out = dcfg.get("outputs", {}) if isinstance(dcfg, dict) else {}

    if _has_runtime_kv(graph):
        return _inspect_runtime_kv(
            source, kind, onnx_path, folder, config_path, config, context_length, model
        )
    ids = _find(inputs, cfg_in.get("input_ids", "input_ids"), "token ids", where)
    mask = _find(inputs, cfg_in.get("attention_mask", "attention_mask"), "attention mask", where)
    pos_name = cfg_in.get("position_ids", "position_ids")
    pos = inputs.get(pos_name)
    logits = _find(outputs, cfg_out.get("logits", "logits"), "logits", where, side="output")

    past_patterns, past_shown = _kv_patterns(cfg_in, "past")
    present_patterns, present_shown = _kv_patterns(cfg_out, "present")
    past = _match_kv(inputs, past_patterns, "past")
    present = _match_kv(outputs, present_patterns, "present")
    if not past:
        raise ModelError(
            f"{where} has no past key/value inputs: its inputs are {', '.join(inputs)}; expected "
            f"names matching {past_shown}"
        )
    if not present:
        raise ModelError(
            f"{where} has no present key/value outputs: its outputs are {', '.join(outputs)}; "
            f"expected names matching {present_shown}"
        )
    known = {ids.name, mask.name, *past.values()} | ({pos.name} if pos else set())
    unknown = [n for n in inputs if n not in known]
    if unknown:
        raise ModelError(
            f"{where} has inputs this runtime cannot feed: {', '.join(unknown)}; it feeds "
            f"input_ids, attention_mask, position_ids and past names matching {past_shown}"
        )

    layer_lists = {
        "past keys": _layers(past, "key"),
        "past values": _layers(past, "value"),
        "present keys": _layers(present, "key"),
        "present values": _layers(present, "value"),
    }
    first_list = layer_lists["past keys"]
    if any(v != first_list for v in layer_lists.values()) or first_list != list(
        range(len(first_list))
    ):
        detail = "; ".join(f"{k}: layers {v}" for k, v in layer_lists.items())
        raise ModelError(
            f"{where}: inconsistent layer counts ({detail}); expected layers 0..N-1 with a past "
            "and present key and value each"
        )
    num_layers = len(first_list)
    cfg_layers = dcfg.get("num_hidden_layers") if isinstance(dcfg, dict) else None
    if cfg_layers is not None and int(cfg_layers) != num_layers:
        raise ModelError(
            f"{where}: inconsistent layer counts: the graph has {num_layers} layers of "
            f"past/present but genai_config.json says num_hidden_layers={cfg_layers}"
        )

    order = [(layer, k) for layer in range(num_layers) for k in ("key", "value")]
    past_vals = [inputs[past[key]] for key in order]
    present_vals = [outputs[present[key]] for key in order]
    for v in past_vals + present_vals:
        if len(v.shape) != 4:
            raise ModelError(
                f"{where}: {v.name!r} has shape {list(v.shape)}; expected 4 dims "
                "[batch, kv_heads, sequence, head_dim]"
            )
        if isinstance(v.shape[2], int) and not isinstance(v.shape[1], int):
            raise ModelError(
                f"{where}: {v.name!r} has shape {list(v.shape)}, which looks sequence-major "
                "[batch, sequence, kv_heads, head_dim]; this runtime drives head-major "
                "[batch, kv_heads, sequence, head_dim] past/present tensors"
            )
    dtypes = {v.dtype for v in past_vals + present_vals}
    if len(dtypes) != 1 or next(iter(dtypes)) not in _KV_DTYPES:
        raise ModelError(
            f"{where}: past/present dtypes are {sorted(dtypes)}; expected one of {_KV_DTYPES} for "
            "all of them"
        )
    kv_dtype = dtypes.pop()

    gqa = _gqa_info(graph)
    kv_heads = _one_int((v.shape[1] for v in past_vals + present_vals), "kv_heads", where)
    head_dim = _one_int((v.shape[3] for v in past_vals + present_vals), "head_dim", where)
    kv_heads = _agree(kv_heads, dcfg.get("num_key_value_heads"), "kv_heads", where)
    head_dim = _agree(head_dim, dcfg.get("head_size"), "head_dim", where)
    if kv_heads is None and gqa is not None and gqa.kv_heads:
        kv_heads = gqa.kv_heads
    if head_dim is None and gqa is not None:
        head_dim = gqa.head_dim
    if kv_heads is None or head_dim is None:
        missing = "kv_heads" if kv_heads is None else "head_dim"
        raise ModelError(
            f"{where}: cannot tell {missing} from the graph (past shape "
            f"{list(past_vals[0].shape)} is symbolic there) and there is no genai_config.json "
            "giving it; add a genai_config.json with num_key_value_heads and head_size"
        )

    vocab = _vocab_size(logits, mcfg, where)

    domains = {(n.domain, n.op_type) for n in graph.node}
    for fn in model.functions:
        domains |= {(n.domain, n.op_type) for n in fn.node}
    flavour: Flavour
    if any(d == EP_DOMAIN for d, _ in domains):
        flavour = "ep"
    elif (MS_DOMAIN, "GroupQueryAttention") in domains:
        flavour = "contrib"
    else:
        flavour = "standard"
    if flavour == "contrib":
        share = True
    elif flavour == "ep":
        # This project's ops beside past/present I/O (e.g. a rewrite that kept the attention):
        # GroupQueryAttention writes in place; otherwise the graph says so by giving past and
        # present the same sequence dim (genai_config's share flag is not evidence: builders
        # write it for concat graphs too).
        past_seq, present_seq = past_vals[0].shape[2], present_vals[0].shape[2]
        share = gqa is not None or (past_seq == present_seq and past_seq != "?")
    else:
        share = False

    limit = gqa.max_positions if gqa is not None else None
    ctx = _context_length(context_length, mcfg.get("context_length"), limit, where)

    bos, eos, pad = _special_ids(config, folder, vocab, where)
    num_heads = dcfg.get("num_attention_heads") or (gqa.num_heads if gqa else None)
    io = DecoderIO(
        input_ids=ids.name,
        attention_mask=mask.name,
        position_ids=pos.name if pos else None,
        logits=logits.name,
        past_keys=tuple(past[(layer, "key")] for layer in range(num_layers)),
        past_values=tuple(past[(layer, "value")] for layer in range(num_layers)),
        present_keys=tuple(present[(layer, "key")] for layer in range(num_layers)),
        present_values=tuple(present[(layer, "value")] for layer in range(num_layers)),
        input_ids_dtype=_check_int_input(ids, where),
        attention_mask_dtype=_check_int_input(mask, where),
        position_ids_dtype=_check_int_input(pos, where) if pos else "int64",
        logits_dtype=logits.dtype,
    )
    return DecoderModel(
        source=source,
        kind=kind,
        onnx_path=onnx_path,
        folder=folder,
        genai_config=config_path,
        tokenizer_dir=folder if (folder / "tokenizer.json").is_file() else None,
        flavour=flavour,
        io=io,
        num_layers=num_layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        kv_dtype=kv_dtype,
        vocab_size=vocab,
        context_length=ctx,
        bos_token_id=bos,
        eos_token_ids=eos,
        pad_token_id=pad,
        share_buffer=share,
        padding="right" if share else "left",
        num_heads=int(num_heads) if num_heads else None,
    )


# --- graphs whose KV cache the runtime owns (ep flavour) -----------------------------------------

_KV_COMMIT_OPS = ("KVCommit", "KVCommitPaged")
_KV_ATTENTION_OPS = ("KVAttention", "KVAttentionPaged")


def _ep_op(node: Any) -> tuple[str, dict[str, str]] | None:
    """(op name, dtype signature) of a node in this project's domain, None for other nodes."""
    if node.domain != EP_DOMAIN:
        return None
    from ep.ops import op_types

    found = op_types().get(node.op_type)
    return (found[0].name, dict(found[1])) if found else None


def _has_runtime_kv(graph: Any) -> bool:
    return any(n.domain == EP_DOMAIN and n.op_type.startswith("KVCommit") for n in graph.node)


def _int_attr(node: Any, name: str) -> int | None:
    return next((int(a.i) for a in node.attribute if a.name == name), None)


def _inspect_runtime_kv(
    source: str,
    kind: SourceKind,
    onnx_path: Path,
    folder: Path,
    config_path: Path | None,
    config: Mapping[str, Any],
    context_length: int | None,
    model: Any,
) -> DecoderModel:
    """A graph whose KVCommit/KVAttention ops reach a runtime-owned cache through a handle.

    I/O: input_ids, positions (int64 [B, S], < 0 = padding), kv_cache (int64 handle),
    kv_geometry (int64 [7]) in; logits out. Layers, KV heads and the KV dtype come from the KV
    ops; head_dim from genai_config.json (head_size) or the model's ``genai_ep.head_dim``
    metadata.
    """
    where = str(onnx_path)
    graph = model.graph
    initializers = {i.name: i for i in graph.initializer}
    inputs = _values(i for i in graph.input if i.name not in initializers)
    outputs = _values(graph.output)
    mcfg = config.get("model", {}) if config else {}
    dcfg = mcfg.get("decoder", {}) if isinstance(mcfg, dict) else {}
    cfg_in = dcfg.get("inputs", {}) if isinstance(dcfg, dict) else {}
    cfg_out = dcfg.get("outputs", {}) if isinstance(dcfg, dict) else {}
    meta = {p.key: p.value for p in model.metadata_props}

    ids = _find(inputs, cfg_in.get("input_ids", "input_ids"), "token ids", where)
    pos = _find(inputs, cfg_in.get("positions", "positions"), "cache slot per token", where)
    handle = _find(inputs, cfg_in.get("kv_cache", "kv_cache"), "KV cache handle", where)
    geometry = _find(inputs, cfg_in.get("kv_geometry", "kv_geometry"), "KV geometry", where)
    logits = _find(outputs, cfg_out.get("logits", "logits"), "logits", where, side="output")
    known = {ids.name, pos.name, handle.name, geometry.name}
    unknown = [n for n in inputs if n not in known]
    if unknown:
        raise ModelError(
            f"{where} keeps its KV cache in the runtime (KVCommit/KVAttention) but has inputs "
            f"this runtime cannot feed: {', '.join(unknown)}; it feeds input_ids, positions, "
            "kv_cache and kv_geometry (and, for a paged layout, the block table it adds itself)"
        )
    for value, want in ((pos, "[batch, seq]"), (handle, "[1]"), (geometry, "[7]")):
        if value.dtype != "int64":
            raise ModelError(
                f"{where}: input {value.name!r} is {value.dtype}; expected int64 {want}"
            )
    _check_int_input(ids, where)

    commits: dict[int, str] = {}
    kv_heads_seen: set[int] = set()
    attention_layers: set[int] = set()
    kv_dtypes: set[str] = set()
    for node in graph.node:
        op = _ep_op(node)
        if op is None or op[0] not in (*_KV_COMMIT_OPS, *_KV_ATTENTION_OPS):
            continue
        name, sig = op
        label = f"{where}: node {node.name!r} ({node.op_type})"
        layer = _int_attr(node, "layer")
        if layer is None:
            raise ModelError(f"{label} has no layer attribute; build it with ep.ops.make_nodes")
        cache_in, geometry_in = node.input[-1], node.input[3]
        if cache_in != handle.name or geometry_in != geometry.name:
            raise ModelError(
                f"{label} reads the cache handle {cache_in!r} and geometry {geometry_in!r}; "
                f"expected the graph inputs {handle.name!r} and {geometry.name!r}, which the "
                "runtime feeds"
            )
        kv_dtypes.add(sig.get("T", "float32"))
        if name in _KV_COMMIT_OPS:
            if layer in commits:
                raise ModelError(
                    f"{label} commits layer {layer}, which node {commits[layer]!r} commits "
                    "too; each layer's K/V is written by exactly one KVCommit"
                )
            commits[layer] = node.name
        else:
            attention_layers.add(layer)
            heads = _int_attr(node, "kv_heads")
            if heads is not None:
                kv_heads_seen.add(heads)
    num_layers = len(commits)
    if sorted(commits) != list(range(num_layers)) or attention_layers - set(commits):
        raise ModelError(
            f"{where}: KVCommit layers {sorted(commits)} and KVAttention layers "
            f"{sorted(attention_layers)}; expected layers 0..N-1, each committed once"
        )
    cfg_layers = dcfg.get("num_hidden_layers") if isinstance(dcfg, dict) else None
    if cfg_layers is not None and int(cfg_layers) != num_layers:
        raise ModelError(
            f"{where}: inconsistent layer counts: the graph commits KV for {num_layers} layers "
            f"but genai_config.json says num_hidden_layers={cfg_layers}"
        )
    if len(kv_heads_seen) != 1:
        raise ModelError(
            f"{where}: the KVAttention nodes give kv_heads {sorted(kv_heads_seen) or 'none'}; "
            "expected one value for every layer"
        )
    kv_heads = kv_heads_seen.pop()
    _agree(kv_heads, dcfg.get("num_key_value_heads"), "kv_heads", where)
    if len(kv_dtypes) != 1 or next(iter(kv_dtypes)) not in _KV_DTYPES:
        raise ModelError(
            f"{where}: the KV ops run in {sorted(kv_dtypes)}; expected one of {_KV_DTYPES}"
        )
    kv_dtype = kv_dtypes.pop()
    head_size = dcfg.get("head_size") if isinstance(dcfg, dict) else None
    if head_size is None:
        head_size = meta.get("genai_ep.head_dim")
    if head_size is None:
        raise ModelError(
            f"{where}: cannot tell the KV head_dim (the KV ops do not carry it) and there is no "
            "genai_config.json head_size or 'genai_ep.head_dim' model metadata; add a "
            "genai_config.json with head_size"
        )
    head_dim = int(head_size)

    vocab = _vocab_size(logits, mcfg, where)

    limit = _rotary_table_rows(graph, initializers)
    ctx = _context_length(context_length, mcfg.get("context_length"), limit, where)

    bos, eos, pad = _special_ids(config, folder, vocab, where)
    num_heads = dcfg.get("num_attention_heads") if isinstance(dcfg, dict) else None
    io = DecoderIO(
        input_ids=ids.name,
        attention_mask="",
        position_ids=None,
        logits=logits.name,
        past_keys=(),
        past_values=(),
        present_keys=(),
        present_values=(),
        input_ids_dtype=ids.dtype,
        logits_dtype=logits.dtype,
        positions=pos.name,
        kv_cache=handle.name,
        kv_geometry=geometry.name,
    )
    return DecoderModel(
        source=source,
        kind=kind,
        onnx_path=onnx_path,
        folder=folder,
        genai_config=config_path,
        tokenizer_dir=folder if (folder / "tokenizer.json").is_file() else None,
        flavour="ep",
        io=io,
        num_layers=num_layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        kv_dtype=kv_dtype,
        vocab_size=vocab,
        context_length=ctx,
        bos_token_id=bos,
        eos_token_ids=eos,
        pad_token_id=pad,
        # The runtime's buffers are written in place at a fixed capacity; positions place every
        # token, so a batch is left-padded (negative positions) like a standard graph's.
        share_buffer=True,
        padding="left",
        num_heads=int(num_heads) if num_heads else None,
    )


def _vocab_size(logits: Any, mcfg: Mapping[str, Any], where: str) -> int:
    """The logits' width, checked against genai_config.json's vocab_size."""
    if logits.dtype not in _KV_DTYPES or len(logits.shape) != 3:
        raise ModelError(
            f"{where}: logits {logits.name!r} are {logits.dtype} of shape {list(logits.shape)}; "
            f"expected [batch, sequence, vocab] in one of {_KV_DTYPES}"
        )
    vocab = logits.shape[-1] if isinstance(logits.shape[-1], int) else None
    vocab = _agree(vocab, mcfg.get("vocab_size"), "vocab_size (logits width)", where)
    if vocab is None:
        raise ModelError(
            f"{where}: the logits shape {list(logits.shape)} does not fix the vocabulary size "
            "and no genai_config.json gives vocab_size; add one"
        )
    return int(vocab)


def _context_length(given: int | None, configured: Any, table_rows: int | None, where: str) -> int:
    """The context: given, else genai_config's, else the rotary table's; never above a bound."""
    if given is not None:
        ctx = given
    elif configured is not None:
        ctx = int(configured)
    elif table_rows is not None:
        ctx = table_rows
    else:
        raise ModelError(
            f"{where}: no context length known (no genai_config.json); pass context_length= "
            "(the CLI's --context-length) with the longest sequence the model supports"
        )
    bounds = ((configured, "genai_config.json context_length"), (table_rows, "rotary table"))
    for bound, why in bounds:
        if bound is not None and ctx > int(bound):
            raise ModelError(
                f"{where}: context length {ctx} exceeds the model's {why} of {bound}; use at "
                f"most {bound}"
            )
    return ctx


def _rotary_table_rows(graph: Any, initializers: Mapping[str, Any]) -> int | None:
    """Rows of the cos table a Rotary node reads (through a BitCast carrier if any)."""
    producers = {out: n for n in graph.node for out in n.output}
    for node in graph.node:
        op = _ep_op(node)
        if op is None or op[0] != "Rotary":
            continue
        name = node.input[2]
        carrier = producers.get(name)
        if carrier is not None and carrier.op_type == "BitCast":
            name = carrier.input[0]
        if name in initializers:
            return int(initializers[name].dims[0])
    return None


# --- conversions through ep_graphs ---------------------------------------------------------------


def _ep_graphs() -> Any:
    try:
        import ep_graphs
    except ImportError as exc:
        raise ModelError(
            f"converting a checkpoint or a spec needs the ep_graphs package, which cannot be "
            f"imported ({exc}); install genai-ep with its graphs (pip install -e .)"
        ) from None
    return ep_graphs


def _hash_files(h: Any, files: Iterable[Path], root: Path) -> None:
    for file in sorted(files):
        h.update(str(file.relative_to(root)).encode() + b"\0")
        with file.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        h.update(b"\0")


def _builder_fingerprint(h: Any, module: Any) -> None:
    # Builder code changes invalidate converted models, so a stale cache never hides a fix.
    root = Path(module.__file__).parent
    _hash_files(h, (p for p in root.rglob("*.py")), root)


def _atomic_build(key: str, cache_dir: str | os.PathLike[str] | None, build: Any) -> Path:
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    final = root / key
    if final.is_dir():
        return final
    try:
        root.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f".{key}.", dir=root))
    except OSError as exc:
        raise ModelError(
            f"cannot write the model cache {root}: {exc}; set GENAI_EP_CACHE to a writable folder"
        ) from None
    try:
        out = scratch / "model"
        build(out)
        try:
            os.rename(out, final)
        except OSError:
            if not final.is_dir():  # not a lost race with another process: a real failure
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return final


def _copy_tokenizer(src: Path, dst: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (src / name).is_file() and not (dst / name).exists():
            shutil.copyfile(src / name, dst / name)


def _convert_checkpoint(
    hf_dir: Path,
    flavour: Flavour | None,
    dtype: str,
    quant: str | None,
    cache_dir: str | os.PathLike[str] | None,
) -> Path:
    graphs = _ep_graphs()
    flavour = flavour or "contrib"
    h = hashlib.sha256(f"hf\0{flavour}\0{dtype}\0{quant}\0".encode())
    files = [p for p in hf_dir.iterdir() if p.is_file() and p.suffix in (".json", ".safetensors")]
    _hash_files(h, files, hf_dir)
    _builder_fingerprint(h, graphs)

    def build(out: Path) -> None:
        graphs.convert_checkpoint(hf_dir, out, flavour=flavour, dtype=dtype, quant=quant)
        _copy_tokenizer(hf_dir, out)

    return _atomic_build(h.hexdigest()[:32], cache_dir, build)


def _build_from_spec(
    text: str, flavour: Flavour | None, quant: str | None, cache_dir: str | os.PathLike[str] | None
) -> Path:
    graphs = _ep_graphs()
    seed = 0
    rest = []
    for item in (part.strip() for part in text.split(",")):
        key, _, value = item.partition("=")
        if key.strip() == "seed":
            try:
                seed = int(value)
            except ValueError:
                raise ModelError(f"spec: seed={value!r} is not an integer") from None
        elif key.strip() in ("flavour", "flavor"):
            if flavour is not None and value.strip() != flavour:
                raise ModelError(
                    f"spec says flavour={value.strip()!r} but flavour={flavour!r} was also "
                    "passed; give it once"
                )
            flavour = value.strip()  # type: ignore[assignment]
        elif item:
            rest.append(item)
    flavour = flavour or "contrib"
    if flavour not in ("contrib", "ep", "standard"):
        raise ModelError(f"spec: flavour={flavour!r}; expected one of 'contrib', 'ep', 'standard'")
    spec = graphs.ModelSpec.parse(",".join(rest))
    normal = json.dumps(spec.to_dict(), sort_keys=True)
    h = hashlib.sha256(f"spec\0{flavour}\0{seed}\0{quant}\0{normal}\0".encode())
    _builder_fingerprint(h, graphs)

    def build(out: Path) -> None:
        weights = graphs.random_weights(spec, seed)
        graphs.build_model(spec, weights, flavour=flavour, out_dir=out, quant=quant)

    return _atomic_build(h.hexdigest()[:32], cache_dir, build)
