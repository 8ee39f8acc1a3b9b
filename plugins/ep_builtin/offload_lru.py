"""The ``lru`` offload policy: a dynamic cache that evicts the least recently used weights.

Not capture-safe: a weight's device address depends on when it was paged in. On a decode step
(a scan over every weight) a cache smaller than the model misses on every access; it is here as
the classic baseline that ``scan_resistant`` beats.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ep.hookspecs import hookimpl
from ep.offload import footprint
from ep.registry import Register
from ep.seams import AccessDecision, OffloadPlan, Placement, WeightInfo

__all__ = ["LRUPolicy"]


class LRUPolicy:
    """Every weight cached; on a miss, evict from the least recently used until it fits."""

    name = "lru"

    def __init__(self) -> None:
        self._sizes: dict[str, int] = {}

    def plan(self, weights: Sequence[WeightInfo], budget_bytes: int) -> OffloadPlan:
        self._sizes = {w.name: footprint(w.nbytes) for w in weights}
        placements = {w.name: Placement("cache", "lru cache") for w in weights}
        return OffloadPlan(
            placements=placements,
            capture_safe=False,  # addresses depend on the order of page-ins
            dynamic=True,
            reason=(
                f"{len(weights)} weights ({sum(self._sizes.values())} bytes) cached in "
                f"{budget_bytes} bytes, least recently used evicted first"
            ),
        )

    def access(self, weight: WeightInfo, cached: Sequence[str], free_bytes: int) -> AccessDecision:
        need = footprint(weight.nbytes)
        evict: list[str] = []
        free = free_bytes
        for name in cached:  # least recently used first (the core's order)
            if free >= need:
                break
            evict.append(name)
            free += self._sizes[name]
        return AccessDecision(
            tuple(evict), f"{need} bytes needed, {free_bytes} free: evict {len(evict)} LRU"
        )


def _make(options: Mapping[str, Any]) -> LRUPolicy:
    return LRUPolicy()


@hookimpl(trylast=True)
def ep_register_offload_policies(register: Register) -> None:
    register.add(
        "lru", _make, description="a dynamic LRU cache under the budget (not capture-safe)"
    )
