"""ep.ort.OrtBackend: logits-level batch row identity, in-place shared KV, growth, concat commit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ep.errors import GenerationError, ModelError
from ep.model import DecoderModel, load_model
from ep.ort import OrtBackend
from ep_builtin.kv_head_major import HeadMajorLayout

DATA = Path(__file__).parents[1] / "data" / "genai-llama-tiny"
PROMPTS = json.loads((DATA / "expected_tokens.json").read_text())["prompts"]


@pytest.fixture(scope="module")
def fp32() -> DecoderModel:
    return load_model(DATA / "genai-fp32")


@pytest.fixture(scope="module")
def backend(fp32: DecoderModel) -> OrtBackend:
    return OrtBackend(fp32, HeadMajorLayout())


def _greedy(backend: OrtBackend, prompts: list[list[int]], steps: int, reserve: int = 0):
    """Logits of every step (per row), feeding back the argmax with EOS masked."""
    logits = backend.prefill([np.array(p) for p in prompts], reserve=reserve)
    seen = [logits.copy()]
    for _ in range(steps):
        masked = logits.copy()
        masked[:, 2] = -np.inf
        logits = backend.step(masked.argmax(axis=1))
        seen.append(logits.copy())
    return np.stack(seen, axis=1)  # [B, steps + 1, V]


def test_batch_logits_equal_solo_logits(backend: OrtBackend) -> None:
    batch = _greedy(backend, PROMPTS, 24)
    for b, prompt in enumerate(PROMPTS):
        solo = _greedy(backend, [prompt], 24)[0]
        np.testing.assert_allclose(batch[b], solo, rtol=0, atol=1e-5)


def test_shared_graph_writes_into_the_runtime_buffer(backend: OrtBackend) -> None:
    backend.prefill([np.array(p) for p in PROMPTS])
    keys = backend.kv.keys[0]
    assert keys.shape == (4, 2, 16, 32)
    lens = [len(p) for p in PROMPTS]
    # GQA wrote K for exactly each row's own tokens into our zeroed buffer (not its padding):
    # the buffer bound as past and present is the cache itself.
    for b, n in enumerate(lens):
        assert np.abs(keys[b, :, :n]).sum(axis=2).all()
        assert not keys[b, :, n:].any()
    before = keys.copy()
    backend.step(np.array([5, 6, 7, 8]))
    for b, n in enumerate(lens):  # each row's new token landed at its own length
        assert not np.array_equal(keys[b, :, n], before[b, :, n])
        np.testing.assert_array_equal(keys[b, :, :n], before[b, :, :n])
    assert backend.kv.live_lengths == tuple(n + 1 for n in lens)


def test_growth_matches_a_large_fixed_capacity(backend: OrtBackend) -> None:
    grown = _greedy(backend, PROMPTS, 30)
    assert backend.kv.capacity == 64 and backend.kv.growths == 2
    fixed = _greedy(backend, PROMPTS, 30, reserve=256)
    assert backend.kv.capacity == 256 and backend.kv.growths == 0
    np.testing.assert_array_equal(grown, fixed)


def test_step_before_prefill(fp32: DecoderModel) -> None:
    with pytest.raises(GenerationError, match=r"step\(\) before prefill"):
        OrtBackend(fp32, HeadMajorLayout()).step(np.array([1]))


def test_concat_graph_cache_equals_a_full_prefill(tmp_path: Path) -> None:
    """The layout buffer of a standard graph holds what one prefill of the whole text computes."""
    model = load_model(
        "spec:hidden=64,layers=2,heads=4,kv_heads=2,vocab=256,context=64,flavour=standard",
        cache_dir=tmp_path,
    )
    backend = OrtBackend(model, HeadMajorLayout())
    prompts = [[5, 9, 14, 3, 77, 8, 1, 4, 4, 2, 100], [7, 7, 30]]
    logits = backend.prefill([np.array(p) for p in prompts])
    fed = [list(p) for p in prompts]
    for _ in range(9):  # 11 + 9 crosses the 16-token bucket
        token = logits.argmax(axis=1)
        for row, t in zip(fed, token, strict=True):
            row.append(int(t))
        logits = backend.step(token)
    assert backend.kv.growths == 1
    # Oracle: one left-padded prefill of everything fed so far, plain session.run.
    width = len(fed[0])
    ids = np.zeros((2, width), np.int64)
    mask = np.zeros((2, width), np.int64)
    for b, row in enumerate(fed):
        ids[b, width - len(row) :] = row
        mask[b, width - len(row) :] = 1
    sess = ort.InferenceSession(str(model.onnx_path), providers=["CPUExecutionProvider"])
    empty = np.zeros((2, model.kv_heads, 0, model.head_dim), np.float32)
    feed = {"input_ids": ids, "attention_mask": mask}
    feed["position_ids"] = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    feed |= {n: empty for n in (*model.io.past_keys, *model.io.past_values)}
    outs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feed), strict=True))
    kv = backend.kv
    for layer in range(model.num_layers):
        for buf, name in ((kv.keys[layer], "key"), (kv.values[layer], "value")):
            present = outs[f"present.{layer}.{name}"]  # [B, H, T, D]
            live = kv.token_view(buf).transpose(0, 2, 1, 3)
            # Compare real tokens only (pad positions hold whatever a fully masked query makes),
            # up to the last fed token, which has not been run through the backend yet.
            for b, row in enumerate(fed):
                lo = width - len(row)
                np.testing.assert_allclose(
                    live[b, :, lo : width - 1], present[b, :, lo : width - 1], atol=1e-5
                )


def test_a_graph_that_fails_to_run_is_a_model_error(tmp_path: Path) -> None:
    """Declared logits wider than computed: the bound decode buffer cannot take them."""
    import shutil

    import onnx

    graph = onnx.load(str(DATA / "genai-fp32" / "model.onnx"), load_external_data=False)
    graph.graph.output[0].type.tensor_type.shape.dim[2].dim_value = 600
    onnx.save_model(graph, str(tmp_path / "model.onnx"))
    shutil.copyfile(DATA / "genai-fp32" / "model.onnx.data", tmp_path / "model.onnx.data")
    model = load_model(tmp_path / "model.onnx")
    assert model.vocab_size == 600
    backend = OrtBackend(model, HeadMajorLayout())
    backend.prefill([np.array([5, 6, 7])])
    with pytest.raises(ModelError, match=r"failed in the decode step of .*model\.onnx"):
        backend.step(np.array([8]))
    with pytest.raises(GenerationError, match=r"before prefill"):
        backend.step(np.array([8]))
