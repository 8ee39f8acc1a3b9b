"""L2 prefetch in native decode plans: placement, budget, the switch, the kernel, and identity.

Placement is checked on the CPU device, whose prefetch twin does nothing: the CPU reports no L2,
so the tests give an explicit byte budget (``GENAI_EP_L2_PREFETCH=<size>``) to put the calls in.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ep.config import NON_CONFIG_ENV
from ep.device import Device, KernelCache, compile_kernel, cuda_available, get_device
from ep.device._kernels import KERNELS, compiled_source, cubin_symbols
from ep.errors import ConfigError, KernelArgumentError
from ep.model import DecoderModel
from ep.native import NativeBackend
from ep.native import _kernels as nk
from ep.native.plan import StepPlan, WeightRead, weight_reads
from ep.native.prefetch import (
    PREFETCH_ENV,
    L2Prefetch,
    PrefetchRange,
    plan_l2_prefetch,
    prefetch_budget,
)
from ep.native.program import Program, load_program
from ep_builtin.capture_warmup import WarmupCapture
from ep_builtin.kv_seq_major import SeqMajorLayout
from ep_builtin.offload_scan_resistant import ScanResistantPolicy

PROMPTS = [[1, 17, 43, 99, 5], [1, 8, 250]]
L0, L1 = "model.layers.0", "model.layers.1"
# What the tiny model's nodes read after each attention, up to the next one, in order of use.
AFTER_L0 = (
    f"{L0}.attn.o_proj.MatMul.weight", f"{L0}.post_attention_layernorm.weight",
    f"{L0}.mlp.gate_up_proj.MatMul.weight", f"{L0}.mlp.down_proj.MatMul.weight",
    f"{L1}.input_layernorm.weight", f"{L1}.attn.qkv_proj.MatMul.weight",
)  # fmt: skip
AFTER_L1 = (
    f"{L1}.attn.o_proj.MatMul.weight", f"{L1}.post_attention_layernorm.weight",
    f"{L1}.mlp.gate_up_proj.MatMul.weight", f"{L1}.mlp.down_proj.MatMul.weight",
    "model.layers.2.final_norm_layernorm.weight",
    "model.embed_tokens.weight",  # the tied head
)  # fmt: skip
ATTN = ("/model/layers.0/attn/KVAttention", "/model/layers.1/attn/KVAttention")


def _decode(backend: NativeBackend, steps: int) -> tuple[np.ndarray, StepPlan]:
    """Greedy logits of prefill and ``steps`` decode steps of PROMPTS; the decode plan."""
    logits = backend.prefill([np.array(p) for p in PROMPTS])
    seen = [logits]
    for _ in range(steps):
        logits = backend.step(logits.argmax(axis=1))
        seen.append(logits)
    return np.stack(seen), backend._plan(len(PROMPTS), 1)


def _backend(
    model: DecoderModel,
    monkeypatch: pytest.MonkeyPatch,
    switch: str | None,
    device: str = "cpu",
    **offload: Any,
) -> NativeBackend:
    """A warmup-capture backend made under ``GENAI_EP_L2_PREFETCH=switch`` (None: unset)."""
    if switch is None:
        monkeypatch.delenv(PREFETCH_ENV, raising=False)
    else:
        monkeypatch.setenv(PREFETCH_ENV, switch)
    layout = SeqMajorLayout(min_capacity=16, fixed_stride=True)
    return NativeBackend(model, layout, device=device, capture=WarmupCapture(steps=1), **offload)


def _rows_cover(plan: StepPlan) -> dict[str, list[tuple[int, int]]]:
    """Per prefetch call: the table's rows read back, merged into (address, bytes) runs."""
    assert plan.prefetch_table is not None
    rows = plan.prefetch_table.to_host(stream=plan.stream)
    out: dict[str, list[tuple[int, int]]] = {}
    at = 0
    for p in plan.prefetches:
        count = len(nk.prefetch_rows([(0, r.nbytes) for r in p.ranges]))
        runs: list[tuple[int, int]] = []
        for address, nbytes in rows[at : at + count].tolist():
            if runs and runs[-1][0] + runs[-1][1] == address:
                runs[-1] = (runs[-1][0], runs[-1][1] + nbytes)
            else:
                runs.append((address, nbytes))
        out[p.before] = runs
        at += count
    assert at == len(rows)
    return out


# --- placement in the tiny model's decode plan ------------------------------------------------


def test_a_prefetch_runs_before_each_attention_with_the_weights_after_it(
    tiny_ep: DecoderModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _backend(tiny_ep, monkeypatch, "64MiB")
    assert backend.l2_prefetch_bytes == 64 * 2**20
    _, plan = _decode(backend, 3)
    names = plan.call_names
    where = [i for i, n in enumerate(names) if n.startswith("L2Prefetch:")]
    assert [names[i + 1] for i in where] == [f"KVAttention:{a}" for a in ATTN]
    assert [names[i] for i in where] == [f"L2Prefetch:{a}" for a in ATTN]
    assert [p.before for p in plan.prefetches] == list(ATTN)
    assert [p.weights for p in plan.prefetches] == [AFTER_L0, AFTER_L1]
    # whole weights, from their first byte, and the table holds exactly their device bytes
    fixed = plan._fixed
    for p, runs in zip(plan.prefetches, _rows_cover(plan).values(), strict=True):
        assert all(r.offset == 0 and r.nbytes == fixed[r.weight].nbytes for r in p.ranges)
        assert sorted(runs) == sorted({(fixed[w].ptr, fixed[w].nbytes) for w in p.weights})
    # the prefill plan (seq > 1) has none
    (prefill,) = [p for key, p in backend._plans.items() if key[1] > 1]
    assert not prefill.prefetches and not any("L2Prefetch" in n for n in prefill.call_names)


def test_the_budget_cuts_each_call_in_order_of_use(
    tiny_ep: DecoderModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    budget = 300_000  # o (65536) + norm (512) + the first 233952 bytes of gate_up (262144)
    _, plan = _decode(_backend(tiny_ep, monkeypatch, str(budget)), 2)
    for p, layer in zip(plan.prefetches, (L0, L1), strict=True):
        assert p.ranges == (
            PrefetchRange(f"{layer}.attn.o_proj.MatMul.weight", 0, 65536),
            PrefetchRange(f"{layer}.post_attention_layernorm.weight", 0, 512),
            PrefetchRange(f"{layer}.mlp.gate_up_proj.MatMul.weight", 0, budget - 65536 - 512),
        )
        assert p.nbytes == budget and "budget cut" in p.reason
    fixed = plan._fixed
    runs = _rows_cover(plan)[ATTN[0]]
    gate_up = fixed[f"{L0}.mlp.gate_up_proj.MatMul.weight"]
    assert (gate_up.ptr, budget - 65536 - 512) in runs  # the cut range ends inside the weight


def test_switch_off_gives_no_prefetch_and_the_same_logits(
    tiny_ep: DecoderModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_backend = _backend(tiny_ep, monkeypatch, "64MiB")
    on, on_plan = _decode(on_backend, 6)
    off_backend = _backend(tiny_ep, monkeypatch, "0")
    off, off_plan = _decode(off_backend, 6)
    assert off_backend.l2_prefetch_bytes == 0
    assert not off_plan.prefetches and off_plan.prefetch_table is None
    assert not any(n.startswith("L2Prefetch") for n in off_plan.call_names)
    assert [n for n in on_plan.call_names if not n.startswith("L2Prefetch")] == off_plan.call_names
    assert np.array_equal(on, off)
    for b in (on_backend, off_backend):  # both captured once and replayed the rest
        m = b.capture_metrics
        assert m.captures == 1 and m.replays >= 4 and m.fallbacks == 0


def test_the_cpu_device_has_no_l2_so_the_default_puts_no_prefetch(
    tiny_ep: DecoderModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _backend(tiny_ep, monkeypatch, None)
    assert backend.device.l2_cache_bytes == 0 and backend.l2_prefetch_bytes == 0
    _, plan = _decode(backend, 1)
    assert not plan.prefetches and not any("L2Prefetch" in n for n in plan.call_names)


def test_streamed_weights_are_never_prefetched(
    tiny_ep: DecoderModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _backend(tiny_ep, monkeypatch, "64MiB", offload=ScanResistantPolicy(), budget="50%")
    assert backend.offloaded is not None
    placements = backend.offloaded.store.layout.placements
    _, plan = _decode(backend, 3)
    assert backend.capture_metrics.replays > 0
    prefetched = {w for p in plan.prefetches for w in p.weights}
    streamed = {n for n, w in placements.items() if w != "resident"}
    after = set(AFTER_L0) | set(AFTER_L1)
    assert streamed & after, "the budget must stream some weight a prefetch would cover"
    assert prefetched == after - streamed
    assert any("not at fixed addresses left out" in p.reason for p in plan.prefetches)
    backend.close()


def test_a_rebind_keeps_the_table_and_the_signature_names_it(
    tiny_ep: DecoderModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = _backend(tiny_ep, monkeypatch, "64MiB")
    _, plan = _decode(backend, 20)  # past the first capacity of 16: the cache grew, rebinding
    assert backend.kv.growths > 0 and backend.capture_metrics.growth_keeps > 0
    table = plan.prefetch_table
    assert table is not None
    sig = backend._bind(plan).signature
    assert table.binding in sig.bindings
    plan.bind(backend._kv_binding(plan.batch))
    assert plan.prefetch_table is table  # one table per plan: captured graphs keep reading it


def test_a_bf16_graph_binds_what_the_rule_gives_for_its_program(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ep.model import load_model
    from ep_graphs import ModelSpec, build_model, random_weights

    spec = ModelSpec.parse(
        "hidden=64,layers=2,heads=4,kv_heads=2,vocab=512,dtype=bf16,type=qwen2,bias=1,tie=1"
    )
    build_model(spec, random_weights(spec, 3), flavour="ep", out_dir=tmp_path)
    backend = _backend(load_model(tmp_path), monkeypatch, "64MiB")
    _, plan = _decode(backend, 2)
    sizes = {name: int(a.nbytes) for name, a in backend.program.arrays.items()}
    # the weights behind the bf16 carriers (BitCast) are found by their initializers' names
    rule = plan_l2_prefetch(weight_reads(backend.program), sizes, 64 * 2**20)
    assert [(p.before, p.ranges) for p in plan.prefetches] == [(p.before, p.ranges) for p in rule]
    assert f"{L1}.attn.qkv_proj.Add.bias" in plan.prefetches[0].weights
    assert all(plan._fixed[w].dtype.name == "bfloat16" for w in plan.prefetches[0].weights)


# --- the pure placement rule ------------------------------------------------------------------


def _reads(*rows: tuple[str, str, Sequence[str]]) -> list[WeightRead]:
    return [WeightRead(node, op, tuple(w)) for node, op, w in rows]


def test_placement_rule_edges() -> None:
    reads = _reads(
        ("emb", "Gather", ["table"]), ("n0", "RMSNorm", ["n0.w"]), ("qkv0", "MatMul", ["qkv0.w"]),
        ("rot0", "Rotary", ["cos", "sin"]), ("a0", "KVAttention", []),
        ("o0", "MatMul", ["o0.w"]), ("b0", "Add", ["b0.w"]), ("rot1", "Rotary", ["cos", "sin"]),
        ("a1", "KVAttentionPaged", []),  # nothing after it: no call
        ("emb2", "Gather", ["table"]),
    )  # fmt: skip
    sizes = {n: 100 for n in ("table", "n0.w", "qkv0.w", "cos", "sin", "o0.w", "b0.w")}
    (only,) = plan_l2_prefetch(reads, sizes, budget=1000)
    assert only == L2Prefetch(
        "a0", 4, (PrefetchRange("o0.w", 0, 100), PrefetchRange("b0.w", 0, 100)), only.reason
    )  # neither Rotary's tables (shared by every layer) nor a Gather's table (a few rows read)
    assert "until a1" in only.reason
    assert plan_l2_prefetch(reads, sizes, budget=0) == []
    assert plan_l2_prefetch(reads, sizes, budget=-5) == []
    assert plan_l2_prefetch(reads, {}, budget=1000) == []  # nothing at a fixed address
    # a weight read twice in one window is asked for once; a window ends at the step's end
    tied = _reads(("a", "KVAttention", []), ("x", "MatMul", ["w"]), ("y", "MatMul", ["v", "w"]))
    (call,) = plan_l2_prefetch(tied, {"w": 64, "v": 32}, budget=80)
    assert call.ranges == (PrefetchRange("w", 0, 64), PrefetchRange("v", 0, 16))
    assert "the end of the step" in call.reason and "budget cut" in call.reason


# --- a Qwen2.5-0.5B-shaped layer --------------------------------------------------------------

QWEN_LAYERS = (
    "hidden=896,layers=2,heads=14,kv_heads=2,head_dim=64,intermediate=4864,vocab=4096,"
    "tie=true,bias=true,theta=1000000,eps=1e-6,dtype=bf16,type=qwen2"
)


@pytest.fixture(scope="module")
def qwen_program(tmp_path_factory: pytest.TempPathFactory) -> Program:
    from ep_graphs import ModelSpec, build_model, random_weights

    spec = ModelSpec.parse(QWEN_LAYERS)
    out = tmp_path_factory.mktemp("qwen-layers")
    build_model(spec, random_weights(spec, 0), flavour="ep", out_dir=out)
    return load_program(out / "model.onnx", prepack=True)  # as the CUDA device loads it


def test_a_qwen_layer_fits_half_an_h200_l2_and_the_head_is_cut(qwen_program: Program) -> None:
    h, inter, q, kv = 896, 4864, 14 * 64, 2 * 64
    bf16 = 2
    qkv = (q + 2 * kv) * h * bf16
    layer_after_attention = (h * h + h + 2 * inter * h + inter * h + h) * bf16
    budget = prefetch_budget(60 * 2**20, environ={})
    assert budget == 30 * 2**20
    reads = weight_reads(qwen_program)
    sizes = {n: int(a.nbytes) for n, a in qwen_program.arrays.items()}
    first, last = plan_l2_prefetch(reads, sizes, budget)
    # o, norm, gate_up, down; layer 1's norm, QKV weight and QKV bias: 29.8 MB, all of it
    assert first.nbytes == layer_after_attention + qkv + (q + 2 * kv) * bf16 == 29_824_768
    assert first.nbytes <= budget and "budget cut" not in first.reason
    assert first.weights == (
        f"{L0}.attn.o_proj.MatMul.weight", f"{L0}.post_attention_layernorm.weight",
        f"{L0}.mlp.gate_up_proj.MatMul.weight", f"{L0}.mlp.down_proj.MatMul.weight",
        f"{L1}.input_layernorm.weight", f"{L1}.attn.qkv_proj.MatMul.weight",
        f"{L1}.attn.qkv_proj.Add.bias",
    )  # fmt: skip
    # the last: o, norm, gate_up, down, final norm, then the tied head up to the budget
    assert last.nbytes == budget and last.ranges[-1].weight == "model.embed_tokens.weight"
    assert last.ranges[-1].nbytes == budget - layer_after_attention < 4096 * h * bf16


# --- the switch ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, 500), ("", 500), ("1", 500), ("on", 500), ("0", 0), ("off", 0), ("75%", 750),
     ("100%", 1000), ("2KiB", 2048), ("123", 123)],
)  # fmt: skip
def test_prefetch_budget_reads_the_switch(value: str | None, expected: int) -> None:
    env = {} if value is None else {PREFETCH_ENV: value}
    assert prefetch_budget(1000, environ=env) == expected


def test_a_bad_switch_is_refused_with_what_is_allowed() -> None:
    assert PREFETCH_ENV in NON_CONFIG_ENV  # not mistaken for a misspelled config key
    for bad in ("maybe", "150%", "-3", "0.5"):
        with pytest.raises(ConfigError, match=rf"{PREFETCH_ENV}={bad!r} .*0/off, 1/on"):
            prefetch_budget(1000, environ={PREFETCH_ENV: bad})
    # a share of a device with no L2 is nothing; a size is a size anywhere
    assert prefetch_budget(0, environ={PREFETCH_ENV: "50%"}) == 0
    assert prefetch_budget(0, environ={PREFETCH_ENV: "1MiB"}) == 2**20


# --- the kernel ------------------------------------------------------------------------------


def test_table_rows_cut_ranges_into_chunks() -> None:
    rows = nk.prefetch_rows([(1001, 20000), (64, 0), (4096, 16)], chunk=8192)
    assert rows.dtype == np.uint64 and rows.tolist() == [
        [1001, 8192], [9193, 8192], [17385, 3616], [4096, 16],
    ]  # fmt: skip
    assert nk.prefetch_rows([]).shape == (0, 2)
    with pytest.raises(KernelArgumentError, match="non-negative"):
        nk.prefetch_rows([(5, -1)])
    # by default a call's rows spread over about PREFETCH_BLOCKS blocks, never below the minimum
    assert nk.prefetch_chunk(100) == nk.PREFETCH_MIN_CHUNK
    layer = 29_824_768  # a Qwen2.5-0.5B layer window
    assert nk.prefetch_chunk(layer) == 233_472 and nk.prefetch_chunk(layer) % 4096 == 0
    sizes = [1_605_632, 1792, 17_432_576, 8_716_288, 1792, 2_064_384, 2304]
    ranges = list(zip(np.cumsum([0, *sizes[:-1]]).tolist(), sizes, strict=True))
    rows = nk.prefetch_rows(ranges)
    assert 128 <= len(rows) <= 128 + len(sizes) and int(rows[:, 1].sum()) == layer


def test_the_prefetch_kernel_compiles_with_its_own_pdl(tmp_path: Path) -> None:
    source = KERNELS.get(nk.PREFETCH_KERNEL)
    text = compiled_source(source, "sm_90")
    # launch_dependents first, wait last, and nothing inserted before them
    assert text == source.source
    assert text.index("griddepcontrol.launch_dependents") < text.index("cp.async.bulk.prefetch")
    assert text.rindex("griddepcontrol.wait") > text.index("prefetch_line(end - 1)")
    cache = KernelCache(tmp_path)
    for arch in ("sm_90", "sm_80"):  # the bulk prefetch, and the per-line one before sm_90
        cubin = compile_kernel(source, arch, cache=cache).cubin
        assert nk.PREFETCH_KERNEL in cubin_symbols(cubin)


def _cuda() -> Device:
    ok, reason = cuda_available()
    if not ok:
        pytest.skip(reason)
    return get_device("cuda")


@pytest.mark.cuda
def test_the_kernel_takes_odd_and_unaligned_ranges_without_faults() -> None:
    dev = _cuda()
    s = dev.default_stream
    data = np.random.default_rng(7).integers(0, 255, 3 * 2**20 + 37, dtype=np.uint8)
    buf = dev.to_device(data, stream=s, name="prefetched")
    p = buf.ptr
    n = len(data)
    ranges = [(p, 1), (p + 1, 15), (p + 3, 17), (p + 15, 33), (p + 16, 4096), (p + 7, 8192 + 5),
              (p, n), (p + n - 1, 1), (p + 100, 0), (p + 5, n - 5)]  # fmt: skip
    rows = nk.prefetch_rows(ranges)
    extra = [[p + 9, 3 * 2**20], [p + 100, 0]]  # a row over 1 MiB (cut in the kernel), an empty one
    rows = np.concatenate([rows, extra]).astype(np.uint64)
    table = dev.to_device(rows, stream=s, name="prefetch-table")
    nk.l2_prefetch(dev, table, count=len(rows), stream=s)
    s.sync()  # a fault would surface here
    with dev.capture(stream=s) as cap:  # and inside a graph, replayed
        nk.l2_prefetch(dev, table, count=len(rows), stream=s)
    for _ in range(3):
        cap.graph.launch(stream=s)
    assert np.array_equal(buf.to_host(stream=s), data)  # a prefetch never writes


@pytest.mark.cuda
def test_cuda_tokens_and_logits_are_bitwise_the_same_with_the_switch_on_and_off(
    tiny_ep: DecoderModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    _cuda()
    on_backend = _backend(tiny_ep, monkeypatch, None, device="cuda")  # the default: half the L2
    assert on_backend.l2_prefetch_bytes == on_backend.device.l2_cache_bytes // 2 > 0
    on, on_plan = _decode(on_backend, 24)
    off, off_plan = _decode(_backend(tiny_ep, monkeypatch, "0", device="cuda"), 24)
    assert [p.before for p in on_plan.prefetches] == list(ATTN) and not off_plan.prefetches
    assert on_backend.capture_metrics.replays > 0
    assert np.array_equal(on, off)
    assert np.array_equal(on.argmax(-1), off.argmax(-1))
