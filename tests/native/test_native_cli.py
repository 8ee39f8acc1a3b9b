"""`genai-ep run --backend native` on the onnxruntime-genai model: its tokens, with capture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ep.cli import main

TINY = Path(__file__).parents[1] / "data" / "genai-llama-tiny"
EXPECTED = json.loads((TINY / "expected_tokens.json").read_text())
N = str(EXPECTED["new_tokens"])


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code = main(["run", "--json", "--model", str(TINY / "genai-fp32"), *argv,
                 "--max-new-tokens", N, "--min-new-tokens", N])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GENAI_EP_CACHE", str(tmp_path / "cache"))


@pytest.mark.usefixtures("cache")
def test_seq_major_fixed_stride_keeps_its_graph_and_gives_genai_tokens(capsys) -> None:
    ids = ",".join(map(str, EXPECTED["prompts"][0]))
    out = run_json(capsys, "--backend", "native", "--capture", "warmup", "--kv-layout",
                   "seq_major", "--set", "kv_layout.seq_major.fixed_stride=true",
                   "--prompt-ids", ids)  # fmt: skip
    assert out["tokens"] == [EXPECTED["genai-fp32"][0]]
    capture = out["metrics"]["capture"]
    assert capture["captures"] == 1 and capture["replays"] > 40
    assert capture["growth_keeps"] > 0 and capture["invalidations"] == 0
    assert capture["fallbacks"] == 0


@pytest.mark.usefixtures("cache")
@pytest.mark.parametrize("layout", ["head_major", "seq_major", "paged"])
def test_batch_of_prompts_of_different_lengths_gives_genai_tokens(capsys, layout: str) -> None:
    argv = [a for p in EXPECTED["prompts"] for a in ("--prompt-ids", ",".join(map(str, p)))]
    out = run_json(capsys, "--backend", "native", "--capture", "warmup",
                   "--kv-layout", layout, *argv)  # fmt: skip
    assert out["tokens"] == EXPECTED["genai-fp32"]
    capture = out["metrics"]["capture"]
    assert capture["captures"] > 0 and capture["fallbacks"] == 0
    if layout == "head_major":  # its growth moves the cache: the graph must be recaptured
        assert capture["invalidations"] > 0


@pytest.mark.usefixtures("cache")
def test_never_capture_runs_eagerly_with_the_same_tokens(capsys) -> None:
    ids = ",".join(map(str, EXPECTED["prompts"][3]))
    out = run_json(capsys, "--backend", "native", "--prompt-ids", ids)
    assert out["tokens"] == [EXPECTED["genai-fp32"][3]]
    capture = out["metrics"]["capture"]
    assert capture["policy"] == "never" and capture["enabled"] is False
    assert capture["captures"] == 0 and capture["replays"] == 0
    assert capture["eager_steps"] == int(N) - 1
