"""Which layouts run on which graphs, and `genai-ep run --kv-layout`.

onnxruntime-genai (contrib) graphs bind their head-major past/present to the cache itself: any
other layout is refused with the exact commands that make the model an ep graph. After
``genai-ep rewrite`` every layout gives onnxruntime-genai's own greedy tokens, solo and batched.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kv_gate_lib import DATA, EXPECTED, PROMPTS

from ep.cli import main
from ep.errors import ConfigError
from ep.model import DecoderModel, load_model
from ep.runtime import GenerationOptions, Generator
from ep.seams import KVLayout
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_builtin.kv_paged import PagedLayout
from ep_builtin.kv_seq_major import SeqMajorLayout

GENAI = DATA / "genai-fp32"
N = 48  # expected_tokens.json: 48 new tokens, EOS masked until then


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from ep.rewrite import rewrite_model

    out = tmp_path_factory.mktemp("kv_rewrite") / "genai-fp32-ep"
    rewrite_model(GENAI, out)
    return out


def _all_layouts() -> list[KVLayout]:
    return [
        HeadMajorLayout(),
        SeqMajorLayout(),
        SeqMajorLayout(fixed_stride=True),
        PagedLayout(),
        PagedLayout(page_size=4, min_capacity=8),
    ]


@pytest.mark.parametrize("layout", _all_layouts(), ids=lambda x: f"{x.name}")
def test_rewritten_genai_model_gives_onnxruntime_genai_tokens(
    rewritten: Path, layout: KVLayout
) -> None:
    gen = Generator(
        load_model(rewritten), layout=layout, options=GenerationOptions(N, min_new_tokens=N)
    )
    batch = gen.generate(PROMPTS)  # lengths 12, 7, 10, 3
    assert [list(t) for t in batch.tokens] == EXPECTED["genai-fp32"]
    assert batch.metrics.growths >= 1 and batch.metrics.kv_layout == layout.name
    for prompt, want in zip(PROMPTS, EXPECTED["genai-fp32"], strict=True):
        assert list(gen.generate(prompt).tokens[0]) == want


@pytest.mark.parametrize("layout", [SeqMajorLayout(), PagedLayout()], ids=lambda x: x.name)
def test_genai_graph_refuses_other_layouts_with_the_command_to_run(layout: KVLayout) -> None:
    gen = Generator(load_model(GENAI), layout=layout)
    with pytest.raises(ConfigError) as info:
        gen.generate([3, 4, 5])
    text = str(info.value)
    assert "must be head-major" in text and "Use the head_major layout" in text
    assert f"genai-ep rewrite {GENAI} -o {GENAI}-ep" in text
    assert f"genai-ep run --model {GENAI}-ep --kv-layout {layout.name}" in text


@pytest.fixture(scope="module")
def standard(tmp_path_factory: pytest.TempPathFactory) -> DecoderModel:
    spec = "spec:hidden=64,layers=2,heads=4,kv_heads=2,vocab=256,context=64,flavour=standard"
    return load_model(spec, cache_dir=tmp_path_factory.mktemp("kv_std"))


def test_standard_graph_commits_into_any_contiguous_layout(standard: DecoderModel) -> None:
    options = GenerationOptions(30, min_new_tokens=30)
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 200], [9] * 12]
    runs = {}
    for layout in (HeadMajorLayout(min_capacity=8), SeqMajorLayout(8, fixed_stride=True)):
        gen = Generator(standard, layout=layout, options=options)
        result = gen.generate(prompts)
        assert result.metrics.growths >= 2
        runs[layout.name] = result.tokens
    assert runs["head_major"] == runs["seq_major"]


def test_standard_graph_refuses_a_paged_layout_with_the_command_to_run(
    standard: DecoderModel,
) -> None:
    gen = Generator(standard, layout=PagedLayout())
    with pytest.raises(ConfigError, match=r"'paged' is paged \(page_size 16\); a standard graph"):
        gen.generate([3, 4, 5])
    with pytest.raises(ConfigError) as info:
        gen.generate([3, 4, 5])
    assert "genai-ep run --model spec:hidden=64,layers=2,heads=4,kv_heads=2,vocab=256," in str(
        info.value
    )
    assert str(info.value).endswith("context=64,flavour=ep --kv-layout paged")


# --- the command line ----------------------------------------------------------------------------


def _run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code = main(["run", "--json", "--greedy", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)  # type: ignore[no-any-return]


def test_cli_kv_layout_on_a_rewritten_model_prints_the_layout_metrics(
    rewritten: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = (PROMPTS[0], PROMPTS[0], PROMPTS[1])
    prompts = [arg for p in rows for arg in ("--prompt-ids", ",".join(map(str, p)))]
    common = ["--model", str(rewritten), *prompts, "--max-new-tokens", "20",
              "--min-new-tokens", "20"]  # fmt: skip
    paged = _run_json(capsys, *common, "--kv-layout", "paged",
                      "--set", "kv_layout.paged.page_size=8")  # fmt: skip
    head = _run_json(capsys, *common, "--kv-layout", "head_major")
    assert paged["tokens"] == head["tokens"]
    m = paged["metrics"]
    assert (m["kv_layout"], m["kv_page_size"]) == ("paged", 8)
    assert m["kv_pages_in_use"] > 0 and m["kv_shared_pages"] >= 1 and m["kv_cow_bytes"] > 0
    assert m["kv_bytes_per_token"] == 2 * 2 * 2 * 32 * 4  # K+V, layers, kv heads, head dim, fp32
    fixed = _run_json(capsys, *common, "--kv-layout", "seq_major",
                      "--set", "kv_layout.seq_major.fixed_stride=true")  # fmt: skip
    assert fixed["tokens"] == head["tokens"]
    f = fixed["metrics"]
    assert f["kv_relocated_bytes"] == 0 and f["kv_committed_bytes"] < f["kv_bytes"]
    assert head["metrics"]["kv_relocated_bytes"] > 0 and head["metrics"]["kv_moved_growths"] >= 1


def test_cli_genai_model_with_another_layout_says_what_to_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["run", "--model", str(GENAI), "--kv-layout", "seq_major", "--prompt-ids", "3,4"])
    _, err = capsys.readouterr()
    assert code == 2
    assert f"genai-ep rewrite {GENAI} -o {GENAI}-ep, then genai-ep run --model {GENAI}-ep" in err


def test_cli_converts_a_spec_to_the_ep_flavour_for_another_layout(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GENAI_EP_CACHE", str(tmp_path))
    spec = "spec:hidden=64,layers=1,heads=4,kv_heads=2,vocab=128,context=64"
    args = ["--model", spec, "--prompt-ids", "5,6,7", "--prompt-ids", "9",
            "--max-new-tokens", "24", "--min-new-tokens", "24"]  # fmt: skip
    runs = {name: _run_json(capsys, *args, "--kv-layout", name) for name in ("head_major", "paged")}
    assert runs["paged"]["tokens"] == runs["head_major"]["tokens"]
    assert runs["paged"]["metrics"]["kv_pages_in_use"] > 0


def test_paged_graph_swaps_every_kv_op_and_adds_the_table(rewritten: Path, tmp_path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    from ep.errors import ModelError
    from ep.ort.backend import PAGED_TABLE_INPUT, paged_graph

    paged = paged_graph(rewritten / "model.onnx")
    kinds = sorted({n.op_type for n in paged.graph.node if n.op_type.startswith("KV")})
    assert kinds == ["KVAttentionPaged", "KVCommitPaged"]
    for node in paged.graph.node:
        if node.op_type.startswith("KV"):
            assert list(node.input[-2:]) == [PAGED_TABLE_INPUT, "kv_cache"]
    assert paged.graph.input[-1].name == PAGED_TABLE_INPUT
    # Negative: a graph without KV ops has nothing a paged layout could use.
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g", [x], [y])
    onnx.save(helper.make_model(graph), tmp_path / "plain.onnx")
    with pytest.raises(ModelError, match=r"no KVCommit/KVAttention nodes to swap"):
        paged_graph(tmp_path / "plain.onnx")
