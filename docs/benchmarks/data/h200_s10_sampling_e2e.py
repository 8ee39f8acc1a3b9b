"""Decode with sampling in the device token loop against greedy in the same loop and against
sampling on the host (tenth session; kept beside its figures in native.md, not a tool). Run from
the repository root on the GPU machine: ``python3 docs/benchmarks/data/h200_s10_sampling_e2e.py``.

The benchmark's Qwen2.5-0.5B-shaped bf16 model (vocab 151936), `Generator.generate`, 64 new
tokens (none stops), batch 1, 4 and 16: greedy with decode.sync_every = 16; temperature 0.8 and
top-p 0.9 (seed 7) with sync_every = 16 (the sampling kernel on the device) and, at batch 1 and 4,
sync_every = 1 picking on the host (the logits to the host each step, `ep.sampling.sample` there:
``device_picks=False``; runs 2-4 of the session ran before that switch, when sync_every = 1 meant
it). Each setting runs
three times after a warm-up (the capture); the median of the three runs' mean decode ms a step is
reported (and the median prefill ms, host wall clock, the logits of the prompt's last token
on the host included), with whether the sampled tokens of sync_every 1 and 16 agree.
"""

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
for _path in (ROOT, ROOT / "plugins", ROOT / "graphs", ROOT / "tools"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench_native import QWEN_SPEC, build_or_reuse, make_prompts, model_spec  # noqa: E402

from ep.model import load_model  # noqa: E402
from ep.native import NativeBackend  # noqa: E402
from ep.runtime import GenerationOptions, Generator  # noqa: E402
from ep.sampling import SamplingParams  # noqa: E402
from ep_builtin.capture_warmup import WarmupCapture  # noqa: E402
from ep_builtin.kv_seq_major import SeqMajorLayout  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--device", default="cuda")
p.add_argument("--spec", default=QWEN_SPEC)
p.add_argument("--new", type=int, default=64)
p.add_argument("--batches", default="1,4,16")
a = p.parse_args()
model = load_model(build_or_reuse(model_spec(a.spec, 2048), Path("/tmp/genai-ep-bench"), 0, None))
drawn = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
greedy = SamplingParams(temperature=0.0)
opts = GenerationOptions(max_new_tokens=a.new, min_new_tokens=a.new)
for batch in (int(b) for b in a.batches.split(",")):
    prompts = [list(p) for p in make_prompts(batch, 32, model.vocab_size, seed=batch)]
    runs = [("greedy", greedy, 16), ("sampled", drawn, 16)]
    if batch <= 4:
        runs.append(("sampled", drawn, 1))
    tokens = {}
    for name, sampling, every in runs:
        backend = NativeBackend(model, SeqMajorLayout(fixed_stride=True), device=a.device,
                                capture=WarmupCapture(), sync_every=every,
                                device_picks=every > 1)  # fmt: skip
        gen = Generator(model, layout=SeqMajorLayout(fixed_stride=True), backend=backend,
                        options=opts)  # fmt: skip
        gen.generate(prompts, sampling=sampling)  # warm: the capture
        means, prefills = [], []
        for _ in range(3):
            result = gen.generate(prompts, sampling=sampling)
            means.append(result.metrics.decode_ms_per_step_mean)
            prefills.append(result.metrics.prefill_ms)
        tokens[name, every] = result.tokens
        runs_ms = ", ".join(f"{m:.3f}" for m in means)
        print(f"batch {batch:2d} {name:7s} sync_every {every:2d}: decode "
              f"{statistics.median(means):.3f} ms a step (runs {runs_ms}), prefill "
              f"{statistics.median(prefills):.2f} ms, notes {list(result.notes)}",
              flush=True)  # fmt: skip
    if ("sampled", 1) in tokens:
        agree = tokens["sampled", 1] == tokens["sampled", 16]
        print(f"batch {batch:2d}: sampled tokens of sync_every 1 and 16 agree: {agree}", flush=True)
