"""What ONNX Runtime's GroupQueryAttention does with a shared, fixed-capacity KV buffer.

These pin the measured behaviour the ort backend is built on (onnxruntime 1.32, CPU EP), with the
raw ONNX Runtime API and no project code, so a version that changes it fails here first:

1. past and present bound to one [B, Hkv, C, D] buffer: present comes back with the capacity as
   its sequence dim, at the same address, and the op writes only the positions it computes;
2. ``total_sequence_length`` (the mask width) may be anything up to the capacity ("static
   cache"); beyond it the op refuses;
3. per-row lengths come from the mask *sum* (seqlens_k), so a right-padded batch reproduces each
   row's solo logits exactly, while a left-padded batch does not (rows are misread).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

DATA = Path(__file__).parents[1] / "data" / "genai-llama-tiny"
EXPECTED = json.loads((DATA / "expected_tokens.json").read_text())
LAYERS, HEADS, DIM, EOS = 2, 2, 32, 2


@pytest.fixture(scope="module")
def session() -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.log_severity_level = 4
    return ort.InferenceSession(
        str(DATA / "genai-fp32" / "model.onnx"), options, providers=["CPUExecutionProvider"]
    )


def _run_shared(
    sess: ort.InferenceSession,
    prompts: list[list[int]],
    steps: int,
    *,
    capacity: int = 64,
    pad: str = "right",
    mask_width: int | None = None,
) -> tuple[list[list[int]], list[list[np.ndarray]], dict[str, np.ndarray]]:
    """Greedy decode with one shared KV buffer per tensor; returns tokens, logits, buffers."""
    batch, lens = len(prompts), [len(p) for p in prompts]
    width = max(lens)
    kv = {
        f"{i}.{k}": np.full((batch, HEADS, capacity, DIM), np.nan, np.float32)
        for i in range(LAYERS)
        for k in ("key", "value")
    }
    ids = np.zeros((batch, width), np.int64)
    mask = np.zeros((batch, width), np.int64)
    for b, p in enumerate(prompts):
        lo = 0 if pad == "right" else width - len(p)
        ids[b, lo : lo + len(p)] = p
        mask[b, lo : lo + len(p)] = 1
    io = sess.io_binding()
    io.bind_output("logits", "cpu")  # bound first so it is outputs[0]
    for name, buf in kv.items():
        shape = list(buf.shape)
        io.bind_input(f"past_key_values.{name}", "cpu", 0, np.float32, shape, buf.ctypes.data)
        io.bind_output(f"present.{name}", "cpu", 0, np.float32, shape, buf.ctypes.data)
    tokens: list[list[int]] = [[] for _ in prompts]
    logits_seen: list[list[np.ndarray]] = [[] for _ in prompts]
    cur = list(lens)
    for step in range(steps):
        io.bind_cpu_input("input_ids", ids)
        io.bind_cpu_input("attention_mask", mask)
        io.bind_output("logits", "cpu")  # ORT keeps a bound output's shape: rebind to reshape
        sess.run_with_iobinding(io)
        outs = io.get_outputs()
        if step == 0:
            assert outs[1].shape() == [batch, HEADS, capacity, DIM]
            assert outs[1].data_ptr() == kv["0.key"].ctypes.data
        logits = outs[0].numpy()
        new = []
        for b in range(batch):
            pos = (lens[b] - 1 if pad == "right" else width - 1) if step == 0 else 0
            row = logits[b, pos].copy()
            logits_seen[b].append(row.copy())
            row[EOS] = -np.inf
            new.append(int(row.argmax()))
            tokens[b].append(new[-1])
        ids = np.array(new, np.int64)[:, None]
        if pad == "right":
            cur = [c + 1 for c in cur]
            w = mask_width or max(cur)
            mask = (np.arange(w)[None, :] < np.array(cur)[:, None]).astype(np.int64)
        else:
            mask = np.concatenate([mask, np.ones((batch, 1), np.int64)], axis=1)
    return tokens, logits_seen, kv


def test_shared_buffer_reproduces_onnxruntime_genai(session: ort.InferenceSession) -> None:
    prompt = EXPECTED["prompts"][0]
    tokens, _, kv = _run_shared(session, [prompt], 20)
    assert tokens[0] == EXPECTED["genai-fp32"][0][:20]
    # Written in place: the positions that were fed hold K; the rest keep the NaN poison, and
    # NaN beyond the live length never reached the logits.
    filled = len(prompt) + 19
    assert np.isfinite(kv["0.key"][:, :, :filled]).all()
    assert np.isnan(kv["0.key"][:, :, filled:]).all()


def test_mask_width_may_be_the_capacity(session: ort.InferenceSession) -> None:
    prompts = EXPECTED["prompts"]
    tokens, _, _ = _run_shared(session, prompts, 12, mask_width=64)
    assert tokens == [t[:12] for t in EXPECTED["genai-fp32"]]


def test_mask_wider_than_the_capacity_is_refused(session: ort.InferenceSession) -> None:
    # onnxruntime 1.32 names total_sequence_length; 1.30 refuses the present it would grow.
    with pytest.raises(Exception, match=r"total_sequence_length|computed output shape"):
        _run_shared(session, [EXPECTED["prompts"][0]], 3, mask_width=70)


def test_right_padding_keeps_rows_identical_left_padding_does_not(
    session: ort.InferenceSession,
) -> None:
    prompts = EXPECTED["prompts"]
    solo = [_run_shared(session, [p], 8)[1][0] for p in prompts]
    _, right, _ = _run_shared(session, prompts, 8, pad="right")
    _, left, _ = _run_shared(session, prompts, 8, pad="left")
    for b in range(len(prompts)):
        assert all(np.array_equal(x, y) for x, y in zip(right[b], solo[b], strict=True))
    # Row 0 is the longest (no padding) and is unaffected; padded rows are misread on the left.
    assert all(np.array_equal(x, y) for x, y in zip(left[0], solo[0], strict=True))
    for b in (1, 2, 3):
        assert max(np.abs(x - y).max() for x, y in zip(left[b], solo[b], strict=True)) > 0.1
