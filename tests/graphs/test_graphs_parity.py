"""Built graphs (standard and contrib, fp32) against the independent NumPy forward.

Prefill of a padded batch of three prompts of different lengths, then one decode step with the
past; logits and present K/V compared at every real (mask == 1) position with relative error
< 1e-5. Standard takes left padding (its mask hides padding anywhere); contrib takes right padding,
as GroupQueryAttention counts real tokens instead of reading the mask (see the last tests).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import numpy_llama as nl
import pytest
from graphs_testlib import PROMPTS, left_padded, max_row_error, right_padded, run, session

from ep_graphs import ModelSpec, build_model, random_weights

TOL = 1e-5

BASE = ModelSpec.parse(
    "hidden=64,layers=2,heads=4,kv_heads=2,vocab=128,intermediate=96,theta=10000,eps=1e-5,"
    "context=64"
)
VARIANTS: dict[str, ModelSpec] = {
    "llama_untied": BASE,
    "llama_tied": dataclasses.replace(BASE, tie_embeddings=True),
    "qwen2_bias": dataclasses.replace(BASE, qkv_bias=True, model_type="qwen2", rope_theta=1e6),
    "mqa": dataclasses.replace(BASE, num_kv_heads=1),
    "mha": dataclasses.replace(BASE, num_kv_heads=4),
}


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Any:
    cache: dict[tuple[str, str], tuple[ModelSpec, dict[str, np.ndarray], Path]] = {}

    def get(flavour: str, variant: str) -> tuple[ModelSpec, dict[str, np.ndarray], Path]:
        if (flavour, variant) not in cache:
            spec = VARIANTS[variant]
            weights = random_weights(spec, seed=11)
            out = tmp_path_factory.mktemp(f"{flavour}_{variant}")
            build_model(spec, weights, flavour=flavour, out_dir=out)
            cache[flavour, variant] = (spec, weights, out)
        return cache[flavour, variant]

    return get


def _decode_inputs(mask: np.ndarray, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    ids = np.array(tokens, dtype=np.int64)[:, None]
    return ids, np.concatenate([mask, np.ones((mask.shape[0], 1), np.int64)], axis=1)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_standard_left_padded_prefill_and_decode(built: Any, variant: str) -> None:
    spec, weights, out = built("standard", variant)
    sess = session(out)
    ids, mask = left_padded(PROMPTS)
    pos = nl.positions_from_mask(mask, ids.shape[1])
    got = run(sess, ids, mask, position_ids=pos)
    ref_logits, ref_present = nl.forward(spec, weights, ids, mask, pos)
    assert got.logits.dtype == np.float32
    assert max_row_error(got.logits, ref_logits, mask) < TOL
    for (k, v), (rk, rv) in zip(got.present, ref_present, strict=True):
        assert k.shape == (3, spec.num_kv_heads, ids.shape[1], spec.head_dim)
        for row in range(3):
            real = mask[row] == 1
            assert nl.relative_error(k[row][:, real], rk[row][:, real]) < TOL
            assert nl.relative_error(v[row][:, real], rv[row][:, real]) < TOL

    dec_ids, dec_mask = _decode_inputs(mask, [7, 81, 30])
    dec_pos = nl.positions_from_mask(dec_mask, 1)
    step = run(sess, dec_ids, dec_mask, past=got.present, position_ids=dec_pos)
    ref_step, ref_present2 = nl.forward(spec, weights, dec_ids, dec_mask, dec_pos, ref_present)
    assert nl.relative_error(step.logits, ref_step) < TOL
    assert step.present[0][0].shape[2] == ids.shape[1] + 1
    assert nl.relative_error(step.present[1][0][:, :, -1], ref_present2[1][0][:, :, -1]) < TOL


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_contrib_right_padded_prefill_and_decode(built: Any, variant: str) -> None:
    spec, weights, out = built("contrib", variant)
    sess = session(out)
    assert "position_ids" not in sess.input_names
    ids, mask = right_padded(PROMPTS)
    pos = nl.positions_from_mask(mask, ids.shape[1])
    got = run(sess, ids, mask)
    ref_logits, ref_present = nl.forward(spec, weights, ids, mask, pos)
    assert max_row_error(got.logits, ref_logits, mask) < TOL
    lengths = mask.sum(axis=1)
    for (k, v), (rk, rv) in zip(got.present, ref_present, strict=True):
        for row, n in enumerate(lengths):
            assert nl.relative_error(k[row, :, :n], rk[row, :, :n]) < TOL
            assert nl.relative_error(v[row, :, :n], rv[row, :, :n]) < TOL

    # GroupQueryAttention writes row b's new token at slot lengths[b] (right after its prompt).
    dec_ids, dec_mask = _decode_inputs(mask, [7, 81, 30])
    dec_pos = nl.positions_from_mask(dec_mask, 1)
    step = run(sess, dec_ids, dec_mask, past=got.present)
    ref_step, ref_present2 = nl.forward(spec, weights, dec_ids, dec_mask, dec_pos, ref_present)
    assert nl.relative_error(step.logits, ref_step) < TOL
    for row, n in enumerate(lengths):
        new_k = step.present[0][0][row, :, n]
        assert nl.relative_error(new_k, ref_present2[0][0][row, :, -1]) < TOL


def test_standard_takes_right_padding_too(built: Any) -> None:
    spec, weights, out = built("standard", "llama_untied")
    ids, mask = right_padded(PROMPTS)
    pos = nl.positions_from_mask(mask, ids.shape[1])
    got = run(session(out), ids, mask, position_ids=pos)
    ref, _ = nl.forward(spec, weights, ids, mask, pos)
    assert max_row_error(got.logits, ref, mask) < TOL


def test_batch_rows_equal_solo_runs(built: Any) -> None:
    _, _, out = built("standard", "llama_untied")
    sess = session(out)
    ids, mask = left_padded(PROMPTS)
    batch = run(sess, ids, mask, position_ids=nl.positions_from_mask(mask, ids.shape[1]))
    for row, prompt in enumerate(PROMPTS):
        solo_ids = np.array([prompt])
        solo_mask = np.ones_like(solo_ids)
        solo = run(sess, solo_ids, solo_mask, position_ids=nl.positions_from_mask(solo_mask, 7))
        real = batch.logits[row, mask[row] == 1]
        assert nl.relative_error(real, solo.logits[0]) < TOL


def test_multi_token_step_with_past(built: Any) -> None:
    """A second chunk of several tokens on top of a past (standard handles any split)."""
    spec, weights, out = built("standard", "llama_tied")
    sess = session(out)
    prompt = np.array([[9, 8, 7, 6, 5, 4, 3, 2]])
    first = run(sess, prompt[:, :5], np.ones((1, 5), np.int64), position_ids=np.arange(5)[None])
    second = run(
        sess,
        prompt[:, 5:],
        np.ones((1, 8), np.int64),
        past=first.present,
        position_ids=np.arange(5, 8)[None],
    )
    ref, _ = nl.forward(spec, weights, prompt, np.ones((1, 8), np.int64), np.arange(8)[None])
    assert nl.relative_error(second.logits, ref[:, 5:]) < TOL


# --- negative oracles: the comparison catches what it guards ------------------------------


def test_wrong_rope_theta_is_detected(built: Any) -> None:
    spec, weights, out = built("contrib", "llama_untied")
    ids, mask = right_padded(PROMPTS)
    got = run(session(out), ids, mask)
    wrong = dataclasses.replace(spec, rope_theta=spec.rope_theta * 50)
    ref, _ = nl.forward(wrong, weights, ids, mask, nl.positions_from_mask(mask, ids.shape[1]))
    assert max_row_error(got.logits, ref, mask) > 100 * TOL


def test_ignoring_padding_is_detected(built: Any) -> None:
    spec, weights, out = built("standard", "llama_untied")
    ids, mask = left_padded(PROMPTS)
    pos = nl.positions_from_mask(mask, ids.shape[1])
    got = run(session(out), ids, mask, position_ids=pos)
    ref, _ = nl.forward(spec, weights, ids, np.ones_like(mask), pos)
    assert max_row_error(got.logits, ref, mask) > 100 * TOL


def test_wrong_kv_head_grouping_is_detected(built: Any) -> None:
    """Query head h must use KV head h // group; swapping the KV heads breaks the match."""
    spec, weights, out = built("standard", "llama_untied")
    ids, mask = left_padded(PROMPTS)
    pos = nl.positions_from_mask(mask, ids.shape[1])
    got = run(session(out), ids, mask, position_ids=pos)
    swapped = dict(weights)
    d = spec.head_dim
    for layer in range(spec.num_layers):
        for kind in ("k_proj", "v_proj"):
            name = f"model.layers.{layer}.self_attn.{kind}.weight"
            swapped[name] = np.concatenate([weights[name][d:], weights[name][:d]])
    ref, _ = nl.forward(spec, swapped, ids, mask, pos)
    assert max_row_error(got.logits, ref, mask) > 100 * TOL


def test_contrib_left_padding_is_not_supported(built: Any) -> None:
    """Documents the format's limit: GroupQueryAttention reads the mask as a count of real tokens
    at the front of each row, so a left-padded short row comes out wrong (the full row is fine)."""
    spec, weights, out = built("contrib", "llama_untied")
    ids, mask = left_padded(PROMPTS)
    got = run(session(out), ids, mask)
    ref, _ = nl.forward(spec, weights, ids, mask, nl.positions_from_mask(mask, ids.shape[1]))
    assert nl.relative_error(got.logits[0], ref[0]) < TOL  # the longest row has no padding
    short = mask[1] == 1
    assert nl.relative_error(got.logits[1, short], ref[1, short]) > 100 * TOL
