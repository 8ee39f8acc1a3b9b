"""fp16 and bf16 graphs on ONNX Runtime's CPU execution provider (onnxruntime 1.32).

Measured: fp16 runs in both flavours (and with int4); bf16 builds but the CPU EP has no bf16
kernels for MatMul, Mul, MatMulNBits, ..., so session creation fails with NOT_IMPLEMENTED. The
bf16 test pins that down so graphs/ep_graphs/README.md gets updated when ONNX Runtime changes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import ml_dtypes
import numpy as np
import numpy_llama as nl
import onnx
import onnxruntime as ort
import pytest
from graphs_testlib import (
    PROMPTS,
    dequantized_weights,
    left_padded,
    max_row_error,
    right_padded,
    run,
    session,
)
from onnx import TensorProto, numpy_helper

from ep_graphs import Int4Options, ModelSpec, build_model, random_weights

FP16 = ModelSpec.parse(
    "hidden=64,layers=2,heads=4,kv_heads=2,vocab=128,intermediate=96,eps=1e-5,context=64,"
    "dtype=fp16,tie=1"
)


@pytest.mark.parametrize(
    ("flavour", "quant"),
    # accuracy_level 0: float compute, so int4 is compared on its dequantized weights alone
    [("standard", None), ("contrib", None), ("contrib", Int4Options(accuracy_level=0))],
)
def test_fp16_runs_on_cpu_with_float32_logits(
    tmp_path: Path, flavour: str, quant: Int4Options | None
) -> None:
    weights = random_weights(FP16, seed=2)
    assert weights["model.norm.weight"].dtype == np.float16
    out = build_model(FP16, weights, flavour=flavour, out_dir=tmp_path, quant=quant)
    model = session(out)
    past_type = model.sess.get_inputs()[model.input_names.index("past_key_values.0.key")].type
    assert past_type == "tensor(float16)"
    ids, mask = (left_padded if flavour == "standard" else right_padded)(PROMPTS)
    pos = nl.positions_from_mask(mask, ids.shape[1])
    got = run(model, ids, mask, position_ids=pos, kv_dtype=np.float16)
    assert got.logits.dtype == np.float32 and got.present[0][0].dtype == np.float16
    reference_weights = dequantized_weights(out, FP16, weights) if quant else weights
    ref, ref_present = nl.forward(FP16, reference_weights, ids, mask, pos)
    # fp16 activations: about 1e-3 relative against the float64 reference
    assert max_row_error(got.logits, ref, mask) < 1e-2
    step_ids = np.array([[3], [4], [5]])
    step_mask = np.concatenate([mask, np.ones((3, 1), np.int64)], axis=1)
    step = run(
        model,
        step_ids,
        step_mask,
        past=got.present,
        position_ids=nl.positions_from_mask(step_mask, 1),
    )
    ref_step, _ = nl.forward(
        FP16,
        reference_weights,
        step_ids,
        step_mask,
        nl.positions_from_mask(step_mask, 1),
        ref_present,
    )
    assert nl.relative_error(step.logits, ref_step) < 1e-2


def test_fp16_error_is_fp16_sized_not_a_bug(tmp_path: Path) -> None:
    """Negative oracle for the loose tolerance: a wrong eps-free norm would exceed it; the real
    fp16 graph sits far below it and far above fp32's 1e-6 (it really computes in fp16)."""
    weights = random_weights(FP16, seed=2)
    out = build_model(FP16, weights, flavour="standard", out_dir=tmp_path)
    ids, mask = left_padded(PROMPTS)
    pos = nl.positions_from_mask(mask, ids.shape[1])
    got = run(session(out), ids, mask, position_ids=pos, kv_dtype=np.float16)
    ref, _ = nl.forward(FP16, weights, ids, mask, pos)
    assert 1e-5 < max_row_error(got.logits, ref, mask) < 5e-3
    wrong, _ = nl.forward(dataclasses.replace(FP16, rope_theta=1e5), weights, ids, mask, pos)
    assert max_row_error(got.logits, wrong, mask) > 1e-2


@pytest.mark.parametrize(
    ("flavour", "quant"), [("standard", None), ("contrib", None), ("contrib", "int4")]
)
def test_bf16_builds_but_cpu_ep_has_no_kernels(
    tmp_path: Path, flavour: str, quant: str | None
) -> None:
    spec = dataclasses.replace(FP16, dtype="bf16")
    weights = random_weights(spec, seed=2)
    out = build_model(spec, weights, flavour=flavour, out_dir=tmp_path, quant=quant)
    model = onnx.load(out / "model.onnx")
    past = next(i for i in model.graph.input if i.name == "past_key_values.0.key")
    assert past.type.tensor_type.elem_type == TensorProto.BFLOAT16
    logits = next(o for o in model.graph.output if o.name == "logits")
    assert logits.type.tensor_type.elem_type == TensorProto.FLOAT
    norm = next(
        t for t in model.graph.initializer if t.name == "model.layers.0.input_layernorm.weight"
    )
    stored = numpy_helper.to_array(norm, str(out))
    assert stored.dtype == np.dtype(ml_dtypes.bfloat16)
    assert np.array_equal(stored, weights["model.layers.0.input_layernorm.weight"])
    with pytest.raises(
        ort.capi.onnxruntime_pybind11_state.NotImplemented,
        match=r"Could not find an implementation",
    ):
        ort.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
