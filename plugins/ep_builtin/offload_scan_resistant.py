"""The ``scan_resistant`` offload policy: residents first-fit in order of use, the rest streamed.

A decode step reads every weight once, in order: a scan, which defeats an LRU cache smaller than
the model (every access misses). Here the weights that fit stay resident for good and the rest
pass through the fixed staging slots, so each step copies exactly the streamed bytes and no
address ever changes (capture-safe).

Staging slots: by default (``slots`` None, option 0) the policy reserves as many as the weight
store uses: one more than the most weights one kernel reads at once (2 for a float model, 3 for
MatMulNBits, which reads B and its scales together). The native executor gives a default policy
its store's count (`ep.native.backend.offload_store`); a policy planned on its own reserves 2.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ep.hookspecs import hookimpl
from ep.offload import footprint
from ep.registry import Option, Register
from ep.seams import AccessDecision, OffloadPlan, Placement, WeightInfo

__all__ = ["ScanResistantPolicy"]


class ScanResistantPolicy:
    """Residents first-fit (in order of use) into the budget less the staging slots."""

    name = "scan_resistant"

    def __init__(self, slots: int | None = None) -> None:
        # the store's staging slots (WeightStore(slots=...)); None: whatever the store uses
        self.slots = slots

    def _first_fit(
        self, ordered: Sequence[WeightInfo], limit: int
    ) -> tuple[dict[str, Placement], int]:
        placements: dict[str, Placement] = {}
        used = 0
        for w in ordered:
            size = footprint(w.nbytes)
            if used + size <= limit:
                used += size
                placements[w.name] = Placement("resident", f"fits: {used} of {limit} bytes")
            else:
                placements[w.name] = Placement(
                    "stream", f"{size} bytes do not fit beside {used} of {limit}"
                )
        return placements, used

    def plan(self, weights: Sequence[WeightInfo], budget_bytes: int) -> OffloadPlan:
        ordered = sorted(weights, key=lambda w: w.order)
        total = sum(footprint(w.nbytes) for w in ordered)
        if total <= budget_bytes:
            placements = {w.name: Placement("resident", "all weights fit") for w in ordered}
            reason = f"all {len(ordered)} weights resident: {total} of {budget_bytes} bytes"
            return OffloadPlan(placements, capture_safe=True, dynamic=False, reason=reason)
        # Reserve slots for the largest weight, then for the largest one left streamed: residents
        # only shrink the largest streamed weight, so the second reserve is never too small.
        slots = 2 if self.slots is None else self.slots  # the store's least count
        reserve = slots * max(footprint(w.nbytes) for w in ordered)
        placements, _ = self._first_fit(ordered, budget_bytes - reserve)
        streamed = [w for w in ordered if placements[w.name].where == "stream"]
        if streamed:
            reserve = slots * max(footprint(w.nbytes) for w in streamed)
            placements, _ = self._first_fit(ordered, budget_bytes - reserve)
        streamed = [w for w in ordered if placements[w.name].where == "stream"]
        resident = len(ordered) - len(streamed)
        streamed_bytes = sum(w.nbytes for w in streamed)
        reason = (
            f"{resident} weights resident first-fit in order of use within {budget_bytes} - "
            f"{reserve} bytes (staging: {slots} slots); {len(streamed)} streamed "
            f"({streamed_bytes} bytes per step)"
        )
        return OffloadPlan(placements, capture_safe=True, dynamic=False, reason=reason)

    def access(self, weight: WeightInfo, cached: Sequence[str], free_bytes: int) -> AccessDecision:
        return AccessDecision((), "scan_resistant never caches")


def _make(options: Mapping[str, Any]) -> ScanResistantPolicy:
    return ScanResistantPolicy(slots=int(options.get("slots", 0)) or None)


@hookimpl(trylast=True)
def ep_register_offload_policies(register: Register) -> None:
    register.add(
        "scan_resistant",
        _make,
        options=(
            Option(
                "slots",
                int,
                0,
                "staging slots to reserve (the weight store's slot count; 0: as many as the "
                "store needs, one more than the most weights a kernel reads at once)",
                check=lambda v: "" if v == 0 or v >= 2 else "must be 0 (the store's) or >= 2",
            ),
        ),
        description="residents first-fit up to the budget, the rest streamed (capture-safe)",
    )
