"""CUDA kernels of the ops (NVRTC, with NumPy twins for the CPU device).

Importing this package registers every kernel (``genai-ep kernels`` and ``compile_all`` see them);
each module's wrappers are what the native executor and the ORT custom ops call.
"""

from __future__ import annotations

from ep.kernels import attention as attention
from ep.kernels import embed as embed
from ep.kernels import matmul as matmul
from ep.kernels import mlp as mlp
from ep.kernels import mx4f8 as mx4f8
from ep.kernels import norm as norm
from ep.kernels import q4f8 as q4f8
from ep.kernels import q4p as q4p
from ep.kernels import rotary as rotary
from ep.kernels import sample as sample
from ep.kernels._common import KernelFault as KernelFault
from ep.kernels._common import check_faults as check_faults
from ep.kernels._common import new_status as new_status
