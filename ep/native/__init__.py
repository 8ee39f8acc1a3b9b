"""The native executor: ep graphs from static plans on the CPU or CUDA device, with capture."""

from __future__ import annotations

from ep.native.backend import LoopRun, NativeBackend, as_ep_model
from ep.native.capture import CaptureManager, CaptureMetrics
from ep.native.kv import DeviceKVCache
from ep.native.plan import KVBinding, StepPlan
from ep.native.program import Program, load_program
from ep.native.weights import ResidentWeights, WeightSource

__all__ = [
    "CaptureManager",
    "CaptureMetrics",
    "DeviceKVCache",
    "KVBinding",
    "LoopRun",
    "NativeBackend",
    "Program",
    "ResidentWeights",
    "StepPlan",
    "WeightSource",
    "as_ep_model",
    "load_program",
]
