"""The ``buckets`` capture policy: a configured set of batch sizes is captured on first sight.

Keys whose batch is in ``batches`` are captured at their first decode step and replayed after;
other batches run eagerly with the set as the reason. `BucketsCapture.pad_to` gives the nearest
captured size at or above a batch: the native backend runs such a batch at that size, with padding
rows (position -1: nothing written or attended) after the real ones, so it is captured too; a
batch above every listed size runs at its own size, eagerly.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from typing import Any

from ep.hookspecs import hookimpl
from ep.registry import Option, Register
from ep.seams import CaptureDecision, StepInfo

__all__ = ["BucketsCapture"]


def _parse(text: str) -> tuple[int, ...]:
    return tuple(sorted({int(x) for x in text.replace(" ", "").split(",") if x}))


class BucketsCapture:
    """Captures decode steps of the configured batch sizes, at every capacity bucket."""

    name = "buckets"

    def __init__(self, batches: tuple[int, ...] = (1, 2, 4, 8, 16)) -> None:
        self.batches = batches
        self._kept: set[Hashable] = set()
        self._failed: dict[Hashable, str] = {}

    def pad_to(self, batch: int) -> int:
        """The smallest configured size >= ``batch`` (``batch`` itself when none is)."""
        return next((b for b in sorted(self.batches) if b >= batch), batch)

    def decide(self, step: StepInfo) -> CaptureDecision:
        key = (step.batch, step.capacity, step.phase)
        source = step.sources.get("capture.buckets.batches", "default")
        given = f"{','.join(map(str, self.batches))} ({source})"
        if step.phase != "decode" or not step.backend_can_capture:
            return CaptureDecision(
                "eager", "only capturable decode steps are captured", key,
                "decode step the backend can capture",
                {"phase": step.phase, "backend": step.backend_reason},
            )  # fmt: skip
        if not step.offload_address_stable:
            return CaptureDecision(
                "eager", "weights move between steps", key, "offload plan is address-stable",
                {"offload": f"not address-stable ({step.sources.get('offload', 'default')})"},
            )  # fmt: skip
        if step.batch not in self.batches:
            return CaptureDecision(
                "eager", f"batch {step.batch} is not a captured bucket", key,
                "batch is a configured bucket", {"batches": given},
            )  # fmt: skip
        if key in self._failed:
            return CaptureDecision(
                "eager", f"capture failed: {self._failed[key]}", key, "capture succeeds",
                {"key": str(key)},
            )  # fmt: skip
        if key in self._kept:
            return CaptureDecision("replay", f"bucket {key} captured", key)
        return CaptureDecision("capture", f"batch {step.batch} is a configured bucket", key)

    def captured(self, key: Hashable, ok: bool, error: str = "") -> None:
        if ok:
            self._kept.add(key)
        else:
            self._failed[key] = error

    def invalidated(self, key: Hashable, why: str) -> None:
        self._kept.discard(key)


def _check(value: Any) -> str:
    try:
        sizes = _parse(str(value))
    except ValueError:
        return f"{value!r} is not a comma-separated list of batch sizes"
    return "" if sizes and min(sizes) > 0 else f"{value!r} needs positive batch sizes"


def _make(options: Mapping[str, Any]) -> BucketsCapture:
    return BucketsCapture(_parse(options["batches"]))


@hookimpl(trylast=True)
def ep_register_capture_policies(register: Register) -> None:
    register.add(
        "buckets",
        _make,
        options=[Option("batches", str, "1,2,4,8,16", "batch sizes to capture", check=_check)],
        description="capture a configured set of batch sizes",
    )
