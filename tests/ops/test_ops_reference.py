"""Ops without an ONNX Runtime counterpart, against independent NumPy and known encodings; and the
KV ops across layouts. Each op also runs once inside a real session."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest
from opsutil import rel_err, run_nodes

import ep.ops as eo
from ep.errors import OpError
from ep.ops.runtime import KV_CACHES
from ep.sampling import SamplingParams, make_rngs
from ep.sampling import sample as loop_sample
from ep.seams import KVStrides

RNG = np.random.default_rng(4242)


# --- MXFP4 -----------------------------------------------------------------------------------


def test_e2m1_codes_decode_to_the_ocp_values() -> None:
    assert eo.decode_e2m1(np.arange(8)).tolist() == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    negatives = eo.decode_e2m1(np.arange(8, 16))
    assert negatives.tolist() == [-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
    assert np.signbit(negatives[0])
    # Independent oracle: ml_dtypes' float4_e2m1fn reads the same 16 bit patterns.
    ml = np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(eo.decode_e2m1(np.arange(16)), ml)


def test_e8m0_scales_decode_to_powers_of_two() -> None:
    assert eo.decode_e8m0(np.array([127, 128, 126, 0, 254])).tolist() == [
        1.0,
        2.0,
        0.5,
        2.0**-127,
        2.0**127,
    ]
    assert np.isnan(eo.decode_e8m0(np.array([255]))[0])
    every = np.arange(256, dtype=np.uint8)
    ml = every.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    np.testing.assert_array_equal(eo.decode_e8m0(every), ml)


def test_mxfp4_bytes_hold_two_values_low_nibble_first() -> None:
    b = np.zeros((1, 1, 16), np.uint8)
    b[0, 0, 0] = 0x21  # element 0 = code 1 (0.5), element 1 = code 2 (1.0)
    b[0, 0, 1] = 0xF7  # element 2 = code 7 (6.0), element 3 = code 15 (-6.0)
    b[0, 0, 2] = 0x9B  # element 4 = code 11 (-1.5), element 5 = code 9 (-0.5)
    w = eo.dequantize_mxfp4(b, np.array([[128]], np.uint8))  # scale 2
    assert w.shape == (1, 32)
    assert w[0, :6].tolist() == [1.0, 2.0, 12.0, -12.0, -3.0, -1.0]
    assert not w[0, 6:].any()


def test_mxfp4_rounding_matches_a_round_to_nearest_even_cast() -> None:
    x = RNG.uniform(-7, 7, size=4096).astype(np.float32)
    x[:8] = [2.5, 5.0, 0.25, 0.75, 1.25, 1.75, -0.25, 3.5]  # ties
    from ep.ops.matmul import _nearest_e2m1

    ours = eo.decode_e2m1(_nearest_e2m1(x))
    cast = x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(ours, cast)


def test_quantize_mxfp4_keeps_representable_weights_exactly() -> None:
    b = RNG.integers(0, 256, size=(6, 4, 16), dtype=np.uint8)
    s = RNG.integers(100, 140, size=(6, 4), dtype=np.uint8)
    w = eo.dequantize_mxfp4(b, s)
    b2, s2 = eo.quantize_mxfp4(w)
    np.testing.assert_array_equal(eo.dequantize_mxfp4(b2, s2), w)
    smooth = RNG.standard_normal((4, 64)).astype(np.float32)
    assert rel_err(eo.dequantize_mxfp4(*eo.quantize_mxfp4(smooth)), smooth) < 0.25


def test_mxfp4_matmul_in_a_session_equals_dequantize_then_matmul() -> None:
    n, k = 10, 96
    b = RNG.integers(0, 256, size=(n, k // 32, 16), dtype=np.uint8)
    s = RNG.integers(118, 132, size=(n, k // 32), dtype=np.uint8)
    a = RNG.standard_normal((2, 3, k)).astype(np.float32)
    nodes = eo.make_nodes("MatMulMXFP4", ["a", "b", "s"], ["y"], name="mx", K=k, N=n)
    (y,) = run_nodes(nodes, {"a": a, "b": b, "s": s}, ["y"])
    want = a.astype(np.float64) @ eo.dequantize_mxfp4(b, s).astype(np.float64).T
    assert y.shape == (2, 3, n) and rel_err(y, want) < 1e-6
    wrong = a.astype(np.float64) @ eo.dequantize_mxfp4(b, s + 1).astype(np.float64).T
    assert rel_err(y, wrong) > 0.1  # negative oracle: an off-by-one exponent bias is caught


# --- SwiGLU ----------------------------------------------------------------------------------


def test_swiglu_forms_agree_with_the_formula() -> None:
    gate = RNG.standard_normal((2, 3, 8)).astype(np.float32)
    up = RNG.standard_normal((2, 3, 8)).astype(np.float32)
    g64 = gate.astype(np.float64)
    want = g64 / (1 + np.exp(-g64)) * up
    halves = np.concatenate([gate, up], axis=-1)
    interleaved = np.stack([gate, up], axis=-1).reshape(2, 3, 16)
    nodes = [
        *eo.make_nodes("SwiGLU", ["g", "u"], ["y1"], name="two"),
        *eo.make_nodes("SwiGLUPacked", ["h"], ["y2"], name="halves", interleaved=0),
        *eo.make_nodes("SwiGLUPacked", ["i"], ["y3"], name="pairs", interleaved=1),
    ]
    feeds = {"g": gate, "u": up, "h": halves, "i": interleaved}
    y1, y2, y3 = run_nodes(nodes, feeds, ["y1", "y2", "y3"])
    assert rel_err(y1, want) < 1e-6
    np.testing.assert_array_equal(y1, y2)
    np.testing.assert_array_equal(y1, y3)


# --- Sample ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=1.0, top_k=5, seed=11),
        SamplingParams(temperature=0.9, top_p=0.8, seed=5),
        SamplingParams(temperature=1.3, min_p=0.05, top_k=40, seed=9),
    ],
)
def test_sample_op_picks_what_the_decode_loop_picks(params: SamplingParams) -> None:
    batch, vocab, steps = 3, 50, 6
    seed = params.seed or 0
    rngs = make_rngs(seed, batch)
    keys = np.array([[seed, row] for row in range(batch)], np.int64)
    op = eo.core_op("Sample")
    attrs: dict[str, Any] = {
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
    }
    draws = 0
    for _ in range(steps):
        logits = RNG.standard_normal((batch, vocab)).astype(np.float32) * 2
        want = loop_sample(logits, params, rngs)
        got = op(logits, keys, np.full(batch, draws, np.int64), **attrs)
        np.testing.assert_array_equal(got, want)
        draws += 0 if params.greedy else 1


def test_sample_without_step_counts_diverges_from_the_loop() -> None:
    """Negative oracle: a generator that is not advanced repeats its first draw."""
    params = SamplingParams(temperature=1.0, seed=1)
    rngs = make_rngs(1, 1)
    keys = np.array([[1, 0]], np.int64)
    logits = np.zeros((1, 1000), np.float32)
    loop = [int(loop_sample(logits, params, rngs)[0]) for _ in range(4)]
    stuck = [
        int(eo.core_op("Sample")(logits, keys, np.zeros(1, np.int64), temperature=1.0)[0])
        for _ in range(4)
    ]
    assert stuck[0] == loop[0] and len(set(stuck)) == 1 and len(set(loop)) > 1


def test_sample_runs_in_a_session() -> None:
    logits = RNG.standard_normal((2, 30)).astype(np.float32)
    keys = np.array([[5, 0], [5, 1]], np.int64)
    steps = np.array([2, 0], np.int64)
    nodes = eo.make_nodes(
        "Sample", ["logits", "keys", "steps"], ["ids"], name="pick", temperature=0.8, top_k=10
    )
    (ids,) = run_nodes(nodes, {"logits": logits, "keys": keys, "steps": steps}, ["ids"])
    want = eo.core_op("Sample")(logits, keys, steps, temperature=0.8, top_k=10)
    assert ids.dtype == np.int64 and ids.tolist() == want.tolist()
    with pytest.raises(OpError, match="temperature"):
        eo.core_op("Sample")(logits, keys, steps, temperature=-1.0)


# --- Rotary ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_theta_equals_rotary_with_the_cache(dtype: Any, interleaved: int) -> None:
    x = RNG.standard_normal((2, 5, 3, 32)).astype(dtype)
    pos = RNG.integers(0, 100, size=(2, 5)).astype(np.int64)
    cos, sin = eo.rope_cache(500000.0, 32, 128, dtype)
    name = "float32" if dtype is np.float32 else "float16"
    nodes = [
        *eo.make_nodes(
            "RotaryTheta",
            ["x", "pos"],
            ["a"],
            name="t",
            dtype=name,
            theta=500000.0,
            interleaved=interleaved,
        ),
        *eo.make_nodes(
            "Rotary",
            ["x", "pos", "cos", "sin"],
            ["b"],
            name="c",
            dtype=name,
            interleaved=interleaved,
        ),
    ]
    a, b = run_nodes(nodes, {"x": x, "pos": pos, "cos": cos, "sin": sin}, ["a", "b"])
    np.testing.assert_array_equal(a, b)


def test_rotary_matches_the_hugging_face_formula_and_skips_padding() -> None:
    d = 16
    x = RNG.standard_normal((1, 4, 2, d)).astype(np.float32)
    pos = np.array([[-1, 0, 1, 7]], np.int64)
    y = eo.core_op("RotaryTheta")(x, pos, theta=10000.0, rotary_dim=0, interleaved=0)
    np.testing.assert_array_equal(y[0, 0], x[0, 0])  # padding passes through
    inv = 1.0 / 10000.0 ** (np.arange(0, d, 2) / d)
    ang = np.concatenate([pos[0, 1:, None] * inv] * 2, axis=-1)[:, None, :]
    xh = x[0, 1:].astype(np.float64)
    rotated = np.concatenate([-xh[..., d // 2 :], xh[..., : d // 2]], axis=-1)
    want = xh * np.cos(ang) + rotated * np.sin(ang)
    assert rel_err(y[0, 1:], want) < 1e-5
    with pytest.raises(OpError, match="outside the cos/sin cache"):
        cos, sin = eo.rope_cache(10000.0, d, 4)
        eo.core_op("Rotary")(x, pos, cos, sin, interleaved=0)


# --- KV ops across layouts -------------------------------------------------------------------


def _layouts(batch: int, hkv: int, cap: int, d: int, page: int) -> dict[str, tuple]:
    """(key buffer, value buffer, geometry, block table or None) per layout."""
    head_major = KVStrides(hkv * cap * d, d, cap * d, 1)
    seq_major = KVStrides(cap * hkv * d, hkv * d, d, 1)
    pages_per_row = cap // page
    n_pages = batch * pages_per_row + 3  # spare pages, so the table is not the identity
    paged = KVStrides(0, hkv * d, d, 1, page=page * hkv * d, page_size=page)
    table = RNG.permutation(n_pages)[: batch * pages_per_row].reshape(batch, pages_per_row)
    out = {}
    for name, strides, size, tab in [
        ("head_major", head_major, batch * hkv * cap * d, None),
        ("seq_major", seq_major, batch * cap * hkv * d, None),
        ("paged", paged, n_pages * page * hkv * d, table.astype(np.int32)),
    ]:
        out[name] = (
            np.zeros(size, np.float32),
            np.zeros(size, np.float32),
            eo.kv_geometry(strides, cap),
            tab,
        )
    return out


def test_kv_ops_give_identical_results_in_every_layout() -> None:
    batch, hq, hkv, d, cap, page = 2, 4, 2, 8, 16, 4
    layouts = _layouts(batch, hkv, cap, d, page)
    steps = [(6, [[-1, -1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]), (1, [[4], [6]]), (1, [[5], [7]])]
    results: dict[str, list[np.ndarray]] = {name: [] for name in layouts}
    for s, positions in steps:
        q = RNG.standard_normal((batch, s, hq, d)).astype(np.float32)
        k = RNG.standard_normal((batch, s, hkv, d)).astype(np.float32)
        v = RNG.standard_normal((batch, s, hkv, d)).astype(np.float32)
        pos = np.array(positions, np.int64)
        for name, (kb, vb, geo, table) in layouts.items():
            lengths = eo.kv_commit_into(kb, vb, k, v, pos, geo, table)
            out = eo.kv_attention_from(
                kb, vb, q, pos, lengths, geo, kv_heads=hkv, scale=0.0, block_table=table
            )
            results[name].append(out)
    for name in ("seq_major", "paged"):
        for a, b in zip(results["head_major"], results[name], strict=True):
            np.testing.assert_array_equal(a, b)
    hm = layouts["head_major"][0].reshape(batch, hkv, cap, d)
    sm = layouts["seq_major"][0].reshape(batch, cap, hkv, d)
    np.testing.assert_array_equal(hm, sm.transpose(0, 2, 1, 3))


def test_paged_kv_ops_run_in_a_session() -> None:
    batch, hq, hkv, d, cap, page = 2, 2, 1, 8, 8, 4
    kb, vb, geo, table = _layouts(batch, hkv, cap, d, page)["paged"]
    handle = KV_CACHES.bind([(kb, vb)])
    try:
        q = RNG.standard_normal((batch, 5, hq, d)).astype(np.float32)
        k = RNG.standard_normal((batch, 5, hkv, d)).astype(np.float32)
        v = RNG.standard_normal((batch, 5, hkv, d)).astype(np.float32)
        pos = np.array([[0, 1, 2, 3, 4], [-1, -1, 0, 1, 2]], np.int64)
        feeds = {
            "q": q,
            "k": k,
            "v": v,
            "pos": pos,
            "geo": geo,
            "table": table,
            "cache": np.array([handle], np.int64),
        }
        nodes = [
            *eo.make_nodes(
                "KVCommitPaged",
                ["k", "v", "pos", "geo", "table", "cache"],
                ["lengths"],
                name="commit",
                layer=0,
            ),
            *eo.make_nodes(
                "KVAttentionPaged",
                ["q", "pos", "lengths", "geo", "table", "cache"],
                ["out"],
                name="attend",
                layer=0,
                kv_heads=hkv,
            ),
        ]
        out, lengths = run_nodes(nodes, feeds, ["out", "lengths"])
        assert lengths.tolist() == [5, 3]
        kb2, vb2 = np.zeros_like(kb), np.zeros_like(vb)
        lengths2 = eo.kv_commit_into(kb2, vb2, k, v, pos, geo, table)
        want = eo.kv_attention_from(
            kb2, vb2, q, pos, lengths2, geo, kv_heads=hkv, scale=0.0, block_table=table
        )
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(kb, kb2)
    finally:
        KV_CACHES.release(handle)


def _head_major(batch=1, hkv=1, cap=4, d=2):
    kb = np.zeros(batch * hkv * cap * d, np.float32)
    return kb, kb.copy(), eo.kv_geometry(KVStrides(hkv * cap * d, d, cap * d, 1), cap)


@pytest.mark.parametrize(
    ("positions", "message"),
    [
        ([[3, 4]], "does not fit the cache capacity 4"),
        ([[1, 1]], "must increase along each row"),
        ([[2, 0]], "must increase along each row"),
    ],
)
def test_kv_commit_refuses_bad_positions(positions, message) -> None:
    kb, vb, geo = _head_major()
    new = np.ones((1, 2, 1, 2), np.float32)
    with pytest.raises(OpError, match=message):
        eo.kv_commit_into(kb, vb, new, new, np.array(positions, np.int64), geo)
    assert not kb.any(), "a refused commit writes nothing"


def test_kv_ops_refuse_mismatched_buffers_and_geometry() -> None:
    kb, vb, geo = _head_major()
    new = np.ones((2, 1, 1, 2), np.float32)  # batch 2 against a batch-1 buffer
    with pytest.raises(OpError, match="addresses element"):
        eo.kv_commit_into(kb, vb, new, new, np.zeros((2, 1), np.int64), geo)
    with pytest.raises(OpError, match="float16"):
        eo.kv_commit_into(
            kb,
            vb,
            new[:1].astype(np.float16),
            new[:1].astype(np.float16),
            np.zeros((1, 1), np.int64),
            geo,
        )
    with pytest.raises(OpError, match="int64\\[7\\]"):
        eo.kv_commit_into(kb, vb, new[:1], new[:1], np.zeros((1, 1), np.int64), geo[:6])
    with pytest.raises(OpError, match="paged"):
        paged = eo.kv_geometry(KVStrides(0, 2, 2, 1, page=8, page_size=4), 4)
        eo.kv_commit_into(kb, vb, new[:1], new[:1], np.zeros((1, 1), np.int64), paged)
    lengths = eo.kv_commit_into(kb, vb, new[:1], new[:1], np.array([[0]], np.int64), geo)
    with pytest.raises(OpError, match="reported only 1 tokens"):
        eo.kv_attention_from(
            kb,
            vb,
            np.ones((1, 1, 1, 2), np.float32),
            np.array([[2]]),
            lengths,
            geo,
            kv_heads=1,
            scale=0.0,
        )


def test_kv_cache_handles_are_checked() -> None:
    kb, vb, geo = _head_major()
    handle = KV_CACHES.bind([(kb.reshape(1, 1, 4, 2), vb.reshape(1, 1, 4, 2))])
    op = eo.core_op("KVCommit")
    new = np.ones((1, 1, 1, 2), np.float32)
    try:
        lengths = op(new, new, np.array([[2]], np.int64), geo, np.array(handle), layer=0)
        assert lengths.tolist() == [3] and kb.reshape(4, 2)[2].tolist() == [1.0, 1.0]
        with pytest.raises(OpError, match="holds 1 layer"):
            op(new, new, np.array([[2]], np.int64), geo, np.array(handle), layer=3)
    finally:
        KV_CACHES.release(handle)
    with pytest.raises(OpError, match="not bound"):
        op(new, new, np.array([[2]], np.int64), geo, np.array(handle), layer=0)
    with pytest.raises(OpError, match="C-contiguous"):
        KV_CACHES.bind([(np.zeros((4, 4), np.float32)[:, ::2], np.zeros((4, 2), np.float32))])


# --- named weights ---------------------------------------------------------------------------


def test_named_weight_resolution_errors_say_how_to_fix() -> None:
    op = eo.core_op("MatMul")
    a = np.ones((2, 4), np.float32)
    previous = eo.set_weight_resolver(None)
    try:
        with pytest.raises(OpError, match="no weight resolver is set"):
            op(a, weight="w", N=3, transpose_b=0)
        with (
            eo.use_weights(eo.DictWeights({"w": np.ones((4, 3), np.float64)})),
            pytest.raises(OpError, match="float32\\[4, 3\\]"),
        ):
            op(a, weight="w", N=3, transpose_b=0)
        with eo.use_weights(eo.DictWeights({"w": np.ones((4, 3), np.float32)})):
            np.testing.assert_array_equal(op(a, weight="w", N=3, transpose_b=0), np.full((2, 3), 4))
        with pytest.raises(OpError, match="weight\\(name\\)"):
            eo.set_weight_resolver(object())  # type: ignore[arg-type]
    finally:
        eo.set_weight_resolver(previous)
