"""Where the device token loop's time beyond the captured step goes (seventh session; kept beside
its figures in native.md, not a tool). Run from the repository root on the GPU machine:
``python3 docs/benchmarks/data/h200_s7_loop_overhead.py``.

Per batch: the captured decode graph replayed back to back; the argmax and the token advance
alone (each a one-kernel graph, so mostly a graph launch); both in one graph; the step's calls
captured fresh, alone and with the argmax and advance; the captured step, argmax and advance
launched 32 times from Python; and ``backend.steps(tokens, 32)`` between two device events.
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, "tools")
import profile_native as pn

from ep.kernels import sample
from ep.model import load_model
from ep.native import NativeBackend
from ep.native import _kernels as nk
from ep_builtin.capture_warmup import WarmupCapture
from ep_builtin.kv_seq_major import SeqMajorLayout

spec = pn.model_spec(pn.QWEN_SPEC, 2048)
model = load_model(pn.build_or_reuse(spec, Path("/tmp/genai-ep-bench"), seed=0, weights=None))


def measure(batch: int) -> dict[str, float]:
    backend = NativeBackend(
        model, SeqMajorLayout(fixed_stride=True), device="cuda", capture=WarmupCapture(steps=2)
    )
    logits = backend.prefill(pn.make_prompts(batch, 32, model.vocab_size, seed=1))
    tokens = logits.argmax(-1)
    for _ in range(4):
        tokens = backend.step(tokens).argmax(-1)
    backend.steps(tokens.astype(np.int64), 32)
    dev, st = backend.device, backend.stream
    plan = backend._plan(batch, 1)
    loop = backend._loop[batch]
    graph = list(backend.capture.graphs.values())[-1].graph

    def am() -> None:
        sample.argmax(dev, loop.sampled, plan.logits, batch=batch, vocab=model.vocab_size,
                      scratch=loop.scratch, stream=st)  # fmt: skip

    def adv() -> None:
        nk.advance(dev, plan.input_ids, plan.positions, loop.history, loop.sampled, batch=batch,
                   slot=0, stream=st)  # fmt: skip

    out = {"graph_us": pn._graph_ms(dev, st, graph, 100) * 1e3}
    out["argmax_us"] = pn._replay_us(dev, st, [am], 100)
    out["advance_us"] = pn._replay_us(dev, st, [adv], 100)
    out["argmax+advance_us"] = pn._replay_us(dev, st, [am, adv], 100)
    calls = backend._bind(plan).calls
    out["step_calls_us"] = pn._replay_us(dev, st, calls, 50)
    out["step+argmax+advance_one_graph_us"] = pn._replay_us(dev, st, [*calls, am, adv], 50)
    start, end = dev.create_event(timing=True), dev.create_event(timing=True)
    for _ in range(2):
        st.record(start)
        for _ in range(32):
            graph.launch(stream=st)
            am()
            adv()
        st.record(end)
        end.sync()
    out["eager_seq_us_per_step"] = end.elapsed_ms(start) * 1e3 / 32
    tok = backend.steps(tokens.astype(np.int64), 8)[-1]
    st.record(start)
    backend.steps(tok, 32)
    st.record(end)
    end.sync()
    out["steps32_device_us_per_step"] = end.elapsed_ms(start) * 1e3 / 32
    return out


for batch in (1, 16):
    print(batch, {k: round(v, 2) for k, v in measure(batch).items()})
