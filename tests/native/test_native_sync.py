"""The device token loop (``decode.sync_every = k``): k steps per host synchronisation, their tokens
picked on the device (k = 1 too), give the tokens picked on the host from each step's logits
(``device_picks=False``), stops and ``min_new_tokens`` included."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _devices import device_or_skip

from ep.cli import main
from ep.errors import ConfigError, GenerationError
from ep.model import load_model
from ep.native import NativeBackend
from ep.native._kernels import advance, mask_ids
from ep.runtime import GenerationOptions, Generator
from ep.sampling import SamplingParams, make_rngs, sample
from ep_builtin.capture_warmup import WarmupCapture
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_builtin.kv_seq_major import SeqMajorLayout

TINY = Path(__file__).parents[1] / "data" / "genai-llama-tiny"
EXPECTED = json.loads((TINY / "expected_tokens.json").read_text())
N = EXPECTED["new_tokens"]
PROMPTS = EXPECTED["prompts"]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENAI_EP_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def model():
    return load_model(TINY / "genai-fp32")


def generator(model, every: int, *, device_picks: bool = True, **options) -> Generator:
    backend = NativeBackend(model, HeadMajorLayout(), capture=WarmupCapture(), sync_every=every,
                            device_picks=device_picks)  # fmt: skip
    opts = GenerationOptions(**{"max_new_tokens": N, "min_new_tokens": N, **options})
    return Generator(model, layout=HeadMajorLayout(), backend=backend, options=opts)


@pytest.mark.parametrize("every", [1, 4, 7])
def test_cli_batch_gives_genai_tokens_for_every_k(capsys, every: int) -> None:
    argv = [a for p in PROMPTS for a in ("--prompt-ids", ",".join(map(str, p)))]
    code = main(["run", "--json", "--model", str(TINY / "genai-fp32"), "--backend", "native",
                 "--capture", "warmup", *argv, "--max-new-tokens", str(N), "--min-new-tokens",
                 str(N), "--set", f"decode.sync_every={every}"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    assert result["tokens"] == EXPECTED["genai-fp32"]
    assert result["metrics"]["capture"]["captures"] > 0
    assert result["metrics"]["capture"]["fallbacks"] == 0


@pytest.mark.parametrize("ahead", ["true", "false"])
def test_cli_run_ahead_setting_reaches_the_loop(capsys, monkeypatch, ahead: str) -> None:
    continued = []
    launch = NativeBackend.launch_steps

    def spy(self, tokens, *a, **k):
        continued.append(tokens is None)
        return launch(self, tokens, *a, **k)

    monkeypatch.setattr(NativeBackend, "launch_steps", spy)
    code = main(["run", "--json", "--model", str(TINY / "genai-fp32"), "--backend", "native",
                 "--prompt-ids", ",".join(map(str, PROMPTS[0])), "--max-new-tokens", str(N),
                 "--min-new-tokens", str(N), "--set", "decode.sync_every=4",
                 "--set", f"decode.run_ahead={ahead}"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["tokens"] == [EXPECTED["genai-fp32"][0]]
    assert any(continued) == (ahead == "true")  # runs launched ahead continue on the device


@pytest.mark.parametrize("every", [1, 4, 7])
def test_one_host_sync_per_block(model, every: int) -> None:
    gen = generator(model, every)
    result = gen.generate(PROMPTS)
    assert [list(t) for t in result.tokens] == EXPECTED["genai-fp32"]
    # The first token comes from the prefill's logits; the other N - 1 in blocks of k.
    assert gen.backend.decode_syncs == -(-(N - 1) // every)  # type: ignore[attr-defined]
    assert not result.notes


def test_stop_inside_a_block_discards_the_tokens_after_it(model) -> None:
    # Row 0's token 10 is a stop id: with k = 4 it is the 2nd token of the 3rd block.
    stop = EXPECTED["genai-fp32"][0][10]
    opts = {"min_new_tokens": 0, "stop_token_ids": (stop,)}
    want = generator(model, 1, device_picks=False, **opts).generate(PROMPTS)
    got = generator(model, 4, **opts).generate(PROMPTS)
    assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons
    assert got.tokens[0] == tuple(EXPECTED["genai-fp32"][0][:11])
    assert got.finish_reasons[0] == "stop"
    assert len(got.tokens[1]) > 11  # the other rows run on past row 0's stop


def test_all_rows_stopping_mid_block_ends_generation(model) -> None:
    row = EXPECTED["genai-fp32"][3]
    opts = {"min_new_tokens": 0, "stop_token_ids": (row[9],)}
    want = generator(model, 1, device_picks=False, **opts).generate([PROMPTS[3]])
    got = generator(model, 7, **opts).generate([PROMPTS[3]])
    assert got.tokens == want.tokens == (tuple(row[: row.index(row[9]) + 1]),)


def test_stop_ids_are_masked_on_the_device_until_min_new_tokens(model) -> None:
    # Row 0's token 5 is a stop id, masked while fewer than 8 tokens exist: the device loop must
    # mask it too (without the mask it would pick it at step 5 and diverge from k = 1).
    stop = EXPECTED["genai-fp32"][0][5]
    opts = {"min_new_tokens": 8, "stop_token_ids": (stop,), "max_new_tokens": 20}
    want = generator(model, 1, device_picks=False, **opts).generate(PROMPTS)
    got = generator(model, 3, **opts).generate(PROMPTS)
    assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons
    assert got.tokens[0][5] != stop


def test_a_repetition_penalty_falls_back_to_one_step_with_a_note(model) -> None:
    gen = generator(model, 4, max_new_tokens=6, min_new_tokens=0)
    sampling = SamplingParams(temperature=0.8, seed=3, repetition_penalty=1.3)
    result = gen.generate([PROMPTS[3]], sampling=sampling)
    assert any("sync_every=4" in n and "repetition penalty" in n for n in result.notes)
    assert gen.backend.decode_syncs == 5  # type: ignore[attr-defined]


SAMPLING = SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.02, seed=11)


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("every", [1, 4, 7])
def test_sampling_on_the_device_gives_the_host_tokens(model, kind: str, every: int) -> None:
    # Each row draws its uniforms from default_rng([seed, row]) on the device as on the host,
    # one a step, with the stop id masked until min_new_tokens: the tokens of k = 1.
    device_or_skip(kind)
    stop = EXPECTED["genai-fp32"][0][3]
    opts = {"max_new_tokens": 24, "min_new_tokens": 6, "stop_token_ids": (stop,)}

    def run(k: int, device_picks: bool = True):
        backend = NativeBackend(model, HeadMajorLayout(), device=kind, capture=WarmupCapture(),
                                sync_every=k, device_picks=device_picks)  # fmt: skip
        gen = Generator(model, layout=HeadMajorLayout(), backend=backend,
                        options=GenerationOptions(**opts))  # fmt: skip
        return gen.generate(PROMPTS, sampling=SAMPLING), backend

    want, _ = run(1, device_picks=False)  # picked on the host, from each step's logits
    got, backend = run(every)
    assert got.tokens == want.tokens and got.finish_reasons == want.finish_reasons
    longest = len(max(got.tokens, key=len))
    assert not got.notes and backend.decode_syncs == -(-(longest - 1) // every)
    assert got.tokens != generator(model, 1, **opts).generate(PROMPTS).tokens  # not greedy


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_first_tokens_are_picked_on_the_device_as_the_host_picks_them(model, kind: str) -> None:
    """The device loop's first token: the prefill's last logits, masked, then the argmax or row
    b's first uniform of default_rng([seed, b]): the host's pick from the returned logits."""
    device_or_skip(kind)
    backend = NativeBackend(model, HeadMajorLayout(), device=kind)
    prompts = [np.array(p) for p in PROMPTS]
    logits = backend.prefill(prompts)
    np.testing.assert_array_equal(backend.first_tokens(), logits.argmax(-1))
    top = int(logits[0].argmax())
    masked = logits.copy()
    masked[:, top] = -np.inf
    backend.prefill(prompts)
    np.testing.assert_array_equal(backend.first_tokens(mask=[top]), masked.argmax(-1))
    backend.prefill(prompts)
    want = sample(masked, SAMPLING, make_rngs(SAMPLING.seed, len(prompts)))
    np.testing.assert_array_equal(backend.first_tokens(mask=[top], sampling=SAMPLING), want)
    assert not np.array_equal(want, masked.argmax(-1))  # a draw, not the argmax


def test_first_tokens_only_once_after_a_prefill(model) -> None:
    backend = NativeBackend(model, HeadMajorLayout())
    with pytest.raises(GenerationError, match=r"call it once after prefill\(\)"):
        backend.first_tokens()
    backend.prefill([np.array(PROMPTS[3])])
    ids = backend.first_tokens()
    with pytest.raises(GenerationError, match="once after prefill"):
        backend.first_tokens()  # its logits were masked in place
    backend.prefill([np.array(PROMPTS[3])])
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        backend.first_tokens(mask=[-1])
    with pytest.raises(GenerationError, match=r"seed=None; the device's generators need a seed"):
        backend.first_tokens(sampling=SamplingParams(0.5))
    backend.steps(ids, 2)
    with pytest.raises(GenerationError, match="once after prefill"):
        backend.first_tokens()


@pytest.mark.parametrize("device_picks", [True, False])
def test_who_picks_the_tokens_at_one_step_a_sync(model, monkeypatch, device_picks: bool) -> None:
    """decode.sync_every = 1 picks on the device, a run of one step a collect (launched ahead),
    unless device_picks=False, which picks on the host from each step's logits; the same tokens
    either way."""
    gen = generator(model, 1, device_picks=device_picks)
    calls = {"step": 0, "collect": 0}
    for name in calls:
        real = getattr(gen.backend, name)

        def counted(*a, _name=name, _real=real, **k):
            calls[_name] += 1
            return _real(*a, **k)

        monkeypatch.setattr(gen.backend, name, counted)
    result = gen.generate(PROMPTS, sampling=SAMPLING)
    want = {True: {"step": 0, "collect": N - 1}, False: {"step": N - 1, "collect": 0}}
    assert calls == want[device_picks] and not result.notes
    other = generator(model, 1, device_picks=not device_picks).generate(PROMPTS, sampling=SAMPLING)
    assert result.tokens == other.tokens


def test_sampling_without_a_seed_runs_on_the_device(model) -> None:
    gen = generator(model, 4, max_new_tokens=9, min_new_tokens=9)
    result = gen.generate(PROMPTS[:2], sampling=SamplingParams(temperature=1.0))
    assert not result.notes and [len(t) for t in result.tokens] == [9, 9]
    assert gen.backend.decode_syncs == 2  # type: ignore[attr-defined]


def test_a_seed_too_large_for_the_device_falls_back_with_a_note(model) -> None:
    gen = generator(model, 4, max_new_tokens=5, min_new_tokens=0)
    result = gen.generate([PROMPTS[3]], sampling=SamplingParams(temperature=0.7, seed=2**64))
    assert any("seed below 2**63" in n for n in result.notes)
    assert gen.backend.decode_syncs == 4  # type: ignore[attr-defined]


def test_a_vocabulary_past_the_sampling_kernel_falls_back_with_a_note(model, monkeypatch) -> None:
    from ep.kernels import sample as sample_kernels

    monkeypatch.setattr(sample_kernels, "MAX_SAMPLE_VOCAB", model.vocab_size - 1)
    gen = generator(model, 4, max_new_tokens=5, min_new_tokens=0)
    drawn = SamplingParams(temperature=0.7, seed=3)
    result = gen.generate([PROMPTS[3]], sampling=drawn)
    assert any(f"a vocabulary of {model.vocab_size} ids" in n for n in result.notes)
    assert gen.backend.decode_syncs == 4  # type: ignore[attr-defined]
    assert (
        result.tokens
        == generator(model, 1, device_picks=False, max_new_tokens=5, min_new_tokens=0)
        .generate([PROMPTS[3]], sampling=drawn)
        .tokens
    )
    with pytest.raises(GenerationError, match="the sampling kernel draws from at most"):
        gen.backend.steps(np.array([1]), 2, sampling=drawn)  # type: ignore[attr-defined]
    assert not generator(model, 4, max_new_tokens=5, min_new_tokens=0).generate([PROMPTS[3]]).notes


def test_steps_refuses_bad_requests(model) -> None:
    backend = NativeBackend(model, HeadMajorLayout())
    with pytest.raises(GenerationError, match="before prefill"):
        backend.steps(np.array([1]), 2)
    backend.prefill([np.array(PROMPTS[3])])
    with pytest.raises(GenerationError, match="expected an integer >= 1"):
        backend.steps(np.array([1]), 0)
    with pytest.raises(GenerationError, match="past the context"):
        backend.steps(np.array([1]), model.context_length)
    with pytest.raises(GenerationError, match="outside the vocabulary"):
        backend.steps(np.array([1]), 2, mask=[model.vocab_size])
    with pytest.raises(GenerationError, match="one id per row"):
        backend.steps(np.array([1, 2]), 2)
    with pytest.raises(GenerationError, match=r"repetition_penalty=1\.2: the penalty needs"):
        backend.steps(np.array([1]), 2, sampling=SamplingParams(0.5, repetition_penalty=1.2))
    with pytest.raises(GenerationError, match=r"repetition_penalty=1\.2: the penalty needs"):
        backend.steps(np.array([1]), 2, sampling=SamplingParams(repetition_penalty=1.2))  # greedy
    with pytest.raises(GenerationError, match=r"seed=None; the device's generators need a seed"):
        backend.steps(np.array([1]), 2, sampling=SamplingParams(0.5))
    with pytest.raises(GenerationError, match=r"draws=-1\); expected an integer >= 0"):
        backend.steps(np.array([1]), 2, sampling=SamplingParams(0.5, seed=1), draws=-1)
    with pytest.raises(ConfigError, match="sync_every=0"):
        NativeBackend(model, HeadMajorLayout(), sync_every=0)
    with pytest.raises(ConfigError, match=r"device_picks='no'; expected True .* or False"):
        NativeBackend(model, HeadMajorLayout(), device_picks="no")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"run_ahead=1; expected True .* or False"):
        NativeBackend(model, HeadMajorLayout(), run_ahead=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_runs_launched_ahead_give_the_tokens_of_steps_one_call_at_a_time(model, kind) -> None:
    """launch_steps(None, ...) continues from the last launched run's pick on the device, before
    the host has read it: the tokens of steps() called with each run's last tokens, masks and
    draws included; each collect is one synchronisation."""
    device_or_skip(kind)
    prompts = [np.array(p) for p in PROMPTS]
    stop = EXPECTED["genai-fp32"][0][3]
    calls = [(3, {"mask": [stop], "mask_steps": 2}), (4, {"mask": [stop], "mask_steps": 1}),
             (2, {})]  # fmt: skip

    def make() -> NativeBackend:
        return NativeBackend(model, HeadMajorLayout(), device=kind, capture=WarmupCapture())

    for sampling in (None, SAMPLING):
        one = make()
        one.prefill(prompts)
        first = one.first_tokens(sampling=sampling)
        want, tokens, draws = [], first, 1
        for count, kw in calls:
            want.append(one.steps(tokens, count, sampling=sampling, draws=draws, **kw))
            tokens, draws = want[-1][-1], draws + count
        ahead = make()
        ahead.prefill(prompts)
        tokens, draws, runs = ahead.first_tokens(sampling=sampling), 1, []
        for count, kw in calls:
            runs.append(ahead.launch_steps(tokens, count, sampling=sampling, draws=draws, **kw))
            tokens, draws = None, draws + count
        assert ahead.decode_syncs == 0  # nothing waited for yet
        got = [ahead.collect(run) for run in runs]
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(g, w)
        assert ahead.decode_syncs == len(calls) and ahead.lens.tolist() == one.lens.tolist()


def test_runs_in_flight_are_collected_once_and_a_prefill_discards_them(model) -> None:
    backend = NativeBackend(model, HeadMajorLayout())
    prompt = [np.array(PROMPTS[3])]
    backend.prefill(prompt)
    with pytest.raises(GenerationError, match=r"no run was launched since the last prefill"):
        backend.launch_steps(None, 2)
    ids = backend.first_tokens()
    run = backend.launch_steps(ids, 2)
    later = backend.launch_steps(None, 3)
    with pytest.raises(GenerationError, match=r"step\(\) while 2 run\(s\) of launch_steps"):
        backend.step(ids)
    backend.collect(run)
    with pytest.raises(GenerationError, match="collected already"):
        backend.collect(run)
    backend.launch_steps(None, 1)  # after a collect, a run still continues the last one
    backend.prefill(prompt)  # starts over: the 2 runs not collected are dropped
    assert backend.discarded_steps == 4
    with pytest.raises(GenerationError, match=r"a prefill\(\) since its launch discarded it"):
        backend.collect(later)
    with pytest.raises(GenerationError, match="no run was launched since the last prefill"):
        backend.launch_steps(None, 1)
    assert backend.steps(backend.first_tokens(), 2).shape == (2, 1)  # and it works on


def test_a_fault_in_a_run_is_raised_at_its_collect_and_the_runs_are_dropped(model) -> None:
    from ep.errors import KernelFaultError

    backend = NativeBackend(model, HeadMajorLayout())
    backend.prefill([np.array(PROMPTS[3])])
    backend.first_tokens()
    bad = backend.launch_steps(np.array([model.vocab_size + 5]), 2)  # an id outside the table
    backend.launch_steps(None, 2)
    with pytest.raises(KernelFaultError, match="token id"):
        backend.collect(bad)
    assert backend.discarded_steps == 2
    backend.prefill([np.array(PROMPTS[3])])  # the status was reset: the next run is clean
    assert backend.steps(backend.first_tokens(), 2).shape == (2, 1)


@pytest.mark.parametrize("every", [1, 4])
def test_run_ahead_gives_the_same_tokens_and_drops_what_a_stop_made_surplus(model, every) -> None:
    stop = EXPECTED["genai-fp32"][0][10]
    opts = {"min_new_tokens": 3, "stop_token_ids": (stop,)}
    got = {}
    for ahead in (False, True):
        gen = generator(model, every, **opts)
        gen.backend.run_ahead = ahead  # type: ignore[attr-defined]
        solo = gen.generate([PROMPTS[0]])  # stops at its token 10: the run after it is surplus
        got[ahead] = solo, gen.generate(PROMPTS, sampling=SAMPLING)  # (whose prefill drops it)
        assert gen.backend.discarded_steps == (every if ahead else 0)  # type: ignore[attr-defined]
    assert got[True][1].tokens == got[False][1].tokens  # sampled
    solo = got[True][0]
    assert solo.tokens == got[False][0].tokens == (tuple(EXPECTED["genai-fp32"][0][:11]),)
    assert solo.finish_reasons == ("stop",)


def test_stream_yields_the_device_loop_tokens_one_step_at_a_time(model) -> None:
    stream = generator(model, 4).stream(PROMPTS)
    steps = [s.tokens for s in stream]
    assert len(steps) == N
    assert [list(col) for col in zip(*steps, strict=True)] == EXPECTED["genai-fp32"]
    assert [list(t) for t in stream.result.tokens] == EXPECTED["genai-fp32"]


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_mask_ids_sets_minus_inf_in_every_row(kind: str) -> None:
    dev = device_or_skip(kind)
    s = dev.default_stream
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 11)).astype(np.float32)
    buf = dev.alloc((3, 11), np.float32, stream=s)
    buf.copy_from_host(logits, stream=s)
    ids = dev.alloc(2, np.int64, stream=s)
    ids.copy_from_host(np.array([2, 9], np.int64), stream=s)
    mask_ids(dev, buf, ids, batch=3, count=2, vocab=11, stream=s)
    want = logits.copy()
    want[:, [2, 9]] = -np.inf
    np.testing.assert_array_equal(buf.to_host(stream=s), want)


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_advance_writes_ids_history_and_moves_live_positions(kind: str) -> None:
    dev = device_or_skip(kind)
    s = dev.default_stream
    i64 = np.int64
    ids, pos, sampled = (dev.alloc(3, i64, stream=s) for _ in range(3))
    hist = dev.alloc((2, 3), i64, stream=s)
    hist.copy_from_host(np.zeros((2, 3), i64), stream=s)
    pos.copy_from_host(np.array([4, -1, 7], i64), stream=s)
    sampled.copy_from_host(np.array([5, 6, 8], i64), stream=s)
    advance(dev, ids, pos, hist, sampled, batch=3, slot=1, stream=s)
    assert ids.to_host(stream=s).tolist() == [5, 6, 8]
    assert pos.to_host(stream=s).tolist() == [5, -1, 8]
    assert hist.to_host(stream=s).tolist() == [[0, 0, 0], [5, 6, 8]]


@pytest.mark.cuda
def test_cuda_device_loop_gives_the_tokens_of_one_step_at_a_time(model) -> None:
    device_or_skip("cuda")
    got = {}
    for every in (1, 4, 7):
        backend = NativeBackend(model, HeadMajorLayout(), device="cuda",
                                capture=WarmupCapture(), sync_every=every)  # fmt: skip
        opts = GenerationOptions(max_new_tokens=N, min_new_tokens=N)
        gen = Generator(model, layout=HeadMajorLayout(), backend=backend, options=opts)
        got[every] = gen.generate(PROMPTS).tokens
        assert backend.decode_syncs == -(-(N - 1) // every)
    assert got[1] == got[4] == got[7]


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_a_second_prompt_keeps_the_graph_and_the_bound_calls(model, kind, monkeypatch) -> None:
    # The cache keeps its buffers from one prompt to the next, so the calls stay bound and the
    # step's graph stays valid: no invalidation, no second capture, no binding again.
    from ep.native.plan import StepPlan

    device_or_skip(kind)
    binds = []
    bind = StepPlan.bind
    monkeypatch.setattr(StepPlan, "bind", lambda plan, kv: binds.append(plan.seq) or bind(plan, kv))

    def tokens(backend: NativeBackend, prompt: list[int], counts: list[int]) -> list[int]:
        token = backend.prefill([np.array(prompt)]).argmax(-1).astype(np.int64)
        out = [int(token[0])]
        for count in counts:
            ids = backend.steps(token, count)
            out += ids[:, 0].tolist()
            token = ids[-1]
        return out

    def fresh() -> NativeBackend:
        return NativeBackend(model, SeqMajorLayout(fixed_stride=True), device=kind,
                             capture=WarmupCapture())  # fmt: skip

    backend = fresh()
    first = tokens(backend, PROMPTS[0], [3, 7])
    binds.clear()
    second = tokens(backend, PROMPTS[1], [7, 7])
    assert binds == [len(PROMPTS[1])]  # the new prompt's prefill plan only; decode kept
    assert first == tokens(fresh(), PROMPTS[0], [1] * 10)
    assert second == tokens(fresh(), PROMPTS[1], [1] * 14)
    m = backend.capture_metrics
    assert (m.captures, m.invalidations, m.fallbacks) == (1, 0, 0)
    assert m.replays == 7 + 7 + 7  # the first call: 2 warm-up steps and the capture
