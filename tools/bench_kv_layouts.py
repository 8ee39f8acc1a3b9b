"""Benchmark: the KV layouts on the CPU — growth cost, per-step KV cost, memory committed.

Every layout runs through the runtime's own `ep.runtime.kv.KVCache` (so the numbers include the
contract checks, the zeroing of fresh memory and the device layer's stable-address buffers) and
through this project's KV ops' NumPy kernels (`kv_commit_into`, `kv_attention_from`: what an ep
graph runs inside ONNX Runtime on the CPU). Cache shape per layer: ``--kv-heads`` heads of
``--head-dim`` (default 2 x 64, Qwen2.5-0.5B's), fp32, ``--layers`` layers; bytes scale with
layers.

* **growth**: every row full at capacity C, grow to the next bucket, from 16 up to the largest
  context: bytes the plan moves, milliseconds, whether the address stayed; and the time of the
  first allocation (16 tokens), which commits (and zeroes) what the geometry addresses.
* **step**: one decode step's KV work at context L (commit one token per row, attend one query
  per row over L tokens, in every layer; plus `KVCache.prepare`), batch B.
* **memory**: bytes committed with every row at L tokens, and with B rows sharing one L-token
  prompt (the paged layout forks it; contiguous layouts hold B copies).
* **e2e** (``--e2e``): the bundled default model as an ep graph on the ``ort`` backend, greedy
  decode per layout and batch: ms per step, growth ms, bytes moved, bytes committed; the tokens
  of every layout are asserted equal first.

Repeats are interleaved across layouts; medians with min and max are reported.

    .venv/bin/python tools/bench_kv_layouts.py [--batches 1 4 16] [--contexts 256 1024 4096]
        [--layers 2] [--repeats 3] [--e2e] [--e2e-tokens 200] [--json OUT] [--tables JSON]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _bench import machine_info, spread

from ep.ops.kv import kv_attention_from, kv_commit_into, kv_geometry
from ep.runtime.kv import KVCache
from ep.seams import KVLayout
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_builtin.kv_paged import PagedLayout
from ep_builtin.kv_seq_major import SeqMajorLayout

LAYOUTS: dict[str, Callable[[], KVLayout]] = {
    "head_major": lambda: HeadMajorLayout(min_capacity=16),
    "seq_major": lambda: SeqMajorLayout(min_capacity=16),
    "seq_major fixed_stride": lambda: SeqMajorLayout(min_capacity=16, fixed_stride=True),
    "paged (16)": lambda: PagedLayout(page_size=16, min_capacity=16),
}


def make_cache(name: str, args: argparse.Namespace, context: int) -> KVCache:
    return KVCache(
        LAYOUTS[name](),
        num_layers=args.layers,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        dtype=np.dtype(np.float32),
        context=context,
    )


# --- growth --------------------------------------------------------------------------------------


def bench_growth(args: argparse.Namespace) -> list[dict[str, Any]]:
    context = max(args.contexts)
    rows = []
    for batch in args.batches:
        runs: dict[str, list[list[tuple[int, int, float, int, bool]]]] = {n: [] for n in LAYOUTS}
        allocate: dict[str, list[float]] = {n: [] for n in LAYOUTS}
        for _ in range(args.repeats):
            for name in LAYOUTS:
                cache = make_cache(name, args, context)
                start = time.perf_counter()
                cache.allocate(batch, 16)
                allocate[name].append((time.perf_counter() - start) * 1e3)
                steps = []
                while cache.capacity < context:
                    cap = cache.capacity
                    if cache.pool is not None:
                        cache.prepare([0] * batch, [cap] * batch)  # every row's pages taken
                    address = cache.keys[0].ctypes.data
                    moved = cache.relocated_bytes
                    start = time.perf_counter()
                    cache.prepare([cap] * batch, [cap + 1] * batch)
                    ms = (time.perf_counter() - start) * 1e3
                    steps.append(
                        (
                            cap,
                            cache.capacity,
                            ms,
                            cache.relocated_bytes - moved,
                            cache.keys[0].ctypes.data == address,
                        )
                    )
                runs[name].append(steps)
                del cache
        for name, repeats in runs.items():
            for i, (old, new, _, moved, stable) in enumerate(repeats[0]):
                rows.append(
                    {
                        "layout": name,
                        "batch": batch,
                        "from": old,
                        "to": new,
                        "bytes_moved": moved,
                        "address_stable": stable,
                        "ms": spread([r[i][2] for r in repeats]),
                    }
                )
            totals = [sum(s[2] for s in r) for r in repeats]
            rows.append(
                {
                    "layout": name,
                    "batch": batch,
                    "from": 16,
                    "to": context,
                    "bytes_moved": sum(s[3] for s in repeats[0]),
                    "address_stable": all(s[4] for s in repeats[0]),
                    "ms": spread(totals),
                    "allocate_ms": spread(allocate[name]),
                    "total": True,
                }
            )
    return rows


# --- per-step KV work ----------------------------------------------------------------------------


def bench_step(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    h, d, q_heads = args.kv_heads, args.head_dim, args.kv_heads * 2
    rows = []
    for batch in args.batches:
        for length in args.contexts:
            times: dict[str, list[float]] = {n: [] for n in LAYOUTS}
            outputs: dict[str, np.ndarray] = {}
            caches = {}
            for name in LAYOUTS:
                cache = make_cache(name, args, max(args.contexts))
                cache.allocate(batch, length)
                cache.prepare([0] * batch, [length - 1] * batch)
                for buf in cache.keys + cache.values:  # random live tokens
                    flat = buf.reshape(-1)
                    flat[:] = rng.standard_normal(flat.size, dtype=np.float32)
                caches[name] = cache
            new_k = rng.standard_normal((batch, 1, h, d), dtype=np.float32)
            new_v = rng.standard_normal((batch, 1, h, d), dtype=np.float32)
            query = rng.standard_normal((batch, 1, q_heads, d), dtype=np.float32)
            positions = np.full((batch, 1), length - 1, np.int64)
            lens = np.full(batch, length - 1, np.int64)
            for _ in range(args.repeats):
                for name, cache in caches.items():
                    start = time.perf_counter()
                    cache.prepare(lens, lens + 1)
                    assert cache.geometry is not None
                    geometry = kv_geometry(cache.geometry)
                    table = cache.block_table
                    out = None
                    for layer in range(args.layers):
                        k, v = cache.keys[layer], cache.values[layer]
                        got = kv_commit_into(
                            k.reshape(-1), v.reshape(-1), new_k, new_v, positions, geometry, table
                        )
                        out = kv_attention_from(
                            k.reshape(-1), v.reshape(-1), query, positions, got, geometry,
                            kv_heads=h, scale=0.0, block_table=table,
                        )  # fmt: skip
                    times[name].append((time.perf_counter() - start) * 1e3)
                    assert out is not None
                    outputs[name] = out
            for name, cache in caches.items():
                rows.append(
                    {
                        "layout": name,
                        "batch": batch,
                        "context": length,
                        "capacity": cache.capacity,
                        "ms": spread(times[name]),
                    }
                )
            del caches
    return rows


# --- memory --------------------------------------------------------------------------------------


def bench_memory(args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    context = max(args.contexts)
    for batch in args.batches:
        for length in args.contexts:
            for name in LAYOUTS:
                cache = make_cache(name, args, context)
                cache.allocate(batch, length)
                cache.prepare([0] * batch, [length] * batch)
                cache.live_lengths = (length,) * batch
                own = cache.stats()
                shared = own.committed_bytes
                if cache.pool is not None:  # one prompt of `length` tokens, forked B - 1 times
                    cache.allocate(batch, length)
                    cache.prepare([0] * batch, [length] + [0] * (batch - 1))
                    for b in range(1, batch):
                        cache.fork(0, b)
                    shared = cache.stats().committed_bytes
                rows.append(
                    {
                        "layout": name,
                        "batch": batch,
                        "context": length,
                        "kv_bytes": own.kv_bytes,
                        "committed_bytes": own.committed_bytes,
                        "live_bytes": own.live_bytes,
                        "committed_shared_prompt": shared,
                    }
                )
                del cache
    return rows


# --- whole model ---------------------------------------------------------------------------------


def bench_e2e(args: argparse.Namespace) -> list[dict[str, Any]]:
    from ep.model import load_model
    from ep.runtime import GenerationOptions, Generator
    from ep_graphs import DEFAULT_MODEL

    model = load_model(str(DEFAULT_MODEL), flavour="ep")
    rng = np.random.default_rng(1)
    rows = []
    for batch in args.batches:
        prompts = [rng.integers(3, model.vocab_size, n).tolist() for n in (9, 5, 12, 3) * 4][:batch]
        new = min(args.e2e_tokens, model.context_length - max(len(p) for p in prompts))
        options = GenerationOptions(new, min_new_tokens=new)
        gens = {n: Generator(model, layout=LAYOUTS[n](), options=options) for n in LAYOUTS}
        first = {n: g.generate(prompts) for n, g in gens.items()}  # warm-up, and the tokens
        tokens = {r.tokens for r in first.values()}
        if len(tokens) != 1:
            sys.exit(f"batch {batch}: the layouts disagree on the tokens: stop, this is a bug")
        steps: dict[str, list[float]] = {n: [] for n in LAYOUTS}
        last = {}
        for _ in range(args.repeats):
            for name, gen in gens.items():
                m = gen.generate(prompts).metrics
                steps[name].append(m.decode_ms_per_step_median)
                last[name] = m
        for name, m in last.items():
            rows.append(
                {
                    "layout": name,
                    "batch": batch,
                    "new_tokens": new,
                    "ms_per_step": spread(steps[name]),
                    "growths": m.growths,
                    "growth_ms": m.kv_growth_ms,
                    "relocated_bytes": m.kv_relocated_bytes,
                    "committed_bytes": m.kv_committed_bytes,
                    "kv_bytes": m.kv_bytes,
                    "capacity": m.kv_capacity,
                }
            )
        for gen in gens.values():
            gen.backend.close()  # type: ignore[attr-defined]
    return rows


# --- output --------------------------------------------------------------------------------------


def mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def fmt(s: dict[str, float]) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}–{s['max']:.2f})"


def _row(*cells: object) -> None:
    print("| " + " | ".join(map(str, cells)) + " |")


def print_tables(result: dict[str, Any]) -> None:
    """The markdown tables of docs/benchmarks/kv_layouts.md (ratios against head_major)."""
    batches, contexts = result["args"]["batches"], result["args"]["contexts"]
    top = contexts[-1]

    def pick(section: str, **want: Any) -> dict[str, Any]:
        return next(
            r for r in result[section] if all(r.get(k) == v for k, v in want.items())
        )  # fmt: skip

    print(f"### Growth from 16 to {top} tokens, every row full (all growths together)\n")
    _row("layout", "batch", "bytes moved (MiB)", "address stable", "ms median (min–max)",
         "÷ head_major", "first allocation ms")  # fmt: skip
    _row(*["---"] * 7)
    for b in batches:
        ref = pick("growth", layout="head_major", batch=b, total=True)["ms"]["median"]
        for name in LAYOUTS:
            r = pick("growth", layout=name, batch=b, total=True)
            _row(name, b, mib(r["bytes_moved"]), "yes" if r["address_stable"] else "no",
                 fmt(r["ms"]), f"{r['ms']['median'] / ref:.2f}", fmt(r["allocate_ms"]))  # fmt: skip
    print(f"\n### The last growth alone (to {top} tokens): MiB moved, ms median (min–max)\n")
    _row("layout", *(f"batch {b}" for b in batches))
    _row(*["---"] * (len(batches) + 1))
    for name in LAYOUTS:
        cells = []
        for b in batches:
            r = pick("growth", layout=name, batch=b, to=top, total=None)
            cells.append(f"{mib(r['bytes_moved'])} MiB, {fmt(r['ms'])}")
        _row(name, *cells)
    layers = result["args"]["layers"]
    print(f"\n### KV work of one decode step ({layers} layers): ms median (min–max) · "
          "÷ head_major\n")  # fmt: skip
    _row("layout", "batch", *(f"context {c}" for c in contexts))
    _row(*["---"] * (len(contexts) + 2))
    for b in batches:
        for name in LAYOUTS:
            cells = []
            for c in contexts:
                r = pick("step", layout=name, batch=b, context=c)["ms"]
                ref = pick("step", layout="head_major", batch=b, context=c)["ms"]
                cells.append(f"{fmt(r)} · {r['median'] / ref['median']:.2f}")
            _row(name, b, *cells)
    print(f"\n### Memory committed (MiB, {layers} layers, K and V): every row at L tokens / "
          "B rows sharing one L-token prompt\n")  # fmt: skip
    _row("layout", "batch", *(f"L = {c}" for c in contexts))
    _row(*["---"] * (len(contexts) + 2))
    for b in batches:
        for name in LAYOUTS:
            cells = []
            for c in contexts:
                r = pick("memory", layout=name, batch=b, context=c)
                cells.append(f"{mib(r['committed_bytes'])} / {mib(r['committed_shared_prompt'])}")
            _row(name, b, *cells)
    if result.get("e2e"):
        print("\n### Whole model: the bundled default model as an ep graph, ort backend\n")
        _row("layout", "batch", "new tokens", "ms/step median (min–max)", "÷ head_major",
             "growths", "growth ms", "moved MiB", "committed MiB")  # fmt: skip
        _row(*["---"] * 9)
        for b in batches:
            ref = pick("e2e", layout="head_major", batch=b)["ms_per_step"]["median"]
            for name in LAYOUTS:
                r = pick("e2e", layout=name, batch=b)
                _row(name, b, r["new_tokens"], fmt(r["ms_per_step"]),
                     f"{r['ms_per_step']['median'] / ref:.2f}", r["growths"],
                     f"{r['growth_ms']:.2f}", f"{r['relocated_bytes'] / 2**20:.2f}",
                     f"{r['committed_bytes'] / 2**20:.2f}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--e2e", action="store_true", help="also run the bundled model")
    parser.add_argument("--e2e-tokens", type=int, default=200)
    parser.add_argument("--json", metavar="OUT", help="write the raw results here")
    parser.add_argument("--tables", metavar="JSON", help="only print the tables of a saved run")
    args = parser.parse_args(argv)
    args.contexts = sorted(args.contexts)
    result: dict[str, Any] = {
        "machine": machine_info(),
        "args": vars(args),
        "command": " ".join(["tools/bench_kv_layouts.py", *(argv or sys.argv[1:])]),
    }
    if args.tables:  # print the tables of an earlier run
        print_tables(json.loads(Path(args.tables).read_text()))
        return 0
    result["growth"] = bench_growth(args)
    result["step"] = bench_step(args)
    result["memory"] = bench_memory(args)
    if args.e2e:
        result["e2e"] = bench_e2e(args)
    print_tables(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
