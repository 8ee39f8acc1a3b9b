"""The ``warmup`` capture policy: N eager steps per key, then capture, then replay.

After an invalidation the key is captured again; after ``max_failures`` failed captures of a key
it runs eagerly for good, with the last error as the reason.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from ep.hookspecs import hookimpl
from ep.registry import Option, Register
from ep.seams import CaptureDecision, StepInfo

__all__ = ["WarmupCapture"]


class WarmupCapture:
    """Eager for ``steps`` decode steps of each (batch, capacity, phase) key, then captured."""

    name = "warmup"

    def __init__(self, steps: int = 2, max_failures: int = 2) -> None:
        self.steps = steps
        self.max_failures = max_failures
        self._seen: dict[Hashable, int] = {}
        self._kept: set[Hashable] = set()
        self._failures: dict[Hashable, tuple[int, str]] = {}

    def decide(self, step: StepInfo) -> CaptureDecision:
        key = (step.batch, step.capacity, step.phase)
        src = step.sources
        if step.phase != "decode":
            return CaptureDecision(
                "eager", "only decode steps are captured", key, "phase is decode",
                {"phase": f"{step.phase} (from the runtime)"},
            )  # fmt: skip
        if not step.backend_can_capture:
            return CaptureDecision(
                "eager", f"the backend cannot capture: {step.backend_reason}", key,
                "backend can capture", {"backend": f"{step.backend_reason} (from the backend)"},
            )  # fmt: skip
        if not step.offload_address_stable:
            return CaptureDecision(
                "eager", "weights move between steps", key, "offload plan is address-stable",
                {"offload": f"not address-stable ({src.get('offload', 'default')})"},
            )  # fmt: skip
        failed, error = self._failures.get(key, (0, ""))
        if failed >= self.max_failures:
            return CaptureDecision(
                "eager", f"capture failed {failed} times for {key}: {error}", key,
                "capture succeeds", {"max_failures": f"{self.max_failures} "
                f"({src.get('capture.warmup.max_failures', 'default')})"},
            )  # fmt: skip
        if key in self._kept:
            return CaptureDecision("replay", f"graph kept for {key}", key)
        seen = self._seen.get(key, 0)
        if seen < self.steps:
            self._seen[key] = seen + 1
            return CaptureDecision(
                "eager", f"warmup step {seen + 1} of {self.steps} for {key}", key,
                "warmup steps done", {"steps": f"{self.steps} "
                f"({src.get('capture.warmup.steps', 'default')})"},
            )  # fmt: skip
        return CaptureDecision("capture", f"{self.steps} warmup steps done for {key}", key)

    def captured(self, key: Hashable, ok: bool, error: str = "") -> None:
        if ok:
            self._kept.add(key)
            return
        failed, _ = self._failures.get(key, (0, ""))
        self._failures[key] = (failed + 1, error)

    def invalidated(self, key: Hashable, why: str) -> None:
        """The graph is gone: capture again at the next step of this key."""
        self._kept.discard(key)
        self._seen[key] = self.steps


def _make(options: Mapping[str, Any]) -> WarmupCapture:
    return WarmupCapture(steps=options["steps"], max_failures=options["max_failures"])


def _non_negative(value: Any) -> str:
    return "" if value >= 0 else f"{value} must be >= 0"


@hookimpl(trylast=True)
def ep_register_capture_policies(register: Register) -> None:
    register.add(
        "warmup",
        _make,
        options=[
            Option(
                "steps", int, 2, "eager decode steps per key before capturing",
                check=_non_negative,
            ),
            Option(
                "max_failures", int, 2, "failed captures of a key before running it eagerly",
                check=_non_negative,
            ),
        ],
        description="capture each (batch, capacity) key after N eager steps",
    )  # fmt: skip
