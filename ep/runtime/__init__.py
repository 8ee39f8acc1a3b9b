"""The decode runtime: the generator, the backends' Protocol, the KV cache it owns, metrics."""

from __future__ import annotations

from ep.runtime.backend import BACKENDS, Backend, create_backend
from ep.runtime.generator import (
    GenerationOptions,
    GenerationResult,
    GenerationStream,
    Generator,
    Prompts,
    StepTokens,
)
from ep.runtime.kv import KVCache, KVStats
from ep.runtime.metrics import GenerationMetrics

__all__ = [
    "BACKENDS",
    "Backend",
    "GenerationMetrics",
    "GenerationOptions",
    "GenerationResult",
    "GenerationStream",
    "Generator",
    "KVCache",
    "KVStats",
    "Prompts",
    "StepTokens",
    "create_backend",
]
