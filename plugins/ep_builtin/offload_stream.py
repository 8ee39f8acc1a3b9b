"""The ``stream`` offload policy: every weight is copied to the device at each use."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ep.hookspecs import hookimpl
from ep.registry import Register
from ep.seams import AccessDecision, OffloadPlan, Placement, WeightInfo

__all__ = ["StreamPolicy"]


class StreamPolicy:
    """Nothing resident: the smallest footprint (the staging slots), the most copies."""

    name = "stream"

    def plan(self, weights: Sequence[WeightInfo], budget_bytes: int) -> OffloadPlan:
        total = sum(w.nbytes for w in weights)
        placements = {w.name: Placement("stream", "stream policy") for w in weights}
        return OffloadPlan(
            placements=placements,
            capture_safe=True,  # fixed staging slots: no address changes
            dynamic=False,
            reason=f"all {len(weights)} weights ({total} bytes) streamed through staging slots",
        )

    def access(self, weight: WeightInfo, cached: Sequence[str], free_bytes: int) -> AccessDecision:
        return AccessDecision((), "streamed weights are never cached")


def _make(options: Mapping[str, Any]) -> StreamPolicy:
    return StreamPolicy()


@hookimpl(trylast=True)
def ep_register_offload_policies(register: Register) -> None:
    register.add("stream", _make, description="every weight copied from pinned memory at each use")
