"""The ``never`` capture policy: every step runs eagerly."""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from ep.hookspecs import hookimpl
from ep.registry import Register
from ep.seams import CaptureDecision, StepInfo

__all__ = ["NeverCapture"]


class NeverCapture:
    """Declines every step: the reference to compare captured runs against."""

    name = "never"

    def decide(self, step: StepInfo) -> CaptureDecision:
        return CaptureDecision(
            "eager",
            reason="capture policy 'never' runs every step eagerly",
            predicate="policy allows capture",
            inputs={"capture": f"never ({step.sources.get('capture', 'default')})"},
        )

    def captured(self, key: Hashable, ok: bool, error: str = "") -> None:
        """Never asked to capture, so there is nothing to count."""

    def invalidated(self, key: Hashable, why: str) -> None:
        """Holds no graphs, so there is nothing to forget."""


def _make(options: Mapping[str, Any]) -> NeverCapture:
    return NeverCapture()


@hookimpl(trylast=True)
def ep_register_capture_policies(register: Register) -> None:
    register.add("never", _make, description="run every step eagerly")
