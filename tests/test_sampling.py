"""ep.sampling: validation, greedy, the logits processors, and seeded reproducibility."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ep.errors import GenerationError
from ep.sampling import SamplingParams, apply_repetition_penalty, make_rngs, sample, seen_mask


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("temperature", -0.5, ">= 0"),
        ("temperature", math.nan, ">= 0"),
        ("temperature", "hot", ">= 0"),
        ("top_k", -1, ">= 0"),
        ("top_k", 2.5, ">= 0"),
        ("top_k", True, ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_p", 1.5, "(0, 1]"),
        ("min_p", 1.0, "[0, 1)"),
        ("min_p", -0.1, "[0, 1)"),
        ("repetition_penalty", 0.0, "> 0"),
        ("repetition_penalty", -2.0, "> 0"),
        ("seed", -3, ">= 0"),
        ("seed", 1.5, "integer"),
    ],
)
def test_invalid_params_name_value_and_range(field: str, value: object, allowed: str) -> None:
    with pytest.raises(GenerationError) as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    message = str(info.value)
    assert field in message and repr(value) in message and allowed in message


def test_valid_edges_are_accepted() -> None:
    p = SamplingParams(temperature=0, top_k=0, top_p=1.0, min_p=0.0, repetition_penalty=1, seed=0)
    assert p.greedy and not p.uses_history
    assert not SamplingParams(temperature=0.7).greedy


def test_greedy_is_argmax_and_lowest_index_wins_a_tie() -> None:
    logits = np.array([[0.0, 3.0, 3.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -2.0, -0.5, -3.0]])
    ids = sample(logits.astype(np.float32), SamplingParams())
    assert ids.tolist() == [1, 0, 2]
    assert ids.dtype == np.int64


def test_repetition_penalty_follows_hf_semantics() -> None:
    logits = np.array([[2.0, -2.0, 1.0, 0.5]], dtype=np.float32)
    seen = seen_mask([[0, 1]], 1, 4)
    work = logits.copy()
    apply_repetition_penalty(work, seen, 2.0)
    # positive seen logit divided, negative seen logit multiplied, unseen untouched
    assert work.tolist() == [[1.0, -4.0, 1.0, 0.5]]
    # penalty 2: tokens 0 and 2 tie at 1.0 (lowest index wins); penalty 4: token 2 wins;
    # without a penalty token 0 wins outright.
    assert sample(logits, SamplingParams(repetition_penalty=2.0), history=[[0, 1]]).tolist() == [0]
    assert sample(logits, SamplingParams(repetition_penalty=4.0), history=[[0, 1]]).tolist() == [2]
    assert sample(logits, SamplingParams(), history=[[0, 1]]).tolist() == [0]
    assert logits.tolist() == [[2.0, -2.0, 1.0, 0.5]], "sample must not modify its input"


def test_history_ids_out_of_range_are_rejected() -> None:
    with pytest.raises(GenerationError, match="token id 9, outside the vocabulary"):
        seen_mask([[1, 9]], 1, 4)


def _draws(logits: np.ndarray, params: SamplingParams, n: int) -> np.ndarray:
    rngs = make_rngs(params.seed, 1)
    return np.array([sample(logits, params, rngs)[0] for _ in range(n)])


def test_top_k_one_is_greedy_for_every_seed() -> None:
    logits = np.random.default_rng(1).normal(size=(1, 50)).astype(np.float32)
    for seed in range(5):
        ids = _draws(logits, SamplingParams(temperature=1.5, top_k=1, seed=seed), 20)
        assert set(ids.tolist()) == {int(logits.argmax())}


def test_top_k_keeps_only_the_k_best_and_resolves_boundary_ties_by_index() -> None:
    logits = np.array([[1.0, 4.0, 3.0, 3.0, 3.0, 0.0]], dtype=np.float32)
    ids = _draws(logits, SamplingParams(temperature=1.0, top_k=3, seed=3), 400)
    # the k-th value (3.0) is shared by tokens 2, 3, 4: the lowest indices (2, 3) are kept
    assert set(ids.tolist()) == {1, 2, 3}


def test_top_p_keeps_the_nucleus_only() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05])
    logits = np.log(probs)[None, :].astype(np.float32)
    ids = _draws(logits, SamplingParams(temperature=1.0, top_p=0.7, seed=0), 500)
    assert set(ids.tolist()) == {0, 1}  # 0.5 < 0.7, 0.5 + 0.3 >= 0.7
    ids = _draws(logits, SamplingParams(temperature=1.0, top_p=0.01, seed=0), 50)
    assert set(ids.tolist()) == {0}


def test_min_p_drops_tokens_below_the_scaled_maximum() -> None:
    probs = np.array([0.4, 0.3, 0.2, 0.1])
    logits = np.log(probs)[None, :].astype(np.float32)
    ids = _draws(logits, SamplingParams(temperature=1.0, min_p=0.6, seed=0), 500)
    assert set(ids.tolist()) == {0, 1}  # 0.3 >= 0.6 * 0.4 = 0.24 > 0.2


def test_sampling_matches_the_softmax_distribution() -> None:
    probs = np.array([0.1, 0.2, 0.3, 0.4])
    logits = (np.log(probs) * 2.0)[None, :].astype(np.float32)  # temperature 2 undoes the * 2
    ids = _draws(logits, SamplingParams(temperature=2.0, seed=11), 20000)
    freq = np.bincount(ids, minlength=4) / ids.size
    assert np.abs(freq - probs).max() < 0.015


def test_same_seed_same_tokens_different_seed_different_tokens() -> None:
    logits = np.random.default_rng(0).normal(size=(3, 200)).astype(np.float32)
    params = SamplingParams(temperature=1.0, seed=42)

    def run(p: SamplingParams) -> list[list[int]]:
        rngs = make_rngs(p.seed, 3)
        return [sample(logits, p, rngs).tolist() for _ in range(30)]

    assert run(params) == run(params)
    assert run(params) != run(SamplingParams(temperature=1.0, seed=43))


def test_row_generators_depend_on_seed_and_row_only() -> None:
    a = make_rngs(7, 2)[1].random(5)
    b = make_rngs(7, 5)[1].random(5)
    c = make_rngs(7, 5)[0].random(5)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_no_seed_draws_fresh_entropy() -> None:
    logits = np.zeros((1, 1000), dtype=np.float32)
    params = SamplingParams(temperature=1.0)
    first = [_draws(logits, params, 20).tolist() for _ in range(2)]
    assert first[0] != first[1]


def test_sampling_without_generators_is_an_error() -> None:
    with pytest.raises(GenerationError, match="one random generator per row"):
        sample(np.zeros((2, 4), np.float32), SamplingParams(temperature=1.0), make_rngs(0, 1))


def test_everything_masked_is_an_error() -> None:
    logits = np.full((1, 4), -np.inf, dtype=np.float32)
    with pytest.raises(GenerationError, match="nothing can be sampled"):
        sample(logits, SamplingParams(temperature=1.0), make_rngs(0, 1))


def _reference_row(row: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    """The sampler as it was before it sorted values instead of indices: a stable argsort of the
    whole row (the oracle of the test below)."""
    scaled = row.astype(np.float64) / params.temperature
    order = np.argsort(-scaled, kind="stable")
    cand = scaled[order]
    probs = np.exp(cand - cand[0])
    probs /= probs.sum()
    keep_n = probs.size
    if params.top_p < 1.0:
        keep_n = max(1, int(np.count_nonzero(np.cumsum(probs) - probs < params.top_p)))
    if params.min_p > 0.0:
        keep_n = min(keep_n, max(1, int(np.count_nonzero(probs >= params.min_p * probs[0]))))
    cdf = np.cumsum(probs[:keep_n])
    u = rng.random() * cdf[-1]
    return int(order[min(int(np.searchsorted(cdf, u, side="right")), keep_n - 1)])


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.3, min_p=0.05),
        SamplingParams(temperature=2.0, top_p=0.5, min_p=0.01),
    ],
    ids=["top-p", "plain", "min-p", "both"],
)
def test_sorting_values_picks_the_stable_order_s_tokens(params: SamplingParams) -> None:
    """Bitwise the same picks as the stable argsort of indices, for every seed: rows full of
    ties (few distinct logits, so a draw lands inside a run of equal values), masked (-inf)
    tokens, signed zeros, float64 rows, a row with NaN (sorted last by both)."""
    rng = np.random.default_rng(11)
    rows = [
        rng.integers(-3, 4, 4000).astype(np.float32),  # 7 values: every draw is in a tie
        np.where(rng.random(3000) < 0.5, -np.inf, rng.standard_normal(3000)).astype(np.float32),
        np.array([0.0, -0.0, 0.0, -0.0, -1.0, 0.5, 0.5], np.float32),
        rng.standard_normal(5000),  # float64
        np.array([1.0, np.nan, 2.0, 2.0, np.nan, -1.0], np.float32),
        (rng.standard_normal(151936) * 3).astype(np.float32),
    ]
    for row in rows:
        for seed in range(40 if row.size < 10000 else 4):
            want = _reference_row(row, params, np.random.default_rng(seed))
            got = sample(row[None], params, [np.random.default_rng(seed)])[0]
            assert got == want, (row[:8], seed)
