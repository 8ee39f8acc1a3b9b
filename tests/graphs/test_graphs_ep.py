"""The ep flavour: this project's ops over a runtime-owned KV cache, against the NumPy forward.

The graph is run directly (a session with the ops registered, the cache bound with
KV_CACHES.bind, named weights through use_weights) so the graph contract itself is tested, not
the backend: prefill of a left-padded batch (negative positions), then a decode step, logits
compared at every real position with the float64 reference. Then whole generations: the ep
flavour's greedy tokens equal the contrib flavour's of the same weights.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import numpy_llama as nl
import onnx
import onnxruntime as ort
import pytest
from graphs_testlib import PROMPTS, TINY, left_padded, max_row_error, right_padded
from onnx import numpy_helper

import ep.ops as eo
from ep.errors import ConfigError
from ep.model import load_model
from ep.runtime import GenerationOptions, Generator
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_graphs import Int4Options, ModelSpec, build_model, load_hf_checkpoint, random_weights
from ep_graphs._ep import EP_INPUTS, EpEmitter

TOL = 1e-5
BASE = ModelSpec.parse(
    "hidden=64,layers=2,heads=4,kv_heads=2,vocab=128,intermediate=96,theta=10000,eps=1e-5,"
    "context=64"
)
VARIANTS: dict[str, ModelSpec] = {
    "llama_untied": BASE,
    "llama_tied": dataclasses.replace(BASE, tie_embeddings=True),
    "qwen2_bias": dataclasses.replace(BASE, qkv_bias=True, model_type="qwen2", rope_theta=1e6),
    "mqa": dataclasses.replace(BASE, num_kv_heads=1),
    # more than 6 significant digits: RotaryTheta would see it rounded, so cos/sin tables
    "theta_tables": dataclasses.replace(BASE, rope_theta=12345.678),
}


@pytest.fixture(autouse=True)
def _no_leftover_op_state() -> Iterator[None]:
    resolver = eo.get_weight_resolver()
    yield
    eo.take_op_errors(all_threads=True)
    eo.set_weight_resolver(resolver)


class EpSession:
    """An ep graph in a plain ORT session, its cache bound and its named weights resolvable."""

    def __init__(self, folder: Path, spec: ModelSpec, batch: int, capacity: int) -> None:
        so = ort.SessionOptions()
        so.log_severity_level = 3
        eo.register_session_options(so)
        self.sess = ort.InferenceSession(
            str(folder / "model.onnx"), so, providers=["CPUExecutionProvider"]
        )
        graph = onnx.load(folder / "model.onnx", load_external_data=False).graph
        self.weights = eo.DictWeights(
            {t.name: numpy_helper.to_array(t, str(folder)) for t in graph.initializer}
        )
        g = HeadMajorLayout().geometry(
            batch=batch,
            capacity=capacity,
            kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            itemsize=np.dtype(np.float32).itemsize,
        )
        self.buffers = [
            (np.zeros(g.shape, np.float32), np.zeros(g.shape, np.float32))
            for _ in range(spec.num_layers)
        ]
        self.handle = eo.KV_CACHES.bind(self.buffers)
        self.geometry = eo.kv_geometry(g)

    def run(self, ids: np.ndarray, positions: np.ndarray) -> np.ndarray:
        feeds = {
            "input_ids": ids,
            "positions": positions,
            "kv_cache": np.array([self.handle], np.int64),
            "kv_geometry": self.geometry,
        }
        with eo.use_weights(self.weights):
            (logits,) = eo.run(self.sess, None, feeds)
        return logits

    def close(self) -> None:
        eo.KV_CACHES.release(self.handle)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[ModelSpec, dict, Path]]:
    out = {}
    for name, spec in VARIANTS.items():
        weights = random_weights(spec, seed=11)
        folder = tmp_path_factory.mktemp(f"ep_{name}")
        build_model(spec, weights, flavour="ep", out_dir=folder)
        out[name] = (spec, weights, folder)
    return out


def _slots(mask: np.ndarray) -> np.ndarray:
    """Positions of an ep graph: the running count of real tokens, -1 for padding."""
    return np.where(mask == 1, np.cumsum(mask, axis=1) - 1, -1)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_left_padded_prefill_and_decode_match_numpy(built: dict, variant: str) -> None:
    spec, weights, folder = built[variant]
    ids, mask = left_padded(PROMPTS)
    sess = EpSession(folder, spec, batch=len(PROMPTS), capacity=16)
    try:
        logits = sess.run(ids, _slots(mask))
        ref, _ = nl.forward(spec, weights, ids, mask, nl.positions_from_mask(mask, ids.shape[1]))
        assert logits.dtype == np.float32 and logits.shape == ref.shape
        assert max_row_error(logits, ref, mask) < TOL
        # Each row's K sits at slots 0..n-1 of its own cache rows; pads wrote nothing.
        keys = sess.buffers[0][0]
        for row, prompt in enumerate(PROMPTS):
            assert np.abs(keys[row, :, : len(prompt)]).sum(axis=2).all()
            assert not keys[row, :, len(prompt) :].any()

        new = np.array([[7], [81], [30]], dtype=np.int64)
        step = sess.run(new, mask.sum(axis=1, keepdims=True))
        full_ids = np.concatenate([ids, new], axis=1)
        full_mask = np.concatenate([mask, np.ones((3, 1), np.int64)], axis=1)
        ref2, _ = nl.forward(
            spec, weights, full_ids, full_mask, nl.positions_from_mask(full_mask, ids.shape[1] + 1)
        )
        assert nl.relative_error(step[:, 0], ref2[:, -1]) < TOL
    finally:
        sess.close()


def test_right_padding_works_too(built: dict) -> None:
    """Positions place every token, so the padding side does not matter (unlike GQA)."""
    spec, weights, folder = built["llama_untied"]
    ids, mask = right_padded(PROMPTS)
    sess = EpSession(folder, spec, batch=3, capacity=16)
    try:
        logits = sess.run(ids, _slots(mask))
    finally:
        sess.close()
    lids, lmask = left_padded(PROMPTS)
    ref, _ = nl.forward(spec, weights, lids, lmask, nl.positions_from_mask(lmask, lids.shape[1]))
    for row, prompt in enumerate(PROMPTS):
        assert nl.relative_error(logits[row, len(prompt) - 1], ref[row, -1]) < TOL


def test_graph_contract(built: dict) -> None:
    _, _, folder = built["llama_tied"]
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    eo.check_model(model)
    assert [i.name for i in model.graph.input] == list(EP_INPUTS)
    assert [o.name for o in model.graph.output] == ["logits"]
    domains = {n.domain for n in model.graph.node}
    assert domains <= {"", "ai.genai_ep"} and "com.microsoft" not in domains
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["ep_graphs.flavour"] == "ep"
    decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    assert decoder["genai_ep"]["flavour"] == "ep"
    assert list(decoder["inputs"]) == list(EP_INPUTS)
    # Named weights: initializers no node reads, named by MatMul nodes (the tied head reads the
    # embedding table transposed instead of a second copy).
    named = {
        a.s.decode()
        for n in model.graph.node
        if n.domain == "ai.genai_ep" and n.op_type == "MatMul"
        for a in n.attribute
        if a.name == "weight"
    }
    read = {i for n in model.graph.node for i in n.input}
    inits = {t.name for t in model.graph.initializer}
    assert "model.embed_tokens.weight" in named and named <= inits
    assert "lm_head.MatMul.weight" not in inits
    assert not (named - {"model.embed_tokens.weight"}) & read
    rotary = {
        name: {n.op_type for n in onnx.load(f / "model.onnx").graph.node}
        & {"Rotary", "RotaryTheta"}
        for name, (_, _, f) in built.items()
    }
    assert rotary.pop("theta_tables") == {"Rotary"}  # exact cos/sin tables
    assert all(ops == {"RotaryTheta"} for ops in rotary.values())
    loaded = load_model(folder)
    assert (loaded.flavour, loaded.padding, loaded.io.runtime_kv) == ("ep", "left", True)
    assert (loaded.num_layers, loaded.kv_heads, loaded.head_dim) == (2, 2, 16)
    # The config with the ep graph's I/O names and the marker (build_model applies it once it
    # calls the flavour's hook; loading needs neither: the graph says what it is).
    config = EpEmitter.adjust_genai_config(json.loads((folder / "genai_config.json").read_text()))
    decoder = config["model"]["decoder"]
    assert decoder["inputs"] == {name: name for name in EP_INPUTS}
    assert decoder["genai_ep"]["flavour"] == "ep" and config["search"]["past_present_share_buffer"]
    (folder / "genai_config.json").write_text(json.dumps(config))
    assert load_model(folder).io == loaded.io


def test_fp16_matches_numpy_loosely(tmp_path: Path) -> None:
    spec = dataclasses.replace(BASE, dtype="fp16")
    weights = random_weights(spec, seed=3)
    build_model(spec, weights, flavour="ep", out_dir=tmp_path)
    model = onnx.load(tmp_path / "model.onnx", load_external_data=False)
    assert {o.domain: o.version for o in model.opset_import}[""] >= eo.BITCAST_OPSET
    assert any(n.op_type == "BitCast" for n in model.graph.node)
    from ep.ort import OrtBackend

    backend = OrtBackend(load_model(tmp_path), HeadMajorLayout())
    last = backend.prefill([np.array(p) for p in PROMPTS])
    ids, mask = left_padded(PROMPTS)
    ref, _ = nl.forward(spec, weights, ids, mask, nl.positions_from_mask(mask, ids.shape[1]))
    assert nl.relative_error(last, ref[:, -1]) < 5e-3
    backend.close()


def test_inexact_epsilon_is_refused_before_writing(tmp_path: Path) -> None:
    spec = dataclasses.replace(BASE, rms_norm_eps=1.2345678e-5)
    with pytest.raises(ConfigError, match=r"rms_norm_eps=1\.2345678e-05 has more than 6"):
        build_model(spec, random_weights(spec), flavour="ep", out_dir=tmp_path / "m")
    assert not (tmp_path / "m").exists()


# --- whole generations against the contrib flavour --------------------------------------------


def _tokens(folder: Path, prompts: list[list[int]], n: int) -> tuple[list, list]:
    gen = Generator(
        load_model(folder),
        layout=HeadMajorLayout(),
        options=GenerationOptions(max_new_tokens=n, min_new_tokens=n, decode_text=False),
    )
    solo = [list(gen.generate([p]).tokens[0]) for p in prompts]
    batch = [list(t) for t in gen.generate(prompts).tokens]
    return solo, batch


def test_tokens_equal_the_contrib_flavour_of_the_same_weights(tmp_path: Path) -> None:
    """The genai-llama-tiny checkpoint in both flavours: 48 greedy tokens per prompt, solo and
    in a left-padded batch of four, equal each other and onnxruntime-genai's."""
    expected = json.loads((TINY / "expected_tokens.json").read_text())
    spec, weights = load_hf_checkpoint(TINY / "hf")
    for flavour in ("ep", "contrib"):
        build_model(spec, weights, flavour=flavour, out_dir=tmp_path / flavour)
    ep_solo, ep_batch = _tokens(tmp_path / "ep", expected["prompts"], 48)
    contrib_solo, _ = _tokens(tmp_path / "contrib", expected["prompts"], 48)
    assert ep_solo == contrib_solo == expected["genai-fp32"]
    assert ep_batch == ep_solo


def test_int4_equals_contrib_with_float_accuracy(tmp_path: Path) -> None:
    """ep MatMulNBits computes in float32: equal to contrib's MatMulNBits at accuracy_level 0."""
    weights = random_weights(BASE, seed=5)
    quant = Int4Options(accuracy_level=0, symmetric=False)
    for flavour in ("ep", "contrib"):
        build_model(BASE, weights, flavour=flavour, out_dir=tmp_path / flavour, quant=quant)
    ops = {n.op_type for n in onnx.load(tmp_path / "ep" / "model.onnx").graph.node}
    assert "MatMulNBitsZP" in ops and "MatMul" not in ops
    prompts = [list(p) for p in PROMPTS]
    ep_solo, ep_batch = _tokens(tmp_path / "ep", prompts, 16)
    contrib_solo, _ = _tokens(tmp_path / "contrib", prompts, 16)
    assert ep_solo == contrib_solo and ep_batch == ep_solo
