"""Sampling in the device token loop against sampling on the host (ninth session; kept beside its
figures in native.md, not a tool). Run from the repository root on the GPU machine:
``python3 docs/benchmarks/data/h200_s9_sampling.py [--device cpu --spec SMALL]``.

The benchmark's Qwen2.5-0.5B-shaped bf16 model (vocab 151936), `Generator.generate` with
temperature 0.8, top-p 0.9 and a seed, 64 new tokens (none stops), batch 1 and 4: decode.sync_every
= 1 (the logits go to the host each step and `ep.sampling.sample` draws there) against 16 (the
sampling kernel draws on the device). Each setting runs twice (the first captures), the second
is reported: decode ms a step (wall clock, sampling included) and whether the tokens agree.
"""

import argparse
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
a = p.parse_args()
model = load_model(build_or_reuse(model_spec(a.spec, 2048), Path("/tmp/genai-ep-bench"), 0, None))
sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=7)
opts = GenerationOptions(max_new_tokens=a.new, min_new_tokens=a.new)
for batch in (1, 4):
    prompts = [list(p) for p in make_prompts(batch, 32, model.vocab_size, seed=batch)]
    tokens = {}
    for every in (1, 16):
        # sync_every 1 picked on the host then; device_picks=False keeps it so
        backend = NativeBackend(model, SeqMajorLayout(fixed_stride=True), device=a.device,
                                capture=WarmupCapture(), sync_every=every,
                                device_picks=every > 1)  # fmt: skip
        gen = Generator(model, layout=SeqMajorLayout(fixed_stride=True), backend=backend,
                        options=opts)  # fmt: skip
        gen.generate(prompts, sampling=sampling)  # warm: the capture
        result = gen.generate(prompts, sampling=sampling)
        tokens[every] = result.tokens
        m = result.metrics
        print(f"batch {batch} sync_every {every:2d}: decode {m.decode_ms_per_step_mean:.3f} ms a "
              f"step (median {m.decode_ms_per_step_median:.3f}), notes {list(result.notes)}",
              flush=True)  # fmt: skip
    print(f"batch {batch}: tokens agree {tokens[1] == tokens[16]}", flush=True)
