"""Eager calls issue again the kernel launches their first run recorded (`GENAI_EP_REPLAY`, on by
default): the logits and tokens of running each op's host work every time, with that host work
(checks, planning, argument conversion) done once per binding."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from _devices import device_or_skip

from ep.errors import ConfigError
from ep.model import load_model
from ep.native import NativeBackend
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_builtin.offload_scan_resistant import ScanResistantPolicy

TINY = Path(__file__).parents[1] / "data" / "genai-llama-tiny"
PROMPTS = json.loads((TINY / "expected_tokens.json").read_text())["prompts"]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENAI_EP_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def model():
    return load_model(TINY / "genai-fp32")


def _decode(model, kind: str, steps: int = 4) -> list[np.ndarray]:
    """The prefill's logits, then each greedy eager step's (capture `never`)."""
    backend = NativeBackend(model, HeadMajorLayout(), device=kind)
    logits = [backend.prefill([np.array(p) for p in PROMPTS])]
    for _ in range(steps):
        logits.append(backend.step(logits[-1].argmax(-1)))
    return logits


@pytest.mark.parametrize("kind", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_replayed_calls_give_the_logits_of_calls_run_in_full(model, kind, monkeypatch) -> None:
    device_or_skip(kind)
    monkeypatch.setenv("GENAI_EP_REPLAY", "0")
    want = _decode(model, kind)
    monkeypatch.setenv("GENAI_EP_REPLAY", "1")
    got = _decode(model, kind)
    for a, b in zip(want, got, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("replay", ["1", "0"])
def test_an_ops_host_work_runs_once_per_binding(model, monkeypatch, replay: str) -> None:
    """The norms' host work runs for the prefill's and the decode step's first runs only; with
    GENAI_EP_REPLAY=0 (the negative oracle) on every step."""
    from ep.kernels import norm

    monkeypatch.setenv("GENAI_EP_REPLAY", replay)
    runs = []
    real = norm._launch
    monkeypatch.setattr(norm, "_launch", lambda *a, **k: (runs.append(1), real(*a, **k))[1])
    counts = []
    backend = NativeBackend(model, HeadMajorLayout())
    for _ in range(2):  # a second prompt of the same shape keeps the prefill's binding
        ids = backend.prefill([np.array(p) for p in PROMPTS]).argmax(-1)
        counts.append(len(runs))
        for _ in range(3):
            ids = backend.step(ids).argmax(-1)
            counts.append(len(runs))
    per_prefill, per_step = counts[0], counts[1] - counts[0]
    assert per_prefill > 0 and per_step > 0
    if replay == "1":
        assert counts == [per_prefill] + [per_prefill + per_step] * 7
    else:
        assert counts[-1] == 2 * per_prefill + 6 * per_step


def test_offloaded_weights_run_their_calls_in_full(model) -> None:
    """Calls that fetch weights the store moves between steps are never replayed."""
    backend = NativeBackend(model, HeadMajorLayout(), offload=ScanResistantPolicy(), budget="50%")
    backend.prefill([np.array(PROMPTS[0])])
    calls = [c for bound in backend._bound.values() for c in bound.calls]
    assert calls and not any(type(c).__name__ == "_Replayed" for c in calls)
    backend.close()


def test_a_bad_replay_switch_is_refused(model, monkeypatch) -> None:
    monkeypatch.setenv("GENAI_EP_REPLAY", "yes")
    with pytest.raises(ConfigError, match=r"GENAI_EP_REPLAY='yes'; expected 0 .* or 1"):
        NativeBackend(model, HeadMajorLayout())
