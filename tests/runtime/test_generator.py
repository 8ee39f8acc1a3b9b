"""ep.runtime.Generator on real ONNX Runtime sessions of genai-llama-tiny (and ep_graphs builds)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kv_layouts import SeqMajorPacked

from ep.errors import ConfigError, GenerationError, ModelError
from ep.model import DecoderModel, load_model
from ep.runtime import GenerationOptions, Generator, StepTokens
from ep.sampling import SamplingParams
from ep_builtin.kv_head_major import HeadMajorLayout

DATA = Path(__file__).parents[1] / "data" / "genai-llama-tiny"
MakeGen = Callable[..., Generator]


def _opts(n: int = 48, **kw: Any) -> GenerationOptions:
    kw.setdefault("min_new_tokens", n)
    return GenerationOptions(max_new_tokens=n, **kw)


# --- parity with onnxruntime-genai -----------------------------------------------------------


@pytest.mark.parametrize("which", ["fp32", "int4"])
def test_greedy_solo_equals_onnxruntime_genai(
    which: str, request: pytest.FixtureRequest, make_generator: MakeGen, expected: dict[str, Any]
) -> None:
    model: DecoderModel = request.getfixturevalue(which)
    gen = make_generator(model, options=_opts())
    for prompt, want in zip(expected["prompts"], expected[f"genai-{which}"], strict=True):
        result = gen.generate(prompt)
        assert list(result.tokens[0]) == want
        assert result.finish_reasons == ("length",)


@pytest.mark.parametrize("which", ["fp32", "int4"])
def test_batch_rows_equal_their_solo_runs(
    which: str, request: pytest.FixtureRequest, make_generator: MakeGen, expected: dict[str, Any]
) -> None:
    model: DecoderModel = request.getfixturevalue(which)
    gen = make_generator(model, options=_opts())
    result = gen.generate(expected["prompts"])  # lengths 12, 7, 10, 3
    assert [list(t) for t in result.tokens] == expected[f"genai-{which}"]
    assert result.prompt_lengths == (12, 7, 10, 3)


def test_greedy_is_identical_run_to_run(fp32_generator: Generator, expected: dict) -> None:
    first = fp32_generator.generate(expected["prompts"]).tokens
    assert fp32_generator.generate(expected["prompts"]).tokens == first


def test_growth_across_buckets_equals_a_large_fixed_capacity(
    fp32_generator: Generator, expected: dict
) -> None:
    grown = fp32_generator.generate(expected["prompts"])
    fixed = fp32_generator.generate(expected["prompts"], options=_opts(kv_capacity=256))
    assert grown.tokens == fixed.tokens
    assert grown.metrics.growths == 2 and grown.metrics.kv_capacity == 64  # 16 -> 32 -> 64
    assert fixed.metrics.growths == 0 and fixed.metrics.kv_capacity == 256


def test_metrics_describe_the_run(fp32_generator: Generator, expected: dict) -> None:
    m = fp32_generator.generate(expected["prompts"]).metrics
    assert (m.batch, m.prompt_tokens, m.new_tokens, m.steps) == (4, 32, 4 * 48, 47)
    assert m.kv_layout == "head_major"
    assert m.kv_bytes == 2 * 2 * 4 * 2 * 64 * 32 * 4  # K+V, layers, B, Hkv, C, D, fp32
    assert m.kv_live_bytes == 2 * 2 * 2 * 32 * 4 * sum(n + 47 for n in (12, 7, 10, 3))
    assert m.prefill_ms > 0 and m.decode_ms > 0 and m.tokens_per_s > 0
    assert m.decode_ms_per_step_median > 0 and m.decode_ms_per_step_mean > 0
    assert set(m.to_dict()) >= {"prefill_ms", "decode_ms_per_step_median", "growths"}


# --- sampling --------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_and_seed_dependent(
    fp32_generator: Generator, expected: dict
) -> None:
    prompts = expected["prompts"]

    def run(seed: int) -> tuple:
        params = SamplingParams(temperature=1.0, top_k=50, top_p=0.95, seed=seed)
        return fp32_generator.generate(prompts, sampling=params).tokens

    assert run(1) == run(1)
    assert run(1) != run(2)
    assert run(1) != fp32_generator.generate(prompts).tokens  # it does sample


def test_repetition_penalty_changes_greedy_output(
    fp32_generator: Generator, expected: dict
) -> None:
    plain = fp32_generator.generate(expected["prompts"][3]).tokens[0]
    penalised = fp32_generator.generate(
        expected["prompts"][3], sampling=SamplingParams(repetition_penalty=5.0)
    ).tokens[0]
    assert penalised != plain
    assert len(set(penalised)) >= len(set(plain))


# --- streaming -------------------------------------------------------------------------------


def test_stream_yields_the_tokens_of_generate(fp32_generator: Generator, expected: dict) -> None:
    prompts = expected["prompts"]
    stream = fp32_generator.stream(prompts)
    steps: list[StepTokens] = list(stream)
    assert [s.step for s in steps] == list(range(48))
    per_row = [[s.tokens[b] for s in steps] for b in range(4)]
    assert per_row == expected["genai-fp32"]
    result = stream.result
    assert [list(t) for t in result.tokens] == expected["genai-fp32"]
    assert result.text is not None and steps[0].text is not None
    tok = fp32_generator.tokenizer
    assert tok is not None
    for b in range(4):
        streamed = "".join(s.text[b] for s in steps if s.text)
        # Streamed text continues the prompt (it carries the joining space).
        assert tok.decode(prompts[b]) + streamed == tok.decode([*prompts[b], *result.tokens[b]])
        assert streamed.lstrip() == result.text[b]


def test_stream_result_before_the_end_is_an_error(fp32_generator: Generator) -> None:
    stream = fp32_generator.stream([5, 6, 7])
    next(stream)
    with pytest.raises(GenerationError, match="has not finished yet"):
        _ = stream.result


def test_stream_validates_before_the_first_step(fp32_generator: Generator) -> None:
    with pytest.raises(GenerationError, match="token id 999"):
        fp32_generator.stream([1, 999])


# --- stopping --------------------------------------------------------------------------------


def test_max_new_tokens(fp32_generator: Generator, expected: dict) -> None:
    result = fp32_generator.generate(expected["prompts"], options=_opts(5))
    assert [list(t) for t in result.tokens] == [t[:5] for t in expected["genai-fp32"]]
    assert result.finish_reasons == ("length",) * 4 and result.metrics.steps == 4


def test_stop_ids_end_each_row_on_its_own(fp32_generator: Generator, expected: dict) -> None:
    prompts = expected["prompts"]
    free = fp32_generator.generate(prompts, options=GenerationOptions(48, stop_on_eos=False))
    want = [list(t) for t in free.tokens]
    stop = want[1][4]  # row 1's fifth token; where does it first appear in each row?
    firsts = [row.index(stop) if stop in row else None for row in want]
    options = GenerationOptions(48, stop_on_eos=False, stop_token_ids=(stop,))
    result = fp32_generator.generate(prompts, options=options)
    for b, first in enumerate(firsts):
        if first is None:
            assert list(result.tokens[b]) == want[b] and result.finish_reasons[b] == "length"
        else:  # the stop id ends the row and is kept as its last token
            assert list(result.tokens[b]) == want[b][: first + 1]
            assert result.finish_reasons[b] == "stop"
    assert "stop" in result.finish_reasons and "length" in result.finish_reasons


def test_min_new_tokens_masks_stop_ids(fp32_generator: Generator, expected: dict) -> None:
    want = expected["genai-fp32"][1]
    stop = want[4]
    result = fp32_generator.generate(
        expected["prompts"][1],
        options=GenerationOptions(max_new_tokens=48, min_new_tokens=10, stop_token_ids=(stop,)),
    )
    tokens = list(result.tokens[0])
    assert stop not in tokens[:9]  # masked to -inf: it cannot be chosen before token 10
    assert len(tokens) >= 10
    assert tokens[:4] == want[:4] and tokens[4] != stop


def _with_eos(tmp_path: Path, eos: int | list[int]) -> DecoderModel:
    folder = tmp_path / "model"
    shutil.copytree(DATA / "genai-fp32", folder)
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = eos
    (folder / "genai_config.json").write_text(json.dumps(config))
    return load_model(folder)


def test_eos_ends_rows_and_is_left_out_of_the_text(
    tmp_path: Path, make_generator: MakeGen, expected: dict
) -> None:
    want = expected["genai-fp32"][0]
    eos = want[6]
    gen = make_generator(_with_eos(tmp_path, [2, eos]), options=GenerationOptions(48))
    result = gen.generate(expected["prompts"][0])
    first = want.index(eos)
    assert list(result.tokens[0]) == want[: first + 1]
    assert result.finish_reasons == ("eos",)
    assert result.text is not None
    assert result.text[0] == " ".join(f"w{t}" for t in want[:first])
    # The same EOS can be ignored.
    free = gen.generate(expected["prompts"][0], options=GenerationOptions(8, stop_on_eos=False))
    assert len(free.tokens[0]) == 8


def test_finished_rows_are_fed_pad_and_their_outputs_discarded(
    tmp_path: Path, make_generator: MakeGen, expected: dict
) -> None:
    want = expected["genai-fp32"]
    eos = want[3][2]
    gen = make_generator(_with_eos(tmp_path, eos), options=GenerationOptions(20))
    batch = gen.generate(expected["prompts"])
    for b, prompt in enumerate(expected["prompts"]):
        assert batch.tokens[b] == gen.generate(prompt).tokens[0]
    stream_steps = list(gen.stream(expected["prompts"]))
    row3_end = want[3].index(eos)
    assert all(s.tokens[3] is None for s in stream_steps[row3_end + 1 :])
    assert stream_steps[row3_end].finished[3] and stream_steps[row3_end].tokens[3] == eos


# --- the context and bad input ---------------------------------------------------------------


def test_prompt_longer_than_the_context_fails_before_any_work(
    fp32: DecoderModel, make_generator: MakeGen
) -> None:
    gen = make_generator(fp32)
    with pytest.raises(GenerationError) as info:
        gen.generate([[5] * 10, [5] * 256])
    message = str(info.value)
    assert "prompt 1 has 256 tokens" in message and "context is 256" in message
    assert "at most 255" in message
    assert gen.backend.kv.geometry is None, "a cache was allocated for a refused request"


def test_max_new_tokens_is_clipped_to_the_context(fp32_generator: Generator) -> None:
    result = fp32_generator.generate([7] * 250, options=_opts(48))
    assert len(result.tokens[0]) == 6
    assert result.notes and "clipped from 48 to 6" in result.notes[0]


@pytest.mark.parametrize(
    ("prompts", "message"),
    [
        ([1, 512], "prompt 0 holds token id 512, outside the model's vocabulary [0, 512)"),
        ([[3, 4], [-1]], "prompt 1 holds token id -1"),
        ([], "no prompts given"),
        ([[3], []], "prompt 1 is empty"),
        ([1.5, 2.5], "integer token ids"),
        (42, "prompts of type int"),
    ],
)
def test_bad_prompts(fp32_generator: Generator, prompts: Any, message: str) -> None:
    with pytest.raises(GenerationError) as info:
        fp32_generator.generate(prompts)
    assert message in str(info.value)


def test_bad_options() -> None:
    with pytest.raises(GenerationError, match="max_new_tokens=0; expected an integer >= 1"):
        GenerationOptions(max_new_tokens=0)
    with pytest.raises(GenerationError, match="min_new_tokens=9 exceeds max_new_tokens=4"):
        GenerationOptions(max_new_tokens=4, min_new_tokens=9)
    with pytest.raises(GenerationError, match="stop token id -3"):
        GenerationOptions(stop_token_ids=(-3,))


def test_stop_id_outside_the_vocabulary(fp32_generator: Generator) -> None:
    with pytest.raises(
        GenerationError, match=r"stop token id 600 is outside .* \(vocab size 512\)"
    ):
        fp32_generator.generate([3], options=GenerationOptions(4, stop_token_ids=(600,)))


def test_unknown_backend(fp32: DecoderModel) -> None:
    with pytest.raises(ConfigError, match="unknown backend 'nativ'; available: ort"):
        Generator(fp32, layout=HeadMajorLayout(), backend="nativ")


def test_gqa_graph_refuses_a_layout_it_cannot_bind(fp32: DecoderModel) -> None:
    gen = Generator(fp32, layout=SeqMajorPacked())
    with pytest.raises(ConfigError, match=r"must be head-major .* Use the head_major layout"):
        gen.generate([3, 4, 5])


# --- text ------------------------------------------------------------------------------------


def test_text_prompts_use_the_model_tokenizer(fp32_generator: Generator, expected: dict) -> None:
    prompt = expected["prompts"][2]
    text = " ".join(f"w{t}" for t in prompt)
    result = fp32_generator.generate(text)
    assert list(result.tokens[0]) == expected["genai-fp32"][2]
    assert result.text == (" ".join(f"w{t}" for t in expected["genai-fp32"][2]),)


def test_without_the_tokenizers_library(tmp_path: Path) -> None:
    script = f"""
import sys
sys.modules["tokenizers"] = None  # the import now fails as if it were not installed
from ep.errors import ModelError
from ep.model import load_model
from ep.runtime import GenerationOptions, Generator
from ep_builtin.kv_head_major import HeadMajorLayout
gen = Generator(load_model({str(DATA / "genai-fp32")!r}), layout=HeadMajorLayout(),
                options=GenerationOptions(3))
result = gen.generate([5, 6, 7])
print("TEXT", result.text, "NOTES", result.notes)
try:
    gen.generate("w5 w6")
except ModelError as exc:
    print("ERROR", exc)
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True
    ).stdout
    assert "TEXT None" in out and "pip install 'genai-ep[tokenizers]'" in out
    assert "ERROR prompt 0 is text but the model has no usable tokenizer" in out


def test_text_prompt_without_a_tokenizer_file(tmp_path: Path, make_generator: MakeGen) -> None:
    folder = tmp_path / "m"
    shutil.copytree(DATA / "genai-fp32", folder)
    (folder / "tokenizer.json").unlink()
    gen = make_generator(load_model(folder), options=GenerationOptions(2))
    assert gen.generate([4, 5]).text is None
    with pytest.raises(ModelError, match=r"no tokenizer\.json"):
        gen.generate("w4 w5")


# --- other sources and graph flavours --------------------------------------------------------


@pytest.mark.parametrize(("quant", "key"), [(None, "transformers"), ("int4", "genai-int4")])
def test_hf_checkpoint_converted_equals_the_references(
    quant: str | None, key: str, tmp_path: Path, make_generator: MakeGen, expected: dict
) -> None:
    model = load_model(DATA / "hf", quant=quant, cache_dir=tmp_path)
    gen = make_generator(model, options=_opts())
    result = gen.generate(expected["prompts"])
    assert [list(t) for t in result.tokens] == expected[key]


@pytest.fixture(scope="module")
def standard_and_contrib(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """One set of random weights built as a standard graph and as a contrib graph."""
    import ep_graphs

    spec = ep_graphs.ModelSpec.parse("hidden=64,layers=2,heads=4,kv_heads=2,vocab=256,context=96")
    weights = ep_graphs.random_weights(spec, 5)
    root = tmp_path_factory.mktemp("built")
    return (
        ep_graphs.build_model(spec, weights, flavour="standard", out_dir=root / "standard"),
        ep_graphs.build_model(spec, weights, flavour="contrib", out_dir=root / "contrib"),
    )


@pytest.mark.parametrize("layout", [HeadMajorLayout(), SeqMajorPacked()], ids=lambda x: x.name)
def test_standard_graph_rows_and_tokens_equal_the_contrib_build(
    standard_and_contrib: tuple[Path, Path], layout: Any, make_generator: MakeGen
) -> None:
    standard, contrib = (load_model(p) for p in standard_and_contrib)
    assert (standard.flavour, standard.padding) == ("standard", "left")
    assert (contrib.flavour, contrib.padding) == ("contrib", "right")
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 256, n).tolist() for n in (12, 7, 10, 3)]
    options = _opts(40)  # 12 + 40 crosses the 16- and 32-token buckets: growth on both paths
    got_standard = make_generator(standard, layout=layout, options=options).generate(prompts)
    got_contrib = make_generator(contrib, options=options).generate(prompts)
    assert got_standard.tokens == got_contrib.tokens
    assert got_standard.metrics.growths >= 1
    solo = make_generator(standard, layout=layout, options=options)
    for b, prompt in enumerate(prompts):
        assert solo.generate(prompt).tokens[0] == got_standard.tokens[b]


def test_decode_text_can_be_turned_off(fp32_generator: Generator, expected: dict) -> None:
    options = GenerationOptions(4, min_new_tokens=4, decode_text=False)
    result = fp32_generator.generate(expected["prompts"][0], options=options)
    assert result.text is None and result.notes == ()
    assert list(result.tokens[0]) == expected["genai-fp32"][0][:4]
    assert all(s.text is None for s in fp32_generator.stream([5, 6], options=options))


def test_fp16_graphs_keep_an_fp16_cache(tmp_path: Path, make_generator: MakeGen) -> None:
    spec = "spec:hidden=64,layers=2,heads=4,kv_heads=2,vocab=256,context=64,dtype=fp16,flavour="
    prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 200]]
    runs = {}
    for flavour in ("contrib", "standard"):
        model = load_model(spec + flavour, cache_dir=tmp_path)
        gen = make_generator(model, options=_opts(20))
        batch = gen.generate(prompts)
        assert gen.backend.kv.keys[0].dtype == np.float16
        assert batch.metrics.kv_bytes == 2 * 2 * 2 * 2 * 32 * 16 * 2  # K+V, layers, B, H, C, D
        for b, prompt in enumerate(prompts):
            assert gen.generate(prompt).tokens[0] == batch.tokens[b]
        runs[flavour] = batch.tokens
    assert runs["contrib"] == runs["standard"]
