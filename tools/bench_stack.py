"""The persistent decoder-stack kernel (`ep.kernels.stack`) against the native executor's
captured decode step, on the benchmark's Qwen2.5-0.5B-shaped bf16 model (an experiment; H200).

Same process, same weights (read from the model `bench_native.py` builds and caches):

1. **Correctness**: the kernel decodes a ``--prompt`` token by token (each of the
   ``--tunings`` must give bitwise the same logits); its final-norm output at every step is
   compared with
   `ep.kernels.stack.reference_step` (NumPy, float32 sums), and its last logits with NumPy's
   and with the native backend's after a prefill of the same prompt.
2. **Time**: device ms of one replayed graph of the kernel (which reads the token's embedding
   row itself, with its head), and of a device-loop step: the kernel, the argmax and
   ``native_advance``, or the kernel picking itself (its own argmax, next id and position: one
   launch), the position moving on from the prompt's length each round; against the native
   backend's captured decode graph (what `profile_native.py` calls "graph"), replayed back to
   back, rounds interleaved.
3. ``--trace``: one launch's per-block global-timer stamps, as the median µs of each stage of
   a layer, of the waits for weights and of the producer's waits for ring space.

    python3 tools/bench_stack.py --out DIR                    # on the H200
    python3 tools/bench_stack.py --tunings 8:0:4:-1,8:0:4:0 --trace  # warps:chunk:min_cols:poll
    python3 tools/bench_stack.py --tunings 8:0:4:0:1:0,8:0:4:0:1:128 --positions 64,1000
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
for _path in (ROOT, ROOT / "plugins", ROOT / "graphs", ROOT / "tools"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from _bench import machine_info, replay_ms  # noqa: E402
from bench_native import QWEN_SPEC, build_or_reuse, model_spec  # noqa: E402


def model_weights(folder: Path, layers: int) -> tuple[list[dict[str, np.ndarray]], np.ndarray,
                                                       np.ndarray]:  # fmt: skip
    """An `ep_graphs` model's weights as `ep.kernels.stack` takes them, read from its graph by
    `ep.native.fused.match_stack`: per layer, the final norm's weight, the embedding table
    (tied: also the head)."""
    from ep.native.fused import match_stack, stack_layers
    from ep.native.program import load_program

    program = load_program(folder / "model.onnx")
    match = match_stack(program)
    if match.shape.layers != layers:
        raise ValueError(f"{folder}: {match.shape.layers} layers, expected {layers}")
    out, final = stack_layers(program, match)
    return out, final, program.arrays[match.embed]


# (name, first stamp, last stamp, over): "all"/"attn", median over those blocks of the stamps'
# difference; "sync", from the last block's first stamp to the median block's last (the
# attention blocks' at stamps 4 and 5); "attn-sync", from the last QKV store to the attention
# blocks' stores. Stamp 15 is the next layer's stamp 0.
STAGES = (
    ("norm", 0, 1, "all"),
    ("QKV projection", 1, 2, "all"),
    ("QKV store", 2, 3, "all"),
    ("KV prefetch", 3, 4, "attn"),
    ("QKV stored -> attention stored", 3, 5, "attn-sync"),
    ("  attention: q, k, v arrived", 4, 21, "attn"),
    ("  attention: scores", 21, 22, "attn"),
    ("  attention: softmax", 22, 23, "attn"),
    ("  attention: p v", 23, 25, "attn"),
    ("  attention: stored", 25, 5, "attn"),
    ("attention -> O's inputs", 5, 6, "sync"),
    ("O projection", 6, 7, "all"),
    ("O residual store", 7, 8, "all"),
    ("O -> norm's inputs", 8, 9, "sync"),
    ("norm + gate/up projection", 9, 10, "all"),
    ("SwiGLU store", 10, 11, "all"),
    ("gate/up -> down's inputs", 11, 12, "sync"),
    ("down projection", 12, 13, "all"),
    ("down residual store", 13, 14, "all"),
    ("down -> next layer's inputs", 14, 15, "sync"),
)


def stage_times(dev: Any, stream: Any, step: Any) -> dict[str, float]:
    """Median µs of a layer's stages (layers 2 .. L-3) from one traced launch."""
    from ep.kernels.stack import TRACE_STAMPS

    shape = step.shape
    buf = dev.alloc((step.blocks, shape.layers, TRACE_STAMPS), np.uint64, stream=stream)
    dev.fill(buf, 0, stream=stream)
    step.launch(stream=stream, trace=buf)
    t = buf.to_host(stream=stream).astype(np.float64) / 1e3  # µs
    t[:, :-1, 15] = t[:, 1:, 0]
    attn = np.arange(shape.heads)
    mid = range(2, shape.layers - 2)
    out: dict[str, list[float]] = {name: [] for name, *_ in STAGES}
    for layer in mid:
        x = t[:, layer]
        for name, a, b, over in STAGES:
            if over == "sync":
                src = attn if a == 5 else slice(None)
                out[name].append(float(np.median(x[slice(None), b]) - x[src, a].max()))
            elif over == "attn-sync":
                out[name].append(float(np.median(x[attn, b]) - x[:, a].max()))
            else:
                rows = attn if over == "attn" else slice(None)
                out[name].append(float(np.median(x[rows, b] - x[rows, a])))
    res = {k: float(np.median(v)) for k, v in out.items()}
    res["layer"] = float(np.median(t[:, 3 : shape.layers - 2, 0] - t[:, 2 : shape.layers - 3, 0]))
    for i, name in enumerate(("QKV", "O", "gate/up", "down")):
        res[f"waiting for {name} weights"] = float(np.median(t[:, mid, 16 + i]))
    res["producer waiting for ring space"] = float(np.median(t[:, mid, 20]))
    print("a layer's stages (µs, median over layers 2 .. L-3; one launch):")
    for k, v in res.items():
        print(f"  {k:34s} {v:7.2f}")
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--spec", default=QWEN_SPEC)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--reps", type=int, default=100)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument(
        "--tunings",
        default="",
        help="comma-separated warps:chunk:min_cols[:poll[:kv_l2[:split]]] "
        "(`ep.kernels.stack.StackTuning`; chunk 0: the default; default: the kernel's)",
    )
    p.add_argument("--trace", action="store_true", help="also the stages of one launch")
    p.add_argument(
        "--positions", default=[], type=lambda text: [int(v) for v in text.split(",") if v],
        help="comma-separated positions to time every tuning's kernel at too (the attention "
        "reads position + 1 cached keys and values); with --trace, the first's stages there",
    )  # fmt: skip
    p.add_argument("--work", default="/tmp/genai-ep-bench")
    p.add_argument("--out", default=None)
    s = p.parse_args(argv)

    from profile_native import profiled_backend

    from ep.device import get_device
    from ep.kernels import sample
    from ep.kernels.stack import StackShape, StackStep, StackTuning, reference_step
    from ep.model import load_model
    from ep.ops.rotary import _inv_freq

    spec = model_spec(s.spec, s.context)
    folder = build_or_reuse(spec, Path(s.work), seed=0, weights=None)
    layers, final, embed = model_weights(folder, spec.num_layers)
    shape = StackShape(spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim,
                       spec.intermediate_size, spec.num_layers, spec.rms_norm_eps)  # fmt: skip
    inv_freq = _inv_freq(spec.rope_theta, spec.head_dim)
    dev = get_device("cuda")
    stream = dev.create_stream(name="stack")
    vocab = embed.shape[0]
    emb = dev.to_device(embed, stream=stream)
    tunings = [StackTuning(*(int(v) for v in t.split(":"))) for t in s.tunings.split(",") if t]
    tunings = [t.resolved(shape) for t in tunings or [StackTuning()]]
    names = [f"w{t.warps} c{t.chunk} m{t.min_cols} p{t.poll} k{t.kv_l2} s{t.split}"
             for t in tunings]  # fmt: skip
    steps: list[Any] = []
    for tuning in tunings:  # one packed copy of the weights serves every tuning
        packed = (steps[0].ws, steps[0].starts) if steps else None
        steps.append(StackStep(dev, shape, layers, final, inv_freq, emb, s.context,
                               stream=stream, tuning=tuning, packed=packed))  # fmt: skip
    step = steps[0]
    print(f"stack: {step.blocks} blocks x {step.threads} threads, {step.shared} B of shared "
          "memory; "
          f"{step.ws.nbytes / 1e6:.1f} MB of layer weights and {emb.nbytes / 1e6:.1f} MB of "
          f"head streamed a step; tunings {names}")  # fmt: skip
    ids = dev.alloc(1, np.int64, stream=stream)
    scratch = sample.argmax_scratch(dev, 1, stream=stream)

    # 1. correctness
    prompt = np.random.default_rng(1).integers(3, vocab, s.prompt, dtype=np.int64)
    kc = list(np.zeros((shape.layers, shape.kv_heads, s.context, shape.head_dim), np.float32))
    vc = list(np.zeros((shape.layers, shape.kv_heads, s.context, shape.head_dim), np.float32))
    ref_layers = [{k: np.asarray(v, np.float32) for k, v in w.items()} for w in layers]
    errors, tunings_equal = [], True
    for t, tok in enumerate(prompt):
        outs = []
        for st in steps:
            st.io.ids.copy_from_host(np.array([tok]), stream=stream)
            st.io.pos.copy_from_host(np.array([t]), stream=stream)
            st.launch(stream=stream)
            outs.append(st.io.logits.to_host(stream=stream).copy())
        # another warp count sums long columns in another order: only same-warps runs compare
        tunings_equal &= all(np.array_equal(o, outs[0]) for o, t in zip(outs, tunings, strict=True)
                             if t.warps == tunings[0].warps)  # fmt: skip
        want = reference_step(shape, ref_layers, final, inv_freq, embed[tok].astype(np.float32),
                              t, kc, vc)  # fmt: skip
        got = step.y.to_host(stream=stream).astype(np.float32)
        errors.append(float(np.abs(got - want).max() / np.abs(want).max()))
    print(f"final norm, max |kernel - NumPy| / max |NumPy| over {s.prompt} steps: "
          f"{min(errors):.2e} .. {max(errors):.2e}; logits of every tuning with the first's "
          "warps bitwise equal: "
          f"{tunings_equal}")  # fmt: skip
    ref_logits = want @ embed.astype(np.float32).T
    got_logits = outs[0]
    backend = profiled_backend(load_model(folder), "cuda")
    native_logits = np.asarray(backend.prefill([prompt]), np.float32)[0]

    def rel(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.abs(a - b).max() / np.abs(b).max())

    diffs = {"kernel - NumPy": rel(got_logits, ref_logits),
             "native - NumPy": rel(native_logits, ref_logits),
             "kernel - native": rel(got_logits, native_logits)}  # fmt: skip
    argmaxes = {
        k: int(v.argmax())
        for k, v in (("kernel", got_logits), ("native", native_logits), ("NumPy", ref_logits))
    }
    top = np.argsort(-ref_logits)[:3]
    print("last prompt token's logits, max |a - b| / max |b|: "
          + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items())
          + f"; argmax {argmaxes} (NumPy's top 3 {top.tolist()} at "
          f"{ref_logits[top].round(3).tolist()})")  # fmt: skip

    # 2. time
    tokens = native_logits.argmax(-1)
    for _ in range(4):  # eager steps, then the capture policy captures
        tokens = np.asarray(backend.step(np.atleast_1d(tokens))).argmax(-1)
    native_graph = list(backend.capture.graphs.values())[-1].graph
    # a device loop's step, from the prompt's length on each round (the position moves on):
    # the kernel, the argmax and native_advance (three launches), or the kernel picking (one)
    from ep.native import _kernels as nk

    picking = dev.to_device(np.array([1], np.int64), stream=stream)
    history = dev.alloc(1, np.int64, stream=stream)
    graphs, loop_pos = {}, {}
    for tag, st in zip(names, steps, strict=True):
        st.io.pos.copy_from_host(np.array([s.prompt]), stream=stream)
        with dev.capture(stream=stream) as cap:
            st.launch(stream=stream)
        graphs[f"kernel {tag}"] = cap.graph
        for name, picks in ((f"loop {tag}: kernel + argmax + advance", False),
                            (f"loop {tag}: kernel picking", True)):  # fmt: skip
            io = dataclasses.replace(st.io, pos=dev.alloc(1, np.int64, stream=stream))
            if picks:
                picked = dev.alloc(st.positions + 1, np.int64, stream=stream)
                io = dataclasses.replace(io, tokens=picked, picking=picking)
            with dev.capture(stream=stream) as cap:
                st.launch(stream=stream, io=io)
                if not picks:
                    sample.argmax(dev, ids, io.logits, batch=1, vocab=vocab, scratch=scratch,
                                  stream=stream)  # fmt: skip
                    nk.advance(dev, io.ids, io.pos, history, ids, batch=1, slot=0, stream=stream)
            graphs[name], loop_pos[name] = cap.graph, io.pos
    times: dict[str, list[float]] = {"native graph": [], **{k: [] for k in graphs}}
    for _ in range(s.rounds):
        times["native graph"].append(replay_ms(dev, backend.stream, native_graph, s.reps))
        for name, g in graphs.items():
            if name in loop_pos:
                loop_pos[name].copy_from_host(np.array([s.prompt]), stream=stream)
            times[name].append(replay_ms(dev, stream, g, s.reps))
    for position in s.positions:  # every tuning's kernel, rounds interleaved
        at = {tag: f"kernel {tag} at position {position}" for tag in names}
        times.update({name: [] for name in at.values()})
        for st in steps:
            st.io.pos.copy_from_host(np.array([position]), stream=stream)
        for _ in range(s.rounds):
            for tag, name in at.items():
                times[name].append(replay_ms(dev, stream, graphs[f"kernel {tag}"], s.reps))
    for st in steps:
        st.io.pos.copy_from_host(np.array([s.prompt]), stream=stream)
    native = statistics.median(times["native graph"])
    for name, v in times.items():
        med = statistics.median(v)
        print(f"{name:26s} {med:.4f} ms a step ({min(v):.4f} .. {max(v):.4f}), "
              f"{med / native:.3f} x the native graph")  # fmt: skip
    stages = stage_times(dev, stream, step) if s.trace else None
    stages_at = {}
    for position in s.positions if s.trace else ():
        print(f"at position {position}:")
        steps[0].io.pos.copy_from_host(np.array([position]), stream=stream)
        stages_at[position] = stage_times(dev, stream, steps[0])
    steps[0].io.pos.copy_from_host(np.array([s.prompt]), stream=stream)
    if s.out:
        out = Path(s.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_stack.json").write_text(json.dumps({
            "tool": "bench_stack", "machine": machine_info(), "spec": s.spec, "prompt": s.prompt,
            "blocks": step.blocks, "tunings": names, "final_norm_errors": errors,
            "tunings_bitwise_equal": tunings_equal, "logit_diffs": diffs, "argmax": argmaxes,
            "times_ms": times, "stages_us": stages,
            "stages_us_at": stages_at,
        }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
