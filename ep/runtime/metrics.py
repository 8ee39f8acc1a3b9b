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

    KV layout counters (`ep.runtime.kv.KVStats`): ``kv_bytes`` is what the geometry spans (a
    fixed-stride layout's full reservation), ``kv_committed_bytes`` what is backed by memory;
    ``kv_relocated_bytes`` moved by growth plans and ``kv_growth_ms`` the time they took;
    ``kv_moved_growths`` growths that changed the buffers' address; ``kv_copied_bytes``
    relocated plus copy-on-write bytes; ``kv_bytes_per_token`` one token of one sequence over
    every layer's K and V. Paged layouts: ``kv_page_size``, ``kv_pages_in_use``,
    ``kv_shared_pages`` (held by more than one sequence) and ``kv_cow_bytes`` (0 otherwise).
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
    kv_committed_bytes: int = 0
    kv_relocated_bytes: int = 0
    kv_moved_growths: int = 0
    kv_growth_ms: float = 0.0
    kv_bytes_per_token: int = 0
    kv_page_size: int = 0
    kv_pages_in_use: int = 0
    kv_shared_pages: int = 0
    kv_cow_bytes: int = 0

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
        kv_committed_bytes=kv.committed_bytes,
        kv_relocated_bytes=kv.relocated_bytes,
        kv_moved_growths=kv.moved_growths,
        kv_growth_ms=kv.growth_ms,
        kv_bytes_per_token=kv.bytes_per_token,
        kv_page_size=kv.page_size,
        kv_pages_in_use=kv.pages_in_use,
        kv_shared_pages=kv.shared_pages,
        kv_cow_bytes=kv.cow_bytes,
    )
