"""Where an eager prefill's host time goes (tenth session; kept beside its figures, not a tool).
From the repository root on the GPU machine:
``python3 docs/benchmarks/data/h200_s10_prefill_profile.py``.

The benchmark's Qwen2.5-0.5B-shaped bf16 model, batch 1, a 32-token prompt: the wall clock of a
prefill (median of 10, after 3 warm-up ones; the device time in between is under 1 ms), then
cProfile over 10 more, the functions with the most time of their own and the launch path's
cumulative times.
"""

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
for _path in (ROOT, ROOT / "plugins", ROOT / "graphs", ROOT / "tools"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from bench_native import QWEN_SPEC, build_or_reuse, make_prompts, model_spec  # noqa: E402

from ep.model import load_model  # noqa: E402
from ep.native import NativeBackend  # noqa: E402
from ep_builtin.kv_seq_major import SeqMajorLayout  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("--device", default="cuda")
p.add_argument("--spec", default=QWEN_SPEC)
p.add_argument("--batch", type=int, default=1)
a = p.parse_args()
model = load_model(build_or_reuse(model_spec(a.spec, 2048), Path("/tmp/genai-ep-bench"), 0, None))
backend = NativeBackend(model, SeqMajorLayout(fixed_stride=True), device=a.device)
prompts = make_prompts(a.batch, 32, model.vocab_size, seed=1)
for _ in range(3):
    backend.prefill(prompts)
walls = []
for _ in range(10):
    t0 = time.perf_counter()
    backend.prefill(prompts)
    walls.append((time.perf_counter() - t0) * 1e3)
print(f"prefill {statistics.median(walls):.2f} ms (min {min(walls):.2f}, max {max(walls):.2f})")
profile = cProfile.Profile()
profile.enable()
for _ in range(10):
    backend.prefill(prompts)
profile.disable()
stats = pstats.Stats(profile)
stats.sort_stats("tottime").print_stats(30)
path = r"(launch|_convert|gemm|plan_matmul|rms|attention|commit|replay|issue)"
stats.sort_stats("cumulative").print_stats(path, 25)

# The launch path alone, on a [1, 896] RMSNorm of the prompt's dtype: the op's wrapper (checks,
# its kernel's lookup), Kernel.launch (argument checks and conversion) and the device's own launch
# with arguments converted once (what replaying recorded launches would pay); host µs a launch,
# 4 rounds of 500 launches then a synchronisation, the median round.
import numpy as np  # noqa: E402

from ep.kernels import norm  # noqa: E402
from ep.kernels._common import threads_for  # noqa: E402

dev, stream = backend.device, backend.stream
x = dev.to_device(np.ones((1, 896), np.float32), stream=stream)
y = dev.alloc((1, 896), np.float32, stream=stream)
w = dev.to_device(np.ones(896, np.float32), stream=stream)
kernel = dev.kernel(norm.RMS_NORM_KERNELS["f32"].name)
args = (y, y, x, x, w, 1, 896, 1e-6, 0, 1)
kernel.launch(1, threads_for(224), *args, stream=stream)
converted = kernel._convert(args)
grid, block = (1, 1, 1), (threads_for(224), 1, 1)


def per_launch(fn) -> float:
    rounds = []
    for _ in range(4):
        stream.sync()
        t0 = time.perf_counter()
        for _ in range(500):
            fn()
        rounds.append((time.perf_counter() - t0) * 1e6 / 500)
        stream.sync()
    return statistics.median(rounds)


wrapper = per_launch(lambda: norm.rms_norm(dev, y, x, w, rows=1, hidden=896, epsilon=1e-6,
                                           stream=stream))  # fmt: skip
checked = per_launch(lambda: kernel.launch(1, block[0], *args, stream=stream))
raw = per_launch(lambda: dev._launch(kernel, grid, block, converted, 0, stream))
print(
    f"host us a launch: op wrapper {wrapper:.1f}, Kernel.launch {checked:.1f}, "
    f"device._launch with converted arguments {raw:.1f}"
)
