"""Policies that break the offload contract get a ContractError naming the plugin and the rule."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import pytest

from ep.config import parse_budget
from ep.device import Device
from ep.errors import ContractError
from ep.offload import WeightStore, decoder_use_order
from ep.seams import AccessDecision, OffloadPlan, Placement, WeightInfo
from ep_builtin.offload_lru import LRUPolicy


class _Pairs(Mapping[str, Placement]):
    """A placements mapping built from a list of pairs that repeats a name (a plugin's bug)."""

    def __init__(self, pairs: list[tuple[str, Placement]]) -> None:
        self._pairs = pairs

    def __getitem__(self, key: str) -> Placement:
        return dict(self._pairs)[key]

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self._pairs)

    def __len__(self) -> int:
        return len(self._pairs)


class BrokenPolicy:
    """Places weights as told by ``mode``; every mode breaks one rule of the contract."""

    name = "broken"

    def __init__(self, mode: str) -> None:
        self.mode = mode

    def plan(self, weights: Sequence[WeightInfo], budget_bytes: int) -> OffloadPlan:
        stream = Placement("stream", "test")
        placements: Mapping[str, Placement] = {w.name: stream for w in weights}
        capture_safe, dynamic = True, False
        if self.mode == "double":
            pairs = [(w.name, stream) for w in weights] + [(weights[0].name, stream)]
            placements = _Pairs(pairs)
        elif self.mode == "unknown_where":
            placements = {**placements, weights[1].name: Placement("gpu", "test")}  # type: ignore[arg-type]  # the bug under test
        elif self.mode == "unknown_name":
            placements = {**placements, "not.a.weight": stream}
        elif self.mode == "missing":
            placements = {w.name: stream for w in weights[1:]}
        elif self.mode == "false_capture_safe":
            placements = {w.name: Placement("cache", "test") for w in weights}
            dynamic = True
        elif self.mode == "cache_not_dynamic":
            placements = {w.name: Placement("cache", "test") for w in weights}
            capture_safe = False
        elif self.mode == "raises":
            raise KeyError("oops")
        elif self.mode == "not_a_plan":
            return {"placements": placements}  # type: ignore[return-value]  # the bug under test
        return OffloadPlan(placements, capture_safe, dynamic, "test plan")

    def access(self, weight: WeightInfo, cached: Sequence[str], free_bytes: int) -> AccessDecision:
        return AccessDecision((), "never called")


@pytest.mark.parametrize(
    ("mode", "rule"),
    [
        ("double", r"placed exactly once; got 'model.embed_tokens.weight' placed more than once"),
        ("unknown_where", r"Placement with where in .*got 'gpu'"),
        ("unknown_name", r"unknown weight\(s\) 'not.a.weight'"),
        ("missing", r"no placement for 'model.embed_tokens.weight'"),
        ("false_capture_safe", r"capture_safe=True promises no weight address ever changes"),
        ("cache_not_dynamic", r"'cache' placements need dynamic=True"),
        ("raises", r"plan\(\) raised KeyError"),
        ("not_a_plan", r"must return an ep.seams.OffloadPlan; got dict"),
    ],
)
def test_a_broken_plan_is_refused_naming_the_plugin(
    mode: str,
    rule: str,
    cpu: Device,
    weights: Mapping[str, np.ndarray],
    infos: tuple[WeightInfo, ...],
) -> None:
    alloc0 = cpu.counters().allocated_bytes
    with pytest.raises(ContractError, match=rule) as caught:
        WeightStore(cpu, weights, infos, BrokenPolicy(mode), 10**7, stream=cpu.default_stream)
    assert "offload policy 'broken' (test_offload_contract.BrokenPolicy)" in str(caught.value)
    assert cpu.counters().allocated_bytes == alloc0


class StingyLRU(LRUPolicy):
    """An LRU that evicts one weight fewer than it must."""

    name = "stingy"

    def access(self, weight: WeightInfo, cached: Sequence[str], free_bytes: int) -> AccessDecision:
        answer = super().access(weight, cached, free_bytes)
        return AccessDecision(answer.evict[:-1], "one short")


class HeldEvictingLRU(LRUPolicy):
    """Evicts a name it was not offered (the weight the caller still holds)."""

    name = "grabby"

    def __init__(self) -> None:
        super().__init__()
        self.last = ""

    def access(self, weight: WeightInfo, cached: Sequence[str], free_bytes: int) -> AccessDecision:
        victim = self.last
        self.last = weight.name
        return AccessDecision((victim,) if victim else (), "evicts the held one")


@pytest.mark.parametrize(
    ("policy", "rule"),
    [
        (StingyLRU(), r"must evict enough for a \d+-byte page-in: \d+ bytes were free"),
        (HeldEvictingLRU(), r"are not among the evictable cached weights"),
    ],
)
def test_an_eviction_answer_that_breaks_the_contract_is_refused(
    policy: LRUPolicy,
    rule: str,
    cpu: Device,
    weights: Mapping[str, np.ndarray],
    infos: tuple[WeightInfo, ...],
) -> None:
    stream = cpu.default_stream
    store = WeightStore(cpu, weights, infos, policy, parse_budget("25%"), stream=stream)
    store.begin_step()
    with pytest.raises(ContractError, match=rule) as caught:
        for name in decoder_use_order(list(weights)):
            store.get(name, stream=stream)
    assert f"offload policy {policy.name!r}" in str(caught.value)
    # The refused answer changed nothing: the ledger still balances.
    c = store.counters()
    assert c.peak_device_bytes <= c.budget_bytes and c.page_ins == c.misses
    store.close()


def test_the_lru_policy_sees_recency_and_only_evictable_weights(
    cpu: Device, weights: Mapping[str, np.ndarray], infos: tuple[WeightInfo, ...]
) -> None:
    seen: list[tuple[str, tuple[str, ...], int]] = []

    class Recording(LRUPolicy):
        def access(
            self, weight: WeightInfo, cached: Sequence[str], free_bytes: int
        ) -> AccessDecision:
            seen.append((weight.name, tuple(cached), free_bytes))
            return super().access(weight, cached, free_bytes)

    stream = cpu.default_stream
    store = WeightStore(cpu, weights, infos, Recording(), parse_budget("50%"), stream=stream)
    order = decoder_use_order(list(weights))
    store.begin_step()
    for name in order:
        store.get(name, stream=stream)
    store.end_step(1)
    assert [s[0] for s in seen] == order  # one miss per weight on the first (cold) step
    for index, (_, cached, free) in enumerate(seen[1:], start=1):
        assert order[index - 1] not in cached  # the held weight is never offered
        assert list(cached) == [n for n in order[: index - 1] if n in cached]  # LRU first
        assert free >= 0
    store.close()
