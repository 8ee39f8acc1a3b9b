"""Token sampling in pure NumPy, shared by the decode loop and the Sample custom op's reference.

One call picks one token per batch row from ``logits[B, V]``. The order of the logits processors
follows Hugging Face ``generate``: repetition penalty, then temperature, top-k, top-p, min-p.
``temperature == 0`` means greedy (argmax after the repetition penalty; the lowest index wins a
tie). Sampling is reproducible: each row draws from its own ``numpy.random.Generator`` derived from
``(seed, row)``, and a row consumes exactly one uniform number per call.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ep.errors import GenerationError

__all__ = [
    "SamplingParams",
    "apply_repetition_penalty",
    "make_rngs",
    "sample",
    "seen_mask",
]


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token. The defaults are greedy decoding.

    ``temperature`` >= 0 (0: greedy); ``top_k`` >= 0 (0: off); ``top_p`` in (0, 1] (1: off);
    ``min_p`` in [0, 1) (0: off); ``repetition_penalty`` > 0 (1: off); ``seed`` an int, or None for
    fresh entropy on every generation.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        _check_number("temperature", self.temperature, ">= 0 (0 means greedy)", lambda v: v >= 0)
        _check_int("top_k", self.top_k, ">= 0 (0 turns top-k off)", lambda v: v >= 0)
        _check_number("top_p", self.top_p, "in (0, 1] (1 turns top-p off)", lambda v: 0 < v <= 1)
        _check_number("min_p", self.min_p, "in [0, 1) (0 turns min-p off)", lambda v: 0 <= v < 1)
        _check_number(
            "repetition_penalty",
            self.repetition_penalty,
            "> 0 (1 turns the penalty off)",
            lambda v: v > 0,
        )
        if self.seed is not None:
            _check_int("seed", self.seed, "an integer >= 0, or None", lambda v: v >= 0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_history(self) -> bool:
        """Whether `sample` needs the tokens seen so far (the repetition penalty is on)."""
        return self.repetition_penalty != 1.0


def _check_number(name: str, value: object, allowed: str, ok: Callable[[float], bool]) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise GenerationError(f"sampling {name}={value!r} is not a number; allowed: {allowed}")
    if not math.isfinite(value) or not ok(float(value)):
        raise GenerationError(f"sampling {name}={value!r} is out of range; allowed: {allowed}")


def _check_int(name: str, value: object, allowed: str, ok: Callable[[int], bool]) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise GenerationError(f"sampling {name}={value!r} is not an integer; allowed: {allowed}")
    if not ok(int(value)):
        raise GenerationError(f"sampling {name}={value!r} is out of range; allowed: {allowed}")


def make_rngs(seed: int | None, batch: int) -> list[np.random.Generator]:
    """One generator per batch row, derived from ``(seed, row)``; fresh entropy for seed None."""
    if seed is None:
        root = np.random.SeedSequence()
        return [np.random.default_rng(child) for child in root.spawn(batch)]
    return [np.random.default_rng([seed, row]) for row in range(batch)]


def seen_mask(
    history: Sequence[Sequence[int]] | Sequence[np.ndarray] | np.ndarray, batch: int, vocab: int
) -> np.ndarray:
    """A bool ``[batch, vocab]`` mask of the token ids in each row's history."""
    if isinstance(history, np.ndarray) and history.dtype == np.bool_:
        if history.shape != (batch, vocab):
            raise GenerationError(
                f"history mask has shape {history.shape}; expected (batch, vocab) = "
                f"({batch}, {vocab})"
            )
        return history
    if len(history) != batch:
        raise GenerationError(f"history has {len(history)} rows; the logits have {batch}")
    mask = np.zeros((batch, vocab), dtype=np.bool_)
    for row, ids in enumerate(history):
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= vocab):
            bad = int(arr[(arr < 0) | (arr >= vocab)][0])
            raise GenerationError(
                f"history row {row} holds token id {bad}, outside the vocabulary [0, {vocab})"
            )
        mask[row, arr] = True
    return mask


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> None:
    """In place, HF semantics: divide positive logits of seen tokens, multiply negative ones."""
    if penalty == 1.0:
        return
    picked = logits[seen]
    logits[seen] = np.where(picked > 0, picked / penalty, picked * penalty)


def sample(
    logits: np.ndarray,
    params: SamplingParams,
    rngs: Sequence[np.random.Generator] | None = None,
    history: Sequence[Sequence[int]] | Sequence[np.ndarray] | np.ndarray | None = None,
) -> np.ndarray:
    """Pick one token id per row of ``logits[B, V]`` (float32); returns int64 ``[B]``.

    ``history``: per row, the token ids seen so far (prompt and generated), or a bool ``[B, V]``
    mask of them; only read when the repetition penalty is on. ``rngs``: one generator per row
    (see `make_rngs`); only read when sampling. ``logits`` is not modified.
    """
    if logits.ndim != 2:
        raise GenerationError(f"logits have shape {logits.shape}; expected [batch, vocab]")
    batch, vocab = logits.shape
    work = logits
    if params.uses_history and history is not None:
        work = np.array(logits, dtype=np.float32, copy=True)
        apply_repetition_penalty(work, seen_mask(history, batch, vocab), params.repetition_penalty)
    if params.greedy:
        return np.argmax(work, axis=-1).astype(np.int64, copy=False)
    if rngs is None or len(rngs) != batch:
        got = "none" if rngs is None else str(len(rngs))
        raise GenerationError(
            f"sampling needs one random generator per row: got {got} for {batch} rows; "
            "build them with ep.sampling.make_rngs(seed, batch)"
        )
    out = np.empty(batch, dtype=np.int64)
    for row in range(batch):
        out[row] = _sample_row(work[row], params, rngs[row])
    return out


def _sample_row(row_logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
    scaled = row_logits.astype(np.float64) / params.temperature
    vocab = scaled.shape[0]
    # Candidates in descending order of logit; a stable sort keeps ties in index order so that a
    # seed picks the same token on every platform.
    order: np.ndarray | None = None
    if 0 < params.top_k < vocab:
        part = np.sort(np.argpartition(-scaled, params.top_k - 1)[: params.top_k])
        order = part[np.argsort(-scaled[part], kind="stable")]
        # argpartition may split a tie at the k-th value arbitrarily; resolve it by index.
        kth = scaled[order[-1]]
        tied = np.flatnonzero(scaled == kth)
        if tied.size > 1:
            keep = order[scaled[order] > kth]
            order = np.concatenate([keep, tied[: params.top_k - keep.size]])
        cand = scaled[order]
    else:
        # Every number below depends only on the candidates' values in descending order, which
        # ties do not change: sort the values (4x faster than a stable argsort of the indices at
        # a vocabulary of 152k) and find the picked one's index at the end. Sorting the logits
        # orders their scaled values the same (x / t is monotonic); NaN sorts last either way.
        cand = (-np.sort(-row_logits)).astype(np.float64) / params.temperature
    top = cand[0]
    if not np.isfinite(top):
        raise GenerationError(
            f"every candidate logit is {top}; nothing can be sampled (all tokens masked?)"
        )
    probs = np.exp(cand - top)
    probs /= probs.sum()
    keep_n = probs.size
    if params.top_p < 1.0:
        before = np.cumsum(probs) - probs  # mass of the tokens ranked above each candidate
        keep_n = max(1, int(np.count_nonzero(before < params.top_p)))
    if params.min_p > 0.0:
        # probs[0] is the maximum probability; candidates are sorted, so a prefix survives.
        keep_n = min(keep_n, max(1, int(np.count_nonzero(probs >= params.min_p * probs[0]))))
    kept = probs[:keep_n]
    cdf = np.cumsum(kept)
    u = rng.random() * cdf[-1]
    idx = min(int(np.searchsorted(cdf, u, side="right")), keep_n - 1)
    return int(order[idx]) if order is not None else _stable_index(scaled, cand, idx)


def _stable_index(scaled: np.ndarray, cand: np.ndarray, idx: int) -> int:
    """The token at position ``idx`` of the stable descending order of ``scaled``, given its
    values in that order (``cand``): among the tokens of that value, by index."""
    value = cand[idx]
    if np.isnan(value):  # NaN sorts last: the positions from the first NaN on
        tied = np.flatnonzero(np.isnan(scaled))
        return int(tied[idx - (cand.size - tied.size)])
    first = int(np.searchsorted(-cand[: idx + 1], -value, side="left"))  # ties begin here
    return int(np.flatnonzero(scaled == value)[idx - first])
