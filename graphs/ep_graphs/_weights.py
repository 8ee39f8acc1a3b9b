"""Weights by Hugging Face name: seeded random ones, and a safetensors checkpoint reader.

Weights are a plain ``dict[str, np.ndarray]`` keyed by the Hugging Face Llama / Qwen2 tensor names
(``model.layers.0.self_attn.q_proj.weight``), matrices in the Hugging Face [out, in] orientation.
Arrays keep their stored dtype (float32, float16 or ml_dtypes.bfloat16); the builder casts.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from ep.errors import ModelError

from ._spec import DType, ModelSpec

__all__ = [
    "check_weights",
    "expected_shapes",
    "load_hf_checkpoint",
    "numpy_dtype",
    "progress_bar",
    "progress_enabled",
    "random_weights",
]

_NUMPY_DTYPES: dict[str, Any] = {
    "fp32": np.dtype(np.float32),
    "fp16": np.dtype(np.float16),
    "bf16": np.dtype(ml_dtypes.bfloat16),
}
_FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))


def numpy_dtype(dtype: DType) -> np.dtype[Any]:
    """The NumPy dtype for a spec dtype (bf16 is ml_dtypes.bfloat16)."""
    return np.dtype(_NUMPY_DTYPES[dtype])


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder needs, Hugging Face name → shape ([out, in] for matrices)."""
    h, inter = spec.hidden_size, spec.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (spec.vocab_size, h)}
    for i in range(spec.num_layers):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "self_attn.q_proj.weight"] = (spec.q_size, h)
        shapes[p + "self_attn.k_proj.weight"] = (spec.kv_size, h)
        shapes[p + "self_attn.v_proj.weight"] = (spec.kv_size, h)
        if spec.qkv_bias:
            shapes[p + "self_attn.q_proj.bias"] = (spec.q_size,)
            shapes[p + "self_attn.k_proj.bias"] = (spec.kv_size,)
            shapes[p + "self_attn.v_proj.bias"] = (spec.kv_size,)
        shapes[p + "self_attn.o_proj.weight"] = (h, spec.q_size)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes[p + "mlp.gate_proj.weight"] = (inter, h)
        shapes[p + "mlp.up_proj.weight"] = (inter, h)
        shapes[p + "mlp.down_proj.weight"] = (h, inter)
    shapes["model.norm.weight"] = (h,)
    if not spec.tie_embeddings:
        shapes["lm_head.weight"] = (spec.vocab_size, h)
    return shapes


def check_weights(spec: ModelSpec, weights: Mapping[str, Any], *, source: str = "weights") -> None:
    """Raise `ModelError` naming every missing tensor, wrong shape or non-float dtype."""
    shapes = expected_shapes(spec)
    missing = [name for name in shapes if name not in weights]
    if missing:
        shown = ", ".join(missing[:8]) + (
            f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        )
        hint = ""
        if "lm_head.weight" in missing:
            hint = " (an untied head needs lm_head.weight; set tie_embeddings if it is tied)"
        raise ModelError(
            f"{source}: {len(missing)} tensor(s) missing for this spec: {shown}{hint}; the "
            "checkpoint does not match its config (layers, biases, tied head)"
        )
    for name, shape in shapes.items():
        array = weights[name]
        got = tuple(np.shape(array))
        if got != shape:
            raise ModelError(
                f"{source}: tensor {name} has shape {list(got)}; expected {list(shape)} from the "
                "spec ([out, in] for matrices); the config does not match the weights"
            )
        dtype = array.dtype if isinstance(array, np.ndarray) else np.asarray(array).dtype
        if dtype not in _FLOAT_DTYPES:
            raise ModelError(
                f"{source}: tensor {name} has dtype {dtype}; expected float32, float16 or bfloat16"
            )


def random_weights(spec: ModelSpec, seed: int = 0) -> dict[str, np.ndarray]:
    """Seeded random weights in the spec's dtype, scaled so activations and logits stay O(1).

    Matrices ~ N(0, 1/fan_in) keep each projection's output near unit variance, so logits have a
    spread of a few units (not degenerate, not saturated); norm weights are 1 + N(0, 0.1²) and
    biases N(0, 0.1²) so neither is a no-op that a wrong graph could get away with.
    """
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    target = numpy_dtype(spec.dtype)
    for name, shape in expected_shapes(spec).items():
        # float32 draws: half the memory of float64 for real-sized vocabularies
        array = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith("norm.weight"):
            array = 1.0 + np.float32(0.1) * array
        elif name.endswith(".bias"):
            array *= np.float32(0.1)
        else:
            array *= np.float32(1.0 / np.sqrt(shape[1]))  # 1/sqrt(fan_in)
        out[name] = array.astype(target, copy=False)
    return out


# --- Hugging Face checkpoints --------------------------------------------------------------


def _checkpoint_files(folder: Path) -> dict[Path, list[str] | None]:
    """safetensors file → names to read from it (None: every tensor in the file)."""
    index = folder / "model.safetensors.index.json"
    single = folder / "model.safetensors"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelError(
                f"cannot read {index}: {exc!r}; expected a JSON object with a 'weight_map' of "
                "tensor name → shard file"
            ) from None
        files: dict[Path, list[str] | None] = {}
        for name, shard in weight_map.items():
            names = files.setdefault(folder / shard, [])
            assert names is not None
            names.append(name)
        for shard in files:
            if not shard.is_file():
                raise ModelError(
                    f"{index} names shard {shard.name}, which is not in {folder}; download the "
                    "missing shard"
                )
        return files
    if single.is_file():
        return {single: None}
    found = sorted(p.name for p in folder.glob("*.safetensors"))
    extra = f" (found {', '.join(found)} without an index)" if found else ""
    raise ModelError(
        f"no weights in {folder}: expected model.safetensors or model.safetensors.index.json"
        f"{extra}; .bin/.pt checkpoints are not read, convert them to safetensors first"
    )


@contextmanager
def progress_bar(enabled: bool, total: int, what: str) -> Iterator[Any]:
    """A rich progress bar on stderr (or a no-op advance function when disabled)."""
    if not enabled:
        yield lambda _n=1: None
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    with Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=False,
    ) as bar:
        task = bar.add_task(what, total=total)
        yield lambda n=1: bar.advance(task, n)


def progress_enabled(progress: bool | None) -> bool:
    """None means: show a bar when stderr is a terminal."""
    return sys.stderr.isatty() if progress is None else progress


def load_hf_checkpoint(
    folder: str | Path, *, progress: bool | None = None
) -> tuple[ModelSpec, dict[str, np.ndarray]]:
    """Read ``config.json`` and safetensors weights (single file or sharded) from `folder`.

    Returns the spec (dtype from the config) and the tensors the decoder needs, in their stored
    dtype. Tied checkpoints need no ``lm_head.weight``. Raises `ModelError` for a missing config,
    missing shards, missing tensors (named) or wrong shapes.
    """
    from safetensors import SafetensorError, safe_open

    root = Path(folder)
    if not root.is_dir():
        raise ModelError(f"checkpoint folder {root} does not exist (or is not a folder)")
    spec = ModelSpec.from_hf_config(root)
    wanted = expected_shapes(spec)
    files = _checkpoint_files(root)
    weights: dict[str, np.ndarray] = {}
    total = sum(len(names) if names is not None else 0 for names in files.values()) or len(wanted)
    with progress_bar(progress_enabled(progress), total, f"reading {root.name}") as advance:
        for path, names in files.items():
            try:
                with safe_open(str(path), framework="numpy") as handle:
                    for name in names if names is not None else list(handle.keys()):
                        advance()
                        if name not in wanted:
                            continue  # rotary caches and other extras the graph rebuilds itself
                        weights[name] = handle.get_tensor(name)
            except (SafetensorError, OSError, ValueError, TypeError) as exc:
                raise ModelError(
                    f"cannot read {path}: {exc}; expected a safetensors file with float32, "
                    "float16 or bfloat16 tensors"
                ) from None
    check_weights(spec, weights, source=str(root))
    return spec, weights
