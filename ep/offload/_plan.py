"""Validation of an offload policy's plan, and the device layout the core derives from it.

The policy only decides (a `Placement` per weight); this module checks the decision against the
seam's contract and turns it into byte offsets: residents packed at the start of the arena, then
the fixed staging slots, then (for ``cache`` placements) the capacity of the dynamic cache.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ep.errors import ContractError, OffloadBudgetError
from ep.seams import OffloadPlan, OffloadPolicy, Placement, WeightInfo

__all__ = [
    "ALIGN",
    "PLACEMENTS",
    "StoreLayout",
    "describe_policy",
    "footprint",
    "min_cache_bytes",
    "validate_plan",
]

ALIGN = 256  # what cudaMalloc guarantees; every weight starts on such a boundary in the arena
PLACEMENTS = ("resident", "stream", "cache")


def footprint(nbytes: int) -> int:
    """Device bytes one weight of ``nbytes`` takes in the arena (rounded up to `ALIGN`)."""
    return -(-int(nbytes) // ALIGN) * ALIGN


def describe_policy(policy: object) -> str:
    """``offload policy 'lru' (ep_builtin.offload_lru.LRUPolicy)``: who to blame for a bad plan."""
    name = getattr(policy, "name", "?")
    cls = type(policy)
    return f"offload policy {name!r} ({cls.__module__}.{cls.__qualname__})"


def min_cache_bytes(cache_footprints: Sequence[int], slots: int) -> int:
    """The smallest cache that always works: the ``slots`` largest cache weights at once.

    A caller may hold the buffers of its last ``slots - 1`` calls to ``get`` (they cannot be
    evicted), and the weight being paged in must fit beside them.
    """
    return sum(sorted(cache_footprints, reverse=True)[:slots])


@dataclass(frozen=True)
class StoreLayout:
    """A validated plan and where every byte goes (all sizes are device footprints)."""

    plan: OffloadPlan
    policy: str  # describe_policy(...) of the policy that made the plan
    budget_bytes: int
    placements: Mapping[str, str]  # name -> "resident" | "stream" | "cache"
    resident_offsets: Mapping[str, int]  # byte offset of each resident weight in the arena
    resident_bytes: int
    slots: int  # staging slots (0 when nothing is streamed)
    slot_bytes: int  # bytes per slot: the footprint of the largest streamed weight (or piece)
    cache_bytes: int  # capacity of the dynamic cache (0 without cache placements)

    @property
    def slots_offset(self) -> int:
        return self.resident_bytes

    @property
    def arena_bytes(self) -> int:
        """Residents plus staging slots: the one allocation made at load time."""
        return self.resident_bytes + self.slots * self.slot_bytes

    def names(self, where: str) -> tuple[str, ...]:
        return tuple(n for n, w in self.placements.items() if w == where)


def _contract(policy: object, rule: str, seen: str, fix: str) -> ContractError:
    return ContractError(
        f"{describe_policy(policy)}: plan() broke the offload contract: {rule}; got {seen}. {fix}"
    )


def _names(names: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def validate_plan(
    policy: OffloadPolicy,
    plan: object,
    weights: Sequence[WeightInfo],
    budget_bytes: int,
    *,
    slots: int,
    budget_text: str,
) -> StoreLayout:
    """Check ``plan`` against the contract and the budget; return the layout or raise.

    A broken contract raises `ContractError` addressed to the plugin author (which plugin, which
    weight, what was wrong); a plan the budget cannot hold raises `OffloadBudgetError` with the
    bytes needed and the fix.
    """
    if not isinstance(plan, OffloadPlan):
        raise _contract(
            policy,
            "plan() must return an ep.seams.OffloadPlan",
            type(plan).__name__,
            "Return OffloadPlan(placements, capture_safe, dynamic, reason)",
        )
    if not isinstance(plan.placements, Mapping):
        raise _contract(
            policy,
            "OffloadPlan.placements must be a Mapping of weight name to Placement",
            type(plan.placements).__name__,
            "Build a dict {name: Placement(...)}",
        )
    if not isinstance(plan.reason, str) or not plan.reason.strip():
        raise _contract(
            policy,
            "OffloadPlan.reason must say why, in words",
            repr(plan.reason),
            "Give a short sentence, e.g. 'first 12 weights resident, the rest streamed'",
        )
    known = {w.name: w for w in weights}
    placements: dict[str, str] = {}
    duplicates: list[str] = []
    unknown: list[str] = []
    for name, placement in plan.placements.items():
        if name in placements:
            duplicates.append(name)
            continue
        if name not in known:
            unknown.append(str(name))
            continue
        if not isinstance(placement, Placement) or placement.where not in PLACEMENTS:
            where = getattr(placement, "where", placement)
            raise _contract(
                policy,
                f"weight {name!r} must get a Placement with where in {PLACEMENTS}",
                repr(where),
                "Use Placement('resident' | 'stream' | 'cache', reason)",
            )
        placements[name] = placement.where
    if duplicates:
        raise _contract(
            policy,
            "every weight is placed exactly once",
            f"{_names(duplicates)} placed more than once",
            "Place each weight once",
        )
    if unknown:
        raise _contract(
            policy,
            "placements name only the weights it was given",
            f"unknown weight(s) {_names(unknown)}",
            "Place exactly the weights passed to plan()",
        )
    missing = [w.name for w in weights if w.name not in placements]
    if missing:
        raise _contract(
            policy,
            "every weight is placed exactly once",
            f"no placement for {_names(missing)}",
            "Return a Placement for every weight passed to plan()",
        )
    # Keep the order of use, so the arena and the slots follow the decoder.
    ordered = sorted(weights, key=lambda w: w.order)
    placements = {w.name: placements[w.name] for w in ordered}
    cached = [w for w in ordered if placements[w.name] == "cache"]
    streamed = [w for w in ordered if placements[w.name] == "stream"]
    if cached and plan.capture_safe:
        raise _contract(
            policy,
            "capture_safe=True promises no weight address ever changes, but 'cache' placements "
            "move weights in and out of the device",
            f"capture_safe=True with {len(cached)} cache placement(s), e.g. {cached[0].name!r}",
            "Say capture_safe=False, or place those weights 'resident' or 'stream'",
        )
    if cached and not plan.dynamic:
        raise _contract(
            policy,
            "'cache' placements need dynamic=True (the core asks access() on each miss)",
            f"dynamic=False with {len(cached)} cache placement(s), e.g. {cached[0].name!r}",
            "Say dynamic=True and implement access()",
        )

    offsets: dict[str, int] = {}
    resident_bytes = 0
    for w in ordered:
        if placements[w.name] == "resident":
            offsets[w.name] = resident_bytes
            resident_bytes += footprint(w.nbytes)
    slot_bytes = max((footprint(w.nbytes) for w in streamed), default=0)
    n_slots = slots if streamed else 0
    staging = n_slots * slot_bytes
    cache_min = min_cache_bytes([footprint(w.nbytes) for w in cached], slots)
    needed = resident_bytes + staging + cache_min
    if needed > budget_bytes:
        parts = [f"{resident_bytes} resident ({len(offsets)} weights)"]
        if streamed:
            biggest = max(streamed, key=lambda w: w.nbytes)
            parts.append(
                f"{staging} for {n_slots} staging slots of {slot_bytes} (the largest streamed "
                f"weight or piece, {biggest.name!r}; a smaller offload.piece shrinks them)"
            )
        if cached:
            parts.append(f"{cache_min} for the smallest workable cache ({slots} largest weights)")
        if placements and all(p == "resident" for p in placements.values()):
            fix = (
                f"raise offload.budget to at least {needed} bytes, or pick a policy that streams "
                "(--offload scan_resistant, stream or lru)"
            )
        else:
            fix = f"raise offload.budget to at least {needed} bytes"
        raise OffloadBudgetError(
            f"{describe_policy(policy)}: its plan needs {needed} device bytes "
            f"({' + '.join(parts)}), but offload.budget = {budget_text} allows {budget_bytes}; "
            f"{fix}"
        )
    cache_bytes = budget_bytes - resident_bytes - staging if cached else 0
    return StoreLayout(
        plan=plan,
        policy=describe_policy(policy),
        budget_bytes=budget_bytes,
        placements=placements,
        resident_offsets=offsets,
        resident_bytes=resident_bytes,
        slots=n_slots,
        slot_bytes=slot_bytes,
        cache_bytes=cache_bytes,
    )
