"""Sample: one token id per row from logits, by `ep.sampling.sample` (greedy, temperature, top-k,
top-p, min-p), reproducible without state.

The decode loop gives each row its own generator (``ep.sampling.make_rngs``: ``default_rng([seed,
row])``) and every sampling call draws exactly one uniform number per row. An op cannot keep
generators between calls, so it rebuilds them: ``rng_keys[b]`` is the entropy the loop used
(``[seed, row]``) and ``steps[b]`` how many numbers that generator has drawn before this call
(greedy calls draw none). The op then picks the very token the loop would.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ep.errors import GenerationError, OpError
from ep.ops._infer import FLOATS, as_f32, expect, expect_rank, expect_shape
from ep.ops.schema import ArgInfo, AttrSpec, OpDef, OpSchema, TensorSpec
from ep.sampling import SamplingParams
from ep.sampling import sample as sample_tokens

__all__ = ["SAMPLE", "checked_params", "rng_at", "sample"]


def rng_at(key: Sequence[int], step: int) -> np.random.Generator:
    """``default_rng(key)`` advanced past ``step`` draws (one PCG64 step per uniform float)."""
    rng = np.random.default_rng([int(k) for k in key])
    if step:
        rng.bit_generator.advance(int(step))  # type: ignore[attr-defined]  # PCG64 has it
    return rng


def checked_params(
    rng_keys: np.ndarray,
    steps: np.ndarray,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
) -> SamplingParams:
    """The op's sampling values as `SamplingParams`, or `OpError` (every Sample kernel's checks)."""
    try:
        params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    except GenerationError as exc:
        raise OpError(f"Sample: {exc}") from None
    if int(rng_keys.min(initial=0)) < 0 or int(steps.min(initial=0)) < 0:
        raise OpError("Sample: rng_keys and steps must be >= 0")
    return params


def sample(
    logits: np.ndarray,
    rng_keys: np.ndarray,
    steps: np.ndarray,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
) -> np.ndarray:
    """int64 [B] token ids from logits [B, V]; see the module docstring for the generators."""
    params = checked_params(
        rng_keys, steps, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
    )
    rngs = None
    if not params.greedy:
        rngs = [rng_at(key, step) for key, step in zip(rng_keys, steps, strict=True)]
    try:
        return sample_tokens(as_f32(logits), params, rngs)
    except GenerationError as exc:
        raise OpError(f"Sample: {exc}") from None


def _infer_sample(inputs: Sequence[ArgInfo], attrs: Mapping[str, Any]) -> tuple[ArgInfo, ...]:
    logits, keys, steps = inputs
    expect_rank("Sample", "logits", logits, (2,), "[batch, vocab]")
    expect(logits.shape[1] > 0, "Sample", "the vocabulary is empty")
    batch = logits.shape[0]
    expect_rank("Sample", "rng_keys", keys, (2,), "[batch, words]")
    expect(keys.shape[0] == batch, "Sample", f"rng_keys has {keys.shape[0]} rows; batch {batch}")
    expect_shape("Sample", "steps", steps, (batch,), "[batch]")
    return (ArgInfo((batch,), "int64"),)


SAMPLE = OpDef(
    OpSchema(
        "Sample",
        inputs=(
            TensorSpec("logits", "T", "[batch, vocab]"),
            TensorSpec("rng_keys", "int64", "[batch, words]: each row's generator entropy"),
            TensorSpec("steps", "int64", "[batch]: numbers each generator drew before"),
        ),
        outputs=(TensorSpec("ids", "int64", "[batch]"),),
        attributes=(
            AttrSpec("temperature", "float", 0.0, "0: greedy"),
            AttrSpec("top_k", "int", 0, "0: off"),
            AttrSpec("top_p", "float", 1.0, "1: off"),
            AttrSpec("min_p", "float", 0.0, "0: off"),
        ),
        type_vars=(("T", FLOATS),),
        doc="Pick one token per row (ep.sampling semantics), reproducibly from seeds and steps.",
    ),
    reference=sample,
    infer=_infer_sample,
)
