"""Weights split into pieces along their output axis: the pieces, the store, the config key."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import pytest

from ep.config import load_config, parse_piece
from ep.device import Device
from ep.errors import ConfigError, OffloadError
from ep.offload import (
    PIECE_ROWS,
    SplitSpec,
    WeightStore,
    footprint,
    split_weights,
    weight_infos,
)
from ep.plugins import PluginHost
from ep_builtin.offload_scan_resistant import ScanResistantPolicy
from ep_builtin.offload_stream import StreamPolicy

RNG = np.random.default_rng(7)
TABLE = RNG.standard_normal((1000, 24)).astype(np.float32)  # [N, K]: rows (and a Gather table)
KN = RNG.standard_normal((24, 300)).astype(np.float32)  # [K, N]: column blocks
NORM = RNG.standard_normal(24).astype(np.float32)
Q_B = RNG.integers(0, 255, (200, 2, 16), dtype=np.uint8)  # MatMulNBits b [N, kb, bs/2]
Q_S = RNG.standard_normal(400).astype(np.float32)  # scales [N * kb], flat
Q_Z = RNG.integers(0, 255, (200, 1), dtype=np.uint8)  # zero points [N, ceil(kb/2)]
WEIGHTS: dict[str, np.ndarray] = {
    "table": TABLE,
    "kn": KN,
    "norm": NORM,
    "q.b": Q_B,
    "q.s": Q_S,
    "q.z": Q_Z,
}
SPECS = [
    SplitSpec(("table",), (0,), 1000),
    SplitSpec(("kn",), (1,), 300),
    SplitSpec(("q.b", "q.s", "q.z"), (0, 0, 0), 200),
]


def test_pieces_reassemble_each_weight_along_its_output_axis() -> None:
    stored, splits = split_weights(WEIGHTS, SPECS, 8192)
    assert set(splits) == {"table", "kn"}  # the quantized group (6400 bytes at most) fits
    assert "norm" in stored and "table" not in stored  # whole weights stay, split ones go
    table = splits["table"]
    # 8192 bytes hold 85 rows of 96 bytes: rounded down to a multiple of PIECE_ROWS
    assert [p.stop - p.start for p in table.pieces[:-1]] == [PIECE_ROWS] * 15
    assert np.array_equal(np.concatenate([stored[p.name] for p in table.pieces]), TABLE)
    kn = splits["kn"]
    assert all(stored[p.name].flags.c_contiguous for p in kn.pieces)
    assert np.array_equal(np.concatenate([stored[p.name] for p in kn.pieces], axis=1), KN)
    assert all(stored[p.name].nbytes <= 8192 for s in splits.values() for p in s.pieces)


def test_a_quantized_group_shares_its_boundaries() -> None:
    stored, splits = split_weights(WEIGHTS, SPECS, 2048)
    bounds = {n: [(p.start, p.stop) for p in splits[n].pieces] for n in ("q.b", "q.s", "q.z")}
    assert bounds["q.b"] == bounds["q.s"] == bounds["q.z"] and len(bounds["q.b"]) > 1
    b = np.concatenate([stored[p.name] for p in splits["q.b"].pieces])
    s = np.concatenate([stored[p.name] for p in splits["q.s"].pieces])
    z = np.concatenate([stored[p.name] for p in splits["q.z"].pieces])
    assert np.array_equal(b, Q_B) and np.array_equal(s, Q_S) and np.array_equal(z, Q_Z)
    assert stored[splits["q.s"].pieces[0].name].ndim == 1  # a flat layout stays flat


def test_weights_within_the_piece_size_stay_whole() -> None:
    stored, splits = split_weights(WEIGHTS, SPECS, 1 << 20)
    assert splits == {} and stored.keys() == WEIGHTS.keys()


def test_one_row_wider_than_the_piece_is_a_piece_of_its_own() -> None:
    _, splits = split_weights({"table": TABLE}, SPECS[:1], 64)
    assert len(splits["table"].pieces) == 1000  # 96-byte rows: one row per piece at most


@pytest.mark.parametrize("bad", [0, -5, True, "32MiB"])
def test_a_bad_piece_size_is_refused(bad: object) -> None:
    with pytest.raises(OffloadError, match="positive byte count"):
        split_weights(WEIGHTS, SPECS, bad)  # type: ignore[arg-type]


def test_a_spec_that_does_not_fit_its_weight_is_refused() -> None:
    with pytest.raises(OffloadError, match=r"cannot be split into 299 output indices along axis 1"):
        split_weights(WEIGHTS, [SplitSpec(("kn",), (1,), 299)], 1024)


def _store(cpu: Device, weights: Mapping[str, np.ndarray], piece: int, policy: object,
           budget: int | str) -> WeightStore:  # fmt: skip
    stored, splits = split_weights(weights, SPECS, piece)
    from ep.config import parse_budget

    b = parse_budget(budget) if isinstance(budget, str) else budget
    return WeightStore(cpu, stored, weight_infos(stored, list(stored)), policy, b,  # type: ignore[arg-type]
                       stream=cpu.default_stream, splits=splits)  # fmt: skip


def test_slots_are_the_size_of_the_largest_piece_so_a_smaller_budget_works(cpu: Device) -> None:
    total = sum(footprint(a.nbytes) for a in WEIGHTS.values())
    whole = max(footprint(a.nbytes) for a in WEIGHTS.values())
    budget = int(0.4 * total)
    assert 2 * whole > budget  # two slots of the whole table do not fit
    with pytest.raises(OffloadError, match=r"a smaller offload\.piece shrinks them"):
        _store(cpu, WEIGHTS, 1 << 20, StreamPolicy(), budget)
    with _store(cpu, WEIGHTS, 8192, ScanResistantPolicy(), budget) as store:
        assert store.layout.slot_bytes <= 8192 and store.layout.arena_bytes <= budget
        assert "table" in store.splits and store.placement(store.splits["table"].pieces[0].name)
        stream = cpu.default_stream
        store.begin_step()
        for piece in store.splits["table"].pieces:
            got = store.get(piece.name, stream=stream).to_host(stream=stream)
            assert np.array_equal(got, TABLE[piece.start : piece.stop])
        store.end_step(tokens=1)
        off = store.counters()
        assert off.hits + off.misses == len(store.splits["table"].pieces)
        assert off.peak_device_bytes <= off.budget_bytes
        with pytest.raises(OffloadError, match="not in this store"):
            store.get("table", stream=stream)  # the whole weight has no buffer


def test_a_store_refuses_splits_whose_pieces_it_does_not_hold(cpu: Device) -> None:
    _, splits = split_weights(WEIGHTS, SPECS, 8192)
    with pytest.raises(OffloadError, match="must hold its pieces"):
        WeightStore(cpu, WEIGHTS, weight_infos(WEIGHTS, list(WEIGHTS)), StreamPolicy(), 1 << 30,
                    stream=cpu.default_stream, splits=splits)  # fmt: skip


# --- the offload.piece key ----------------------------------------------------------------------


def test_piece_sizes_parse() -> None:
    assert parse_piece("32MiB") == 32 * 2**20
    assert parse_piece("4096") == 4096 and parse_piece(" 1.5 KiB ") == 1536


def test_the_piece_key_comes_from_every_layer(tmp_path: Path) -> None:
    registry = PluginHost(environ={}).registry
    config = load_config(registry, environ={}, cwd=tmp_path)
    assert config.piece_bytes == 32 * 2**20 and config.source("offload.piece") == "default"
    env = {"GENAI_EP_OFFLOAD__PIECE": "1MiB"}
    assert load_config(registry, environ=env, cwd=tmp_path).piece_bytes == 2**20
    cli = {"offload.piece": ("64KiB", "command line --set")}
    assert load_config(registry, environ=env, cli=cli, cwd=tmp_path).piece_bytes == 65536


@pytest.mark.parametrize(
    ("value", "fix"),
    [("50%", "a share ('50%') is not allowed"), ("0", "at least 256 bytes"),
     ("12 apples", "expected bytes"), ("100", "--set offload.piece=32MiB")],
)  # fmt: skip
def test_bad_piece_values_name_the_key_the_value_and_the_fix(
    tmp_path: Path, value: str, fix: str
) -> None:
    registry = PluginHost(environ={}).registry
    with pytest.raises(ConfigError) as info:
        load_config(registry, environ={"GENAI_EP_OFFLOAD__PIECE": value}, cwd=tmp_path)
    text = str(info.value)
    assert "offload.piece" in text and repr(value) in text and fix in text
    assert "GENAI_EP_OFFLOAD__PIECE" in text  # where the value came from
