"""Nsight Compute on the bf16 vocabulary GEMV (896 x 151936, the 0.5B head) at M = 1, 4 and
16, one launch each, as the native plan runs it (resident weight, a workspace): where do the 17
us that M = 16 costs over M = 1 go? (twentieth session; run under ncu by the device call in
native.md)."""

import ml_dtypes
import numpy as np

from ep.device import get_device
from ep.kernels import matmul

dev = get_device("cuda")
s = dev.default_stream
K, N = 896, 151936
rng = np.random.default_rng(0)
w = dev.to_device(rng.standard_normal((N, K), np.float32).astype(ml_dtypes.bfloat16), stream=s)
ws = matmul.matmul_workspace(dev, stream=s)
for m in (1, 4, 16):
    x = dev.to_device(rng.standard_normal((m, K), np.float32).astype(ml_dtypes.bfloat16), stream=s)
    out = dev.alloc((m, N), ml_dtypes.bfloat16, stream=s)
    plan = matmul.gemm(
        dev, out, x, w, M=m, N=N, K=K, transpose_b=1, stream=s, workspace=ws, resident=True
    )
    s.sync()
    print(m, plan)
