"""Greedy decoding helpers shared by the native executor's tests."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

EOS = 2  # the tiny model's end-of-sequence id: masked so every run decodes all its steps


def greedy_logits(
    backend: Any, prompts: Sequence[Sequence[int]], steps: int, reserve: int = 0
) -> np.ndarray:
    """Logits of the prefill and of each greedy step, [steps + 1, batch, vocab] (EOS masked)."""
    logits = backend.prefill([np.array(p) for p in prompts], reserve=reserve)
    seen = [logits.copy()]
    for _ in range(steps):
        masked = logits.copy()
        masked[:, EOS] = -np.inf
        logits = backend.step(masked.argmax(axis=1))
        seen.append(logits.copy())
    return np.stack(seen)
