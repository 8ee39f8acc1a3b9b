"""What a generation measured: timings, throughput and KV-cache counters."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ep.runtime.kv import KVStats

__all__ = ["GenerationMetrics", "summarize"]


@dataclass(frozen=True)
class GenerationMetrics:
    """Timings of one `Generator.generate` (or stream) call.

    ``steps``: decode steps run (the first new token comes from the prefill, so a row with n new
    tokens took n - 1 steps). ``decode_ms_per_step_*``: wall time per step, sampling included.
    ``tokens_per_s``: new tokens of all rows over prefill + decode time. ``decode_tokens_per_s``:
    batch * steps over decode time. ``kv_*``: the runtime's cache at the end (bytes over all
    layers, K and V); ``growths``: capacity growths during this call.
    """

    batch: int
    prompt_tokens: int
    new_tokens: int
    steps: int
    prefill_ms: float
    decode_ms: float
    decode_ms_per_step_median: float
    decode_ms_per_step_mean: float
    tokens_per_s: float
    decode_tokens_per_s: float
    kv_layout: str
    kv_bytes: int
    kv_live_bytes: int
    kv_capacity: int
    growths: int
    kv_copied_bytes: int

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def summarize(
    *,
    batch: int,
    prompt_tokens: int,
    new_tokens: int,
    prefill_s: float,
    step_s: Sequence[float],
    kv: KVStats,
) -> GenerationMetrics:
    steps = len(step_s)
    decode_s = float(sum(step_s))
    total_s = prefill_s + decode_s
    return GenerationMetrics(
        batch=batch,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        steps=steps,
        prefill_ms=prefill_s * 1e3,
        decode_ms=decode_s * 1e3,
        decode_ms_per_step_median=float(np.median(step_s)) * 1e3 if steps else 0.0,
        decode_ms_per_step_mean=decode_s / steps * 1e3 if steps else 0.0,
        tokens_per_s=new_tokens / total_s if total_s > 0 else 0.0,
        decode_tokens_per_s=batch * steps / decode_s if decode_s > 0 else 0.0,
        kv_layout=kv.layout,
        kv_bytes=kv.kv_bytes,
        kv_live_bytes=kv.live_bytes,
        kv_capacity=kv.capacity,
        growths=kv.growths,
        kv_copied_bytes=kv.copied_bytes,
    )
