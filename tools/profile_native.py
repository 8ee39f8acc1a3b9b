"""Where a native decode step's device time goes: per op, per kernel call, and the whole graph.

On the benchmark's Qwen2.5-0.5B-shaped bf16 model (`bench_native.py`'s spec and build cache),
for each ``--batch``: prefill a ``--prompt``-token prompt, run warm-up steps with the ``warmup``
capture policy, then

- **graph**: the captured decode graph replayed ``--reps`` times back to back between two CUDA
  events (device ms per step, no host work);
- **per op type**: a graph of only that op type's calls of the step (in step order), replayed
  the same way: the device time of those kernels back to back, launch gaps included; the sum
  over op types comes close to the whole graph's time;
- **step**: ``backend.step`` wall-clock (logits on the host) and ``backend.steps(k)`` per step
  (the device token loop, one synchronisation per ``k`` steps);
- **without** (``--ablate``): the step's calls minus one op type's, captured and replayed the
  same way. The graph's time minus that is the op type's share of the critical path: what
  removing (or perfectly fusing) its calls could save, which with programmatic dependent launch
  can be far less than the calls' own time. The numbers such a graph computes are meaningless
  (its device faults are not checked); only its time is.

    python3 tools/profile_native.py --out DIR      # on the H200: DIR/profile_native.json

A/B of the fusions (one call from the QKV projection's bias to the KV commit, op type
``QKVRotaryCommit``, and with the projection's GEMV, ``MatMul+QKVRotaryCommit``; the gate/up GEMV
with a SwiGLU epilogue, ``MatMul+SwiGLUPacked``): ``GENAI_EP_FUSE=0 python3
tools/profile_native.py --out DIR_OFF`` binds each node on its own, ``GENAI_EP_FUSE_MLP=0`` keeps
only the SwiGLU epilogue off, ``GENAI_EP_FUSE_QKV=0`` only the projection's commit epilogue; the
JSON records which (``fuse``, ``fuse_mlp``, ``fuse_qkv``). A/B of the GEMVs' early weight loads
(resident weights loaded before each GEMV's PDL wait): ``GENAI_EP_EARLY=0`` (``early``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "plugins", ROOT / "graphs", ROOT / "tools"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _bench import captured_us, machine_info, replay_ms  # noqa: E402
from bench_native import QWEN_SPEC, build_or_reuse, make_prompts, model_spec  # noqa: E402

from ep.errors import KernelFaultError  # noqa: E402

COMMITS = ("KVCommit", "KVCommitPaged", "QKVRotaryCommit")
ATTENTIONS = ("KVAttention", "KVAttentionPaged")


def profile_batch(backend: Any, batch: int, s: argparse.Namespace) -> dict[str, Any]:
    dev, stream = backend.device, backend.stream
    vocab = backend.model.vocab_size
    prompts = make_prompts(batch, s.prompt, vocab, seed=batch)
    logits = backend.prefill(prompts)
    tokens = logits.argmax(-1)
    for _ in range(4):  # warm-up: eager steps, then a capture
        tokens = backend.step(tokens).argmax(-1)

    # the whole captured graph, back to back
    graphs = list(backend.capture.graphs.values())
    graph_ms = replay_ms(dev, stream, graphs[-1].graph, s.reps) if graphs else None

    # per op type: a graph of only that type's calls (in step order), replayed back to back.
    # Attention runs with the commit before it: it reads the lengths the commit writes, whose
    # bytes later calls of the step reuse, so attention alone would read stale lengths.
    plan = backend._plan(backend.lens.size, 1)
    calls = backend._bind(plan).calls
    names = plan.call_names
    assert len(names) == len(calls), (len(names), len(calls))
    by_type: dict[str, list[Any]] = defaultdict(list)
    commit: tuple[str, Any] | None = None
    paired: set[str] = set()  # the commit + attention groups: two calls per counted call
    for name, call in zip(names, calls, strict=True):
        op = name.split(":")[0]
        if op in COMMITS or op.endswith("+QKVRotaryCommit"):  # the commit in a GEMV epilogue
            commit = (op, call)
        if op in ATTENTIONS and commit is not None:
            paired.add(f"{commit[0]}+{op}")
            by_type[f"{commit[0]}+{op}"] += [commit[1], call]
        by_type[op].append(call)
    for op in ATTENTIONS:
        by_type.pop(op, None)
    ops: dict[str, dict[str, float]] = {}
    for op, group in by_type.items():
        total = captured_us(dev, stream, group, s.reps)
        n = len(group) // 2 if op in paired else len(group)
        ops[op] = {"calls": n, "total_us": total, "per_call_us": total / n}
        backend._check_faults()
    ops = dict(sorted(ops.items(), key=lambda kv: -kv[1]["total_us"]))

    # steps as the generator takes them
    walls = []
    for _ in range(s.reps):
        t0 = time.perf_counter()
        tokens = backend.step(tokens).argmax(-1)
        walls.append((time.perf_counter() - t0) * 1e3)
    loop_ms = None
    if s.loop:
        backend.steps(tokens.astype(np.int64), s.loop)  # warm: capture etc.
        t0 = time.perf_counter()
        out = backend.steps(out_last := tokens.astype(np.int64), s.loop)
        loop_ms = (time.perf_counter() - t0) * 1e3 / s.loop
        del out, out_last
    # Last: the graphs below compute garbage (and may flag faults, cleared here).
    without: dict[str, float] = {}
    if s.ablate:  # the step without one op type's calls (what they compute no longer matters)
        whole = captured_us(dev, stream, calls, s.reps)
        types = [name.split(":")[0] for name in names]
        for op in dict.fromkeys(types):
            kept = [call for call, t in zip(calls, types, strict=True) if t != op]
            without[op] = whole - captured_us(dev, stream, kept, s.reps)
            with contextlib.suppress(KernelFaultError):
                backend._check_faults()
        without = dict(sorted(without.items(), key=lambda kv: -kv[1]))
        without["(whole step)"] = whole
    return {
        "batch": batch,
        "graph_ms": graph_ms,
        "sum_of_ops_ms": sum_once(ops, paired) / 1e3,
        "calls": len(calls),
        "step_wall_ms": statistics.median(walls),
        "loop_ms_per_step": loop_ms,
        "ops": ops,
        "critical_us": without,  # --ablate: graph µs minus the graph without that op type
    }


def sum_once(ops: dict[str, dict[str, float]], paired: set[str]) -> float:
    """µs of every call once: a commit timed with its attention (group ``<commit>+<attention>``,
    the commit's own type may hold a '+': ``MatMul+QKVRotaryCommit``) is not counted alone."""
    commits = {group.rsplit("+", 1)[0] for group in paired}
    return sum(v["total_us"] for op, v in ops.items() if op not in commits)


def profiled_model(spec: str, context: int, work: str) -> Any:
    """The benchmark's model (`bench_native.py`'s spec and build cache under ``work``), loaded."""
    from ep.model import load_model

    return load_model(build_or_reuse(model_spec(spec, context), Path(work), seed=0, weights=None))


def profiled_backend(model: Any, device: str) -> Any:
    """A backend as the profiles measure it (this tool and `loop_host.py`): a seq-major cache
    with a fixed stride (the captured step survives growth), captured after two warm-up steps."""
    from ep.native import NativeBackend
    from ep_builtin.capture_warmup import WarmupCapture
    from ep_builtin.kv_seq_major import SeqMajorLayout

    return NativeBackend(
        model, SeqMajorLayout(fixed_stride=True), device=device, capture=WarmupCapture(steps=2)
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spec", default=QWEN_SPEC)
    p.add_argument("--batch", default="1,16")
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--loop", type=int, default=32, help="steps per backend.steps call (0: skip)")
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--work", default="/tmp/genai-ep-bench")
    p.add_argument("--out", default=None)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test with a small --spec")
    p.add_argument(
        "--ablate", action="store_true", help="also time the step without each op type's calls"
    )
    s = p.parse_args(argv)

    from ep.native.plan import early_enabled, fuse_enabled, fuse_mlp_enabled, fuse_qkv_enabled

    model = profiled_model(s.spec, s.context, s.work)
    results = []
    fuse = fuse_enabled()
    fuse_mlp = fuse and fuse_mlp_enabled()
    fuse_qkv = fuse and fuse_qkv_enabled()
    early = "on" if early_enabled() else "off (GENAI_EP_EARLY=0)"
    mlp = "on" if fuse_mlp else ("off (GENAI_EP_FUSE_MLP=0)" if fuse else "off")
    qkv = "on" if fuse_qkv else ("off (GENAI_EP_FUSE_QKV=0)" if fuse else "off")
    print(f"fused QKV commit: {'on' if fuse else 'off (GENAI_EP_FUSE=0)'}, as the projection's "
          f"GEMV epilogue: {qkv}; gate/up GEMV with a SwiGLU epilogue: {mlp}; resident GEMV "
          f"weights loaded before the PDL wait: {early}")  # fmt: skip
    for batch in (int(b) for b in s.batch.split(",")):
        r = profile_batch(profiled_backend(model, s.device), batch, s)
        results.append(r)
        loop = r["loop_ms_per_step"] or float("nan")
        print(f"batch {batch}: graph {r['graph_ms']:.3f} ms/step ({r['calls']} calls; sum over "
              f"op types {r['sum_of_ops_ms']:.3f} ms), step() "
              f"{r['step_wall_ms']:.3f} ms, steps({s.loop}) {loop:.3f} ms/step")  # fmt: skip
        for op, v in r["ops"].items():
            print(f"  {op:16s} {v['calls']:4d} calls  {v['total_us']:9.1f} us  "
                  f"{v['per_call_us']:7.2f} us a call")  # fmt: skip
        if r["critical_us"]:
            print("  without each op type's calls, the step is shorter by (us):")
            for op, us in r["critical_us"].items():
                print(f"    {op:28s} {us:8.1f}")
    if s.out:
        out = Path(s.out)
        out.mkdir(parents=True, exist_ok=True)
        payload = {"tool": "profile_native", "machine": machine_info(), "spec": s.spec,
                   "fuse": fuse, "fuse_mlp": fuse_mlp, "fuse_qkv": fuse_qkv,
                   "early": early_enabled(), "results": results}  # fmt: skip
        (out / "profile_native.json").write_text(json.dumps(payload, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
