"""Weights streamed in pieces (offload.piece): every policy at 100 / 50 / 25 % gives resident's
tokens, solo and batched; the ledger balances; a streamed plan in pieces is still captured.

The tiny model (ep flavour from its Hugging Face checkpoint, tied [512, 128] table read by the
Gather and by the head) has weights of up to 256 KiB: with 16 KiB pieces its big weights are
split, and 25 % (two slots of the whole table are 31 % of it) works.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ep.cli import main
from ep.errors import ConfigError
from ep.model import DecoderModel, load_model
from ep.native import NativeBackend
from ep_builtin.capture_warmup import WarmupCapture
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_builtin.offload_lru import LRUPolicy
from ep_builtin.offload_scan_resistant import ScanResistantPolicy
from ep_builtin.offload_stream import StreamPolicy
from ep_graphs import build_model, load_hf_checkpoint

from ._greedy import greedy_logits

DATA = Path(__file__).parents[1] / "data" / "genai-llama-tiny"
PROMPTS: list[list[int]] = json.loads((DATA / "expected_tokens.json").read_text())["prompts"]
PIECE = 16384  # bytes: 9 of the 17 weights are split, the tied table in 16 pieces of 32 rows
STEPS = 10
POLICIES = {"stream": StreamPolicy, "scan_resistant": ScanResistantPolicy, "lru": LRUPolicy}


@pytest.fixture(scope="module")
def tiny_q4(tmp_path_factory: pytest.TempPathFactory) -> DecoderModel:
    spec, weights = load_hf_checkpoint(DATA / "hf")
    out = tmp_path_factory.mktemp("tiny_q4_pieces")
    build_model(spec, weights, flavour="ep", quant="int4", out_dir=out)
    return load_model(out)


@pytest.fixture(scope="module")
def resident(tiny_ep: DecoderModel) -> Iterator[dict[int, np.ndarray]]:
    """Resident logits (no store): batched, and solo for prompt 1."""

    def run(prompts: list[list[int]]) -> np.ndarray:
        return greedy_logits(NativeBackend(tiny_ep, HeadMajorLayout()), prompts, STEPS)

    yield {4: run(PROMPTS), 1: run(PROMPTS[1:2])}


@pytest.mark.parametrize("budget", ["100%", "50%", "25%"])
@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("batch", [4, 1])
def test_every_policy_in_pieces_gives_resident_tokens(
    tiny_ep: DecoderModel, resident: dict[int, np.ndarray], policy: str, budget: str, batch: int
) -> None:
    backend = NativeBackend(tiny_ep, HeadMajorLayout(), offload=POLICIES[policy](),
                            budget=budget, piece=PIECE)  # fmt: skip
    assert backend.offloaded is not None
    store = backend.offloaded.store
    assert len(store.splits) == 9 and len(store.splits["model.embed_tokens.weight"].pieces) == 16
    assert store.layout.slot_bytes <= PIECE
    got = greedy_logits(backend, PROMPTS if batch == 4 else PROMPTS[1:2], STEPS)
    ref = resident[batch]
    assert np.array_equal(got.argmax(-1), ref.argmax(-1))
    # 32-column pieces: the CPU twins' sums come out bitwise equal here
    assert np.array_equal(got, ref)
    off = backend.offloaded.counters()
    pieces = len(store.layout.placements)  # 93 weights and pieces, each read once per step
    tied = len(store.splits["model.embed_tokens.weight"].pieces)  # read twice: Gather and head
    assert off.hits + off.misses == (pieces + tied) * (STEPS + 1)
    assert off.peak_device_bytes <= off.budget_bytes
    if policy == "stream":  # every piece copied at each read: the whole model (+ the head)
        table = store.splits["model.embed_tokens.weight"]
        per_step = sum(i.nbytes for i in store._infos.values()) + 512 * 128 * 4
        assert len(table.pieces) == tied and off.hits == 0
        assert off.htod_bytes == per_step * (STEPS + 1)
    backend.close()


def _executor_uploads(model: DecoderModel) -> int:
    """Host-to-device bytes of a run that copies no weight (ids, positions, executor tables)."""
    from ep_builtin.offload_resident import ResidentPolicy

    backend = NativeBackend(model, HeadMajorLayout(), offload=ResidentPolicy(),
                            capture=WarmupCapture(steps=1))  # fmt: skip
    before = backend.device.counters().htod_bytes
    greedy_logits(backend, PROMPTS[:2], STEPS)
    assert backend.offloaded is not None and backend.offloaded.counters().htod_bytes == 0
    return backend.device.counters().htod_bytes - before


def test_htod_bytes_equal_the_pieces_copied_and_the_device_count(tiny_ep: DecoderModel) -> None:
    others = _executor_uploads(tiny_ep)
    backend = NativeBackend(tiny_ep, HeadMajorLayout(), offload=ScanResistantPolicy(),
                            budget="25%", piece=PIECE, capture=WarmupCapture(steps=1))  # fmt: skip
    assert backend.offloaded is not None
    store = backend.offloaded.store
    placements = store.layout.placements
    streamed = {n for n, w in placements.items() if w == "stream"}
    assert any(p.name in streamed for s in store.splits.values() for p in s.pieces)
    sizes = {n: store._infos[n].nbytes for n in placements}
    table = {p.name for p in store.splits["model.embed_tokens.weight"].pieces}
    per_step = sum(sizes[n] for n in streamed) + sum(sizes[n] for n in streamed & table)
    before = backend.device.counters().htod_bytes
    tokens = greedy_logits(backend, PROMPTS[:2], STEPS).argmax(-1)
    copied = backend.device.counters().htod_bytes - before
    off = store.counters()
    assert off.htod_bytes == per_step * (STEPS + 1)  # prefill and each step, captured or not
    assert copied == off.htod_bytes + others  # every copied byte is counted, once
    capture = backend.capture_metrics
    assert capture.captures > 0 and capture.replays > 0 and capture.fallbacks == 0
    assert off.peak_device_bytes <= off.budget_bytes
    assert tokens.shape == (STEPS + 1, 2)
    backend.close()


def test_quantized_weights_split_as_one_group_give_resident_tokens(tiny_q4: DecoderModel) -> None:
    ref = greedy_logits(NativeBackend(tiny_q4, HeadMajorLayout()), PROMPTS, 6)
    backend = NativeBackend(tiny_q4, HeadMajorLayout(), offload=StreamPolicy(), budget="25%",
                            piece=4096, capture=WarmupCapture(steps=1))  # fmt: skip
    assert backend.offloaded is not None
    splits = backend.offloaded.store.splits
    groups = [n for n in splits if len(splits[n].pieces) > 1 and splits[n].shape[-1] == 16]
    assert groups  # MatMulNBits b [N, kb, 16] in pieces, its scales beside it
    assert np.array_equal(greedy_logits(backend, PROMPTS, 6), ref)
    assert backend.capture_metrics.captures > 0
    backend.close()


def test_the_cli_streams_in_pieces_at_a_quarter_of_the_weights(
    capsys: pytest.CaptureFixture[str], tiny_ep: DecoderModel, resident: dict[int, np.ndarray]
) -> None:
    ids = ["--prompt-ids", ",".join(map(str, PROMPTS[1]))]
    code = main(["run", "--json", "--backend", "native", "--model", str(tiny_ep.folder), *ids,
                 "--offload", "scan_resistant", "--set", "offload.budget=25%", "--set",
                 "offload.piece=16KiB", "--capture", "warmup", "--max-new-tokens", "6",
                 "--min-new-tokens", "6"])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    assert result["tokens"][0][:6] == resident[1].argmax(-1)[:6, 0].tolist()
    off = result["metrics"]["offload"]
    assert len(off) == 11 and off["htod_bytes"] > 0 and off["peak_device_bytes"] <= off[
        "budget_bytes"]  # fmt: skip
    assert result["metrics"]["capture"]["captures"] > 0


def test_without_pieces_a_quarter_is_refused_with_the_fix(tiny_ep: DecoderModel) -> None:
    """Negative oracle: the default 32 MiB piece leaves the tiny model whole, and 25 % fails."""
    from ep.errors import OffloadBudgetError

    with pytest.raises(OffloadBudgetError, match=r"a smaller offload\.piece shrinks them"):
        NativeBackend(tiny_ep, HeadMajorLayout(), offload=StreamPolicy(), budget="25%")


@pytest.mark.parametrize("bad", [0, 100, "half", "10%"])
def test_a_bad_piece_is_refused(tiny_ep: DecoderModel, bad: object) -> None:
    with pytest.raises(ConfigError, match="piece"):
        NativeBackend(tiny_ep, HeadMajorLayout(), offload=StreamPolicy(), piece=bad)  # type: ignore[arg-type]
