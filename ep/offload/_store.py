"""The weight store: pinned host copies, a budgeted device arena, staging slots, a copy stream.

The core half of the offload seam. The policy decided where each weight lives (validated in
`ep.offload._plan`); the store owns every byte and acts on that decision at each `get`.
"""

from __future__ import annotations

import difflib
from collections import OrderedDict, deque
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from types import TracebackType

import numpy as np

from ep.config import Budget
from ep.device import Buffer, Device, Event, PinnedBuffer, Stream, get_device
from ep.errors import ContractError, EPError, OffloadBudgetError, OffloadError
from ep.offload._pieces import SplitWeight
from ep.offload._plan import StoreLayout, describe_policy, footprint, validate_plan
from ep.seams import AccessDecision, OffloadPlan, OffloadPolicy, WeightInfo

__all__ = ["AccessTrace", "OffloadCounters", "WeightStore"]


@dataclass(frozen=True)
class OffloadCounters:
    """What the store did, for ``metrics.offload`` of ``genai-ep run --json``.

    Copy counters are in weight bytes; ``resident_bytes``, ``budget_bytes`` and
    ``peak_device_bytes`` in device footprint bytes (each weight rounded up to 256). Only
    decode-time work counts: the one-time load of the residents is `WeightStore.loaded_bytes`.
    """

    htod_bytes: int  # host->device bytes copied by `get` (streamed weights and cache page-ins)
    htod_bytes_per_token: float  # htod_bytes / tokens reported to end_step (0.0 before any)
    page_ins: int  # weight copies host->device (one per miss)
    hits: int  # accesses served from device memory without a copy
    misses: int  # accesses that needed a copy
    hit_rate: float  # hits / accesses (0.0 before any access)
    byte_hit_rate: float  # bytes served without a copy / bytes requested (0.0 before any)
    evictions: int  # cache entries dropped on a policy's answer
    resident_bytes: int  # arena bytes of the resident weights
    budget_bytes: int
    peak_device_bytes: int  # most device bytes held at once: arena + slots + cache

    def to_dict(self) -> dict[str, int | float]:
        return asdict(self)


@dataclass(frozen=True)
class AccessTrace:
    """The accesses recorded while a step was captured; `WeightStore.replayed` counts each replay.

    A graph replays the copies it captured without calling `get`, so the store learns of them
    from the executor, once per launch of that graph.
    """

    accesses: tuple[str, ...]
    hits: int
    misses: int
    hit_bytes: int
    requested_bytes: int
    htod_bytes: int


class _Trace:
    def __init__(self) -> None:
        self.accesses: list[str] = []
        self.hits = self.misses = self.hit_bytes = self.requested_bytes = self.htod_bytes = 0

    def freeze(self) -> AccessTrace:
        return AccessTrace(
            tuple(self.accesses),
            self.hits,
            self.misses,
            self.hit_bytes,
            self.requested_bytes,
            self.htod_bytes,
        )


class _Slot:
    """One fixed staging slot: its events say when its last copy landed and its last use ended."""

    def __init__(self, index: int, offset: int) -> None:
        self.index = index
        self.offset = offset
        self.ready: Event | None = None  # recorded on the copy stream after the copy into it
        self.release: Event | None = None  # recorded on the compute stream after its last use


class WeightStore:
    """Every weight of a model under one offload plan: ``get(name)`` returns its device buffer.

    ``stream`` is the compute stream: resident weights are loaded on it and it waits for each
    streamed copy. The store has a copy stream of its own. ``slots`` staging slots (at least 2,
    so one copy overlaps the previous weight's compute) hold streamed weights; the buffers from
    the caller's last ``slots - 1`` calls to `get` stay valid, so an op that reads k weights at
    once needs ``slots >= k + 1``.
    """

    def __init__(
        self,
        device: Device | str,
        weights: Mapping[str, np.ndarray],
        infos: Sequence[WeightInfo],
        policy: OffloadPolicy,
        budget: Budget | int,
        *,
        stream: Stream,
        slots: int = 2,
        splits: Mapping[str, SplitWeight] | None = None,
    ) -> None:
        self.device = get_device(device)
        self.policy = policy
        self._compute = stream
        if not isinstance(slots, int) or slots < 2:
            raise OffloadError(
                f"slots={slots!r}: the store needs at least 2 staging slots (one being filled "
                "while the other is read); pass slots >= 2"
            )
        self._slots_wanted = slots
        self._infos = self._check_inputs(weights, infos)
        self.splits: Mapping[str, SplitWeight] = self._check_splits(splits or {}, self._infos)
        total = sum(footprint(w.nbytes) for w in self._infos.values())
        budget_bytes, budget_text = self._resolve(budget, total)

        try:
            plan = policy.plan(tuple(self._infos.values()), budget_bytes)
        except EPError:
            raise
        except Exception as exc:
            raise ContractError(
                f"{describe_policy(policy)}: plan() raised {type(exc).__name__}: {exc}. "
                "A policy returns an OffloadPlan and raises only ep.errors exceptions"
            ) from exc
        self.layout: StoreLayout = validate_plan(
            policy, plan, tuple(self._infos.values()), budget_bytes,
            slots=slots, budget_text=budget_text,
        )  # fmt: skip
        self._closed = False
        self._alloc_all(weights)

    # -- construction --

    @staticmethod
    def _check_inputs(
        weights: Mapping[str, np.ndarray], infos: Sequence[WeightInfo]
    ) -> dict[str, WeightInfo]:
        by_name: dict[str, WeightInfo] = {}
        for info in infos:
            if not isinstance(info, WeightInfo):
                raise OffloadError(f"infos must hold WeightInfo, got {type(info).__name__}")
            if info.name in by_name:
                raise OffloadError(f"WeightInfo {info.name!r} is listed twice; list each once")
            by_name[info.name] = info
        if set(by_name) != set(weights):
            extra = sorted(set(by_name) - set(weights))[:4]
            missing = sorted(set(weights) - set(by_name))[:4]
            raise OffloadError(
                f"infos and weights must name the same tensors: infos without a weight {extra}, "
                f"weights without an info {missing}; build infos with ep.offload.weight_infos"
            )
        for name, info in by_name.items():
            array = weights[name]
            if not isinstance(array, np.ndarray) or array.nbytes != info.nbytes:
                got = getattr(array, "nbytes", type(array).__name__)
                raise OffloadError(
                    f"weight {name!r}: WeightInfo says {info.nbytes} bytes, the array has {got}; "
                    "pass NumPy arrays and build infos from them"
                )
        return by_name

    @staticmethod
    def _check_splits(
        splits: Mapping[str, SplitWeight], infos: Mapping[str, WeightInfo]
    ) -> dict[str, SplitWeight]:
        for name, split in splits.items():
            missing = [p.name for p in split.pieces if p.name not in infos]
            if name in infos or missing:
                raise OffloadError(
                    f"split weight {name!r}: the store must hold its pieces ({missing[:3]} "
                    "missing) and not the whole weight; pass the weights split_weights returned"
                )
        return dict(splits)

    @staticmethod
    def _resolve(budget: Budget | int, total: int) -> tuple[int, str]:
        if isinstance(budget, Budget):
            return budget.resolve(total), f"{budget.text!r} (of {total} weight bytes)"
        if isinstance(budget, int) and not isinstance(budget, bool) and budget > 0:
            return budget, f"{budget} bytes"
        raise OffloadBudgetError(
            f"budget {budget!r} is not a byte count: pass a positive int or an ep.config.Budget "
            "(parse_budget('50%'))"
        )

    def _alloc_all(self, weights: Mapping[str, np.ndarray]) -> None:
        dev, layout, stream = self.device, self.layout, self._compute
        before = dev.counters().htod_bytes
        # Every weight in one pinned block, at the same 256-byte boundaries as the arena.
        self._host_offsets: dict[str, int] = {}
        pinned_bytes = 0
        for name in self._infos:
            self._host_offsets[name] = pinned_bytes
            pinned_bytes += footprint(self._infos[name].nbytes)
        self._pinned: PinnedBuffer = dev.alloc_pinned(
            max(pinned_bytes, 1), np.uint8, stream=stream, name="offload-pinned"
        )
        raw = self._pinned.array
        self._dtypes: dict[str, tuple[np.dtype, tuple[int, ...]]] = {}
        for name, offset in self._host_offsets.items():
            array = np.ascontiguousarray(weights[name])
            raw[offset : offset + array.nbytes] = array.reshape(-1).view(np.uint8)
            self._dtypes[name] = (array.dtype, array.shape)

        self._arena: Buffer | None = None
        self._resident: dict[str, Buffer] = {}
        if layout.arena_bytes:
            self._arena = dev.alloc(
                layout.arena_bytes, np.uint8, stream=stream, name="offload-arena"
            )
            for name, offset in layout.resident_offsets.items():
                dtype, shape = self._dtypes[name]
                view = self._arena.view(dtype, shape, offset=offset, name=name)
                self._copy_from_pinned(view, name, stream)
                self._resident[name] = view
        self.loaded_bytes = dev.counters().htod_bytes - before

        self._slots = [
            _Slot(i, layout.slots_offset + i * layout.slot_bytes) for i in range(layout.slots)
        ]
        self._slot_views: dict[tuple[int, str], Buffer] = {}
        needs_copies = bool(layout.slots or layout.cache_bytes)
        self.copy_stream: Stream | None = (
            dev.create_stream(name="offload-copy") if needs_copies else None
        )
        # Cache entries in recency order (least recent first), and evicted ones not yet freed.
        self._cache: OrderedDict[str, Buffer] = OrderedDict()
        self._cache_live = 0
        self._pending: deque[tuple[Buffer, Event | None, int]] = deque()
        self._pending_bytes = 0
        # (name, slot index or -1) of recent gets: the last `slots - 1` stay valid.
        self._held: deque[tuple[str, int]] = deque()
        # Prefetch of streamed weights: the streamed gets of the last eager step, in order, are
        # this step's prediction. Streamed get m of a step uses slot m % slots; the copy for
        # prediction i is issued as soon as its slot is free (see `_prefetch`).
        self._sequence: tuple[str, ...] = ()
        self._learning: list[str] | None = None
        self._gets = 0  # streamed gets so far in this step
        self._issued = 0  # predictions copied ahead so far in this step
        self._predicting = False
        self._unjoined: Event | None = None  # the last copy the compute stream has not waited on
        self._trace: _Trace | None = None

        self._htod = self._page_ins = self._hits = self._misses = self._evictions = 0
        self._hit_bytes = self._requested_bytes = 0
        self._tokens = 0
        self._peak = self.device_bytes

    # -- what the executor calls --

    @property
    def plan(self) -> OffloadPlan:
        """The validated `ep.seams.OffloadPlan` (``capture_safe``, ``reason``)."""
        return self.layout.plan

    @property
    def capture_safe(self) -> bool:
        return bool(self.layout.plan.capture_safe)

    @property
    def device_bytes(self) -> int:
        """Device bytes the store holds now: arena and slots, cache entries, evictions in flight."""
        return self.layout.arena_bytes + self._cache_live + self._pending_bytes

    def placement(self, name: str) -> str:
        """``"resident"``, ``"stream"`` or ``"cache"``."""
        self._info(name)
        return self.layout.placements[name]

    def get(self, name: str, *, stream: Stream) -> Buffer:
        """The device buffer holding weight ``name`` for the kernels enqueued next on ``stream``.

        Resident: its fixed place in the arena. Streamed: copied from pinned memory into the next
        staging slot on the copy stream; ``stream`` waits for the copy. Cached: a hit returns the
        cached buffer; a miss asks the policy what to evict, then pages the weight in. The buffer
        stays valid until ``slots - 1`` further calls to `get`, or `end_step`.
        """
        self._check_open("get")
        info = self._info(name)
        capturing = stream.capturing
        if capturing and self._trace is None:
            raise OffloadError(
                f"get({name!r}) on a capturing stream: call store.begin_capture() before the "
                "capture and store.end_capture() after it, so replays can be counted"
            )
        self._release_old(stream, keep=self._slots_wanted - 1)
        where = self.layout.placements[name]
        if where == "resident":
            self._count(info, copied=False)
            self._held.append((name, -1))
            return self._resident[name]
        if where == "stream":
            buffer = self._stream_in(name, stream)
            self._count(info, copied=True, nbytes=0)  # its bytes count when copied
            return buffer
        return self._cache_get(info, stream)

    def resident_buffer(self, name: str) -> Buffer | None:
        """The fixed buffer of a resident weight (None otherwise), for an executor to bind once.

        Not counted as an access: an executor that binds residents once reports their reads
        each step with ``replayed(store.fixed_reads(names))``, so the ledger still sees them.
        """
        self._check_open("resident_buffer")
        self._info(name)
        return self._resident.get(name)

    def fixed_reads(self, names: Sequence[str]) -> AccessTrace:
        """The reads of resident weights bound once (one per name listed), as a trace."""
        infos = [self._info(n) for n in names]
        streamed = [i.name for i in infos if self.layout.placements[i.name] != "resident"]
        if streamed:
            raise OffloadError(
                f"fixed_reads: {streamed[:4]} are not resident, so they have no fixed buffer; "
                "get them at call time with store.get(name, stream=...)"
            )
        nbytes = sum(i.nbytes for i in infos)
        return AccessTrace(tuple(names), len(infos), 0, nbytes, nbytes, 0)

    def begin_step(self) -> None:
        """Start a decode step: every earlier buffer is released and slots restart at slot 0.

        Restarting makes the slot of each streamed weight the same in every step with the same
        access sequence, which is what makes a streamed plan capture-safe.
        """
        self._check_open("begin_step")
        self._release_old(self._compute, keep=0)
        if self._slots and not self._compute.capturing:
            # Covers reads no event marked: those of a graph launched since the last step.
            boundary = self._compute.record()
            for slot in self._slots:
                slot.release = boundary
        self._reclaim(0)
        self._gets = self._issued = 0
        self._predicting = False

    def start(self, stream: Stream) -> None:
        """The first work of a step on ``stream`` (inside its capture when it is captured):
        copies of the first predicted streamed weights start now, beside whatever the step
        computes before it reads them."""
        self._check_open("start")
        self._gets = self._issued = 0
        self._learning = None if stream.capturing else []
        self._predicting = bool(self._sequence) and self.copy_stream not in (None, stream)
        if self._predicting:
            self._prefetch()

    def finish(self, stream: Stream) -> None:
        """The last work of a step on ``stream``: it waits for every copy still unwaited (a
        prediction the step did not use), which also joins the copy stream into a capture."""
        self._check_open("finish")
        if self._unjoined is not None and self.copy_stream is not None:
            stream.wait(self.copy_stream.record())
            self._unjoined = None

    def end_step(self, tokens: int) -> None:
        """End a decode step that produced ``tokens`` tokens (the batch size, for decode)."""
        self._check_open("end_step")
        if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 0:
            raise OffloadError(f"end_step(tokens={tokens!r}): expected a count of 0 or more")
        self._tokens += tokens
        self._release_old(self._compute, keep=0)
        if self._learning is not None and tuple(self._learning) != self._sequence:
            self._sequence = tuple(self._learning)  # the next steps predict this order
        self._learning = None

    def begin_capture(self) -> None:
        """Before capturing a step: refuses a plan whose addresses change (with its reason)."""
        self._check_open("begin_capture")
        if not self.capture_safe:
            raise OffloadError(
                f"offload plan is not capture-safe: {self.layout.policy} moves weights at run "
                f"time ({self.layout.plan.reason}); run these steps eagerly or pick a "
                "capture-safe policy (resident, stream, scan_resistant)"
            )
        self._trace = _Trace()

    def end_capture(self) -> AccessTrace:
        """After the capture: what the captured step accesses, for `replayed`."""
        if self._trace is None:
            raise OffloadError("end_capture() without begin_capture()")
        trace, self._trace = self._trace.freeze(), None
        return trace

    def replayed(self, trace: AccessTrace) -> None:
        """Count one launch of a graph captured with ``trace`` (its copies ran on the device)."""
        self._check_open("replayed")
        self._hits += trace.hits
        self._misses += trace.misses
        self._page_ins += trace.misses
        self._hit_bytes += trace.hit_bytes
        self._requested_bytes += trace.requested_bytes
        self._htod += trace.htod_bytes

    def counters(self) -> OffloadCounters:
        accesses = self._hits + self._misses
        return OffloadCounters(
            htod_bytes=self._htod,
            htod_bytes_per_token=self._htod / self._tokens if self._tokens else 0.0,
            page_ins=self._page_ins,
            hits=self._hits,
            misses=self._misses,
            hit_rate=self._hits / accesses if accesses else 0.0,
            byte_hit_rate=(
                self._hit_bytes / self._requested_bytes if self._requested_bytes else 0.0
            ),
            evictions=self._evictions,
            resident_bytes=self.layout.resident_bytes,
            budget_bytes=self.layout.budget_bytes,
            peak_device_bytes=self._peak,
        )

    def close(self) -> None:
        """Wait for queued copies, then give back the arena, the cache and the pinned block."""
        if self._closed:
            return
        self._closed = True
        self._compute.sync()
        if self.copy_stream is not None:
            self.copy_stream.sync()
        for buffer in [*self._cache.values(), *(p[0].root for p in self._pending)]:
            buffer.root.free()
        self._cache.clear()
        self._pending.clear()
        self._cache_live = self._pending_bytes = 0
        if self._arena is not None:
            self._arena.free()
        self._pinned.free()
        self._resident.clear()
        self._slot_views.clear()

    def __enter__(self) -> WeightStore:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals --

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise OffloadError(f"{what}: this WeightStore was closed; build a new one")

    def _info(self, name: str) -> WeightInfo:
        info = self._infos.get(name)
        if info is None:
            close = difflib.get_close_matches(str(name), list(self._infos), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise OffloadError(
                f"weight {name!r} is not in this store{hint}; it holds {len(self._infos)} weights"
            )
        return info

    def _count(self, info: WeightInfo, *, copied: bool, nbytes: int | None = None) -> None:
        """One access; a copied one adds ``nbytes`` (default: the weight's) to htod_bytes."""
        copied_bytes = info.nbytes if nbytes is None else nbytes
        trace = self._trace
        if trace is not None:  # captured: counted per replay, as the device counts the copies
            trace.accesses.append(info.name)
            trace.requested_bytes += info.nbytes
            if copied:
                trace.misses += 1
                trace.htod_bytes += copied_bytes
            else:
                trace.hits += 1
                trace.hit_bytes += info.nbytes
            return
        self._requested_bytes += info.nbytes
        if copied:
            self._misses += 1
            self._page_ins += 1
            self._htod += copied_bytes
        else:
            self._hits += 1
            self._hit_bytes += info.nbytes

    def _count_copy(self, name: str) -> None:
        """The bytes of one copy of a streamed weight (a prediction the step did not use
        included: they crossed the bus all the same)."""
        nbytes = self._infos[name].nbytes
        if self._trace is not None:
            self._trace.htod_bytes += nbytes
        else:
            self._htod += nbytes

    def _release_old(self, stream: Stream, *, keep: int) -> None:
        """Release all but the last ``keep`` gets: their reads are enqueued on ``stream`` by now."""
        if len(self._held) <= keep:
            return
        event: Event | None = None
        while len(self._held) > keep:
            _, slot_index = self._held.popleft()
            if slot_index < 0 or stream.capturing:
                continue  # inside a capture one stream orders everything
            if event is None:
                event = stream.record()
            self._slots[slot_index].release = event

    def _slot_view(self, slot: _Slot, name: str) -> Buffer:
        key = (slot.index, name)
        view = self._slot_views.get(key)
        if view is None:
            assert self._arena is not None
            dtype, shape = self._dtypes[name]
            view = self._arena.view(dtype, shape, offset=slot.offset, name=f"slot{slot.index}")
            self._slot_views[key] = view
        return view

    def _stream_in(self, name: str, stream: Stream) -> Buffer:
        """Streamed get m of the step: slot m % slots, filled by a predicted copy already on its
        way, else by a copy issued now."""
        m = self._gets
        self._gets += 1
        slot = self._slots[m % len(self._slots)]
        if self._learning is not None:
            self._learning.append(name)
        copy = self.copy_stream
        if copy is None or copy is stream:  # one stream: copy in order, nothing to overlap
            view = self._slot_view(slot, name)
            self._copy_from_pinned(view, name, stream)
            self._count_copy(name)
        else:
            if not (self._predicting and m < self._issued and self._sequence[m] == name):
                self._predicting = False  # a wrong prediction: copy each weight at its turn
                self._issue(name, slot)
            view = self._slot_view(slot, name)
            assert slot.ready is not None
            stream.wait(slot.ready)
            if slot.ready is self._unjoined:
                self._unjoined = None
        self._held.append((name, slot.index))
        if self._predicting:
            self._prefetch()
        return view

    def _prefetch(self) -> None:
        """Issue the predicted copies whose slots are free: prediction i reuses the slot of
        i - slots, whose buffer the caller gave up at get i - 1 (the last ``slots - 1`` gets
        stay valid), so i may go once i < slots or i <= gets so far."""
        slots = len(self._slots)
        while self._issued < len(self._sequence) and (
            self._issued < slots or self._issued <= self._gets
        ):
            i = self._issued
            self._issue(self._sequence[i], self._slots[i % slots])
            self._issued += 1

    def _issue(self, name: str, slot: _Slot) -> None:
        """Copy ``name`` into ``slot`` on the copy stream after everything the compute stream
        has queued so far (so after every read of the slot's last weight); ``slot.ready``
        marks its end. Inside a capture the copy stream joins it here (a fork)."""
        copy = self.copy_stream
        assert copy is not None
        copy.wait(self._compute.record())
        self._copy_from_pinned(self._slot_view(slot, name), name, copy)
        slot.ready = self._unjoined = copy.record()
        self._count_copy(name)

    def _copy_from_pinned(self, dst: Buffer, name: str, stream: Stream) -> None:
        # From the pinned root with an offset: a view of it would not count as host memory.
        self.device.copy(
            dst, self._pinned, stream=stream, nbytes=dst.nbytes, src_offset=self._host_offsets[name]
        )

    def _copy_in(self, dst: Buffer, name: str, stream: Stream, *, release: Event | None) -> None:
        """Copy ``name`` from pinned memory into ``dst``; ``stream`` waits for it.

        On the copy stream, after ``release`` (the end of the last reads of ``dst``), so the copy
        overlaps whatever ``stream`` is still computing. Inside a capture, on ``stream`` itself:
        a captured graph is one stream.
        """
        copy = self.copy_stream
        if stream.capturing or copy is None or copy is stream:
            self._copy_from_pinned(dst, name, stream)
            return
        if release is not None:
            copy.wait(release)
        self._copy_from_pinned(dst, name, copy)
        stream.wait(copy.record())

    def _cache_get(self, info: WeightInfo, stream: Stream) -> Buffer:
        name = info.name
        hit = self._cache.get(name)
        if hit is not None:
            self._cache.move_to_end(name)
            self._count(info, copied=False)
            self._held.append((name, -1))
            return hit
        if stream.capturing:
            raise OffloadError(
                f"cache miss of {name!r} inside a capture: {self.layout.policy} pages weights in "
                "at run time, which a graph cannot replay; capture only capture-safe plans"
            )
        need = footprint(info.nbytes)
        held = {n for n, _ in self._held}
        candidates = tuple(n for n in self._cache if n not in held)
        free = self.layout.cache_bytes - self._cache_live
        decision = self._ask(info, candidates, free)
        freed = 0
        for victim in decision.evict:
            freed += footprint(self._infos[victim].nbytes)
        if free + freed < need:
            raise ContractError(
                f"{self.layout.policy}: access({name!r}) must evict enough for a {need}-byte page-"
                f"in: {free} bytes were free and its evictions {list(decision.evict)} free "
                f"{freed}, {free + freed} in all. Evict from `cached` (least recently used "
                f"first) until free_bytes + evicted bytes >= {need}"
            )
        for victim in decision.evict:
            self._evict(victim, stream)
        self._reclaim(need)
        dtype, shape = self._dtypes[name]
        entry = self.device.alloc(need, np.uint8, stream=stream, name=f"offload-cache:{name}")
        buffer = entry.view(dtype, shape, name=f"offload-cache:{name}")
        self._cache_live += need
        self._peak = max(self._peak, self.device_bytes)
        # Pool memory is ordered on `stream`: the copy stream may write it only after this point.
        allocated = None if self.copy_stream is stream else stream.record()
        self._copy_in(buffer, name, stream, release=allocated)
        self._cache[name] = buffer
        self._count(info, copied=True)
        self._held.append((name, -1))
        return buffer

    def _ask(self, info: WeightInfo, cached: tuple[str, ...], free: int) -> AccessDecision:
        try:
            decision = self.policy.access(info, cached, free)
        except EPError:
            raise
        except Exception as exc:
            raise ContractError(
                f"{self.layout.policy}: access({info.name!r}) raised {type(exc).__name__}: {exc}"
            ) from exc
        if not isinstance(decision, AccessDecision) or not isinstance(decision.evict, tuple):
            raise ContractError(
                f"{self.layout.policy}: access({info.name!r}) must return an AccessDecision with "
                f"a tuple of names to evict; got {decision!r}"
            )
        allowed = set(cached)
        bad = [v for v in decision.evict if v not in allowed]
        if bad or len(set(decision.evict)) != len(decision.evict):
            why = (
                f"{bad} are not among the evictable cached weights {list(cached)}"
                if bad
                else f"{list(decision.evict)} names a weight twice"
            )
            raise ContractError(
                f"{self.layout.policy}: access({info.name!r}) answered evict={decision.evict!r}: "
                f"{why}. Evict only names from `cached`, each once (weights the caller still "
                "holds are left out of `cached`)"
            )
        return decision

    def _evict(self, name: str, stream: Stream) -> None:
        buffer = self._cache.pop(name)
        size = footprint(self._infos[name].nbytes)
        self._cache_live -= size
        # Reads of it are enqueued on `stream`; free the memory only once they have run.
        event = None if self.copy_stream is None else stream.record()
        self._pending.append((buffer.root, event, size))
        self._pending_bytes += size
        self._evictions += 1

    def _reclaim(self, need: int) -> None:
        """Free evicted entries: the finished ones, then (waiting) as many as ``need`` requires."""
        limit = self.layout.budget_bytes
        while self._pending:
            buffer, event, size = self._pending[0]
            if event is not None and not event.done and self.device_bytes + need <= limit:
                break
            if event is not None:
                event.sync()
            self._pending.popleft()
            self._pending_bytes -= size
            buffer.free()
