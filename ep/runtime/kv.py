"""The KV cache the runtime owns: one K and one V buffer per layer, shaped by the KV layout.

A `KVLayout` plugin decides the geometry (shape, strides, capacity buckets, growth plans); this
class validates each answer, owns the memory, applies growth plans, keeps the page pool of a
paged layout and counts bytes. Layout answers that break the contract raise `ContractError`
naming the layout.

Memory: every buffer is a `GrowableBuffer` of the CPU device (a reserved array whose address
never changes), reserved for the layout's geometry at the full context. Only what the geometry
reaches is committed: all of it for a packed layout, ``(batch - 1) * stride + capacity`` tokens
for a fixed per-sequence stride, the pages taken so far for a paged pool. A plan that is
``in_place`` grows the buffer behind its address and moves bytes within it; any other plan gets
fresh buffers and copies into them. Bytes that hold no live token are zero (fresh memory is
zeroed, bytes vacated by a relocation and pages given back are cleared). A new batch keeps the
buffers of an unpaged layout whose reservation holds it (`allocate`), so their addresses, and
any graph captured over them, outlive one prompt.

Paged layouts (``strides.page_size > 0``): the cache keeps a `PagePool` — one block-table row per
sequence (int32, -1 = no page yet), a reference count per page and a free list. `prepare` takes
pages on demand before a step writes tokens, `fork` shares one sequence's pages with another
(copy-on-write: a write into a shared page copies it first) and `release` returns a sequence's
pages.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ep.device import CPUDevice, Device, GrowableBuffer
from ep.errors import ConfigError, ContractError, GenerationError
from ep.seams import ByteRange, GrowthPlan, KVGeometry, KVLayout

__all__ = ["KVCache", "KVStats", "PagePool", "prompt_lengths", "verify_growth_plan"]


@dataclass(frozen=True)
class KVStats:
    """Counters of one cache. Bytes are totals over every layer's K and V buffers.

    ``kv_bytes``: what the geometry spans (for a fixed stride: the full reservation);
    ``committed_bytes``: what is backed by memory now; ``relocated_bytes``: moved by growth
    plans; ``copied_bytes``: relocated plus copy-on-write page copies; ``moved_growths``:
    growths that changed the buffers' address; ``bytes_per_token``: the layout's answer for one
    token of one sequence, over all layers, K and V.
    """

    layout: str
    batch: int
    capacity: int  # tokens each sequence can hold now
    kv_bytes: int
    live_bytes: int  # holding live tokens (a shared page counts once)
    growths: int
    copied_bytes: int
    committed_bytes: int = 0
    relocated_bytes: int = 0
    moved_growths: int = 0
    growth_ms: float = 0.0
    bytes_per_token: int = 0
    page_size: int = 0
    pages_in_use: int = 0
    shared_pages: int = 0
    cow_bytes: int = 0


# --- byte-range arithmetic (half-open [start, stop) pairs) -------------------------------------


def _merge(ranges: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for start, stop in sorted(r for r in ranges if r[1] > r[0]):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], stop))
        else:
            out.append((start, stop))
    return out


def _subtract(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merged ``a`` minus merged ``b``."""
    out: list[tuple[int, int]] = []
    j = 0
    for start, stop in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < stop:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < stop:
            out.append((cur, stop))
    return out


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    return _subtract(a, _subtract(a, b))


def _ranges(items: Iterable[ByteRange]) -> list[tuple[int, int]]:
    return _merge((r.offset, r.offset + r.nbytes) for r in items)


# --- the page pool -------------------------------------------------------------------------------


class PagePool:
    """The pages of a paged cache: block tables, reference counts and the free list.

    Pages are handed out lowest id first, so the pages ever used form a dense prefix
    (``high_water``) and the runtime commits memory only for that prefix.
    """

    def __init__(self, *, pages: int, page_size: int, batch: int, columns: int) -> None:
        self.page_size = page_size
        self.limit = pages
        self.refs = np.zeros(pages, np.int32)
        self.tables = np.full((batch, columns), -1, np.int32)
        self.mapped = np.zeros(batch, np.int64)  # table columns in use, per sequence
        self.high_water = 0
        self._free: list[int] = []

    @property
    def pages_in_use(self) -> int:
        return int(np.count_nonzero(self.refs))

    @property
    def shared_pages(self) -> int:
        return int(np.count_nonzero(self.refs > 1))

    def take(self) -> int:
        """A free page with one reference; GenerationError when the pool is exhausted."""
        if self._free:
            page = heapq.heappop(self._free)
        elif self.high_water < self.limit:
            page = self.high_water
            self.high_water += 1
        else:
            raise GenerationError(
                f"the KV page pool is exhausted: all {self.limit} pages of {self.page_size} "
                "tokens are in use; use a larger capacity (--set kv_layout.paged.min_capacity) "
                "or fewer sequences"
            )
        self.refs[page] = 1
        return page

    def drop(self, page: int) -> bool:
        """One reference fewer; True when the page went back to the free list."""
        self.refs[page] -= 1
        if self.refs[page] == 0:
            heapq.heappush(self._free, page)
            return True
        return False

    def grow(self, *, pages: int, columns: int) -> None:
        """More pages allowed and wider block tables (a capacity growth; ids stay)."""
        if pages > self.limit:
            self.refs = np.concatenate([self.refs, np.zeros(pages - self.limit, np.int32)])
            self.limit = pages
        if columns > self.tables.shape[1]:
            wider = np.full((self.tables.shape[0], columns), -1, np.int32)
            wider[:, : self.tables.shape[1]] = self.tables
            self.tables = wider

    def release(self, row: int) -> list[int]:
        """Drop every page of sequence ``row``; the pages that went back to the free list."""
        freed = [
            int(p) for p in self.tables[row, : self.mapped[row]] if p >= 0 and self.drop(int(p))
        ]
        self.tables[row] = -1
        self.mapped[row] = 0
        return freed

    def fork(self, src: int, dst: int) -> list[int]:
        """Give ``dst`` the pages of ``src`` (shared); returns the pages ``dst`` freed first."""
        freed = self.release(dst)
        n = int(self.mapped[src])
        self.tables[dst, :n] = self.tables[src, :n]
        self.mapped[dst] = n
        self.refs[self.tables[src, :n]] += 1
        return freed


# --- the cache -----------------------------------------------------------------------------------

_HOST: list[Device] = []


def _host_device() -> Device:
    """The CPU device the caches' host buffers come from: one of their own, so that a cache
    collected at any moment never moves the shared CPU device's ledger under someone measuring
    it."""
    if not _HOST:
        _HOST.append(CPUDevice())
    return _HOST[0]


class KVCache:
    """Per-layer K and V buffers for a batch, shaped by ``layout``.

    ``keys[i]`` / ``values[i]``: the committed part of layer i's buffers as NumPy arrays —
    shaped like the geometry when all of it is committed, ``[pages, page_size, kv_heads,
    head_dim]`` for a paged pool, flat otherwise. Use `token_view` for [B, C, Hkv, D] access.
    ``epoch`` changes whenever an array, the geometry or the block table is replaced: a backend
    that bound them rebinds when it sees a new epoch.
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        num_layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: np.dtype[Any],
        context: int,
    ) -> None:
        self.layout = layout
        self.num_layers = num_layers
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = np.dtype(dtype)
        self.context = context
        self._device = _host_device()
        self._stream = self._device.default_stream
        self._roots: list[GrowableBuffer] = []
        self._committed = 0  # elements committed per buffer
        self._reserve = 0  # bytes reserved per buffer
        self.keys: list[np.ndarray] = []
        self.values: list[np.ndarray] = []
        self.geometry: KVGeometry | None = None
        self.pool: PagePool | None = None
        self.live_lengths: tuple[int, ...] = ()
        self.epoch = 0
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.growths = 0
        self.moved_growths = 0
        self.relocated_bytes = 0
        self.cow_bytes = 0
        self.growth_seconds = 0.0

    @property
    def copied_bytes(self) -> int:
        """Bytes moved by growth plans and copy-on-write, over all buffers."""
        return self.relocated_bytes + self.cow_bytes

    @property
    def block_table(self) -> np.ndarray | None:
        """The paged pool's int32 [batch, columns] block table (None for contiguous layouts)."""
        return self.pool.tables if self.pool is not None else None

    @property
    def committed_bytes(self) -> int:
        return self._committed * self.dtype.itemsize * 2 * self.num_layers

    # --- layout calls, validated -------------------------------------------------------------

    def _who(self, call: str) -> str:
        return f"KV layout {getattr(self.layout, 'name', type(self.layout).__name__)!r} ({call})"

    def capacity_for(self, needed: int) -> int:
        if needed > self.context:
            raise GenerationError(
                f"{needed} tokens do not fit the context of {self.context} tokens"
            )
        cap = self.layout.capacity_for(needed, context=self.context)
        if not isinstance(cap, int) or not needed <= cap <= self.context:
            raise ContractError(
                f"{self._who('capacity_for')} returned {cap!r} for needed={needed}, "
                f"context={self.context}; expected an int in [{needed}, {self.context}]"
            )
        return cap

    def _geometry(self, batch: int, capacity: int) -> KVGeometry:
        g = self.layout.geometry(
            batch=batch,
            capacity=capacity,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            itemsize=self.dtype.itemsize,
        )
        self._check_geometry(g, batch, capacity, "geometry")
        return g

    def _check_geometry(self, g: KVGeometry, batch: int, capacity: int, call: str) -> None:
        want = (batch, capacity, self.kv_heads, self.head_dim, self.dtype.itemsize)
        got = (g.batch, g.capacity, g.kv_heads, g.head_dim, g.itemsize)
        if got != want:
            raise ContractError(
                f"{self._who(call)} returned a geometry for (batch, capacity, kv_heads, head_dim, "
                f"itemsize) = {got}; expected {want}"
            )
        s = g.strides
        if s.page_size:
            pages = g.shape[0] if g.shape else 0
            need = -(-capacity // s.page_size)
            axes = [(s.dim, self.head_dim), (s.head, self.kv_heads), (s.token, s.page_size)]
            axes.append((s.page, pages))
            if pages < need:
                raise ContractError(
                    f"{self._who(call)}: a pool of {pages} pages of {s.page_size} tokens cannot "
                    f"hold one sequence of capacity {capacity} ({need} pages)"
                )
        else:
            axes = [
                (s.dim, self.head_dim),
                (s.head, self.kv_heads),
                (s.token, capacity),
                (s.batch, batch),
            ]
        strides = (s.batch, s.token, s.head, s.dim, s.page)
        last = sum(stride * (extent - 1) for stride, extent in axes)
        if min(strides) < 0 or last >= g.elements:
            raise ContractError(
                f"{self._who(call)}: strides {s} reach element {last}, beyond the "
                f"{g.elements} elements of shape {g.shape}"
            )
        # Two different tokens must never share memory: sorted by stride, each axis must step
        # over everything the smaller ones reach. A stride that "works at batch 1" fails here.
        reach = 0
        for stride, extent in sorted(a for a in axes if a[1] > 1):
            if stride <= reach:
                raise ContractError(
                    f"{self._who(call)}: strides {s} alias: an axis of {extent} with stride "
                    f"{stride} lands inside the {reach + 1} elements the smaller axes span, so "
                    f"two tokens of shape (batch {batch}, capacity {capacity}, kv_heads "
                    f"{self.kv_heads}, head_dim {self.head_dim}) share memory"
                )
            reach += stride * (extent - 1)

    def _live(self, g: KVGeometry, live_lengths: Sequence[int]) -> list[tuple[int, int]]:
        """Merged byte ranges of the live tokens (from the pool's tables when paged)."""
        if self.pool is not None and g.strides.page_size:
            return _ranges(self._page_ranges(g, live_lengths))
        return _ranges(self.layout.live_ranges(g, live_lengths))

    def _page_ranges(self, g: KVGeometry, live_lengths: Sequence[int]) -> list[ByteRange]:
        assert self.pool is not None
        p = g.strides.page_size
        token_bytes = g.strides.token * g.itemsize
        page_bytes = g.strides.page * g.itemsize
        held: dict[int, int] = {}  # page -> most tokens any sequence holds in it
        for b, n in enumerate(live_lengths):
            for j in range(min(-(-n // p), int(self.pool.mapped[b]))):
                page = int(self.pool.tables[b, j])
                held[page] = max(held.get(page, 0), min(p, n - j * p))
        return [ByteRange(page * page_bytes, t * token_bytes) for page, t in held.items()]

    def _check_plan(
        self, plan: GrowthPlan, old: KVGeometry, capacity: int, live: Sequence[int]
    ) -> None:
        who = self._who("growth_plan")
        if not isinstance(plan, GrowthPlan):
            raise ContractError(f"{who} returned {type(plan).__name__}; expected a GrowthPlan")
        self._check_geometry(plan.new, old.batch, capacity, "growth_plan")
        if plan.stable_address and not plan.in_place:
            raise ContractError(
                f"{who}: the plan says stable_address=True with in_place=False; a plan that "
                "copies into a new buffer cannot keep the address (set in_place=True and move "
                "bytes within the grown buffer, or stable_address=False)"
            )
        src_limit = plan.new.nbytes if plan.in_place else old.nbytes
        for c in plan.copies:
            if (
                c.nbytes < 0
                or c.src_offset < 0
                or c.dst_offset < 0
                or c.src_offset + c.nbytes > src_limit
                or c.dst_offset + c.nbytes > plan.new.nbytes
            ):
                raise ContractError(
                    f"{who}: copy {c} falls outside the buffers (old "
                    f"{old.nbytes} bytes, new {plan.new.nbytes} bytes, in_place={plan.in_place})"
                )
        dsts = sorted((c.dst_offset, c.dst_offset + c.nbytes) for c in plan.copies if c.nbytes)
        for (_, a1), (b0, _) in itertools.pairwise(dsts):
            if b0 < a1:
                raise ContractError(
                    f"{who}: two copies write bytes [{b0}, {min(a1, b0 + 1)}...) of the new "
                    "buffer; each destination byte must be written once"
                )
        if not plan.in_place:
            return
        # In place: a copy may only overwrite live bytes that an earlier copy already moved
        # out, and never its own source (no memmove semantics on a device).
        pending = self._live(old, live)
        moved: list[tuple[int, int]] = []
        for i, c in enumerate(plan.copies):
            if not c.nbytes:
                continue
            src = (c.src_offset, c.src_offset + c.nbytes)
            dst = (c.dst_offset, c.dst_offset + c.nbytes)
            if src[0] < dst[1] and dst[0] < src[1]:
                raise ContractError(
                    f"{who}: in-place copy {i} ({c}) overlaps its own source; split it into "
                    "chunks no longer than the distance it moves, last chunk first"
                )
            clobbered = _subtract(_intersect([dst], pending), moved)
            if clobbered:
                start, stop = clobbered[0]
                raise ContractError(
                    f"{who}: in-place copy {i} ({c}) overwrites live bytes [{start}, {stop}) "
                    "before any copy moved them; order the copies so that every source is read "
                    "before it is overwritten (for a relocation: last sequence first)"
                )
            moved = _merge([*moved, src])

    # --- the runtime's operations ------------------------------------------------------------

    @property
    def batch(self) -> int:
        return self.geometry.batch if self.geometry else 0

    @property
    def capacity(self) -> int:
        return self.geometry.capacity if self.geometry else 0

    def allocate(self, batch: int, needed: int, *, reserve: int = 0) -> None:
        """Zeroed buffers for ``batch`` sequences, the layout's bucket for ``needed``.

        Gives back every page of the previous batch. An unpaged layout keeps the previous
        buffers when their reservation holds this batch at the full context: same addresses,
        so a graph captured over them stays valid from one prompt to the next (what the new
        geometry addresses is zeroed, as fresh memory would be; the memory committed stays at
        its high-water mark). Otherwise fresh buffers.
        """
        capacity = self.capacity_for(max(needed, min(reserve, self.context)))
        g = self._geometry(batch, capacity)
        most = self._geometry(batch, self.context) if capacity < self.context else g
        self._reserve = max(g.nbytes, most.nbytes)
        self.geometry = g
        reuse = (
            not g.strides.page_size
            and bool(self._roots)
            and all(not r.closed and r.reserved_bytes >= self._reserve for r in self._roots)
        )
        if reuse:
            self._committed = self._roots[0].nbytes // self.dtype.itemsize
        else:
            self._roots = self._new_roots(self._reserve)
            self._committed = 0
        if g.strides.page_size:
            self.pool = PagePool(
                pages=g.shape[0],
                page_size=g.strides.page_size,
                batch=batch,
                columns=-(-capacity // g.strides.page_size),
            )
        else:
            self.pool = None
            # Zero only what the geometry can address: a fixed stride's gaps between sequences
            # stay untouched (on the CPU the OS backs no page nobody touched).
            self._commit(self._reach(g), zero=False)
            self._zero(self._addressable(g))
        self._refresh()
        self.live_lengths = (0,) * batch
        self._reset_counters()

    def _new_roots(self, reserve: int) -> list[GrowableBuffer]:
        return [
            self._device.alloc_growable(
                (0,), self.dtype, max_nbytes=reserve, stream=self._stream, name=f"kv.{kind}{i}"
            )
            for kind in ("k", "v")
            for i in range(self.num_layers)
        ]

    def _reach(self, g: KVGeometry) -> int:
        """Elements from the start of the buffer to the last one the geometry addresses."""
        s = g.strides
        last = (
            (g.batch - 1) * s.batch
            + (g.capacity - 1) * s.token
            + (g.kv_heads - 1) * s.head
            + (g.head_dim - 1) * s.dim
        )
        return min(last + 1, g.elements)

    def _commit(self, elements: int, *, zero: bool = True) -> None:
        """Back at least ``elements`` elements of every buffer (new memory zeroed if ``zero``)."""
        if elements <= self._committed:
            return
        old = self._committed
        for root in self._roots:
            root.grow((elements,), stream=self._stream)
            if zero:
                root.array[old:elements] = 0
        self._committed = elements
        self._refresh()

    def _addressable(self, g: KVGeometry) -> list[tuple[int, int]]:
        """Merged byte ranges the geometry's tokens can occupy (every sequence at capacity)."""
        return _ranges(self.layout.live_ranges(g, (g.capacity,) * g.batch))

    def _zero(self, ranges: list[tuple[int, int]]) -> None:
        for root in self._roots:
            raw = root.array.view(np.uint8)
            for start, stop in ranges:
                raw[start:stop] = 0

    def _refresh(self) -> None:
        g = self.geometry
        assert g is not None
        n = self._committed
        page = g.strides.page
        if g.strides.page_size and page == math.prod(g.shape[1:]):
            shape: tuple[int, ...] = (n // page, *g.shape[1:])
        elif n == g.elements:
            shape = g.shape
        else:
            shape = (n,)
        arrays = [root.array.reshape(shape) for root in self._roots]
        self.keys = arrays[: self.num_layers]
        self.values = arrays[self.num_layers :]
        self.epoch += 1

    def ensure(self, needed: int, live_lengths: Sequence[int] | np.ndarray) -> bool:
        """Grow (through the layout's plan) so each sequence holds ``needed`` tokens.

        ``live_lengths``: tokens per sequence that must survive. Returns whether buffers changed.
        """
        old = self.geometry
        if old is None:
            raise ConfigError("KVCache.ensure before allocate")
        self.live_lengths = tuple(int(n) for n in live_lengths)
        if needed <= old.capacity:
            return False
        capacity = self.capacity_for(needed)
        start = time.perf_counter()
        plan = self.layout.growth_plan(old, capacity, self.live_lengths)
        self._check_plan(plan, old, capacity, self.live_lengths)
        self._apply(plan, old)
        self.geometry = plan.new
        if self.pool is not None:
            p = plan.new.strides.page_size
            self.pool.grow(pages=plan.new.shape[0], columns=-(-capacity // p))
        self._refresh()
        self.growths += 1
        self.relocated_bytes += sum(c.nbytes for c in plan.copies) * 2 * self.num_layers
        self.growth_seconds += time.perf_counter() - start
        return True

    def _apply(self, plan: GrowthPlan, old: KVGeometry) -> None:
        new = plan.new
        item = self.dtype.itemsize
        ends = [-(-(c.dst_offset + c.nbytes) // item) for c in plan.copies]
        if new.strides.page_size:  # pages are committed as they are taken, not by a growth
            elements = max([self._committed, *ends])
        else:
            elements = max([self._reach(new), *ends])
        nbytes = elements * self.dtype.itemsize
        if plan.in_place and nbytes <= self._roots[0].reserved_bytes:
            before = self._committed
            after = max(elements, before)
            for root in self._roots:
                root.grow((after,), stream=self._stream)
                raw = root.array.view(np.uint8)
                for c in plan.copies:
                    raw[c.dst_offset : c.dst_offset + c.nbytes] = raw[
                        c.src_offset : c.src_offset + c.nbytes
                    ]
            self._committed = after
            self._zero(self._stale(plan, old, before * self.dtype.itemsize))
            return
        # A fresh buffer: the plan is not in place (or outgrew the reservation, which only a
        # layout whose geometry at the context is smaller than at this capacity can cause).
        self._reserve = max(self._reserve, nbytes)
        fresh = self._new_roots(self._reserve)
        for old_root, root in zip(self._roots, fresh, strict=True):
            root.grow((elements,), stream=self._stream)
            root.array[:] = 0
            dst = root.array.view(np.uint8)
            src = old_root.array.view(np.uint8)
            if plan.in_place:
                # Emulate growing behind the address: old bytes keep their offsets first.
                dst[: src.size] = src
                src = dst
            for c in plan.copies:
                dst[c.dst_offset : c.dst_offset + c.nbytes] = src[
                    c.src_offset : c.src_offset + c.nbytes
                ]
        self._roots = fresh
        self._committed = elements
        self.moved_growths += 1

    def _stale(self, plan: GrowthPlan, old: KVGeometry, before: int) -> list[tuple[int, int]]:
        """After an in-place plan: the bytes the new geometry addresses that hold no live token
        and may not be zero — newly committed memory, bytes the copies moved out of, and bytes
        the old geometry did not address (a fixed stride's gap that is a slot now)."""
        new = plan.new
        after = self._committed * self.dtype.itemsize
        if new.strides.page_size:
            return [(before, after)] if after > before else []
        dirty = _merge(
            [
                (before, after),
                *((c.src_offset, c.src_offset + c.nbytes) for c in plan.copies),
                *_subtract([(0, before)], self._addressable(old)),
            ]
        )
        idle = _subtract(self._addressable(new), self._live(new, self.live_lengths))
        return _intersect(idle, dirty)

    # --- paged pools: pages on demand, fork, copy-on-write, release ----------------------------

    def prepare(
        self, starts: Sequence[int] | np.ndarray, stops: Sequence[int] | np.ndarray
    ) -> bool:
        """Make room for each row b to write tokens ``[starts[b], stops[b])`` (none when
        ``stops[b] <= starts[b]``); returns whether anything bound must be rebound.

        Grows the capacity through the layout when needed (``starts`` are the live lengths);
        for a paged pool also takes the pages the new tokens land in and copies any shared page
        they would write (copy-on-write).
        """
        if self.geometry is None:
            raise ConfigError("KVCache.prepare before allocate")
        epoch = self.epoch
        first = np.asarray(starts, dtype=np.int64)
        last = np.asarray(stops, dtype=np.int64)
        needed = int(last.max()) if last.size else 0
        if needed > self.capacity:
            self.ensure(needed, first)
        if self.pool is not None:
            self._map_pages(first, last)
        return self.epoch != epoch

    def _map_pages(self, first: np.ndarray, last: np.ndarray) -> None:
        pool = self.pool
        assert pool is not None
        p = pool.page_size
        writes = last > first
        want = np.where(writes, -(-last // p), 0)
        copies: list[tuple[int, int]] = []  # (shared page, its private copy)
        if pool.shared_pages:
            for b in np.flatnonzero(writes):
                for j in range(int(first[b]) // p, min(int(want[b]), int(pool.mapped[b]))):
                    page = int(pool.tables[b, j])
                    if pool.refs[page] > 1:
                        mine = pool.take()
                        pool.drop(page)
                        pool.tables[b, j] = mine
                        copies.append((page, mine))
        for b in np.flatnonzero(want > pool.mapped):
            for j in range(int(pool.mapped[b]), int(want[b])):
                pool.tables[b, j] = pool.take()
            pool.mapped[b] = want[b]
        g = self.geometry
        assert g is not None
        self._commit(pool.high_water * g.strides.page)
        size = g.strides.page
        for page, mine in copies:
            for arr in (*self.keys, *self.values):
                flat = arr.reshape(-1)
                flat[mine * size : (mine + 1) * size] = flat[page * size : (page + 1) * size]
        self.cow_bytes += len(copies) * g.strides.page * self.dtype.itemsize * 2 * self.num_layers

    def fork(self, src: int, dst: int) -> None:
        """Let sequence ``dst`` share every page of ``src`` (paged layouts; no bytes copied).

        ``dst`` gives back its own pages first; a later write of either sequence into a shared
        page copies that page (copy-on-write).
        """
        pool = self._paged("fork")
        if src == dst or not (0 <= src < self.batch and 0 <= dst < self.batch):
            raise ConfigError(
                f"KVCache.fork({src}, {dst}): expected two different sequences in [0, {self.batch})"
            )
        self._zero_pages(pool.fork(src, dst))
        lengths = list(self.live_lengths)
        lengths[dst] = lengths[src]
        self.live_lengths = tuple(lengths)

    def release(self, row: int) -> int:
        """Give sequence ``row``'s pages back to the pool (paged layouts); pages freed."""
        pool = self._paged("release")
        if not 0 <= row < self.batch:
            raise ConfigError(f"KVCache.release({row}): expected a sequence in [0, {self.batch})")
        freed = pool.release(row)
        self._zero_pages(freed)
        lengths = list(self.live_lengths)
        lengths[row] = 0
        self.live_lengths = tuple(lengths)
        return len(freed)

    def _paged(self, what: str) -> PagePool:
        if self.pool is None:
            g = self.geometry
            raise ConfigError(
                f"KVCache.{what} needs a paged layout; this cache's layout "
                f"{g.layout if g else getattr(self.layout, 'name', '?')!r} is contiguous "
                "(use --kv-layout paged)"
            )
        return self.pool

    def _zero_pages(self, pages: Sequence[int]) -> None:
        g = self.geometry
        if not pages or g is None:
            return
        size = g.strides.page
        for arr in (*self.keys, *self.values):
            flat = arr.reshape(-1)
            for page in pages:
                flat[page * size : (page + 1) * size] = 0

    # --- views and counters ------------------------------------------------------------------

    def token_view(self, buffer: np.ndarray) -> np.ndarray:
        """A writable ``[batch, capacity, kv_heads, head_dim]`` view via the layout's strides."""
        g = self.geometry
        if g is None or g.strides.page_size:
            raise ConfigError(
                f"KV layout {g.layout if g else '?'} is paged; a token view needs a contiguous one"
            )
        s, item = g.strides, self.dtype.itemsize
        flat = buffer.reshape(-1)
        if flat.size < self._reach(g):
            raise ConfigError(
                f"token_view: the buffer has {flat.size} elements; the geometry reaches "
                f"{self._reach(g)} (pass one of this cache's keys/values)"
            )
        return np.lib.stride_tricks.as_strided(
            flat,
            shape=(g.batch, g.capacity, g.kv_heads, g.head_dim),
            strides=(s.batch * item, s.token * item, s.head * item, s.dim * item),
            writeable=True,
        )

    def stats(self) -> KVStats:
        g = self.geometry
        name = getattr(self.layout, "name", "?")
        per_token = (
            self.layout.bytes_per_token(
                kv_heads=self.kv_heads, head_dim=self.head_dim, itemsize=self.dtype.itemsize
            )
            * 2
            * self.num_layers
        )
        if g is None:
            return KVStats(name, 0, 0, 0, 0, self.growths, 0, bytes_per_token=per_token)
        live = sum(stop - start for start, stop in self._live(g, self.live_lengths))
        pool = self.pool
        return KVStats(
            layout=g.layout,
            batch=g.batch,
            capacity=g.capacity,
            kv_bytes=g.nbytes * 2 * self.num_layers,
            live_bytes=live * 2 * self.num_layers,
            growths=self.growths,
            copied_bytes=self.copied_bytes,
            committed_bytes=self.committed_bytes,
            relocated_bytes=self.relocated_bytes,
            moved_growths=self.moved_growths,
            growth_ms=self.growth_seconds * 1e3,
            bytes_per_token=per_token,
            page_size=g.strides.page_size,
            pages_in_use=pool.pages_in_use if pool is not None else 0,
            shared_pages=pool.shared_pages if pool is not None else 0,
            cow_bytes=self.cow_bytes,
        )


# --- an exact check of a growth plan, for tests and layout authors --------------------------------


def verify_growth_plan(
    old: KVGeometry,
    plan: GrowthPlan,
    live_lengths: Sequence[int],
    *,
    block_table: np.ndarray | None = None,
) -> None:
    """Apply ``plan`` to a buffer whose every live element carries a unique label and check that
    each live (sequence, token, head, feature) sits where ``plan.new``'s strides say.

    Exact but O(buffer size): meant for tests. Raises ContractError naming the first misplaced
    token. ``block_table``: the pool's tables for a paged layout (default: the identity table of
    ``old``'s pool); a plan does not change them.
    """
    item = old.itemsize
    new = plan.new
    for c in plan.copies:
        if c.src_offset % item or c.dst_offset % item or c.nbytes % item:
            raise ContractError(f"copy {c} is not aligned to the element size {item}")
    if old.strides.page_size and block_table is None:
        # Pages keep their ids across a growth: the identity table of the old pool, for both.
        per_seq = math.ceil(old.capacity / old.strides.page_size)
        block_table = np.arange(old.batch * per_seq, dtype=np.int64).reshape(old.batch, per_seq)
    size_old = old.elements
    size_new = new.elements
    labels_old = np.zeros(size_old, np.int64)
    b, t, h, d = _live_index(old, live_lengths)
    label = 1 + np.arange(b.size, dtype=np.int64)
    labels_old[_offsets(old, b, t, h, d, block_table)] = label
    if plan.in_place:
        buf = np.zeros(max(size_old, size_new), np.int64)
        buf[:size_old] = labels_old
        src = buf
    else:
        buf = np.zeros(size_new, np.int64)
        src = labels_old
    for c in plan.copies:
        s, dd, n = c.src_offset // item, c.dst_offset // item, c.nbytes // item
        buf[dd : dd + n] = src[s : s + n].copy()  # copies apply in order, as the runtime does
    got = buf[_offsets(new, b, t, h, d, block_table)]
    wrong = np.flatnonzero(got != label)
    if wrong.size:
        i = int(wrong[0])
        raise ContractError(
            f"growth plan ({plan.reason}) misplaces {wrong.size} of {label.size} live elements; "
            f"first: sequence {int(b[i])}, token {int(t[i])}, head {int(h[i])}, feature "
            f"{int(d[i])}"
        )


def _live_index(
    g: KVGeometry, live_lengths: Sequence[int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rows, tokens = [], []
    for seq, n in enumerate(live_lengths):
        count = min(int(n), g.capacity)
        rows.append(np.full(count, seq, np.int64))
        tokens.append(np.arange(count, dtype=np.int64))
    bt = np.concatenate(rows) if rows else np.zeros(0, np.int64)
    tt = np.concatenate(tokens) if tokens else np.zeros(0, np.int64)
    per = g.kv_heads * g.head_dim
    b = np.repeat(bt, per)
    t = np.repeat(tt, per)
    h = np.tile(np.repeat(np.arange(g.kv_heads), g.head_dim), bt.size)
    d = np.tile(np.arange(g.head_dim), bt.size * g.kv_heads)
    return b, t, h, d


def _offsets(
    g: KVGeometry,
    b: np.ndarray,
    t: np.ndarray,
    h: np.ndarray,
    d: np.ndarray,
    table: np.ndarray | None,
) -> np.ndarray:
    s = g.strides
    if s.page_size:
        assert table is not None
        pages = table[b, t // s.page_size].astype(np.int64)
        base = pages * s.page + (t % s.page_size) * s.token
    else:
        base = b * s.batch + t * s.token
    return base + h * s.head + d * s.dim


def prompt_lengths(prompts: Sequence[Any], context: int) -> tuple[np.ndarray, int]:
    """Each prompt's length and the longest, checked to leave room for one new token."""
    lens = np.array([len(p) for p in prompts], dtype=np.int64)
    if lens.size == 0 or lens.min() == 0:
        raise GenerationError("prefill needs at least one prompt and no empty prompt")
    width = int(lens.max())
    if width >= context:
        raise GenerationError(
            f"a prompt of {width} tokens leaves no room in the context of {context} tokens"
        )
    return lens, width
