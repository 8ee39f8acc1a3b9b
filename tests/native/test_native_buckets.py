"""``buckets`` capture: a batch that is not a listed size runs padded up to the nearest one."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ep.cli import main
from ep.errors import ContractError, GenerationError
from ep.model import load_model
from ep.native import NativeBackend
from ep_builtin.capture_buckets import BucketsCapture
from ep_builtin.kv_head_major import HeadMajorLayout

TINY = Path(__file__).parents[1] / "data" / "genai-llama-tiny"
EXPECTED = json.loads((TINY / "expected_tokens.json").read_text())
N = str(EXPECTED["new_tokens"])
THREE = [a for p in EXPECTED["prompts"][:3] for a in ("--prompt-ids", ",".join(map(str, p)))]


@pytest.fixture(autouse=True)
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENAI_EP_CACHE", str(tmp_path / "cache"))


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code = main(["run", "--json", "--model", str(TINY / "genai-fp32"), "--backend", "native",
                 *THREE, *argv, "--max-new-tokens", N, "--min-new-tokens", N])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


def test_pad_to_is_the_nearest_listed_size_at_or_above() -> None:
    policy = BucketsCapture((1, 4, 8))
    assert [policy.pad_to(b) for b in (1, 2, 3, 4, 5, 8, 9)] == [1, 4, 4, 4, 8, 8, 9]


@pytest.mark.parametrize("layout", ["head_major", "paged"])
def test_batch_of_three_runs_padded_to_four_with_the_eager_tokens(capsys, layout: str) -> None:
    eager = run_json(capsys, "--kv-layout", layout)
    assert eager["tokens"] == EXPECTED["genai-fp32"][:3]
    padded = run_json(capsys, "--kv-layout", layout, "--capture", "buckets",
                      "--set", "capture.buckets.batches=1,4")  # fmt: skip
    assert padded["tokens"] == eager["tokens"]
    capture = padded["metrics"]["capture"]
    assert capture["captures"] > 0 and capture["fallbacks"] == 0
    assert capture["replays"] > 0


def test_padding_with_the_device_loop(capsys) -> None:
    out = run_json(capsys, "--capture", "buckets", "--set", "capture.buckets.batches=4",
                   "--set", "decode.sync_every=5")  # fmt: skip
    assert out["tokens"] == EXPECTED["genai-fp32"][:3]
    assert out["metrics"]["capture"]["captures"] > 0
    assert out["metrics"]["capture"]["fallbacks"] == 0


def test_batch_above_every_size_runs_eagerly_unpadded(capsys) -> None:
    out = run_json(capsys, "--capture", "buckets", "--set", "capture.buckets.batches=1,2")
    assert out["tokens"] == EXPECTED["genai-fp32"][:3]
    capture = out["metrics"]["capture"]
    assert capture["captures"] == 0 and capture["fallbacks"] > 0
    assert "batch 3 is not a captured bucket" in capture["last_decline"]["reason"]


class _Shrinking(BucketsCapture):
    """A policy breaking the ``pad_to`` contract (a size below the batch)."""

    def pad_to(self, batch: int) -> int:
        return batch - 1


def test_pad_to_below_the_batch_is_refused_before_any_work() -> None:
    model = load_model(TINY / "genai-fp32")
    backend = NativeBackend(model, HeadMajorLayout(), capture=_Shrinking((1,)))
    prompts = [np.array(p) for p in EXPECTED["prompts"][:3]]
    with pytest.raises(ContractError, match=r"pad_to\(3\) returned 2; expected an integer >= 3"):
        backend.prefill(prompts)
    with pytest.raises(GenerationError, match="before prefill"):
        backend.step(np.array([1, 2, 3]))
