"""The ``resident`` offload policy: every weight lives on the device for the whole run."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ep.hookspecs import hookimpl
from ep.registry import Register
from ep.seams import AccessDecision, OffloadPlan, Placement, WeightInfo

__all__ = ["ResidentPolicy"]


class ResidentPolicy:
    """All weights resident. Over the budget, the plan says so and the core refuses it."""

    name = "resident"

    def plan(self, weights: Sequence[WeightInfo], budget_bytes: int) -> OffloadPlan:
        total = sum(w.nbytes for w in weights)
        placements = {w.name: Placement("resident", "resident policy") for w in weights}
        return OffloadPlan(
            placements=placements,
            capture_safe=True,
            dynamic=False,
            reason=f"all {len(weights)} weights resident: {total} bytes of a {budget_bytes} budget",
        )

    def access(self, weight: WeightInfo, cached: Sequence[str], free_bytes: int) -> AccessDecision:
        return AccessDecision((), "resident weights never miss")


def _make(options: Mapping[str, Any]) -> ResidentPolicy:
    return ResidentPolicy()


@hookimpl(trylast=True)
def ep_register_offload_policies(register: Register) -> None:
    register.add("resident", _make, description="every weight on the device for the whole run")
