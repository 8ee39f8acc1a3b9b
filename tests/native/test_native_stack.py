"""The native backend's fused decode step (``decode.fused``, `ep.native.fused`): the persistent
stack kernel on the plan's buffers and KV cache, on the CPU device through its NumPy twin and on
an sm_90a GPU.

Gates: the fused step's tokens are the plan's on a bf16 Qwen2-style model (its logits within
bf16 rounding of them: same roundings, another summation order); its tokens and logit bits are
the same in every contiguous KV layout, eager and captured, and when a step it cannot take
(a position past its attention) hands over to the plan mid-run, whose graph is then captured
afresh, never the fused one replayed. `match_stack` refuses every graph that computes
something else, naming the node; a mode, device or offload plan it cannot serve is a reason in
``metrics.fused`` (``auto``) or a `ConfigError` (``on``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from ep.errors import ConfigError
from ep.model import DecoderModel, load_model
from ep.native import NativeBackend
from ep.native.fused import match_stack
from ep.native.program import Node, Program, load_program
from ep.seams import KVLayout
from ep_builtin.capture_warmup import WarmupCapture
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_builtin.kv_paged import PagedLayout
from ep_builtin.kv_seq_major import SeqMajorLayout
from ep_graphs import ModelSpec, build_model, random_weights

SPEC = ModelSpec.parse(
    "hidden=128,layers=2,heads=2,kv_heads=1,head_dim=64,intermediate=256,vocab=512,tie=true,"
    "bias=true,theta=1000000,eps=1e-6,dtype=bf16,type=qwen2,context=64"
)
LAYOUTS: dict[str, Callable[[], KVLayout]] = {
    "seq_major_fixed": lambda: SeqMajorLayout(min_capacity=16, fixed_stride=True),
    "head_major": lambda: HeadMajorLayout(min_capacity=16),
}
PROMPT = np.random.default_rng(0).integers(3, 512, 7)
STEPS = 14  # past the first capacity bucket (16): growth inside the run


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., DecoderModel]]:
    """``models(**changes)``: SPEC with ``changes`` built once each (ep flavour)."""
    built: dict[str, DecoderModel] = {}

    def get(**changes: object) -> DecoderModel:
        key = repr(sorted(changes.items()))
        if key not in built:
            spec = dataclasses.replace(SPEC, **changes)  # type: ignore[arg-type]
            out = tmp_path_factory.mktemp("stack-model")
            build_model(spec, random_weights(spec, seed=3), flavour="ep", out_dir=out)
            built[key] = load_model(out)
        return built[key]

    yield get


def decode(backend: NativeBackend, steps: int = STEPS) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens of PROMPT: the first from the prefill, 4 through `step` (host logits),
    the rest through the device loop, in two runs (the second launched before the first is
    read); and the logits of the `step` calls."""
    backend.prefill([PROMPT])
    tokens = [int(backend.first_tokens()[0])]
    logits = []
    for _ in range(4):
        row = backend.step(np.array(tokens[-1:]))[0]
        logits.append(row)
        tokens.append(int(row.argmax()))
    half = max(1, (steps - 4) // 2)
    runs = [backend.launch_steps(np.array(tokens[-1:]), half)]
    if steps - 4 > half:
        runs.append(backend.launch_steps(None, steps - 4 - half))
    for run in runs:
        tokens += backend.collect(run)[:, 0].tolist()
    return tokens, logits


def backend(model: DecoderModel, fused: str, layout: str = "seq_major_fixed",
            device: str = "cpu", **kw: object) -> NativeBackend:  # fmt: skip
    return NativeBackend(model, LAYOUTS[layout](), device=device, fused=fused,
                         capture=kw.pop("capture", WarmupCapture()), **kw)  # type: ignore[arg-type]  # fmt: skip


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_fused_steps_give_the_plans_tokens_in_every_layout(
    models: Callable[..., DecoderModel], layout: str
) -> None:
    model = models()
    plan_tokens, plan_logits = decode(backend(model, "off", layout))
    fused = backend(model, "on", layout)
    tokens, logits = decode(fused)
    assert tokens == plan_tokens
    for got, want in zip(logits, plan_logits, strict=True):
        assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()
        assert np.array_equal(got, got.astype(np.float32))  # float32 logits, bf16 values
    assert fused.fused_metrics == {"mode": "on", "matched": True, "steps": STEPS,
                                   "picks": STEPS - 4, "reason": ""}  # fmt: skip
    m = fused.capture_metrics
    assert m.captures >= 1 and m.replays > 0 and m.fallbacks == 0
    if layout == "seq_major_fixed":  # a fixed stride keeps the fused graph across growth
        assert m.invalidations == 0 and m.growth_keeps > 0


def test_an_untied_head_and_no_qkv_bias(models: Callable[..., DecoderModel]) -> None:
    """The head's own [hidden, vocab] weight (copied [vocab, hidden] for the kernel) and zero
    biases where the graph has no Add."""
    model = models(tie_embeddings=False, qkv_bias=False)
    match = match_stack(load_program(model.onnx_path))
    assert match.head != match.embed and match.head not in match.rows
    plan_tokens, plan_logits = decode(backend(model, "off"))
    fused = backend(model, "on")
    tokens, logits = decode(fused)
    assert tokens == plan_tokens and fused.fused_metrics["steps"] == STEPS
    for got, want in zip(logits, plan_logits, strict=True):
        assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()


def test_fused_logits_are_the_same_bits_in_every_layout_eager_and_captured(
    models: Callable[..., DecoderModel],
) -> None:
    model = models()
    runs = {
        (layout, capture): decode(backend(model, "on", layout, capture=policy))
        for layout in LAYOUTS
        for capture, policy in (("eager", None), ("captured", WarmupCapture()))
    }
    first_tokens, first_logits = next(iter(runs.values()))
    for tokens, logits in runs.values():
        assert tokens == first_tokens
        for got, want in zip(logits, first_logits, strict=True):
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_step_past_the_kernels_attention_hands_over_to_the_plan(
    models: Callable[..., DecoderModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The kernel's longest context lowered to 10: positions 10 and on are the plan's. The kept
    fused graph is then invalidated (its signature is not the plan's) and the plan's graph
    captured; the tokens are the plan's all along."""
    import ep.kernels.stack

    model = models()
    plan_tokens, _ = decode(backend(model, "off"))
    monkeypatch.setattr(ep.kernels.stack, "max_positions", lambda *args: 10)
    fused = backend(model, "on")
    tokens, _ = decode(fused)
    assert tokens == plan_tokens
    metrics = fused.fused_metrics
    assert metrics["steps"] == 10 - len(PROMPT)  # positions 7, 8, 9
    assert re.fullmatch(r"position \d+: the fused kernel's attention holds 10 positions; .*",
                        metrics["reason"])  # fmt: skip
    m = fused.capture_metrics
    assert m.invalidations == 1 and "fused.stack" in m.last_invalidation
    assert m.captures == 2


def test_the_fused_step_takes_the_greedy_loops_pick(
    models: Callable[..., DecoderModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """In a greedy device loop the kernel picks (one launch a step): the plan's tokens over
    several calls, one masking its first step's best id (the kernel masks it: the pick
    changes), one masking more ids than the kernel takes (picked outside it, by the same
    captured launch with its picking flag off) and a longer one (a bigger history); one graph
    and no invalidation; a draw, or a step handed to the plan mid-loop, picks outside it."""
    import ep.kernels.stack
    from ep.sampling import SamplingParams

    model = models()
    many = list(range(3, 3 + ep.kernels.stack.PICK_MASK + 1))

    def run(b: NativeBackend) -> list[int]:
        b.prefill([PROMPT])
        first = b.first_tokens()
        best = int(b.steps(first, 1)[0, 0])
        masked = b.steps(first, 3, mask=[best], mask_steps=1)
        assert masked[0, 0] != best
        wide = b.steps(masked[-1], 2, mask=many, mask_steps=1)
        again = b.steps(wide[-1], 3)
        longer = b.steps(again[-1], 6)  # 6 slots: the loop's history grows
        return [*masked[:, 0], *wide[:, 0], *again[:, 0], *longer[:, 0]]

    plan = run(backend(model, "off"))
    fused = backend(model, "on")
    assert run(fused) == plan
    # 1 + 3 + 2 + 3 + 6 steps, the first of the 2 masking more ids than the kernel takes
    assert fused.fused_metrics["steps"] == 15 and fused.fused_metrics["picks"] == 14
    m = fused.capture_metrics
    assert m.captures == 1 and m.invalidations == 0 and m.fallbacks == 0

    draw = backend(model, "on")
    draw.prefill([PROMPT])
    draw.steps(draw.first_tokens(), 4, sampling=SamplingParams(temperature=0.8, seed=1))
    assert draw.fused_metrics["steps"] == 4 and draw.fused_metrics["picks"] == 0

    # positions 10 on: the plan's
    monkeypatch.setattr(ep.kernels.stack, "max_positions", lambda *args: 10)
    handed = backend(model, "on")
    handed.prefill([PROMPT])
    tokens = handed.steps(handed.first_tokens(), 6)[:, 0].tolist()
    plain = backend(model, "off")
    plain.prefill([PROMPT])
    assert tokens == plain.steps(plain.first_tokens(), 6)[:, 0].tolist()
    assert handed.fused_metrics["picks"] == 3  # positions 7, 8, 9


def test_steps_it_cannot_take_run_the_plan_with_the_reason(
    models: Callable[..., DecoderModel],
) -> None:
    model = models()
    batch = backend(model, "on")
    batch.prefill([PROMPT, PROMPT[:5]])
    batch.steps(np.array(batch.first_tokens()), 2)
    assert batch.fused_metrics["steps"] == 0
    assert batch.fused_metrics["reason"] == "batch 2: the fused step decodes one sequence"

    paged = NativeBackend(model, PagedLayout(page_size=4), device="cpu", fused="on")
    paged.prefill([PROMPT])
    paged.steps(np.array(paged.first_tokens()), 2)
    assert paged.fused_metrics["steps"] == 0
    assert "paged KV layout" in paged.fused_metrics["reason"]


def test_modes_devices_and_offload_plans_it_cannot_serve(
    models: Callable[..., DecoderModel], tiny_ep: DecoderModel
) -> None:
    from ep_builtin.offload_stream import StreamPolicy

    model = models()
    with pytest.raises(ConfigError, match="fused='sometimes'; expected one of auto, on, off"):
        NativeBackend(model, LAYOUTS["head_major"](), device="cpu", fused="sometimes")
    off = NativeBackend(model, LAYOUTS["head_major"](), device="cpu")  # the default
    assert off.fused_metrics["mode"] == "off" and not off.fused_metrics["matched"]
    auto = NativeBackend(model, LAYOUTS["head_major"](), device="cpu", fused="auto")
    assert "CPU device runs the op-per-launch plan" in auto.fused_metrics["reason"]
    decode(auto, 5)
    assert auto.fused_metrics["steps"] == 0
    # a float32 model is not the kernel's decoder: on says so and stops, auto goes on without
    with pytest.raises(ConfigError, match=r"decode\.fused = on, but the model is not the fused"):
        NativeBackend(tiny_ep, LAYOUTS["head_major"](), device="cpu", fused="on")
    with pytest.raises(ConfigError, match="streams weights"):
        NativeBackend(model, LAYOUTS["head_major"](), device="cpu", fused="on",
                      offload=StreamPolicy(), budget="50%")  # fmt: skip


def test_shapes_the_kernel_does_not_run_are_refused_by_name(
    models: Callable[..., DecoderModel],
) -> None:
    wide = models(head_dim=128, hidden_size=256)
    with pytest.raises(ConfigError, match="head_dim 128 \\(the kernel needs 64\\)"):
        NativeBackend(wide, LAYOUTS["head_major"](), device="cpu", fused="on")


# --- match_stack: negative oracles ----------------------------------------------------------


def edited(program: Program, name: str, **changes: object) -> Program:
    """``program`` with node ``name`` changed (inputs, attrs, op)."""
    nodes = [
        dataclasses.replace(n, **changes) if n.name == name else n  # type: ignore[arg-type]
        for n in program.nodes
    ]
    return dataclasses.replace(program, nodes=nodes)


def test_the_matcher_reads_the_decoder(models: Callable[..., DecoderModel]) -> None:
    program = load_program(models().onnx_path, prepack=True)
    match = match_stack(program)
    assert (match.shape.hidden, match.shape.layers, match.shape.heads) == (128, 2, 2)
    assert (match.shape.kv_heads, match.shape.inter, match.theta) == (1, 256, 1e6)
    assert match.head == match.embed and match.head in match.rows  # the tied table, [V, hidden]
    assert all(layer["down"] in match.rows for layer in match.layers)  # prepacked to [N, K]
    assert all(layer["qkv_bias"] for layer in match.layers)
    nobias = load_program(models(qkv_bias=False).onnx_path)
    unpacked = match_stack(nobias)  # the file's layout: [K, N], but the tied head's [V, hidden]
    assert not any(layer["qkv_bias"] for layer in unpacked.layers)
    assert unpacked.rows == {unpacked.head}


def by_op(program: Program, op: str, layer: int = 1) -> Node:
    return next(n for n in program.nodes if n.op == op and f"layers.{layer}/" in n.name)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("swap_swiglu", "is interleaved"),
        ("layer_attr", "is for layer 0, not 1"),
        ("rotary_input", "does not rotate q or k"),
        ("skip_input", "expected the O projection"),
        ("theta", "has another theta"),
        ("extra_node", "follows the logits"),
    ],
)
def test_a_graph_that_computes_something_else_is_refused_by_node(
    models: Callable[..., DecoderModel], change: str, message: str
) -> None:
    program = load_program(models().onnx_path, prepack=True)
    if change == "swap_swiglu":
        node = by_op(program, "SwiGLUPacked")
        program = edited(program, node.name, attrs={**node.attrs, "interleaved": 1})
    elif change == "layer_attr":
        node = by_op(program, "KVAttention")
        program = edited(program, node.name, attrs={**node.attrs, "layer": 0})
    elif change == "rotary_input":  # q's rotation reads v
        rot = by_op(program, "RotaryTheta")
        v = by_op(program, "Split").outputs[2]
        program = edited(program, rot.name, inputs=(v, *rot.inputs[1:]))
    elif change == "skip_input":  # the post-attention norm adds the attention, not O
        post = next(
            n for n in program.nodes if "post_attention" in n.name and n.op == "SkipRMSNorm"
        )
        att = by_op(program, "KVAttention").outputs[0]
        program = edited(program, post.name, inputs=(post.inputs[0], att, post.inputs[2]))
    elif change == "theta":
        rot = by_op(program, "RotaryTheta")
        program = edited(program, rot.name, attrs={**rot.attrs, "theta": 10000.0})
    else:
        last = program.nodes[-1]
        extra = Node("Cast", "extra", (program.output,), ("more",), {"to": 1})
        program = dataclasses.replace(program, nodes=[*program.nodes, extra])
        assert last.op == "Cast"
    with pytest.raises(ValueError, match=message):
        match_stack(program)


# --- the kernel on the GPU ------------------------------------------------------------------


@pytest.mark.cuda
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cuda_fused_steps_give_the_plans_tokens_and_replay_bitwise(
    models: Callable[..., DecoderModel], layout: str
) -> None:
    from _devices import cuda_or_skip

    dev = cuda_or_skip()
    if dev.arch not in ("sm_90", "sm_90a"):
        pytest.skip(f"the fused kernel needs sm_90a; this GPU is {dev.arch}")
    model = models()
    plan_tokens, plan_logits = decode(backend(model, "off", layout, device="cuda"))
    runs = [
        decode(backend(model, "on", layout, device="cuda", capture=policy))
        for policy in (None, WarmupCapture())
    ]
    for tokens, logits in runs:
        assert tokens == plan_tokens
        for got, want in zip(logits, plan_logits, strict=True):
            assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()
    for got, want in zip(runs[0][1], runs[1][1], strict=True):  # eager and captured: same bits
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


# --- genai-ep run ---------------------------------------------------------------------------


def test_the_cli_runs_it_on_request_and_reports_it(
    models: Callable[..., DecoderModel],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from ep.cli import main

    monkeypatch.setenv("GENAI_EP_CACHE", str(tmp_path / "cache"))
    folder = str(Path(models().onnx_path).parent)
    ids = ",".join(map(str, PROMPT))

    def run(*argv: str) -> tuple[int, str, str]:
        code = main(["run", "--json", "--model", folder, "--backend", "native", "--capture",
                     "warmup", "--kv-layout", "seq_major", "--prompt-ids", ids,
                     "--max-new-tokens", "12", "--min-new-tokens", "12", *argv])  # fmt: skip
        out, err = capsys.readouterr()
        return code, out, err

    code, out, err = run()
    assert code == 0, err
    plan = json.loads(out)
    assert plan["metrics"]["fused"] == {"mode": "off", "matched": False, "steps": 0,
                                        "picks": 0, "reason": "decode.fused = off"}  # fmt: skip
    code, out, err = run("--set", "decode.fused=on")
    assert code == 0, err
    fused = json.loads(out)
    assert fused["tokens"] == plan["tokens"]
    assert fused["metrics"]["fused"]["steps"] == 11  # every decode step (the first: prefill)
    assert fused["metrics"]["fused"]["picks"] == 11  # EOS masked (min-new-tokens) in the kernel
    assert fused["metrics"]["capture"]["captures"] == 1
    code, _, err = run("--set", "decode.fused=always")
    assert code != 0 and "decode.fused" in err and "auto" in err
