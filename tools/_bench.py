"""What the benchmark scripts in tools/ share: the machine, a value's spread, and the device time
of a captured graph's replays."""

from __future__ import annotations

import importlib.metadata as md
import os
import platform
import statistics
from pathlib import Path
from typing import Any


def machine_info(*packages: str) -> dict[str, Any]:
    """CPU model, cores (all and usable), Python, platform and the versions of ``packages``."""
    cpu = platform.processor() or platform.machine() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": usable,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }
    for name in ("numpy", *packages):
        try:
            info[name.replace("-", "_")] = md.version(name)
        except md.PackageNotFoundError:
            info[name.replace("-", "_")] = None
    return info


def spread(values: list[float]) -> dict[str, float]:
    """Median, min and max of repeated measurements."""
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def replay_ms(dev: Any, stream: Any, graph: Any, reps: int) -> float:
    """Device ms of one replay of ``graph``: a warm-up launch, then ``reps`` back to back."""
    start, end = dev.create_event(timing=True), dev.create_event(timing=True)
    graph.launch(stream=stream)
    stream.record(start)
    for _ in range(reps):
        graph.launch(stream=stream)
    stream.record(end)
    end.sync()
    return end.elapsed_ms(start) / reps


def captured_us(dev: Any, stream: Any, calls: list[Any], reps: int) -> float:
    """Device µs of one replay of ``calls`` captured as a graph, replayed ``reps`` times."""
    with dev.capture(stream=stream) as cap:
        for call in calls:
            call()
    try:
        return replay_ms(dev, stream, cap.graph, reps) * 1e3
    finally:
        cap.graph.close()
