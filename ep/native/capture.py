"""The core's side of capture: graphs per key, the signature check before a replay, counters.

A policy decides (`ep.seams.CapturePolicy`); `CaptureManager.run` acts: eager, capture (the
step's calls recorded under ``key``, then launched once) or replay (the kept graph's signature is
compared with the bindings now: equal keeps it, different drops it, tells the policy
``invalidated`` and captures again). A capture that raises is reported to the policy
(``captured(key, False, error)``) and the step runs eagerly. `CaptureMetrics` is what
``metrics.capture`` of ``genai-ep run --json`` shows.

With an offload store (``weights``: an `ep.native.weights.OffloadedWeights`), a capture is
bracketed by ``weights.begin_capture()`` / ``weights.end_capture()`` and every launch of the
graph (the one after its capture too) is reported with ``weights.replayed(trace)``: a replay
copies the streamed weights without asking the store.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from ep.device import Device, Graph, Stream
from ep.errors import ContractError, DeviceError, EPError
from ep.seams import BindingSignature, CaptureDecision, CapturePolicy, StepInfo

__all__ = ["CaptureManager", "CaptureMetrics", "CaptureWeights"]


class CaptureWeights(Protocol):
    """The offload store's capture hooks (`ep.offload.WeightStore` has them)."""

    def begin_capture(self) -> None: ...

    def end_capture(self) -> Any: ...

    def replayed(self, trace: Any) -> None: ...


@dataclass
class CaptureMetrics:
    """Counters of one backend's capture activity (cumulative)."""

    policy: str = "never"
    enabled: bool = False
    captures: int = 0
    replays: int = 0
    invalidations: int = 0
    fallbacks: int = 0
    growth_keeps: int = 0
    eager_steps: int = 0
    last_decline: dict[str, Any] = field(default_factory=dict)
    last_invalidation: str = ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class _Kept:
    graph: Graph
    signature: BindingSignature
    growths: int  # the cache's growth count when captured or last kept
    trace: Any = None  # the offload store's AccessTrace of the captured step (None: no store)


class CaptureManager:
    """Runs steps through ``policy`` on ``device``/``stream``; keeps graphs per key."""

    def __init__(
        self,
        policy: CapturePolicy,
        *,
        device: Device,
        stream: Stream,
        weights: CaptureWeights | None = None,
    ) -> None:
        self.policy = policy
        self.device = device
        self.stream = stream
        self.weights = weights
        self.graphs: dict[Hashable, _Kept] = {}
        name = getattr(policy, "name", type(policy).__name__)
        self.metrics = CaptureMetrics(policy=name, enabled=name != "never")

    def _who(self) -> str:
        return f"capture policy {self.metrics.policy!r}"

    def forget(self, key: Hashable, why: str) -> None:
        """Drop the graph under ``key`` (its bindings are gone): an invalidation."""
        kept = self.graphs.pop(key, None)
        if kept is not None:
            kept.graph.close()
            self.metrics.invalidations += 1
            self.metrics.last_invalidation = f"{key}: {why}"
            self.policy.invalidated(key, why)

    def revalidate(self, signature: BindingSignature, growths: int, batch: int) -> None:
        """After a cache growth: drop every graph of this batch whose bindings moved."""
        for key, kept in list(self.graphs.items()):
            if _batch_of(key) != batch:
                continue
            diff = kept.signature.differences(signature)
            if diff:
                self.forget(key, "; ".join(diff))

    def run(
        self,
        info: StepInfo,
        calls: Sequence[Callable[[], object]],
        *,
        growths: int,
    ) -> CaptureDecision:
        """One step: ask the policy, then run eagerly, capture or replay. Returns the decision."""
        decision = self.policy.decide(info)
        if not isinstance(decision, CaptureDecision) or decision.action not in (
            "eager", "capture", "replay"
        ):  # fmt: skip
            raise ContractError(
                f"{self._who()} decide() returned {decision!r}; expected a CaptureDecision with "
                "action 'eager', 'capture' or 'replay'"
            )
        if decision.action == "eager":
            self._eager(calls)
            if self.metrics.enabled and info.phase == "decode":
                self.metrics.last_decline = {
                    "reason": decision.reason,
                    "predicate": decision.predicate,
                    "inputs": dict(decision.inputs),
                }
                if decision.predicate and decision.predicate != "warmup steps done":
                    self.metrics.fallbacks += 1
            return decision
        key = decision.key if decision.key is not None else _default_key(info)
        kept = self.graphs.get(key)
        if decision.action == "replay" and kept is not None:
            diff = kept.signature.differences(info.signature)
            if not diff:
                if growths > kept.growths:
                    self.metrics.growth_keeps += 1
                    kept.growths = growths
                self._launch(kept)
                self.metrics.replays += 1
                return decision
            self.forget(key, "; ".join(diff))
        elif kept is not None:  # a capture asked over a kept graph: replace it
            kept.graph.close()
            del self.graphs[key]
        self._capture(key, info, calls, growths)
        return decision

    def _eager(self, calls: Sequence[Callable[[], object]]) -> None:
        for call in calls:
            call()
        self.metrics.eager_steps += 1

    def _capture(
        self,
        key: Hashable,
        info: StepInfo,
        calls: Sequence[Callable[[], object]],
        growths: int,
    ) -> None:
        weights = self.weights
        tracing = False
        try:
            if weights is not None:
                weights.begin_capture()  # refuses a plan that moves weights, with its reason
                tracing = True
            with self.device.capture(stream=self.stream) as cap:
                for call in calls:
                    call()
            graph = cap.graph
        except (DeviceError, EPError) as exc:
            if tracing and weights is not None:
                weights.end_capture()  # the recording is discarded: so is its trace
            self.policy.captured(key, False, str(exc))
            self.metrics.fallbacks += 1
            self.metrics.last_decline = {
                "reason": f"capture failed: {exc}",
                "predicate": "capture succeeds",
                "inputs": {"key": str(key)},
            }
            self._eager(calls)
            return
        trace = weights.end_capture() if weights is not None else None
        self.policy.captured(key, True)
        kept = _Kept(graph, info.signature, growths, trace)
        self.graphs[key] = kept
        self.metrics.captures += 1
        self._launch(kept)  # a capture records; this step still has to run

    def _launch(self, kept: _Kept) -> None:
        kept.graph.launch(stream=self.stream)
        if self.weights is not None and kept.trace is not None:
            self.weights.replayed(kept.trace)


def _default_key(info: StepInfo) -> Hashable:
    return (info.batch, info.capacity, info.phase)


def _batch_of(key: Hashable) -> int | None:
    if isinstance(key, tuple) and key and isinstance(key[0], int):
        return key[0]
    return None
