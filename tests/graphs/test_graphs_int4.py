"""int4 (com.microsoft MatMulNBits) in the contrib flavour.

The NumPy reference runs on weights dequantized from the model file by an independent decoder
(`numpy_llama.dequantize_matmul_nbits`), so a packing, scale or zero-point mistake shows up as a
logits mismatch. With accuracy_level 0 ONNX Runtime computes in float32 and the match is tight;
the genai default (4: int8 activations) is close but not tight.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import numpy_llama as nl
import onnx
import pytest
from graphs_testlib import PROMPTS, dequantized_weights, max_row_error, right_padded, run, session

from ep.errors import ConfigError
from ep_graphs import Int4Options, ModelSpec, build_model, quantize_int4, random_weights

SPEC = ModelSpec.parse(
    "hidden=64,layers=2,heads=4,kv_heads=2,vocab=128,intermediate=96,theta=10000,eps=1e-5,"
    "context=64"
)


def _check(tmp_path: Path, spec: ModelSpec, options: Int4Options, tol: float) -> float:
    weights = random_weights(spec, seed=5)
    out = build_model(spec, weights, flavour="contrib", out_dir=tmp_path / "m", quant=options)
    model = session(out)
    ids, mask = right_padded(PROMPTS)
    got = run(model, ids, mask)
    deq = dequantized_weights(out, spec, weights)
    pos = nl.positions_from_mask(mask, ids.shape[1])
    ref, ref_present = nl.forward(spec, deq, ids, mask, pos)
    err = max_row_error(got.logits, ref, mask)
    assert err < tol
    step_ids = np.array([[3], [4], [5]])
    step_mask = np.concatenate([mask, np.ones((3, 1), np.int64)], axis=1)
    step = run(model, step_ids, step_mask, past=got.present)
    ref_step, _ = nl.forward(
        spec, deq, step_ids, step_mask, nl.positions_from_mask(step_mask, 1), ref_present
    )
    assert nl.relative_error(step.logits, ref_step) < tol
    return err


@pytest.mark.parametrize(
    ("label", "spec", "options"),
    [
        ("untied", SPEC, Int4Options(accuracy_level=0)),
        ("tied", dataclasses.replace(SPEC, tie_embeddings=True), Int4Options(accuracy_level=0)),
        ("asymmetric", SPEC, Int4Options(symmetric=False, accuracy_level=0)),
        (
            "tied_asymmetric_block16",
            dataclasses.replace(SPEC, tie_embeddings=True),
            Int4Options(block_size=16, symmetric=False, accuracy_level=0),
        ),
        ("qwen2_bias_block64", dataclasses.replace(SPEC, qkv_bias=True), Int4Options(64, True, 0)),
        # K = 80 for down_proj: a partial last block
        (
            "partial_block",
            dataclasses.replace(SPEC, intermediate_size=80),
            Int4Options(32, True, 0),
        ),
    ],
)
def test_int4_matches_reference_on_dequantized_weights(
    tmp_path: Path, label: str, spec: ModelSpec, options: Int4Options
) -> None:
    _check(tmp_path, spec, options, 1e-5)


def test_int4_default_accuracy_level_is_close(tmp_path: Path) -> None:
    """accuracy_level 4 (as genai writes it) quantizes activations to int8: close, not exact."""
    err = _check(tmp_path, SPEC, Int4Options(), 5e-2)
    assert err > 1e-6  # it really is the int8 path, not float


def test_int4_nodes(tmp_path: Path) -> None:
    spec = dataclasses.replace(SPEC, tie_embeddings=True)
    out = build_model(spec, random_weights(spec), flavour="contrib", out_dir=tmp_path, quant="int4")
    graph = onnx.load(out / "model.onnx", load_external_data=False).graph
    ops = [n.op_type for n in graph.node]
    assert ops.count("MatMulNBits") == 5 * spec.num_layers + 1
    assert "MatMul" not in ops and ops.count("GatherBlockQuantized") == 1
    node = next(n for n in graph.node if n.op_type == "MatMulNBits")
    attrs = {a.name: a.i for a in node.attribute}
    assert attrs == {"K": 64, "N": 128, "accuracy_level": 4, "bits": 4, "block_size": 32}


def test_quantizer_round_trip_and_error_bound() -> None:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 96)).astype(np.float32)
    for symmetric in (True, False):
        q = quantize_int4(w, Int4Options(symmetric=symmetric), np.float32)
        ours = q.dequantize()
        independent = nl.dequantize_matmul_nbits(q.packed, q.scales, 96, zero_points=q.zero_points)
        np.testing.assert_array_equal(ours, independent.astype(np.float32))
        step = np.repeat(np.abs(q.scales), 32, axis=1)
        assert np.all(np.abs(ours - w) <= step * (1.0 + 1e-6))
        assert np.abs(ours - w).mean() < 0.1 * np.abs(w).mean() * 3


def test_quantizer_rounds_half_away_from_zero() -> None:
    """ONNX Runtime rounds codes with roundf (ties away from zero), not NumPy's ties-to-even."""
    # block extreme 8 → scale 8 / -8 = -1; value 1.5 → 1.5 / -1 + 8 = 6.5 → 7 (ties-to-even: 6)
    w = np.zeros((1, 32), np.float32)
    w[0, 0], w[0, 1] = 8.0, 1.5
    q = quantize_int4(w, Int4Options(), np.float32)
    assert q.packed[0, 0, 0] >> 4 == 7


def test_standard_refuses_int4(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"standard.*int4.*contrib"):
        build_model(SPEC, random_weights(SPEC), flavour="standard", out_dir=tmp_path, quant="int4")
    assert not (tmp_path / "model.onnx").exists()


def test_bad_int4_options() -> None:
    with pytest.raises(ConfigError, match="block_size=48"):
        Int4Options(block_size=48)
    with pytest.raises(ConfigError, match="accuracy_level=7"):
        Int4Options(accuracy_level=7)
    with pytest.raises(ConfigError, match="quant='int8'"):
        build_model(
            SPEC, random_weights(SPEC), flavour="contrib", out_dir="/nonexistent/x", quant="int8"
        )
