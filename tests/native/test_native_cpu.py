"""The native backend on the CPU device: parity with ort, capture semantics, negative oracles."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ep.model import DecoderModel
from ep.native import NativeBackend
from ep.ort import OrtBackend
from ep_builtin.capture_warmup import WarmupCapture
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_builtin.kv_paged import PagedLayout
from ep_builtin.kv_seq_major import SeqMajorLayout

from ._greedy import greedy_logits

DATA = Path(__file__).parents[1] / "data" / "genai-llama-tiny"
PROMPTS = json.loads((DATA / "expected_tokens.json").read_text())["prompts"]


LAYOUTS = {
    "head_major": lambda: HeadMajorLayout(min_capacity=16),
    "seq_major": lambda: SeqMajorLayout(min_capacity=16),
    "seq_major_fixed": lambda: SeqMajorLayout(min_capacity=16, fixed_stride=True),
}
# Paged layouts are not in the gate yet: the native step faults on the block table (see the
# report); `PagedLayout` stays imported for the test that will be added with the fix.
assert PagedLayout


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_native_matches_ort_bitwise_batch_and_solo(tiny_ep: DecoderModel, layout: str) -> None:
    prompts = PROMPTS[:2]
    ort_logits = greedy_logits(OrtBackend(tiny_ep, LAYOUTS[layout]()), prompts, 24)
    eager = greedy_logits(NativeBackend(tiny_ep, LAYOUTS[layout]()), prompts, 24)
    captured_backend = NativeBackend(tiny_ep, LAYOUTS[layout](), capture=WarmupCapture(steps=1))
    captured = greedy_logits(captured_backend, prompts, 24)
    assert np.array_equal(ort_logits, eager)
    assert np.array_equal(eager, captured)
    m = captured_backend.capture_metrics
    assert m.captures > 0 and m.replays > 0 and m.fallbacks == 0
    # row identity: row 1 of the batch equals the solo run of that prompt
    solo = greedy_logits(NativeBackend(tiny_ep, LAYOUTS[layout]()), prompts[1:], 24)
    # NumPy's CPU matmul rounds M=1 and M=2 differently (BLAS gemv vs gemm), as the ort
    # backend's does: tokens are identical, logits agree to float32 rounding.
    assert np.array_equal(solo[:, 0].argmax(-1), eager[:, 1].argmax(-1))
    np.testing.assert_allclose(solo[:, 0], eager[:, 1], rtol=1e-4, atol=1e-4)


def test_fixed_stride_keeps_its_graph_across_growth(tiny_ep: DecoderModel) -> None:
    b = NativeBackend(
        tiny_ep, SeqMajorLayout(min_capacity=16, fixed_stride=True), capture=WarmupCapture(1)
    )
    greedy_logits(b, PROMPTS[:2], 40)
    m = b.capture_metrics
    assert b.kv.growths > 0
    assert m.growth_keeps > 0 and m.invalidations == 0 and m.captures == 1


def test_head_major_growth_invalidates_and_recaptures(tiny_ep: DecoderModel) -> None:
    b = NativeBackend(tiny_ep, HeadMajorLayout(min_capacity=16), capture=WarmupCapture(1))
    greedy_logits(b, PROMPTS[:2], 40)
    m = b.capture_metrics
    assert b.kv.moved_growths > 0
    assert m.invalidations > 0 and m.captures >= 2 and m.growth_keeps == 0


def test_a_graph_wrongly_kept_across_relocation_is_detected(tiny_ep: DecoderModel) -> None:
    """Negative oracle: a graph captured before a relocating growth, replayed after it, gives
    wrong logits, and the signature comparison the manager makes flags it."""
    prompts = PROMPTS[:2]
    b = NativeBackend(tiny_ep, HeadMajorLayout(min_capacity=16))
    logits = b.prefill([np.array(p) for p in prompts])
    plan = b._plan(len(prompts), 1)
    calls, old_sig = b._calls(plan)
    with b.device.capture(stream=b.stream) as cap:  # kept by the test, not the manager
        for call in calls:
            call()
    while b.kv.moved_growths == 0:
        logits = b.step(logits.argmax(axis=1))
    calls, sig = b._calls(plan)
    assert old_sig.differences(sig)  # the check the manager makes sees the move
    nxt = logits.argmax(axis=1).reshape(-1, 1)

    def feed() -> None:
        plan.input_ids.copy_from_host(nxt, stream=b.stream)
        plan.positions.copy_from_host(b.lens.reshape(-1, 1), stream=b.stream)

    feed()
    for call in calls:
        call()
    right = plan.logits.to_host(stream=b.stream).copy()
    feed()
    cap.graph.launch(stream=b.stream)  # wrongly kept: reads and writes the old cache
    wrong = plan.logits.to_host(stream=b.stream)
    assert not np.array_equal(right, wrong)


def test_never_policy_counts_no_captures(tiny_ep: DecoderModel) -> None:
    b = NativeBackend(tiny_ep, HeadMajorLayout())
    greedy_logits(b, PROMPTS[:1], 4)
    m = b.capture_metrics
    assert (m.enabled, m.captures, m.replays) == (False, 0, 0)
    assert m.eager_steps == 4


def test_offload_not_address_stable_declines_with_inputs(tiny_ep: DecoderModel) -> None:
    b = NativeBackend(tiny_ep, HeadMajorLayout(), capture=WarmupCapture(0))
    b.weights.capture_safe = False  # type: ignore[misc]  # an instance of resident, made unsafe
    b.sources["offload"] = "lru (from config file)"
    greedy_logits(b, PROMPTS[:1], 3)
    m = b.capture_metrics
    assert m.captures == 0 and m.fallbacks == 3
    assert m.last_decline["predicate"] == "offload plan is address-stable"
    assert "from config file" in m.last_decline["inputs"]["offload"]


def test_prepack_reads_kn_weights_as_nk(tiny_ep: DecoderModel) -> None:
    from ep.device import get_device
    from ep.kernels import matmul
    from ep.native import load_program

    plain = load_program(tiny_ep.onnx_path)
    packed = load_program(tiny_ep.onnx_path, prepack=True)
    dev = get_device("cpu")
    stream = dev.create_stream()
    rng = np.random.default_rng(0)
    turned = 0
    for before, after in zip(plain.nodes, packed.nodes, strict=True):
        if before.op != "MatMul":
            assert after == before
            continue
        name = str(before.attrs["weight"])
        w = plain.arrays[name]
        if int(before.attrs["transpose_b"]) == 1:
            assert after.attrs["transpose_b"] == 1 and packed.arrays[name] is not None
            continue
        turned += 1
        assert after.attrs["transpose_b"] == 1
        assert packed.arrays[name].flags.c_contiguous
        np.testing.assert_array_equal(packed.arrays[name], w.T)
        K, N = w.shape
        x = rng.standard_normal((2, K)).astype(w.dtype)
        outs = []
        for weight, tb in ((w, 0), (packed.arrays[name], 1)):
            bufs = [dev.alloc(a.size, a.dtype, stream=stream) for a in (x, weight)]
            for buf, a in zip(bufs, (x, weight), strict=True):
                buf.copy_from_host(a.reshape(-1), stream=stream)
            y = dev.alloc(2 * N, w.dtype, stream=stream)
            matmul.gemm(dev, y, *bufs, M=2, N=N, K=K, transpose_b=tb, stream=stream)
            outs.append(y.to_host(stream=stream))
        np.testing.assert_allclose(outs[1], outs[0], rtol=1e-5, atol=1e-5)
    assert turned >= 3 * tiny_ep.num_layers  # qkv, o, gate_up and down of every layer


def test_prepack_leaves_a_table_another_op_reads() -> None:
    from ep.native.program import Node, _prepack

    arrays = {"table": np.zeros((8, 4), np.float32), "w": np.ones((4, 6), np.float32)}
    nodes = [
        Node("Gather", "g", ("table", "ids"), ("h",)),
        Node("MatMul", "head", ("h",), ("y",), {"weight": "table", "transpose_b": 0, "N": 8}),
        Node("MatMul", "proj", ("h",), ("z",), {"weight": "w", "transpose_b": 0, "N": 6}),
    ]
    out = _prepack(nodes, arrays)
    assert out[1] == nodes[1] and arrays["table"].shape == (8, 4)
    assert out[2].attrs["transpose_b"] == 1 and arrays["w"].shape == (6, 4)


def test_step_logits_stay_the_callers(tiny_ep: DecoderModel) -> None:
    # the backend downloads through one reused pinned buffer: what it returned must not change
    backend = NativeBackend(tiny_ep, SeqMajorLayout(min_capacity=16))
    logits = backend.prefill([np.array(p) for p in PROMPTS[:2]])
    first = backend.step(logits.argmax(1))
    kept = first.copy()
    second = backend.step(first.argmax(1))
    assert np.array_equal(first, kept) and not np.shares_memory(first, second)


def test_q_and_k_rotations_run_as_one_call(
    tiny_ep: DecoderModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GENAI_EP_FUSE", "0")  # fused, the pair joins the commit's call
    backend = NativeBackend(tiny_ep, SeqMajorLayout(min_capacity=16))
    backend.prefill([np.array(PROMPTS[0])])
    (plan,) = backend._plans.values()
    rotations = [n for n in plan.call_names if n.split(":")[0] in ("Rotary", "RotaryTheta")]
    in_graph = [n for n in plan.program.nodes if n.op in ("Rotary", "RotaryTheta")]
    assert len(in_graph) == 2 * tiny_ep.num_layers
    assert len(rotations) == tiny_ep.num_layers  # q's launch rotates k too
