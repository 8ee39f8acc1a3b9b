"""Is a decode graph captured later slower than the one the capture policy kept (ninth session;
kept beside its figures in native.md, not a tool)? Replays each back to back (device events),
interleaved, at batch 1 and 16; graphs of 2 and 4 copies of the step; the step's calls launched
eagerly. Run from the repository root on the GPU machine:
``python3 docs/benchmarks/data/h200_s9_fresh_capture.py``."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
for _path in (ROOT, ROOT / "plugins", ROOT / "graphs", ROOT / "tools"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench_native import QWEN_SPEC, build_or_reuse, make_prompts, model_spec  # noqa: E402
from profile_native import _graph_ms  # noqa: E402

from ep.model import load_model  # noqa: E402
from ep.native import NativeBackend  # noqa: E402
from ep_builtin.capture_warmup import WarmupCapture  # noqa: E402
from ep_builtin.kv_seq_major import SeqMajorLayout  # noqa: E402

spec = model_spec(QWEN_SPEC, 2048)
model = load_model(build_or_reuse(spec, Path("/tmp/genai-ep-bench"), 0, None))
for batch in (1, 16):
    b = NativeBackend(model, SeqMajorLayout(fixed_stride=True), device="cuda",
                      capture=WarmupCapture(steps=2))  # fmt: skip
    dev, st = b.device, b.stream
    tok = b.prefill(make_prompts(batch, 32, model.vocab_size, seed=batch)).argmax(-1)
    for _ in range(4):
        tok = b.step(tok).argmax(-1)
    key, kept = next(iter(b.capture.graphs.items()))
    g0 = kept.graph
    plan = b._plan(batch, 1)
    calls = b._bind(plan).calls

    def fresh(calls=calls, dev=dev, st=st):
        with dev.capture(stream=st) as cap:
            for c in calls:
                c()
        return cap.graph

    g1 = fresh()
    st.sync()
    g2 = fresh()
    # the policy's capture again: forget, then one step captures
    b.capture.graphs.pop(key)  # g0 stays open
    b.capture.policy.invalidated(key, "experiment")
    tok = b.step(tok).argmax(-1)
    g3 = next(iter(b.capture.graphs.values())).graph
    res = {}
    for _ in range(3):
        for name, g in (("kept", g0), ("fresh1", g1), ("fresh2", g2), ("recaptured", g3)):
            res.setdefault(name, []).append(round(_graph_ms(dev, st, g, 100) * 1e3, 1))
    # graphs of 2 and 4 copies of the step
    for n in (2, 4):
        with dev.capture(stream=st) as cap:
            for _ in range(n):
                for c in calls:
                    c()
        res[f"{n}x step, per step"] = [round(_graph_ms(dev, st, cap.graph, 50) * 1e3 / n, 1)
                                       for _ in range(2)]  # fmt: skip
    # eager launches of the same calls
    start, end = dev.create_event(timing=True), dev.create_event(timing=True)
    st.record(start)
    for _ in range(5):
        for c in calls:
            c()
    st.record(end)
    end.sync()
    res["eager (host-bound)"] = round(end.elapsed_ms(start) * 1e3 / 5, 1)
    print(f"batch {batch}: µs a step:", res, flush=True)
    b._check_faults()
