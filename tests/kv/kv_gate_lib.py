"""Helpers for tests/kv: the tiny ep model, greedy runs on a backend, deliberately broken layouts.

The broken layouts are the negative oracles of the gates: each breaks one thing a real layout
must get right at batch > 1, and a gate must fail on it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ep.ort import OrtBackend
from ep.seams import CopyRange, GrowthPlan, KVGeometry, KVStrides
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_builtin.kv_paged import PagedLayout
from ep_builtin.kv_seq_major import SeqMajorLayout

DATA = Path(__file__).parents[1] / "data" / "genai-llama-tiny"
EXPECTED = json.loads((DATA / "expected_tokens.json").read_text())
PROMPTS: list[list[int]] = EXPECTED["prompts"]  # lengths 12, 7, 10, 3
EOS = 2


def layouts() -> dict[str, object]:
    """Every built-in layout and mode, with small buckets so short runs cross several."""
    return {
        "head_major": HeadMajorLayout(min_capacity=8),
        "seq_major": SeqMajorLayout(min_capacity=8),
        "seq_major_fixed": SeqMajorLayout(min_capacity=8, fixed_stride=True),
        "paged": PagedLayout(page_size=4, min_capacity=8),
    }


def greedy(
    backend: OrtBackend, prompts: Sequence[Sequence[int]], steps: int
) -> tuple[np.ndarray, np.ndarray]:
    """Logits [B, steps + 1, V] and greedy tokens [B, steps] (EOS masked)."""
    logits = backend.prefill([np.array(p) for p in prompts])
    seen, tokens = [logits.copy()], []
    for _ in range(steps):
        masked = logits.copy()
        masked[:, EOS] = -np.inf
        ids = masked.argmax(axis=1)
        tokens.append(ids)
        logits = backend.step(ids)
        seen.append(logits.copy())
    return np.stack(seen, axis=1), np.stack(tokens, axis=1)


class SkippedRelocation(SeqMajorLayout):
    """Packed seq-major whose growth forgets to move sequences b > 0 (harmless at batch 1)."""

    name = "seq_major_no_relocation"

    def growth_plan(
        self, old: KVGeometry, new_capacity: int, live_lengths: Sequence[int]
    ) -> GrowthPlan:
        plan = super().growth_plan(old, new_capacity, live_lengths)
        return GrowthPlan(plan.new, (), True, True, "forgets the relocation")


class TransposedCopies(SeqMajorLayout):
    """Seq-major geometry whose growth copies as if the cache were head-major: the plan reads
    (sequence, head) runs with a transposed token/head axis. At batch 1 with one head it would
    be right; at batch 3 with two heads it scrambles the cache."""

    name = "seq_major_transposed_copies"

    def growth_plan(
        self, old: KVGeometry, new_capacity: int, live_lengths: Sequence[int]
    ) -> GrowthPlan:
        new = self.geometry(
            batch=old.batch,
            capacity=new_capacity,
            kv_heads=old.kv_heads,
            head_dim=old.head_dim,
            itemsize=old.itemsize,
        )
        item, d = old.itemsize, old.head_dim
        copies = []
        for b, live in enumerate(live_lengths):
            for h in range(old.kv_heads):
                src = (b * old.strides.batch + h * old.capacity * d) * item
                dst = (b * new.strides.batch + h * new_capacity * d) * item
                copies.append(CopyRange(src, dst, min(live, old.capacity) * d * item))
        reason = "head-major copies of a seq-major cache"
        return GrowthPlan(new, tuple(copies), False, False, reason)


class BatchOneStride(SeqMajorLayout):
    """Seq-major whose batch stride forgets the heads (capacity * head_dim): only batch 1 works."""

    name = "seq_major_batch_one_stride"

    def geometry(
        self, *, batch: int, capacity: int, kv_heads: int, head_dim: int, itemsize: int
    ) -> KVGeometry:
        g = super().geometry(
            batch=batch, capacity=capacity, kv_heads=kv_heads, head_dim=head_dim, itemsize=itemsize
        )
        s = g.strides
        wrong = KVStrides(batch=capacity * head_dim, token=s.token, head=s.head, dim=s.dim)
        return KVGeometry(self.name, batch, capacity, kv_heads, head_dim, itemsize, g.shape, wrong)
