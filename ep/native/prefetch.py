"""L2 prefetch of the weights a decode step reads next, issued while attention runs.

A decode step's attention reads only the small KV cache, so HBM is nearly idle while it runs, and
the GEMVs after it are latency-bound: each one waits on HBM for its weight. `plan_l2_prefetch`
puts one prefetch call ahead of each attention call, covering the weights that the nodes after
it read, up to the next attention (so during layer i's attention, layer i's o, gate_up and down
weights and layer i+1's QKV weights stream into L2), in order of use, capped at a byte budget
(by default half the device's L2, `prefetch_budget`; ``GENAI_EP_L2_PREFETCH=0`` turns it off).

Only weights at fixed addresses are prefetched (the plan binds them once): a weight the offload
store streams or pages in is fetched by its call into whatever slot is free at that step, so an
address known at bind time says nothing about where it will be read.

No prefetch opens the step (for layer 0 before the first attention): only the embedding row,
one norm and layer 0's QKV weight (2 MB on the Qwen2.5-0.5B shape, one 3.5 µs GEMV of a
1170 µs step) come before that attention, so a prefetch there could save at most part of that
GEMV, about what its own launch costs. Nor can the step's last call carry layer 0's weights
into the next step: the head's read after it (272 MB on that shape) evicts them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ep.config import parse_budget
from ep.errors import ConfigError

if TYPE_CHECKING:  # the plan imports this module to place its prefetch calls
    from ep.native.plan import WeightRead

__all__ = [
    "ATTENTION_OPS",
    "DEFAULT_SHARE",
    "PREFETCH_ENV",
    "WEIGHT_OPS",
    "L2Prefetch",
    "PrefetchRange",
    "plan_l2_prefetch",
    "prefetch_budget",
]

PREFETCH_ENV = "GENAI_EP_L2_PREFETCH"
DEFAULT_SHARE = 0.5  # of the device's L2: the rest keeps what the running kernels read
ATTENTION_OPS = frozenset({"KVAttention", "KVAttentionPaged"})
# Ops that read the whole of each of their weights once a step. Not Gather (it reads the rows of
# a step's ids, a few KB of its table) nor Rotary (its cos/sin tables serve every layer: they stay
# in L2 anyway).
WEIGHT_OPS = frozenset({"MatMul", "MatMulNBits", "MatMulNBitsZP", "RMSNorm", "SkipRMSNorm", "Add"})


@dataclass(frozen=True)
class PrefetchRange:
    """Bytes ``[offset, offset + nbytes)`` of one weight."""

    weight: str
    offset: int
    nbytes: int


@dataclass(frozen=True)
class L2Prefetch:
    """One prefetch call: it runs right before node ``before`` (an attention, at ``index`` of
    the reads it was planned from) and asks the L2 for ``ranges``, in the order the nodes after
    it read them."""

    before: str
    index: int
    ranges: tuple[PrefetchRange, ...]
    reason: str

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranges)

    @property
    def weights(self) -> tuple[str, ...]:
        return tuple(r.weight for r in self.ranges)


def plan_l2_prefetch(
    reads: Sequence[WeightRead], sizes: Mapping[str, int], budget: int
) -> list[L2Prefetch]:
    """Per attention node of ``reads`` (the step's working nodes in order), the prefetch ahead of
    it: the weights in ``sizes`` (name -> bytes: the weights at fixed addresses; every other one
    is left out) that the `WEIGHT_OPS` nodes after it read up to the next attention node (after
    the last one: to the end of the step), each once, in order of first use, until ``budget``
    bytes (the weight that crosses it is cut there). An attention with nothing to prefetch after
    it gets none; ``budget <= 0`` gives none at all.
    """
    if budget <= 0:
        return []
    marks = [i for i, read in enumerate(reads) if read.op in ATTENTION_OPS]
    out: list[L2Prefetch] = []
    for at, stop in zip(marks, [*marks[1:], len(reads)], strict=True):
        ranges: list[PrefetchRange] = []
        left = budget
        seen: set[str] = set()
        skipped: list[str] = []
        for read in reads[at + 1 : stop]:
            if read.op not in WEIGHT_OPS:
                continue
            for name in read.weights:
                if name in seen:
                    continue
                seen.add(name)
                if name not in sizes:
                    skipped.append(name)
                    continue
                take = min(int(sizes[name]), left)
                if take > 0:
                    ranges.append(PrefetchRange(name, 0, take))
                    left -= take
        if not ranges:
            continue
        until = reads[stop].node if stop < len(reads) else "the end of the step"
        cut = " (the budget cut the last one)" if left == 0 else ""
        streamed = f"; {len(skipped)} not at fixed addresses left out" if skipped else ""
        reason = (
            f"{len(ranges)} weights, {budget - left} bytes of budget {budget}{cut}, read after "
            f"{reads[at].node} until {until}{streamed}"
        )
        out.append(L2Prefetch(reads[at].node, at, tuple(ranges), reason))
    return out


def prefetch_budget(l2_bytes: int, environ: Mapping[str, str] | None = None) -> int:
    """Bytes one prefetch call may ask for: ``GENAI_EP_L2_PREFETCH`` against the device's L2.

    Unset, ``1`` or ``on``: `DEFAULT_SHARE` of ``l2_bytes``; ``0`` or ``off``: 0 (no prefetch);
    a share (``75%``, of ``l2_bytes``) or a size (``24MiB``, ``25165824``) sets it. A device that
    reports no L2 (``l2_bytes`` 0, the CPU device) gets 0 from a share, so only an explicit size
    puts prefetch calls in its plans (tests do, to check the placement in CI).
    """
    env = os.environ if environ is None else environ
    raw = env.get(PREFETCH_ENV, "")
    text = raw.strip().lower()
    if text in ("", "1", "on", "true", "yes"):
        return int(l2_bytes * DEFAULT_SHARE)
    if text in ("0", "off", "false", "no"):
        return 0
    try:
        budget = parse_budget(text)
    except ConfigError:
        raise ConfigError(
            f"{PREFETCH_ENV}={raw!r} is not a switch or a budget: expected 0/off, 1/on (half "
            "the device's L2), a share of the L2 ('75%') or a size ('24MiB', '25165824')"
        ) from None
    return budget.resolve(int(l2_bytes))
