"""Kernels the device layer itself uses (fill) and a small arithmetic one (axpy) for tests.

``fill_u8/u16/u32/u64`` write a bit pattern, so `Device.fill` covers every dtype of those sizes
(float32, bfloat16, int64, …) by viewing the buffer as unsigned integers.
"""

from __future__ import annotations

import numpy as np

from ep.device._kernels import CompileOptions, KernelSource, register_kernel

__all__ = ["AXPY_F32", "FILL_KERNELS"]

_FILL_TEMPLATE = """
extern "C" __global__ void fill_u{bits}({ctype}* __restrict__ out, {ctype} value,
                                        unsigned long long n) {{
    // Grid-stride loop: any grid size covers all n elements.
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {{
        out[i] = value;
    }}
}}
"""

_CTYPES = {8: "unsigned char", 16: "unsigned short", 32: "unsigned int", 64: "unsigned long long"}


def _fill_cpu(out: np.ndarray, value: np.generic, n: np.uint64) -> None:
    out[: int(n)] = value


FILL_KERNELS = {
    bits: register_kernel(
        KernelSource(
            name=f"fill_u{bits}",
            source=_FILL_TEMPLATE.format(bits=bits, ctype=ctype),
            params=(f"u{bits}*", f"u{bits}", "u64"),
            cpu=_fill_cpu,
        )
    )
    for bits, ctype in _CTYPES.items()
}

_AXPY_SOURCE = """
extern "C" __global__ void axpy_f32(float* __restrict__ y, const float* __restrict__ x, float a,
                                    unsigned long long n) {
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += stride) {
        y[i] = a * x[i] + y[i];
    }
}
"""


def _axpy_cpu(y: np.ndarray, x: np.ndarray, a: np.float32, n: np.uint64) -> None:
    count = int(n)
    # Two roundings (multiply, then add), exactly what the kernel does when built without FMA.
    y[:count] = a * x[:count] + y[:count]


# fma=False: the GPU rounds a*x and then the sum, as NumPy does, so CPU and CUDA agree bitwise.
AXPY_F32 = register_kernel(
    KernelSource(
        name="axpy_f32",
        source=_AXPY_SOURCE,
        params=("f32*", "f32*", "f32", "u64"),
        options=CompileOptions(fma=False),
        cpu=_axpy_cpu,
    )
)
