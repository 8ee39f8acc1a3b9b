"""decode.sync_every = 1 picking on the device against picking on the host (tenth session; kept
beside its figures in native.md, not a tool). From the repository root on the GPU machine:
``python3 docs/benchmarks/data/h200_s10_sync1.py``.

The benchmark's Qwen2.5-0.5B-shaped bf16 model, `Generator.generate`, 64 new tokens (none
stops), batch 1 and 4, greedy and temperature 0.8 / top-p 0.9 (seed 7), sync_every = 1:
`NativeBackend` as configured by default (each token picked on the device, one synchronisation a
step) and with ``device_picks=False`` (the logits to the host each step, picked there). Decode ms
a step, the median of 3 runs' means after a warm-up run; whether the tokens agree.
"""

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

model = load_model(
    build_or_reuse(model_spec(QWEN_SPEC, 2048), Path("/tmp/genai-ep-bench"), 0, None)
)
opts = GenerationOptions(max_new_tokens=64, min_new_tokens=64)
for batch in (1, 4):
    prompts = [list(p) for p in make_prompts(batch, 32, model.vocab_size, seed=batch)]
    for name, sampling in (
        ("greedy", SamplingParams()),
        ("sampled", SamplingParams(0.8, top_p=0.9, seed=7)),
    ):
        tokens = {}
        for picks in (True, False):
            backend = NativeBackend(model, SeqMajorLayout(fixed_stride=True), device="cuda",
                                    capture=WarmupCapture(), device_picks=picks)  # fmt: skip
            gen = Generator(model, layout=SeqMajorLayout(fixed_stride=True), backend=backend,
                            options=opts)  # fmt: skip
            gen.generate(prompts, sampling=sampling)
            means = []
            for _ in range(3):
                result = gen.generate(prompts, sampling=sampling)
                means.append(result.metrics.decode_ms_per_step_mean)
            tokens[picks] = result.tokens
            where = "device" if picks else "host"
            print(f"batch {batch} {name:7s} picked on the {where:6s}: decode "
                  f"{statistics.median(means):.3f} ms a step", flush=True)  # fmt: skip
        print(f"batch {batch} {name}: tokens agree {tokens[True] == tokens[False]}", flush=True)
