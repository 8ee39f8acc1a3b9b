"""The weight store: the core half of the offload seam (policies decide, the store acts).

An offload policy (``ep.seams.OffloadPolicy``, a plugin: ``resident``, ``stream``,
``scan_resistant``, ``lru``) says where each weight lives; `WeightStore` validates that plan, owns
every byte and serves each use::

    store = WeightStore(device, weights, infos, policy, budget, stream=compute)
    store.begin_step()
    buf = store.get(name, stream=compute)  # the device Buffer holding that weight for this use
    ...                                    # enqueue the kernels that read `buf` on `compute`
    store.end_step(tokens=batch)
    store.counters().to_dict()             # metrics.offload
    store.close()

- ``weights``: name → NumPy array; ``infos``: one ``WeightInfo(name, nbytes, layer, op, order)``
  each, ``order`` = position in the order one step reads them (`weight_infos` builds them).
- ``budget``: an ``ep.config.Budget`` (``config.budget``; a share is of the weights' device
  footprint) or a byte count. Every size on the device side is a footprint: bytes rounded up to
  `ALIGN` (256), as each weight starts on such a boundary.
- Construction pins every weight in host memory, asks ``policy.plan(infos, budget_bytes)``,
  validates the plan (`ContractError` naming the plugin for a broken contract,
  `OffloadBudgetError` with the numbers and the fix when the budget cannot hold it), allocates
  one device arena (residents, then ``slots`` staging slots the size of the largest streamed
  weight) and loads the residents on ``stream``.
- ``get``: resident → its fixed place; ``stream`` → copied from pinned memory into the next slot
  on the store's copy stream, after the slot's last reads, while ``stream`` waits on an event
  for the copy; ``cache`` → a hit is served as is; a miss asks ``policy.access(info, cached,
  free_bytes)`` (``cached`` from least to most recently used, without the weights the caller
  still holds), checks that its evictions free enough, and pages the weight in.
- Validity: the buffers of the caller's last ``slots - 1`` calls to ``get`` stay valid (default
  ``slots=2``: one at a time; an op that reads k weights together needs ``slots >= k + 1``), and
  none survive ``end_step``. The caller enqueues a buffer's reads before asking for more.
- Capture: `begin_step` restarts the slots, so every step with the same access sequence puts
  each streamed weight at the same address. Call ``store.begin_capture()`` before capturing a
  step (it refuses a plan that is not ``capture_safe``, with the reason), ``trace =
  store.end_capture()`` after, and ``store.replayed(trace)`` at every launch of that graph (a
  replay copies without calling ``get``; this keeps the ledger equal to the device's).
- Ledger: ``htod_bytes`` (decode-time copies) + `WeightStore.loaded_bytes` (the residents, once)
  equals the device's host→device byte count for the store; ``peak_device_bytes`` ≤ budget.
- Pieces (`split_weights`, ``offload.piece``): a weight larger than the piece size is cut along
  its output axis into pieces, each a weight of the store (``name[start:stop]``); the policies
  place pieces, a slot is the size of the largest streamed piece, and ``store.splits`` tells the
  executor which weights it must run one call per piece for.
"""

from __future__ import annotations

from ep.offload._infos import decoder_use_order, weight_infos
from ep.offload._pieces import (
    DEFAULT_PIECE_BYTES,
    PIECE_ROWS,
    Piece,
    SplitSpec,
    SplitWeight,
    piece_name,
    split_weights,
)
from ep.offload._plan import (
    ALIGN,
    PLACEMENTS,
    StoreLayout,
    describe_policy,
    footprint,
    min_cache_bytes,
    validate_plan,
)
from ep.offload._store import AccessTrace, OffloadCounters, WeightStore

__all__ = [
    "ALIGN",
    "DEFAULT_PIECE_BYTES",
    "PIECE_ROWS",
    "PLACEMENTS",
    "AccessTrace",
    "OffloadCounters",
    "Piece",
    "SplitSpec",
    "SplitWeight",
    "StoreLayout",
    "WeightStore",
    "decoder_use_order",
    "describe_policy",
    "footprint",
    "min_cache_bytes",
    "piece_name",
    "split_weights",
    "validate_plan",
    "weight_infos",
]
