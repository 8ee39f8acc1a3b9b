"""The native executor on onnxruntime-genai's int4 model: onnxruntime-genai's tokens.

genai-int4 (model builder, ``-p int4 -e cpu``) embeds through com.microsoft GatherBlockQuantized
of the tied 4-bit head (a Reshape of the head's B) and runs every MatMulNBits at accuracy_level
4, which ONNX Runtime's CPU computes with int8 activations; expected_tokens.json holds
onnxruntime-genai's greedy tokens of it (solo runs, EOS masked until 48 new tokens). The native
executor must give them in every KV layout, with and without capture, batched, and under every
offload policy at 50 % and 25 % (the tied table in pieces shared by the gather and the head).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from ep.cli import main
from ep.device import cuda_available
from ep.errors import ModelError
from ep.model import DecoderModel, load_model
from ep.native import NativeBackend, as_ep_model, load_program
from ep.native.plan import split_specs, weight_reads
from ep.ort import OrtBackend
from ep.seams import KVLayout
from ep_builtin.capture_warmup import WarmupCapture
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_builtin.kv_paged import PagedLayout
from ep_builtin.kv_seq_major import SeqMajorLayout
from ep_builtin.offload_lru import LRUPolicy
from ep_builtin.offload_resident import ResidentPolicy
from ep_builtin.offload_scan_resistant import ScanResistantPolicy

TINY = Path(__file__).parents[1] / "data" / "genai-llama-tiny"
EXPECTED = json.loads((TINY / "expected_tokens.json").read_text())
PROMPTS: list[list[int]] = EXPECTED["prompts"]
GENAI: list[list[int]] = EXPECTED["genai-int4"]
FULL = int(EXPECTED["new_tokens"])  # 48
HEAD_B, HEAD_SCALES = "lm_head.MatMul.weight_Q4", "lm_head.MatMul.weight_scales"
PIECE = 8192  # bytes: the head's B [512, 4, 16] in 4 pieces of 128 rows, its scales beside
LAYOUTS: dict[str, Callable[[], KVLayout]] = {
    "head_major": lambda: HeadMajorLayout(min_capacity=16),
    "seq_major": lambda: SeqMajorLayout(min_capacity=16),
    "seq_major_fixed": lambda: SeqMajorLayout(min_capacity=16, fixed_stride=True),
    "paged": lambda: PagedLayout(page_size=16),
}
POLICIES = {"scan_resistant": ScanResistantPolicy, "lru": LRUPolicy}


@pytest.fixture(scope="module", autouse=True)
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One rewrite cache for the module: genai-int4's ep rewrite is made once."""
    path = tmp_path_factory.mktemp("int4-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GENAI_EP_CACHE", str(path))
        yield path


@pytest.fixture(scope="module")
def int4(cache: Path) -> DecoderModel:
    return as_ep_model(load_model(TINY / "genai-int4"), cache / "models")


def greedy(backend: NativeBackend | OrtBackend, prompts: Sequence[Sequence[int]],
           new: int = FULL) -> list[list[int]]:  # fmt: skip
    """``new`` greedy tokens per prompt (one batch), EOS masked all along."""
    logits = backend.prefill([np.array(p) for p in prompts])
    out = []
    for step in range(new):
        masked = logits.copy()
        masked[:, 2] = -np.inf
        token = masked.argmax(axis=1)
        out.append(token)
        if step + 1 < new:
            logits = backend.step(token)
    return np.stack(out, axis=1).tolist()


# --- tokens: layouts, capture, batch ------------------------------------------------------------


@pytest.mark.parametrize("capture", [False, True], ids=["eager", "warmup"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_solo_runs_give_genai_int4_tokens(int4: DecoderModel, layout: str, capture: bool) -> None:
    backend = NativeBackend(int4, LAYOUTS[layout](), capture=WarmupCapture(1) if capture else None)
    for prompt, want in zip(PROMPTS, GENAI, strict=True):
        assert greedy(backend, [prompt]) == [want]
    m = backend.capture_metrics
    if capture:
        assert m.captures > 0 and m.replays > 0 and m.fallbacks == 0
    else:
        assert m.captures == 0 and m.eager_steps == len(PROMPTS) * (FULL - 1)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_batched_rows_equal_their_solo_runs(int4: DecoderModel, layout: str) -> None:
    backend = NativeBackend(int4, LAYOUTS[layout](), capture=WarmupCapture(1))
    assert greedy(backend, PROMPTS) == GENAI  # == each prompt's solo tokens (above)


def test_float_activations_miss_the_genai_tokens_and_equal_ort_at_accuracy_0(
    cache: Path, tmp_path: Path
) -> None:
    """Negative oracle for the int8 activations: the same model at accuracy_level 0 (float
    MatMulNBits) leaves onnxruntime-genai's tokens at step 12 of prompt 0; there the native
    executor gives exactly ONNX Runtime's float tokens, so the gather and the rest are right."""
    folder = tmp_path / "accuracy0"
    shutil.copytree(TINY / "genai-int4", folder)
    model = onnx.load(str(folder / "model.onnx"))
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.name == "accuracy_level":
                attr.i = 0
    onnx.save(model, str(folder / "model.onnx"), save_as_external_data=True,
              location="model.onnx.data")  # fmt: skip
    original = load_model(folder)
    native = NativeBackend(as_ep_model(original, cache / "models"), HeadMajorLayout())
    tokens = greedy(native, PROMPTS[:1])
    assert tokens != GENAI[:1] and tokens[0][:12] == GENAI[0][:12]
    ort = OrtBackend(original, HeadMajorLayout())
    assert greedy(ort, PROMPTS[:1]) == tokens
    ort.close()


# --- offload: the tied table shared by the gather and the head ---------------------------------


def test_the_tied_table_is_split_once_for_the_gather_and_the_head(int4: DecoderModel) -> None:
    program = load_program(int4.onnx_path)
    readers = [r.op for r in weight_reads(program) if HEAD_B in r.weights]
    assert readers == ["GatherBlockQuantized", "MatMulNBits"]
    (spec,) = [s for s in split_specs(program) if HEAD_B in s.names]
    assert spec.names == (HEAD_B, HEAD_SCALES) and spec.axes == (0, 0) and spec.size == 512


def test_a_gather_reading_other_rows_keeps_the_table_whole(int4: DecoderModel) -> None:
    """Negative oracle: when the gather's view of B has other rows than the head's outputs
    ([256, 128] instead of [512, 64]), the two readers' specs disagree and nothing is split."""
    program = load_program(int4.onnx_path)
    (reshape,) = [n for n in program.nodes if n.op == "Reshape" and n.inputs[0] == HEAD_B]
    program.arrays[reshape.inputs[1]] = np.array([256, 128], np.int64)
    assert all(HEAD_B not in s.names for s in split_specs(program))


def _reads_per_step(backend: NativeBackend) -> int:
    """Weight (or piece) reads of one step: a split weight is read once per piece."""
    assert backend.offloaded is not None
    store = backend.offloaded.store
    names = set(store.layout.placements)
    count = 0
    for read in weight_reads(backend.program):
        for name in read.weights:
            if name in store.splits:
                count += len(store.splits[name].pieces)
            elif name in names:
                count += 1
    return count


# 25 % needs pieces: 3 staging slots of the whole 32 KiB head take 43 % (refused, tested below)
@pytest.mark.parametrize(("budget", "piece"), [("50%", None), ("50%", PIECE), ("25%", PIECE)],
                         ids=["50%-whole", "50%-pieces", "25%-pieces"])  # fmt: skip
@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_offloaded_runs_give_the_resident_tokens_and_balance(
    int4: DecoderModel, policy: str, budget: str, piece: int | None
) -> None:
    backend = NativeBackend(int4, SeqMajorLayout(min_capacity=16), offload=POLICIES[policy](),
                            budget=budget, piece=piece, capture=WarmupCapture(1))  # fmt: skip
    assert backend.offloaded is not None
    store = backend.offloaded.store
    if piece is not None:  # the gather and the head read the same pieces of B and its scales
        assert len(store.splits[HEAD_B].pieces) == len(store.splits[HEAD_SCALES].pieces) == 4
    assert greedy(backend, PROMPTS) == GENAI
    off = backend.offloaded.counters()
    assert off.hits + off.misses == _reads_per_step(backend) * FULL  # prefill + 47 steps
    assert off.page_ins == off.misses and off.htod_bytes > 0
    assert off.peak_device_bytes <= off.budget_bytes
    m = backend.capture_metrics
    if policy == "scan_resistant":  # streams through fixed slots: captured, never declined
        assert m.captures > 0 and m.replays > 0 and m.fallbacks == 0 and off.evictions == 0
    else:
        assert m.captures == 0 and m.fallbacks == FULL - 1
    backend.close()


def test_htod_bytes_equal_the_device_count_with_the_gather_in_pieces(int4: DecoderModel) -> None:
    steps = 10
    resident = NativeBackend(int4, HeadMajorLayout(), offload=ResidentPolicy(),
                             capture=WarmupCapture(1))  # fmt: skip
    before = resident.device.counters().htod_bytes
    want = greedy(resident, PROMPTS[:2], steps)
    others = resident.device.counters().htod_bytes - before  # ids, positions, rotary tables
    backend = NativeBackend(int4, HeadMajorLayout(), offload=ScanResistantPolicy(), budget="25%",
                            piece=PIECE, capture=WarmupCapture(1))  # fmt: skip
    assert backend.offloaded is not None
    store = backend.offloaded.store
    streamed = {n for n, w in store.layout.placements.items() if w == "stream"}
    head = {p.name for s in (HEAD_B, HEAD_SCALES) for p in store.splits[s].pieces}
    assert head & streamed  # the tied table is streamed, piece by piece, for both readers
    sizes = {n: store._infos[n].nbytes for n in store.layout.placements}
    per_step = sum(sizes[n] for n in streamed) + sum(sizes[n] for n in streamed & head)
    before = backend.device.counters().htod_bytes
    assert greedy(backend, PROMPTS[:2], steps) == want
    copied = backend.device.counters().htod_bytes - before
    off = store.counters()
    assert off.htod_bytes == per_step * steps  # prefill and each decode step
    assert copied == off.htod_bytes + others  # every copied byte counted, once
    assert backend.capture_metrics.captures > 0 and backend.capture_metrics.fallbacks == 0
    backend.close()


def test_a_quarter_without_pieces_is_refused_with_the_fix(int4: DecoderModel) -> None:
    from ep.errors import OffloadBudgetError

    with pytest.raises(OffloadBudgetError, match=r"a smaller offload\.piece shrinks them"):
        NativeBackend(int4, HeadMajorLayout(), offload=ScanResistantPolicy(), budget="25%")


def test_scan_resistant_reserves_the_slots_the_store_needs(
    int4: DecoderModel, capsys: pytest.CaptureFixture[str]
) -> None:
    """MatMulNBits reads B and its scales at once: 3 staging slots. A default policy plans
    with them (as a copy); one set to fewer is refused with the setting to change."""
    from ep.errors import OffloadError

    policy = ScanResistantPolicy()
    backend = NativeBackend(int4, HeadMajorLayout(), offload=policy, budget="50%")
    assert backend.offloaded is not None
    assert backend.offloaded.store.layout.slots == 3 and policy.slots is None
    with pytest.raises(OffloadError, match=r"set --set offload.scan_resistant.slots=3"):
        NativeBackend(int4, HeadMajorLayout(), offload=ScanResistantPolicy(slots=2), budget="50%")
    # the option: 0 (default) is the store's count, 1 can never work
    assert main(["config", "show", "--set", "offload.scan_resistant.slots=1"]) == 2
    assert "must be 0 (the store's) or >= 2" in capsys.readouterr().err


# --- guards ----------------------------------------------------------------------------------


def _edited(int4: DecoderModel, tmp_path: Path, **attrs: int) -> DecoderModel:
    """The ep graph of genai-int4 with the gather's attributes changed."""
    folder = tmp_path / "edited"
    shutil.copytree(int4.folder, folder)
    model = onnx.load(str(folder / "model.onnx"))
    (node,) = [n for n in model.graph.node if n.op_type == "GatherBlockQuantized"]
    for attr in node.attribute:
        if attr.name in attrs:
            attr.i = attrs[attr.name]
    onnx.save(model, str(folder / "model.onnx"), save_as_external_data=True,
              location=Path(int4.onnx_path).name + ".data")  # fmt: skip
    return load_model(folder)


@pytest.mark.parametrize(
    ("attrs", "message"),
    [({"bits": 8}, "bits=8"), ({"quantize_axis": 0}, "quantize_axis=0"),
     ({"block_size": 64}, r"'scales': \[512, 2\]")],
)  # fmt: skip
def test_a_gather_the_kernel_cannot_run_is_refused(
    int4: DecoderModel, tmp_path: Path, attrs: dict[str, int], message: str
) -> None:
    model = _edited(int4, tmp_path, **attrs)
    backend = NativeBackend(model, HeadMajorLayout())
    with pytest.raises(ModelError, match=message) as info:
        backend.prefill([np.array(PROMPTS[3])])
    assert "--backend ort" in str(info.value)


def _ms_matmul_nbits_program(tmp_path: Path, *extra: str, **attrs: int) -> Path:
    """A one-node graph: com.microsoft MatMulNBits with zero points and ``extra`` inputs."""
    k, n, block = 64, 8, 32
    ones = np.ones(n * 2, np.float32).tobytes()
    inits = [
        helper.make_tensor("b", TensorProto.UINT8, [n, 2, 16], bytes(n * 32), raw=True),
        helper.make_tensor("s", TensorProto.FLOAT, [n * 2], ones, raw=True),
        helper.make_tensor("zp", TensorProto.UINT8, [n], bytes(n), raw=True),
    ]
    values: dict[str, Any] = {"K": k, "N": n, "block_size": block, "bits": 4, **attrs}
    node = helper.make_node(
        "MatMulNBits",
        ["x", "b", "s", "zp", *extra],
        ["y"],
        name="mm",
        domain="com.microsoft",
        **values,
    )
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 1, n])
    graph = helper.make_graph([node], "g", [x], [y], initializer=inits)
    path = tmp_path / "mm.onnx"
    onnx.save(helper.make_model(graph), str(path))
    return path


def test_ms_matmul_nbits_keeps_its_zero_points_and_int8_activations(tmp_path: Path) -> None:
    program = load_program(_ms_matmul_nbits_program(tmp_path, accuracy_level=4))
    int8, mm = program.nodes
    assert (int8.op, int8.inputs, int8.attrs["block_size"]) == ("Int8Activations", ("x",), 32)
    assert mm.op == "MatMulNBitsZP" and mm.inputs == (int8.outputs[0], "b", "s", "zp")
    (plain,) = load_program(_ms_matmul_nbits_program(tmp_path, accuracy_level=1)).nodes
    assert plain.op == "MatMulNBitsZP" and plain.inputs[0] == "x"


@pytest.mark.parametrize(
    ("extra", "attrs", "message"), [(("g_idx",), {}, "g_idx or bias"), ((), {"bits": 8}, "bits=8")]
)
def test_ms_matmul_nbits_the_executor_cannot_run_is_refused(
    tmp_path: Path, extra: tuple[str, ...], attrs: dict[str, int], message: str
) -> None:
    with pytest.raises(ModelError, match=message):
        load_program(_ms_matmul_nbits_program(tmp_path, *extra, **attrs))


# --- the command line --------------------------------------------------------------------------


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    ids = [a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))]
    code = main(["run", "--json", "--backend", "native", "--model", str(TINY / "genai-int4"),
                 *ids, "--max-new-tokens", str(FULL), "--min-new-tokens", str(FULL),
                 "--capture", "warmup", "--kv-layout", "seq_major", *argv])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.mark.parametrize("offload", [(), ("--offload", "scan_resistant"), ("--offload", "lru")],
                         ids=["resident", "scan_resistant", "lru"])  # fmt: skip
def test_the_cli_gives_genai_int4_tokens(capsys, offload: tuple[str, ...]) -> None:
    argv = [*offload, "--set", "offload.budget=50%"] if offload else []
    out = run_json(capsys, *argv)
    assert out["tokens"] == GENAI
    capture, off = out["metrics"]["capture"], out["metrics"]["offload"]
    if offload[1:] == ("lru",):  # moving addresses: declined, naming the policy
        assert capture["captures"] == 0
        assert capture["last_decline"]["predicate"] == "offload plan is address-stable"
    else:
        assert capture["captures"] > 0 and capture["replays"] > 0 and capture["fallbacks"] == 0
    if offload:
        assert off["htod_bytes"] > 0 and off["peak_device_bytes"] <= off["budget_bytes"]


CUDA_RUNS = {
    "resident": [],
    "scan_resistant-50%": ["--offload", "scan_resistant", "--set", "offload.budget=50%"],
    "lru-50%": ["--offload", "lru", "--set", "offload.budget=50%"],
    "scan_resistant-25%-pieces": ["--offload", "scan_resistant", "--set", "offload.budget=25%",
                                  "--set", "offload.piece=8KiB"],
}  # fmt: skip


@pytest.mark.cuda
@pytest.mark.parametrize("run", sorted(CUDA_RUNS))
def test_cuda_gives_genai_int4_tokens(capsys, run: str) -> None:
    ok, reason = cuda_available()  # raises on a present-but-broken driver: that must fail
    if not ok:
        pytest.skip(reason)
    out = run_json(capsys, "--device", "cuda", *CUDA_RUNS[run])
    assert out["tokens"] == GENAI
    capture = out["metrics"]["capture"]
    if not run.startswith("lru"):
        assert capture["captures"] > 0 and capture["fallbacks"] == 0
