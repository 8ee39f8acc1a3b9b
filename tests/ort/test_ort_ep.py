"""ep.ort.OrtBackend on ep graphs: the runtime's KV buffers bound by handle, any contiguous layout,
left-padded batches through negative positions, growth, op errors, handles and weights."""

from __future__ import annotations

import gc
import importlib.util
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import onnx
import pytest

import ep.ops as eo
from ep.errors import GenerationError, ModelError, OpError
from ep.model import DecoderModel, load_model
from ep.ort import OrtBackend
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_graphs import ModelSpec, build_model, load_hf_checkpoint, random_weights

DATA = Path(__file__).parents[1] / "data" / "genai-llama-tiny"
PROMPTS = json.loads((DATA / "expected_tokens.json").read_text())["prompts"]


def _seq_major() -> type:
    """tests/runtime/kv_layouts.py's packed seq-major layout (its growth relocates rows b > 0)."""
    spec = importlib.util.spec_from_file_location(
        "kv_layouts_for_ort", Path(__file__).parents[1] / "runtime" / "kv_layouts.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.SeqMajorPacked  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _no_leftover_op_state() -> Iterator[None]:
    resolver = eo.get_weight_resolver()
    yield
    eo.take_op_errors(all_threads=True)
    eo.set_weight_resolver(resolver)


@pytest.fixture(scope="module")
def tiny_ep(tmp_path_factory: pytest.TempPathFactory) -> DecoderModel:
    spec, weights = load_hf_checkpoint(DATA / "hf")
    out = tmp_path_factory.mktemp("tiny_ep")
    build_model(spec, weights, flavour="ep", out_dir=out)
    return load_model(out)


def _greedy(backend: OrtBackend, prompts: Sequence[Sequence[int]], steps: int, reserve: int = 0):
    logits = backend.prefill([np.array(p) for p in prompts], reserve=reserve)
    seen = [logits.copy()]
    for _ in range(steps):
        masked = logits.copy()
        masked[:, 2] = -np.inf
        logits = backend.step(masked.argmax(axis=1))
        seen.append(logits.copy())
    return np.stack(seen, axis=1)  # [B, steps + 1, V]


def test_batch_logits_equal_solo_logits(tiny_ep: DecoderModel) -> None:
    backend = OrtBackend(tiny_ep, HeadMajorLayout())
    batch = _greedy(backend, PROMPTS, 20)
    for b, prompt in enumerate(PROMPTS):
        np.testing.assert_allclose(batch[b], _greedy(backend, [prompt], 20)[0], rtol=0, atol=1e-5)
    backend.close()


def test_rows_occupy_their_own_slots(tiny_ep: DecoderModel) -> None:
    """Left padding with negative positions: row b's tokens at slots 0..n-1, nothing else."""
    backend = OrtBackend(tiny_ep, HeadMajorLayout())
    backend.prefill([np.array(p) for p in PROMPTS])
    keys = backend.kv.keys[0]
    lens = [len(p) for p in PROMPTS]
    assert keys.shape == (4, 2, 16, 32)
    for b, n in enumerate(lens):
        assert np.abs(keys[b, :, :n]).sum(axis=2).all()
        assert not keys[b, :, n:].any()
    before = keys.copy()
    backend.step(np.array([5, 6, 7, 8]))
    for b, n in enumerate(lens):
        assert np.abs(keys[b, :, n]).sum(axis=1).all()
        np.testing.assert_array_equal(keys[b, :, :n], before[b, :, :n])
    assert backend.kv.live_lengths == tuple(n + 1 for n in lens)
    np.testing.assert_array_equal(backend.lengths, np.array(lens) + 1)
    backend.close()


def test_growth_matches_a_large_fixed_capacity(tiny_ep: DecoderModel) -> None:
    backend = OrtBackend(tiny_ep, HeadMajorLayout())
    grown = _greedy(backend, PROMPTS, 30)
    assert backend.kv.capacity == 64 and backend.kv.growths == 2
    fixed = _greedy(backend, PROMPTS, 30, reserve=256)
    assert backend.kv.capacity == 256 and backend.kv.growths == 0
    np.testing.assert_array_equal(grown, fixed)
    backend.close()


def test_seq_major_layout_gives_the_same_logits(tiny_ep: DecoderModel) -> None:
    """The ops read the layout's strides from the geometry input: another layout, same bits,
    across growths that relocate every row b > 0."""
    head = _greedy(OrtBackend(tiny_ep, HeadMajorLayout()), PROMPTS, 24)
    seq_backend = OrtBackend(tiny_ep, _seq_major()(min_capacity=8))
    seq = _greedy(seq_backend, PROMPTS, 24)
    assert seq_backend.kv.geometry is not None
    assert seq_backend.kv.geometry.shape == (4, 64, 2, 32) and seq_backend.kv.growths == 2
    np.testing.assert_array_equal(head, seq)
    seq_backend.close()


def test_an_op_error_is_raised_not_returned_as_zero_logits(tiny_ep: DecoderModel) -> None:
    backend = OrtBackend(tiny_ep, HeadMajorLayout())
    backend.prefill([np.array(PROMPTS[0])])
    handle = int(backend._ep.handle_input[0])  # type: ignore[union-attr]
    eo.KV_CACHES.release(handle)  # the buffers vanish behind the backend's back
    with pytest.raises(OpError, match=rf"KV cache handle {handle} is not bound"):
        backend.step(np.array([5]))
    # The decode state is unknown now: the next step must be a prefill.
    with pytest.raises(GenerationError, match=r"step\(\) before prefill"):
        backend.step(np.array([5]))
    # Negative oracle: without the check the same step "succeeds": the KV ops return zeros and
    # the logits come out finite and plausible, but wrong, with the error left unread.
    good = OrtBackend(tiny_ep, HeadMajorLayout())
    good.prefill([np.array(PROMPTS[0])])
    want = good.step(np.array([5]))[0]
    good.close()
    io = backend.session.io_binding()
    io.bind_cpu_input("input_ids", np.array([[5]], np.int64))
    io.bind_cpu_input("positions", np.array([[len(PROMPTS[0])]], np.int64))
    io.bind_cpu_input("kv_cache", np.array([handle], np.int64))
    io.bind_cpu_input("kv_geometry", np.asarray(backend._ep.geometry))  # type: ignore[union-attr]
    io.bind_output("logits", "cpu")
    with eo.use_weights(backend.weights):  # type: ignore[arg-type]
        backend.session.run_with_iobinding(io)
    got = io.get_outputs()[0].numpy()[0, 0]
    assert np.isfinite(got).all() and np.abs(got - want).max() > 0.1
    assert eo.take_op_errors()  # ... and the error sat there, unread
    backend.close()


def _bound(handle: int) -> bool:
    try:
        eo.KV_CACHES.layer(handle, 0)
    except OpError:
        return False
    return True


def test_handles_are_released(tiny_ep: DecoderModel) -> None:
    backend = OrtBackend(tiny_ep, HeadMajorLayout())
    backend.prefill([np.array(PROMPTS[0])])
    handle = backend._ep.handle  # type: ignore[union-attr]
    backend.prefill([np.array(p) for p in PROMPTS])  # a new batch rebinds the same handle
    assert backend._ep.handle == handle and _bound(handle)  # type: ignore[union-attr]
    assert eo.KV_CACHES.layer(handle, 0).key.size == backend.kv.keys[0].size
    backend.close()
    backend.close()  # idempotent
    assert not _bound(handle)
    dropped = OrtBackend(tiny_ep, HeadMajorLayout())
    dropped.prefill([np.array(PROMPTS[0])])
    handle = dropped._ep.handle  # type: ignore[union-attr]
    assert _bound(handle)
    del dropped
    gc.collect()
    assert not _bound(handle)  # garbage collection released it


def test_two_models_take_turns_with_their_own_weights(tmp_path: Path) -> None:
    """Named weights resolve through a process-wide resolver: each run installs its own."""
    spec = ModelSpec.parse("hidden=64,layers=1,heads=4,kv_heads=2,vocab=128,context=32")
    models = []
    for seed in (1, 2):
        build_model(spec, random_weights(spec, seed), flavour="ep", out_dir=tmp_path / str(seed))
        models.append(load_model(tmp_path / str(seed)))
    alone = [_greedy(OrtBackend(m, HeadMajorLayout()), [[5, 6, 7]], 3) for m in models]
    assert not np.allclose(alone[0], alone[1])
    a, b = (OrtBackend(m, HeadMajorLayout()) for m in models)
    sentinel = eo.DictWeights({})
    eo.set_weight_resolver(sentinel)
    la, lb = a.prefill([np.array([5, 6, 7])]).copy(), b.prefill([np.array([5, 6, 7])]).copy()
    np.testing.assert_array_equal(la[0], alone[0][0, 0])
    np.testing.assert_array_equal(lb[0], alone[1][0, 0])
    assert eo.get_weight_resolver() is sentinel  # restored after each run
    a.close()
    b.close()


def test_a_named_weight_that_is_missing_is_a_model_error(tmp_path: Path) -> None:
    spec = ModelSpec.parse("hidden=64,layers=1,heads=4,vocab=128,context=32")
    build_model(spec, random_weights(spec), flavour="ep", out_dir=tmp_path)
    model = onnx.load(tmp_path / "model.onnx", load_external_data=False)
    node = next(n for n in model.graph.node if n.op_type == "MatMul")
    next(a for a in node.attribute if a.name == "weight").s = b"no.such.weight"
    onnx.save(model, tmp_path / "model.onnx")
    with pytest.raises(ModelError, match=r"names weight 'no\.such\.weight', which is not an init"):
        OrtBackend(load_model(tmp_path), HeadMajorLayout())


def test_step_before_prefill(tiny_ep: DecoderModel) -> None:
    with pytest.raises(GenerationError, match=r"step\(\) before prefill"):
        OrtBackend(tiny_ep, HeadMajorLayout()).step(np.array([1]))


# --- loading: the ep graph's I/O is found, and its problems are named --------------------------


def test_ep_io_discovery(tiny_ep: DecoderModel) -> None:
    io = tiny_ep.io
    assert (io.positions, io.kv_cache, io.kv_geometry) == ("positions", "kv_cache", "kv_geometry")
    assert io.past_keys == () and io.attention_mask == "" and io.runtime_kv
    assert (tiny_ep.kv_dtype, tiny_ep.context_length, tiny_ep.padding) == ("float32", 256, "left")
    assert "runtime-owned KV cache" in tiny_ep.describe()


def test_ep_graph_without_head_size_is_refused(tiny_ep: DecoderModel, tmp_path: Path) -> None:
    model = onnx.load(tiny_ep.onnx_path)
    onnx.save(model, tmp_path / "bare.onnx")
    with pytest.raises(ModelError, match=r"cannot tell the KV head_dim .* 'genai_ep\.head_dim'"):
        load_model(tmp_path / "bare.onnx", context_length=64)
    onnx.helper.set_model_props(model, {"genai_ep.head_dim": "32"})
    onnx.save(model, tmp_path / "bare.onnx")
    assert load_model(tmp_path / "bare.onnx", context_length=64).head_dim == 32


def test_ep_graph_whose_kv_op_reads_another_handle_is_refused(
    tiny_ep: DecoderModel, tmp_path: Path
) -> None:
    model = onnx.load(tiny_ep.onnx_path)
    node = next(n for n in model.graph.node if n.op_type == "KVAttention")
    node.input[4] = "some_other_handle"
    onnx.save(model, tmp_path / "model.onnx")
    (tmp_path / "genai_config.json").write_text(tiny_ep.genai_config.read_text())  # type: ignore[union-attr]
    with pytest.raises(ModelError, match=r"reads the cache handle 'some_other_handle'"):
        load_model(tmp_path)
