"""The native plan's fusions: the fused QKV commit and the gate/up GEMV with a SwiGLU epilogue.
Where they apply they change no bit; where the graph does not allow them, nothing is fused.

QKV commit:
Each model runs twice on the CPU device, ``GENAI_EP_FUSE=0`` and default, and the logits of
every step must be bitwise equal: the tiny genai model built in the ep flavour (RotaryTheta, no
bias) and rewritten from its onnxruntime-genai export (Rotary over cos/sin caches), in every KV
layout, solo and a batch of prompts of different lengths; a Qwen2-style spec model (q/k/v bias)
in float32 and bfloat16 (whose ops read and write through BitCast carriers). Negative oracles:
a second reader of the rotated k or of the biased sum, a working node inside the chain, q and k
rotations that differ, and the rotated k as the graph's output each keep that layer unfused
(and still right).

SwiGLU epilogue (``GENAI_EP_FUSE_MLP=0`` against the default, on weights prepacked to [N, K] as
the CUDA device loads them; the CPU device runs them through the kernels' NumPy twins): every
plan of up to 16 rows runs
each layer's gate/up projection and its SwiGLUPacked as one call whose packed product gets no
arena bytes, bitwise; a prefill of more than 16 (the GEMM) keeps two calls, and so does a plan
below the threshold.
Negative oracles: a second reader of the packed product and a working node between the two.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ep.device import cuda_available
from ep.errors import ConfigError
from ep.kernels import matmul
from ep.model import DecoderModel, load_model
from ep.native import NativeBackend, as_ep_model
from ep.native.plan import FUSE_ENV, FUSE_MLP_ENV, FUSE_QKV_ENV, StepPlan
from ep.native.program import Node, Program, load_program
from ep.seams import KVLayout
from ep_builtin.capture_warmup import WarmupCapture
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_builtin.kv_paged import PagedLayout
from ep_builtin.kv_seq_major import SeqMajorLayout
from ep_builtin.offload_stream import StreamPolicy
from ep_graphs import Int4Options, ModelSpec, build_model, random_weights

TINY = Path(__file__).parents[1] / "data" / "genai-llama-tiny"
PROMPTS: list[list[int]] = json.loads((TINY / "expected_tokens.json").read_text())["prompts"]
STEPS = 12  # past the first capacity bucket (16): growth inside the run
FUSED = "QKVRotaryCommit"
FUSED_MLP = "+SwiGLUPacked"  # "MatMul+SwiGLUPacked" or "MatMulNBits+SwiGLUPacked"
LAYOUTS: dict[str, Callable[[], KVLayout]] = {
    "head_major": lambda: HeadMajorLayout(min_capacity=16),
    "seq_major": lambda: SeqMajorLayout(min_capacity=16),
    "seq_major_fixed": lambda: SeqMajorLayout(min_capacity=16, fixed_stride=True),
    "paged": lambda: PagedLayout(page_size=4, min_capacity=8),
}
QWEN = ModelSpec.parse(
    "hidden=64,layers=2,heads=4,kv_heads=2,vocab=512,intermediate=96,theta=1000000,eps=1e-6,"
    "context=64"
)


@pytest.fixture(scope="module")
def genai_ep(tmp_path_factory: pytest.TempPathFactory) -> DecoderModel:
    """genai-fp32 (GroupQueryAttention) rewritten to the ep flavour: Rotary over caches."""
    return as_ep_model(load_model(TINY / "genai-fp32"), tmp_path_factory.mktemp("rewrite"))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[str], DecoderModel]]:
    """``qwen(dtype)``: a Qwen2-style spec model (q/k/v bias, theta 1e6), built once a dtype;
    ``qwen("int4")``: bf16 activations, 4-bit projections (block 32, float arithmetic) and an
    intermediate of 160 (a gate/up weight of 20 16-row groups)."""
    built: dict[str, DecoderModel] = {}

    def get(dtype: str) -> DecoderModel:
        if dtype not in built:
            spec = dataclasses.replace(QWEN, qkv_bias=True, model_type="qwen2")
            quant = None
            if dtype == "int4":
                spec = dataclasses.replace(spec, dtype="bf16", intermediate_size=160)
                quant = Int4Options(accuracy_level=0)
            else:
                spec = dataclasses.replace(spec, dtype=dtype)
            out = tmp_path_factory.mktemp(f"qwen-{dtype}")
            build_model(spec, random_weights(spec, seed=3), flavour="ep", out_dir=out,
                        quant=quant)  # fmt: skip
            built[dtype] = load_model(out)
        return built[dtype]

    yield get


def pick_model(
    request: pytest.FixtureRequest, qwen: Callable[[str], DecoderModel], name: str
) -> DecoderModel:
    """A test's model by its parameter name: ``qwen_<dtype>`` from `qwen`, else that fixture."""
    if name.startswith("qwen_"):
        return qwen(name.removeprefix("qwen_"))
    model: DecoderModel = request.getfixturevalue(name)
    return model


@dataclasses.dataclass
class Run:
    logits: np.ndarray  # [steps + 1, batch, vocab]: prefill's last logits, then every step's
    plans: list[StepPlan]


def run(
    model: DecoderModel,
    layout: str,
    prompts: Sequence[Sequence[int]],
    *,
    fuse: bool,
    fuse_mlp: bool = True,
    fuse_qkv: bool = False,
    program: Program | None = None,
    capture: bool = False,
    offload: Any = None,
    device: str = "cpu",
) -> Run:
    """Greedy ``STEPS`` steps with the fusions on or off (``fuse_mlp``: the SwiGLU epilogue,
    ``fuse_qkv``: the QKV projection's commit epilogue, when ``fuse``); ``program`` replaces the
    model's graph, ``offload`` (a policy) places the weights in a store at a 100 % budget."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FUSE_ENV, "1" if fuse else "0")
        mp.setenv(FUSE_MLP_ENV, "1" if fuse_mlp else "0")
        mp.setenv(FUSE_QKV_ENV, "1" if fuse_qkv else "0")
        backend = NativeBackend(
            model, LAYOUTS[layout](), capture=WarmupCapture(steps=1) if capture else None,
            offload=offload, budget="100%" if offload is not None else None, device=device,
        )  # fmt: skip
        if program is not None:
            backend.program = program  # plans are made at first use: they read this one
        logits = backend.prefill([np.array(p) % model.vocab_size for p in prompts])
        seen = [logits.copy()]
        for _ in range(STEPS):
            logits = backend.step(logits.argmax(axis=1))
            seen.append(logits.copy())
    if capture:
        m = backend.capture_metrics
        assert m.captures > 0 and m.replays > 0 and m.fallbacks == 0
    if offload is not None:
        backend.close()
    return Run(np.stack(seen), list(backend._plans.values()))


def op_counts(plan: StepPlan) -> dict[str, int]:
    counts: dict[str, int] = {}
    for name in plan.call_names:
        op = name.split(":")[0]
        counts[op] = counts.get(op, 0) + 1
    return counts


def fused_layers(plan: StepPlan) -> list[int]:
    return sorted(int(f.commit.attrs["layer"]) for f in plan.fusions)


def assert_unwritten(on: StepPlan, off: StepPlan, values: set[str]) -> None:
    """The fused plan ``on`` gives these values (storage names) no arena bytes; ``off`` does."""
    assert values.isdisjoint(on.offsets) and values <= set(off.offsets)


def assert_fused_everywhere(fused: Run, unfused: Run, layers: int, absorbed: int) -> None:
    """Bitwise the same logits; per plan one fused call a layer, ``absorbed`` fewer calls each
    (and one fewer for each SwiGLU epilogue the plan has)."""
    assert np.array_equal(fused.logits, unfused.logits)
    assert len(fused.plans) == len(unfused.plans) >= 2  # prefill and decode
    for on, off in zip(fused.plans, unfused.plans, strict=True):
        assert (on.batch, on.seq) == (off.batch, off.seq)
        assert op_counts(on).get(FUSED) == layers and FUSED not in op_counts(off)
        assert off.mlp_fusions == []
        assert len(on.call_names) == len(off.call_names) - absorbed * layers - len(on.mlp_fusions)
        for op in ("Add", "Rotary", "RotaryTheta", "KVCommit"):
            assert op not in op_counts(on)


# --- fused == unfused ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS[:3]], ids=["solo", "batch3"])
@pytest.mark.parametrize("model_name", ["tiny_ep", "genai_ep"])
def test_fused_logits_are_the_unfused_bits(
    request: pytest.FixtureRequest, model_name: str, layout: str, prompts: list[list[int]]
) -> None:
    model: DecoderModel = request.getfixturevalue(model_name)
    unfused = run(model, layout, prompts, fuse=False)
    fused = run(model, layout, prompts, fuse=True)
    # no bias: the rotation pair and the commit become one call (one fewer a layer)
    assert_fused_everywhere(fused, unfused, model.num_layers, absorbed=1)


def test_captured_fused_step_replays_the_unfused_bits(tiny_ep: DecoderModel) -> None:
    unfused = run(tiny_ep, "seq_major_fixed", PROMPTS[:3], fuse=False)
    fused = run(tiny_ep, "seq_major_fixed", PROMPTS[:3], fuse=True, capture=True)
    assert_fused_everywhere(fused, unfused, tiny_ep.num_layers, absorbed=1)


@pytest.mark.parametrize("layout", ["head_major", "seq_major_fixed", "paged"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_biased_projection_is_fused_bitwise(
    qwen: Callable[[str], DecoderModel], dtype: str, layout: str
) -> None:
    model = qwen(dtype)
    unfused = run(model, layout, PROMPTS[:3], fuse=False)
    fused = run(model, layout, PROMPTS[:3], fuse=True)
    # the bias Add joins too: Add, the rotation pair and the commit are one call
    assert_fused_everywhere(fused, unfused, model.num_layers, absorbed=2)
    for on, off in zip(fused.plans, unfused.plans, strict=True):
        # the biased sum and the rotated k are never written: no arena slots for them
        for fusion in on.fusions:
            assert fusion.add is not None
            sums = {on.values[n].base for n in (fusion.add.outputs[0], fusion.k.outputs[0])}
            assert_unwritten(on, off, sums)


def test_streamed_bias_is_fetched_by_the_fused_call(qwen: Callable[[str], DecoderModel]) -> None:
    """The bias streamed by the store (not bound once): the fused call fetches it, captured."""
    model = qwen("fp32")
    policy = StreamPolicy()
    unfused = run(model, "head_major", PROMPTS[:3], fuse=False)
    fused = run(model, "head_major", PROMPTS[:3], fuse=True, capture=True, offload=policy)
    assert_fused_everywhere(fused, unfused, model.num_layers, absorbed=2)
    for plan in fused.plans:
        assert not any(name.endswith(".bias") for name in plan.bound_weights)


@pytest.mark.cuda
@pytest.mark.parametrize("layout", ["seq_major_fixed", "paged"])
@pytest.mark.parametrize("model_name", ["qwen_bf16", "genai_ep"])
def test_cuda_fused_logits_are_the_unfused_bits(
    request: pytest.FixtureRequest, qwen: Callable[[str], DecoderModel], model_name: str,
    layout: str,
) -> None:  # fmt: skip
    """On the GPU (weights prepacked, the real kernels): bitwise, batched (captured) and solo."""
    ok, reason = cuda_available()  # raises on a present-but-broken driver: that must fail
    if not ok:
        pytest.skip(reason)
    model = pick_model(request, qwen, model_name)
    absorbed = 2 if model_name == "qwen_bf16" else 1
    unfused = run(model, layout, PROMPTS[:3], fuse=False, device="cuda")
    capture = layout == "seq_major_fixed"  # the layout the H200 benchmarks capture
    fused = run(model, layout, PROMPTS[:3], fuse=True, device="cuda", capture=capture)
    assert_fused_everywhere(fused, unfused, model.num_layers, absorbed=absorbed)
    solo_off = run(model, layout, PROMPTS[1:2], fuse=False, device="cuda")
    solo_on = run(model, layout, PROMPTS[1:2], fuse=True, device="cuda")
    assert_fused_everywhere(solo_on, solo_off, model.num_layers, absorbed=absorbed)


def test_switched_off_binds_each_node_and_still_pairs_rotations(
    qwen: Callable[[str], DecoderModel],
) -> None:
    """``GENAI_EP_FUSE=0``: the Add, one rotation launch (q takes k along, also through the
    bf16 graph's BitCast carriers) and the commit, per layer."""
    model = qwen("bf16")
    off = run(model, "head_major", PROMPTS[:1], fuse=False)
    for plan in off.plans:
        counts = op_counts(plan)
        assert plan.fusions == [] and FUSED not in counts
        layers = model.num_layers
        assert counts["Add"] == counts["RotaryTheta"] == counts["KVCommit"] == layers


@pytest.mark.parametrize("value", ["yes", "2", "off"])
def test_a_bad_switch_value_is_refused(
    tiny_ep: DecoderModel, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(FUSE_ENV, value)
    backend = NativeBackend(tiny_ep, HeadMajorLayout())
    with pytest.raises(ConfigError, match=rf"GENAI_EP_FUSE='{value}'; expected 0 .* or 1"):
        backend.prefill([np.array(PROMPTS[0])])


# --- where the pattern does not hold: nothing changes -------------------------------------------


def _nodes(program: Program, *ops: str) -> list[Node]:
    return [n for n in program.nodes if n.op in ops]


def _with(program: Program, nodes: list[Node], **changes: Any) -> Program:
    return dataclasses.replace(program, nodes=nodes, **changes)


def _insert_after(program: Program, anchor: Node, node: Node) -> Program:
    nodes = list(program.nodes)
    nodes.insert(nodes.index(anchor) + 1, node)
    return _with(program, nodes)


def _extra_rotation(reads: str, like: Node) -> Node:
    """A rotation of ``reads`` whose output nothing reads (a second reader of ``reads``)."""
    return Node(like.op, "extra/rotation", (reads, *like.inputs[1:]), ("extra/rotated",),
                dict(like.attrs))  # fmt: skip


def _program(model: DecoderModel) -> Program:
    return NativeBackend(model, HeadMajorLayout()).program


def _assert_not_fused_in_layer_0(model: DecoderModel, program: Program) -> None:
    """Layer 0 runs unfused (still right: the same bits as with the switch off); layer 1 fuses."""
    unfused = run(model, "seq_major", PROMPTS[:3], fuse=False, program=program)
    fused = run(model, "seq_major", PROMPTS[:3], fuse=True, program=program)
    assert np.array_equal(fused.logits, unfused.logits)
    for plan in fused.plans:
        assert fused_layers(plan) == [1]
        assert op_counts(plan)[FUSED] == 1 and op_counts(plan)["KVCommit"] == 1


def test_rotated_k_read_twice_is_not_fused(tiny_ep: DecoderModel) -> None:
    program = _program(tiny_ep)
    k0 = _nodes(program, "RotaryTheta")[1]
    commit0 = _nodes(program, "KVCommit")[0]
    changed = _insert_after(program, commit0, _extra_rotation(k0.outputs[0], k0))
    _assert_not_fused_in_layer_0(tiny_ep, changed)
    # the extra reader changes nothing else: the same logits as the model's own graph
    plain = run(tiny_ep, "seq_major", PROMPTS[:3], fuse=True)
    assert np.array_equal(run(tiny_ep, "seq_major", PROMPTS[:3], fuse=True,
                              program=changed).logits, plain.logits)  # fmt: skip


def test_a_working_node_inside_the_chain_stops_it(tiny_ep: DecoderModel) -> None:
    program = _program(tiny_ep)
    q0, k0 = _nodes(program, "RotaryTheta")[:2]
    # reads q's input (not the rotated k), but runs between k's rotation and the commit
    changed = _insert_after(program, k0, _extra_rotation(q0.inputs[0], q0))
    _assert_not_fused_in_layer_0(tiny_ep, changed)


def test_rotations_that_differ_are_not_fused(tiny_ep: DecoderModel) -> None:
    program = _program(tiny_ep)
    k0 = _nodes(program, "RotaryTheta")[1]
    nodes = [
        Node(n.op, n.name, n.inputs, n.outputs, {**n.attrs, "interleaved": 1}) if n is k0 else n
        for n in program.nodes
    ]
    _assert_not_fused_in_layer_0(tiny_ep, _with(program, nodes))


def test_biased_sum_read_elsewhere_keeps_its_add(qwen: Callable[[str], DecoderModel]) -> None:
    """A second reader of the biased sum: the Add stays, rotation + commit still fuse."""
    model = qwen("fp32")
    program = _program(model)
    q0 = _nodes(program, "RotaryTheta")[0]
    commit0 = _nodes(program, "KVCommit")[0]
    changed = _insert_after(program, commit0, _extra_rotation(q0.inputs[0], q0))
    unfused = run(model, "seq_major", PROMPTS[:3], fuse=False, program=changed)
    fused = run(model, "seq_major", PROMPTS[:3], fuse=True, program=changed)
    assert np.array_equal(fused.logits, unfused.logits)
    for plan in fused.plans:
        assert fused_layers(plan) == [0, 1]
        adds = {f.commit.attrs["layer"]: f.add is not None for f in plan.fusions}
        assert adds == {0: False, 1: True}
        assert op_counts(plan)["Add"] == 1 and op_counts(plan)[FUSED] == 2


def test_rotated_k_as_the_graph_output_is_not_fused(
    tiny_ep: DecoderModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(FUSE_ENV, raising=False)  # the default: fused
    assert fused_layers(NativeBackend(tiny_ep, HeadMajorLayout())._plan(1, 1)) == [0, 1]
    backend = NativeBackend(tiny_ep, HeadMajorLayout())
    k0 = _nodes(backend.program, "RotaryTheta")[1]
    backend.program = dataclasses.replace(backend.program, output=k0.outputs[0])
    assert fused_layers(backend._plan(1, 1)) == [1]


# --- the gate/up GEMV with a SwiGLU epilogue ----------------------------------------------------


def _prepacked(model: DecoderModel) -> Program:
    """The model's graph with its MatMul weights as [N, K], as the CUDA device loads it."""
    return load_program(model.onnx_path, prepack=True)


def _gemv_rows(plan: StepPlan) -> bool:
    """Whether a plan's projections run the GEMV (up to 16 rows), where the epilogues apply."""
    return plan.batch * plan.seq <= 16


def assert_mlp_fused(fused: Run, unfused: Run, layers: int) -> None:
    """Bitwise the same logits; a plan of up to 16 rows runs one fused call a layer, and the
    packed gate/up product gets no arena bytes there; larger plans fuse nothing."""
    assert np.array_equal(fused.logits, unfused.logits)
    assert len(fused.plans) == len(unfused.plans) >= 2
    for on, off in zip(fused.plans, unfused.plans, strict=True):
        counts = op_counts(on)
        fused_calls = sum(n for op, n in counts.items() if op.endswith(FUSED_MLP))
        assert off.mlp_fusions == [] and not any(op.endswith(FUSED_MLP) for op in op_counts(off))
        if not _gemv_rows(on):
            assert on.mlp_fusions == [] and counts == op_counts(off)
            continue
        assert fused_calls == len(on.mlp_fusions) == layers
        assert "SwiGLUPacked" not in counts
        assert len(on.call_names) == len(off.call_names) - layers
        assert_unwritten(on, off, {on.values[f.matmul.outputs[0]].base for f in on.mlp_fusions})


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["solo", "batch4"])
@pytest.mark.parametrize("model_name", ["tiny_ep", "qwen_fp32", "qwen_bf16", "qwen_int4"])
def test_swiglu_epilogue_is_the_unfused_bits(
    request: pytest.FixtureRequest, qwen: Callable[[str], DecoderModel], model_name: str,
    prompts: list[list[int]],
) -> None:  # fmt: skip
    """Solo: the 12-row prefill and the decode fuse; four prompts: the decode (4 rows)."""
    model = pick_model(request, qwen, model_name)
    program = _prepacked(model)
    unfused = run(model, "seq_major", prompts, fuse=True, fuse_mlp=False, program=program)
    fused = run(model, "seq_major", prompts, fuse=True, program=program)
    assert_mlp_fused(fused, unfused, model.num_layers)
    assert sum(map(_gemv_rows, fused.plans)) == (2 if len(prompts) == 1 else 1)


def test_swiglu_epilogue_captured_and_with_streamed_weights(tiny_ep: DecoderModel) -> None:
    """Captured; and with every weight streamed by the store (the fused call fetches its gate/up
    weight like the MatMul it replaces)."""
    program = _prepacked(tiny_ep)
    unfused = run(tiny_ep, "seq_major_fixed", PROMPTS, fuse=True, fuse_mlp=False,
                  program=program)  # fmt: skip
    fused = run(tiny_ep, "seq_major_fixed", PROMPTS, fuse=True, program=program, capture=True)
    assert_mlp_fused(fused, unfused, tiny_ep.num_layers)
    streamed = run(tiny_ep, "seq_major_fixed", PROMPTS, fuse=True, program=program,
                   offload=StreamPolicy())  # fmt: skip
    assert_mlp_fused(streamed, unfused, tiny_ep.num_layers)
    for plan in streamed.plans:
        assert not any("gate_up" in name for name in plan.bound_weights)


def _swiglu_nodes(program: Program) -> tuple[Node, Node]:
    """Layer 0's gate/up MatMul and its SwiGLUPacked."""
    act = _nodes(program, "SwiGLUPacked")[0]
    matmul = next(n for n in program.nodes if act.inputs[0] in n.outputs)
    return matmul, act


def _assert_mlp_not_fused_in_layer_0(model: DecoderModel, program: Program) -> None:
    """Layer 0 runs unfused (still right); layer 1 fuses (the solo prompt's 12-row prefill)."""
    unfused = run(model, "seq_major", PROMPTS[:1], fuse=True, fuse_mlp=False, program=program)
    fused = run(model, "seq_major", PROMPTS[:1], fuse=True, program=program)
    assert np.array_equal(fused.logits, unfused.logits)
    layer0 = _swiglu_nodes(program)[0]
    prefill = fused.plans[0]
    assert _gemv_rows(prefill)
    assert [f.matmul.name for f in prefill.mlp_fusions] == [
        n.name for n in _nodes(program, "MatMul") if "gate_up" in n.name and n is not layer0
    ]


def test_packed_product_read_twice_is_not_fused(tiny_ep: DecoderModel) -> None:
    program = _prepacked(tiny_ep)
    _, act = _swiglu_nodes(program)
    extra = Node(act.op, "extra/swiglu", act.inputs, ("extra/act",), dict(act.attrs))
    _assert_mlp_not_fused_in_layer_0(tiny_ep, _insert_after(program, act, extra))


def test_a_working_node_between_projection_and_swiglu_stops_it(tiny_ep: DecoderModel) -> None:
    program = _prepacked(tiny_ep)
    matmul, _ = _swiglu_nodes(program)
    # reads the projection's input (not its product), but runs between the two nodes
    q0 = _nodes(program, "RotaryTheta")[0]
    extra = _extra_rotation(q0.inputs[0], q0)
    _assert_mlp_not_fused_in_layer_0(tiny_ep, _insert_after(program, matmul, extra))


def test_a_projection_that_would_not_run_the_split_k_gemv_is_not_fused(
    qwen: Callable[[str], DecoderModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU of one SM the 4-bit gate/up weight (20 groups of 16 rows) alone would run the
    streaming GEMV, whose sums the epilogue's split-K kernel does not reproduce: not fused."""
    model = qwen("int4")
    backend = NativeBackend(model, HeadMajorLayout())
    assert len(backend._plan(1, 1).mlp_fusions) == model.num_layers
    monkeypatch.setattr(matmul, "sm_count", lambda dev: 1)
    assert backend._plan(2, 1).mlp_fusions == []
    unfused = run(model, "seq_major", PROMPTS, fuse=True, fuse_mlp=False)
    assert np.array_equal(run(model, "seq_major", PROMPTS, fuse=True).logits, unfused.logits)


def test_unprepacked_weights_and_the_switch_keep_two_calls(
    tiny_ep: DecoderModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[K, N] weights (the CPU device's own load) have no SwiGLU epilogue; nor does a plan made
    with the switch off; a bad switch value is refused with the values it takes."""
    assert NativeBackend(tiny_ep, HeadMajorLayout())._plan(1, 1).mlp_fusions == []
    backend = NativeBackend(tiny_ep, HeadMajorLayout())
    backend.program = _prepacked(tiny_ep)
    assert len(backend._plan(1, 1).mlp_fusions) == tiny_ep.num_layers
    monkeypatch.setenv(FUSE_MLP_ENV, "0")
    assert backend._plan(2, 1).mlp_fusions == []
    monkeypatch.setenv(FUSE_MLP_ENV, "on")
    with pytest.raises(ConfigError, match=r"GENAI_EP_FUSE_MLP='on'; expected 0 .* or 1"):
        backend._plan(3, 1)


@pytest.mark.cuda
@pytest.mark.parametrize("model_name", ["qwen_bf16", "tiny_ep"])
def test_cuda_swiglu_epilogue_is_the_unfused_bits(
    request: pytest.FixtureRequest, qwen: Callable[[str], DecoderModel], model_name: str
) -> None:
    """On the GPU (the device prepacks): four prompts captured, and solo."""
    ok, reason = cuda_available()
    if not ok:
        pytest.skip(reason)
    model = pick_model(request, qwen, model_name)
    for prompts, capture in ((PROMPTS, True), (PROMPTS[1:2], False)):
        unfused = run(model, "seq_major_fixed", prompts, fuse=True, fuse_mlp=False, device="cuda")
        fused = run(model, "seq_major_fixed", prompts, fuse=True, device="cuda", capture=capture)
        assert_mlp_fused(fused, unfused, model.num_layers)


# --- the QKV projection's GEMV with the fused commit as its epilogue ----------------------------

FUSED_QKV = "+QKVRotaryCommit"  # "MatMul+QKVRotaryCommit" or "MatMulNBits+QKVRotaryCommit"


def assert_qkv_fused(fused: Run, unfused: Run, layers: int) -> None:
    """Bitwise the same logits as the fused commit after its own projection call; a plan of up
    to 16 rows runs one call a layer for both, whose packed product gets no arena bytes; a
    larger plan (the GEMM) keeps two."""
    assert np.array_equal(fused.logits, unfused.logits)
    assert len(fused.plans) == len(unfused.plans) >= 2
    for on, off in zip(fused.plans, unfused.plans, strict=True):
        counts = op_counts(on)
        joined = [f for f in on.fusions if f.projection is not None]
        assert not any(f.projection is not None for f in off.fusions)
        assert len(on.fusions) == len(off.fusions) == layers
        if not _gemv_rows(on):
            assert joined == [] and counts == op_counts(off)
            continue
        assert len(joined) == layers
        assert sum(n for op, n in counts.items() if op.endswith(FUSED_QKV)) == layers
        assert FUSED not in counts
        assert len(on.call_names) == len(off.call_names) - layers
        assert_unwritten(
            on, off, {on.values[f.projection.outputs[0]].base for f in joined if f.projection}
        )


@pytest.mark.parametrize("prompts", [PROMPTS[:1], PROMPTS], ids=["solo", "batch4"])
@pytest.mark.parametrize("model_name", ["genai_ep", "qwen_fp32", "qwen_bf16", "qwen_int4"])
def test_qkv_epilogue_is_the_unfused_bits(
    request: pytest.FixtureRequest, qwen: Callable[[str], DecoderModel], model_name: str,
    prompts: list[list[int]],
) -> None:  # fmt: skip
    """Without a bias (genai: Rotary over caches) and with one (Qwen), dense and 4-bit."""
    model = pick_model(request, qwen, model_name)
    program = _prepacked(model)
    unfused = run(model, "seq_major", prompts, fuse=True, program=program)
    fused = run(model, "seq_major", prompts, fuse=True, fuse_qkv=True, program=program)
    assert_qkv_fused(fused, unfused, model.num_layers)
    alone = run(model, "seq_major", prompts, fuse=False, program=program)
    assert np.array_equal(alone.logits, fused.logits)


@pytest.mark.parametrize("layout", ["head_major", "seq_major_fixed", "paged"])
def test_qkv_epilogue_in_every_layout_captured_and_streamed(
    qwen: Callable[[str], DecoderModel], layout: str
) -> None:
    """Each layout's strides, captured; with every weight streamed by the store the projection
    keeps its own call (a store's slots hold one node's weights at once), still bitwise."""
    model = qwen("bf16")
    program = _prepacked(model)
    unfused = run(model, layout, PROMPTS[:3], fuse=True, program=program)
    fused = run(model, layout, PROMPTS[:3], fuse=True, fuse_qkv=True, program=program,
                capture=True)  # fmt: skip
    assert_qkv_fused(fused, unfused, model.num_layers)
    streamed = run(model, layout, PROMPTS[:3], fuse=True, fuse_qkv=True, program=program,
                   offload=StreamPolicy())  # fmt: skip
    assert np.array_equal(streamed.logits, unfused.logits)
    for plan in streamed.plans:
        assert len(plan.fusions) == model.num_layers
        assert all(f.projection is None for f in plan.fusions)


def _qkv_projection(program: Program) -> Node:
    """Layer 0's packed QKV projection (what its bias Add reads)."""
    add = _nodes(program, "Add")[0]
    return next(n for n in program.nodes if add.inputs[0] in n.outputs)


def _assert_qkv_not_joined_in_layer_0(model: DecoderModel, program: Program) -> None:
    """Layer 0's projection keeps its own call (still right); layer 1's joins."""
    unfused = run(model, "seq_major", PROMPTS[:1], fuse=True, program=program)
    fused = run(model, "seq_major", PROMPTS[:1], fuse=True, fuse_qkv=True, program=program)
    assert np.array_equal(fused.logits, unfused.logits)
    layer0 = _qkv_projection(program)
    for plan in fused.plans:
        joined = [f.projection.name for f in plan.fusions if f.projection is not None]
        assert layer0.name not in joined and len(joined) == 1


def test_packed_qkv_read_twice_keeps_the_projection_call(
    qwen: Callable[[str], DecoderModel],
) -> None:
    program = _prepacked(qwen("fp32"))
    proj = _qkv_projection(program)
    extra = Node("Add", "extra/add", (proj.outputs[0], _nodes(program, "Add")[0].inputs[1]),
                 ("extra/sum",), {})  # fmt: skip
    _assert_qkv_not_joined_in_layer_0(qwen("fp32"), _insert_after(program, proj, extra))


def test_a_working_node_after_the_projection_keeps_its_call(
    qwen: Callable[[str], DecoderModel],
) -> None:
    program = _prepacked(qwen("fp32"))
    proj = _qkv_projection(program)
    norm = _nodes(program, "RMSNorm")[0]  # again: a working node between projection and chain
    extra = Node(norm.op, "extra/norm", norm.inputs, ("extra/normed",), dict(norm.attrs))
    _assert_qkv_not_joined_in_layer_0(qwen("fp32"), _insert_after(program, proj, extra))


def test_what_would_not_run_the_split_k_gemv_or_split_a_pair_keeps_two_calls(
    qwen: Callable[[str], DecoderModel], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A projection whose plain plan is not the split-K GEMV, a head_dim the GEMV's column
    groups cannot hold in whole pairs, [K, N] weights and the switch: no projection joins; a
    bad switch value is refused."""
    model = qwen("fp32")

    def joined(backend: NativeBackend, rows: int) -> int:
        return sum(f.projection is not None for f in backend._plan(rows, 1).fusions)

    backend = NativeBackend(model, HeadMajorLayout())
    assert joined(backend, 1) == 0  # [K, N]: the CPU device's own load
    backend.program = _prepacked(model)
    assert joined(backend, 2) == model.num_layers
    with monkeypatch.context() as mp:
        mp.setattr(matmul, "split_k_gemv", lambda plan: False)
        assert joined(backend, 3) == 0
    spec = dataclasses.replace(QWEN, num_heads=8, head_dim=8, qkv_bias=True, model_type="qwen2")
    build_model(spec, random_weights(spec, seed=3), flavour="ep", out_dir=tmp_path)
    narrow = NativeBackend(load_model(tmp_path), HeadMajorLayout())
    narrow.program = _prepacked(load_model(tmp_path))
    assert len(narrow._plan(1, 1).fusions) == spec.num_layers and joined(narrow, 2) == 0
    monkeypatch.setenv(FUSE_QKV_ENV, "0")
    assert joined(backend, 4) == 0
    monkeypatch.setenv(FUSE_QKV_ENV, "yes")
    with pytest.raises(ConfigError, match=r"GENAI_EP_FUSE_QKV='yes'; expected 0 .* or 1"):
        backend._plan(5, 1)


@pytest.mark.cuda
@pytest.mark.parametrize("model_name", ["qwen_bf16", "qwen_int4", "genai_ep"])
def test_cuda_qkv_epilogue_is_the_unfused_bits(
    request: pytest.FixtureRequest, qwen: Callable[[str], DecoderModel], model_name: str
) -> None:
    """On the GPU (the device prepacks): three prompts captured, and solo."""
    ok, reason = cuda_available()
    if not ok:
        pytest.skip(reason)
    model = pick_model(request, qwen, model_name)
    for prompts, capture in ((PROMPTS[:3], True), (PROMPTS[1:2], False)):
        unfused = run(model, "seq_major_fixed", prompts, fuse=True, device="cuda")
        fused = run(model, "seq_major_fixed", prompts, fuse=True, fuse_qkv=True, device="cuda",
                    capture=capture)  # fmt: skip
        assert_qkv_fused(fused, unfused, model.num_layers)
