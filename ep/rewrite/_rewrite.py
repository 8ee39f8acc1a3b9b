"""`rewrite_graph` (a model in memory) and `rewrite_model` (a model folder -> a new folder)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import onnx
from onnx import TensorProto, helper

from ep.errors import ModelError
from ep.model import DecoderModel, load_model
from ep.ops import BITCAST_OPSET, DOMAIN, check_model
from ep.rewrite._attention import KVInputs, attention, move_kv_io
from ep.rewrite._graph import Graph
from ep.rewrite._patterns import Rewrite, dominant_float_dtype, local_patterns
from ep.rewrite._types import RewriteOptions, RewriteReport, op_table

__all__ = ["TOKENIZER_FILES", "rewrite_graph", "rewrite_model"]

#: files copied from the source folder when present (tokenizer and generation settings)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)
_KNOWN_LEFT = {
    "GatherBlockQuantized": "no ai.genai_ep op gathers 4-bit blocks; ONNX Runtime runs it as is",
}


def rewrite_graph(
    model: onnx.ModelProto,
    decoder: DecoderModel | None,
    options: RewriteOptions | None = None,
    *,
    base_dir: str | os.PathLike[str] | None = None,
    source: str = "",
) -> tuple[onnx.ModelProto, RewriteReport]:
    """Rewrite ``model`` in place into this project's ops; returns it and the report.

    ``decoder`` (from `ep.model.load_model`) names the past/present I/O: with it the attention
    moves onto the runtime-owned cache when every layer can; without it only local patterns
    (norms, SwiGLU, MatMuls, RotaryEmbedding) are rewritten. ``base_dir`` is where the model's
    external data lives (read for small constants and rotary tables).
    """
    options = options or RewriteOptions()
    g = Graph(model, Path(base_dir) if base_dir is not None else None)
    before = g.op_counts()
    dtype = decoder.kv_dtype if decoder is not None else dominant_float_dtype(g)
    rw = Rewrite(g, options, dtype)
    moved = False
    names = KVInputs(g.fresh("positions"), g.fresh("kv_cache"), g.fresh("kv_geometry"))
    if decoder is not None and not decoder.io.runtime_kv:
        moved = attention(rw, decoder, names)
    g.finish()  # the replaced attention's insides go before the local patterns look
    local_patterns(rw)
    g.finish()
    if moved:
        assert decoder is not None
        move_kv_io(rw, decoder, names)
    reported = {item.node for item in rw.left}
    for node in g.graph.node:
        if node.domain == "com.microsoft" and (node.name or "(unnamed)") not in reported:
            reason = _KNOWN_LEFT.get(node.op_type, "no ai.genai_ep pattern covers it; kept")
            rw.leave("-", node, reason)
    _opsets(model)
    meta = {p.key: p.value for p in model.metadata_props}
    meta["genai_ep.flavour"] = "ep"
    meta["genai_ep.rewrite"] = json.dumps(dict(sorted(rw.counts.items())))
    if source:
        meta["genai_ep.rewritten_from"] = source
    if decoder is not None:
        meta["genai_ep.head_dim"] = str(decoder.head_dim)
    onnx.helper.set_model_props(model, meta)
    check_model(model)
    report = RewriteReport(
        source=source,
        output=None,
        rewritten=dict(rw.counts),
        left=tuple(rw.left),
        kv="runtime" if moved else "past/present",
        kv_inputs=(
            {
                "positions": names.positions,
                "kv_cache": names.kv_cache,
                "kv_geometry": names.kv_geometry,
            }
            if moved
            else {}
        ),
        ops_before=op_table(before),
        ops_after=op_table(g.op_counts()),
    )
    if options.strict and rw.left:
        shown = "\n  ".join(item.describe() for item in rw.left[:20])
        raise ModelError(
            f"strict rewrite of {source or 'the model'}: {len(rw.left)} thing(s) left alone:\n"
            f"  {shown}\nDrop --strict to keep them as they are"
        )
    return model, report


def _opsets(model: onnx.ModelProto) -> None:
    """Import the ops' domain; raise the default opset to 26 when BitCast carriers are used."""
    imports = {o.domain: o for o in model.opset_import}
    uses_ours = any(n.domain == DOMAIN for n in model.graph.node)
    if uses_ours and DOMAIN not in imports:
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    default = imports.get("") or imports.get("ai.onnx")
    if any(n.op_type == "BitCast" and n.domain in ("", "ai.onnx") for n in model.graph.node):
        if default is None:
            model.opset_import.append(helper.make_opsetid("", BITCAST_OPSET))
        elif default.version < BITCAST_OPSET:
            default.version = BITCAST_OPSET


# --- folders ---------------------------------------------------------------------------------


def _check_source(source: str | os.PathLike[str]) -> Path:
    text = os.fspath(source)
    if text.startswith("spec:"):
        raise ModelError(
            f"rewrite takes an existing model, not {text!r}; build one in the ep flavour directly "
            "with: genai-ep build --spec ... --flavour ep -o OUT"
        )
    path = Path(text).expanduser()
    if not path.exists():
        raise ModelError(
            f"model path {text!r} does not exist; expected an onnxruntime-genai model folder "
            "(genai_config.json + model.onnx) or a decoder .onnx file"
        )
    if (
        path.is_dir()
        and not (path / "genai_config.json").is_file()
        and (path / "config.json").is_file()
        and any(path.glob("*.safetensors"))
    ):
        raise ModelError(
            f"{path} is a Hugging Face checkpoint; rewrite takes an ONNX decoder. Build one in "
            f"the ep flavour directly: genai-ep build --hf {path} --flavour ep -o OUT"
        )
    return path


def _check_output(out: Path, source_folder: Path, force: bool) -> None:
    if out.exists() and not out.is_dir():
        raise ModelError(f"output path {out} exists and is not a folder; choose another -o path")
    resolved, src = out.resolve(), source_folder.resolve()
    if resolved == src or resolved in src.parents:
        raise ModelError(
            f"output folder {out} holds the source model {source_folder}; choose another -o path "
            "(the rewrite replaces the output folder's contents)"
        )
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ModelError(
            f"output folder {out} exists and is not empty; choose another -o path or pass "
            "--force to replace its contents"
        )


def _data_files(model: onnx.ModelProto, folder: Path) -> list[str]:
    """External data files the model's initializers read, checked to be plain files in folder."""
    locations = set()
    for init in model.graph.initializer:
        if init.data_location == TensorProto.EXTERNAL:
            for entry in init.external_data:
                if entry.key == "location":
                    locations.add(entry.value)
    for loc in sorted(locations):
        rel = Path(loc)
        if rel.is_absolute() or ".." in rel.parts or not (folder / rel).is_file():
            raise ModelError(
                f"the model's external data {loc!r} is not a file inside {folder}; keep the "
                "data files beside the model"
            )
    return sorted(locations)


def _genai_config(decoder: DecoderModel, report: RewriteReport, names: dict[str, str]) -> Any:
    if decoder.genai_config is not None:
        config = json.loads(decoder.genai_config.read_text(encoding="utf-8"))
    else:
        eos = list(decoder.eos_token_ids)
        config = {
            "model": {
                "context_length": decoder.context_length,
                "decoder": {
                    "filename": decoder.onnx_path.name,
                    "head_size": decoder.head_dim,
                    "num_attention_heads": decoder.num_heads,
                    "num_hidden_layers": decoder.num_layers,
                    "num_key_value_heads": decoder.kv_heads,
                },
                "pad_token_id": decoder.pad_token_id,
                "vocab_size": decoder.vocab_size,
            },
            "search": {"max_length": decoder.context_length},
        }
        # Only the ids the source knew: an invented EOS would stop generations.
        if decoder.bos_token_id is not None:
            config["model"]["bos_token_id"] = decoder.bos_token_id
        if eos:
            config["model"]["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    if report.kv == "runtime":
        from ep_graphs._ep import ep_genai_config

        config = ep_genai_config(config, names=names)
    else:
        config["model"]["decoder"]["genai_ep"] = {
            "flavour": "ep",
            "ops_domain": DOMAIN,
            "kv_cache": "past/present kept (the attention was not rewritten)",
        }
    config["model"]["decoder"]["genai_ep"]["rewritten"] = dict(sorted(report.rewritten.items()))
    config["model"]["decoder"]["genai_ep"]["source"] = report.source
    return config


def rewrite_model(
    source: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    options: RewriteOptions | None = None,
    force: bool = False,
) -> RewriteReport:
    """Rewrite the decoder at ``source`` (an onnxruntime-genai folder or a decoder ``.onnx``)
    into ``out_dir``: the model file, its external data, genai_config.json (with the ep marker)
    and the tokenizer files. The folder is built beside ``out_dir`` and moved in at the end, so
    a failure leaves ``out_dir`` as it was. ``force`` replaces a non-empty ``out_dir``.
    """
    options = options or RewriteOptions()
    path = _check_source(source)
    out = Path(out_dir).expanduser()
    decoder = load_model(path, context_length=options.context_length)
    if decoder.io.runtime_kv:
        raise ModelError(
            f"{decoder.onnx_path} already keeps its KV cache in the runtime (an ep graph); "
            "there is nothing to rewrite"
        )
    _check_output(out, decoder.folder, force)
    model = onnx.load(str(decoder.onnx_path), load_external_data=False)
    model, report = rewrite_graph(
        model, decoder, options, base_dir=decoder.folder, source=str(source)
    )
    data = _data_files(model, decoder.folder)
    names = {"input_ids": decoder.io.input_ids, **report.kv_inputs}
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.rewriting-", dir=out.parent))
    try:
        onnx.save_model(model, str(staging / decoder.onnx_path.name))
        for loc in data:
            (staging / loc).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(decoder.folder / loc, staging / loc)
        config = _genai_config(decoder, report, names)
        (staging / "genai_config.json").write_text(json.dumps(config, indent=4) + "\n")
        for name in TOKENIZER_FILES:
            if (decoder.folder / name).is_file():
                shutil.copyfile(decoder.folder / name, staging / name)
        load_model(staging, context_length=options.context_length)  # loads as it will be run
        if out.exists():
            shutil.rmtree(out)
        os.replace(staging, out)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(staging)
    return RewriteReport(
        source=report.source,
        output=str(out),
        rewritten=report.rewritten,
        left=report.left,
        kv=report.kv,
        kv_inputs=report.kv_inputs,
        ops_before=report.ops_before,
        ops_after=report.ops_after,
    )
