"""`genai-ep run` and `genai-ep build` end to end, on real models."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ep.cli import main

TINY = Path(__file__).parent / "data" / "genai-llama-tiny"

EXPECTED = json.loads((TINY / "expected_tokens.json").read_text())


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    code = main(["run", "--json", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert len(out.strip().splitlines()) == 1, "--json prints exactly one JSON object"
    return json.loads(out)


@pytest.mark.parametrize("flavour", ["fp32", "int4"])
def test_run_matches_onnxruntime_genai_solo_and_batched(capsys, flavour: str) -> None:
    n = str(EXPECTED["new_tokens"])
    ids = [",".join(map(str, p)) for p in EXPECTED["prompts"]]
    model = str(TINY / f"genai-{flavour}")
    want = EXPECTED[f"genai-{flavour}"]
    for i, prompt in enumerate(ids):
        solo = run_json(capsys, "--model", model, "--prompt-ids", prompt,
                        "--max-new-tokens", n, "--min-new-tokens", n)  # fmt: skip
        assert solo["tokens"] == [want[i]]
    argv = [arg for prompt in ids for arg in ("--prompt-ids", prompt)]
    batch = run_json(capsys, "--model", model, *argv, "--max-new-tokens", n, "--min-new-tokens", n)
    assert batch["tokens"] == want
    metrics = batch["metrics"]
    assert metrics["batch"] == 4 and metrics["new_tokens"] == 4 * int(n)
    assert metrics["prefill_ms"] > 0 and metrics["decode_ms_per_step_median"] > 0
    assert metrics["tokens_per_s"] > 0 and metrics["kv_bytes"] > 0


def test_run_json_has_text_when_the_model_has_a_tokenizer(capsys) -> None:
    out = run_json(capsys, "--model", str(TINY / "genai-fp32"), "--prompt", "w5 w6 w7",
                   "--max-new-tokens", "4", "--min-new-tokens", "4")  # fmt: skip
    assert len(out["tokens"][0]) == 4
    assert out["text"][0] == " ".join(f"w{t}" for t in out["tokens"][0])


def test_run_seeded_sampling_is_reproducible(capsys) -> None:
    args = ["--model", str(TINY / "genai-fp32"), "--prompt-ids", "5,6,7", "--max-new-tokens",
            "12", "--min-new-tokens", "12", "--temperature", "1.5", "--top-k", "50"]  # fmt: skip
    a = run_json(capsys, *args, "--seed", "1")["tokens"]
    b = run_json(capsys, *args, "--seed", "1")["tokens"]
    c = run_json(capsys, *args, "--seed", "2")["tokens"]
    assert a == b and a != c


def test_run_streams_text_and_prints_metrics(capsys) -> None:
    code = main(["run", "--model", str(TINY / "genai-fp32"), "--prompt", "w5 w6",
                 "--max-new-tokens", "3", "--min-new-tokens", "3"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    first = out.splitlines()[0]
    assert first.startswith("w5 w6") and len(first.split()) == 5
    assert "prefill_ms" in out and "decode_ms_per_step_median" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "/no/such/model"], "does not exist"),
        (["--prompt-ids", "1,x,3"], "not a comma-separated list"),
        (["--prompt-ids", "1,2", "--temperature", "-1"], "temperature"),
        (["--prompt-ids", "1,2", "--top-p", "1.5"], "top_p"),
        (["--prompt-ids", "1,999999"], "999999"),
        (["--prompt-ids", ",".join(["5"] * 300)], "context"),
        ([], "give a prompt"),
        (["--backend", "native", "--capture", "warmpu", "--prompt-ids", "1"], "did you mean"),
    ],
)
def test_run_bad_input_is_one_clear_error(capsys, argv: list[str], message: str) -> None:
    if "--model" not in argv:
        argv = ["--model", str(TINY / "genai-fp32"), *argv]
    code = main(["run", *argv])
    _, err = capsys.readouterr()
    assert code == 2, err
    assert err.startswith("genai-ep: error: ") and message in err
    assert "Traceback" not in err


def test_build_then_run(tmp_path: Path, capsys) -> None:
    out = tmp_path / "model"
    assert main(["build", "--spec", "hidden=64,layers=2,heads=4,kv_heads=2,vocab=96",
                 "--flavour", "standard", "-o", str(out)]) == 0  # fmt: skip
    capsys.readouterr()
    result = run_json(capsys, "--model", str(out), "--prompt-ids", "3,4,5", "--prompt-ids", "7",
                      "--max-new-tokens", "5", "--min-new-tokens", "5")  # fmt: skip
    assert [len(t) for t in result["tokens"]] == [5, 5]


def test_run_without_arguments_writes_python_with_the_bundled_model(
    capsys, tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setenv("GENAI_EP_CACHE", str(tmp_path / "cache"))
    code = main(["run", "--max-new-tokens", "40", "--seed", "0"])
    out, err = capsys.readouterr()
    assert code == 0, err
    text = out.split("metrics")[0]
    assert text.startswith("def ")
    # Python-looking: indentation, and some of its punctuation.
    assert "\n    " in text or "(" in text or ":" in text
    assert "tokens_per_s" in out


def test_sampling_defaults_come_from_the_models_search_section(capsys, tmp_path: Path) -> None:
    import shutil

    model = tmp_path / "sampled"
    shutil.copytree(TINY / "genai-fp32", model)
    config = json.loads((model / "genai_config.json").read_text())
    config["search"].update(do_sample=True, temperature=1.5, top_k=0)
    (model / "genai_config.json").write_text(json.dumps(config))
    base = ["--model", str(model), "--prompt-ids", "5,6,7",
            "--max-new-tokens", "16", "--min-new-tokens", "16"]  # fmt: skip
    greedy_original = run_json(capsys, *base[:1], str(TINY / "genai-fp32"), *base[2:])["tokens"]
    assert run_json(capsys, *base, "--greedy")["tokens"] == greedy_original
    assert run_json(capsys, *base, "--temperature", "0")["tokens"] == greedy_original
    a = run_json(capsys, *base, "--seed", "1")["tokens"]
    assert a == run_json(capsys, *base, "--seed", "1")["tokens"]
    assert a != greedy_original  # sampled at temperature 1.5 by the model's own default
