"""The built-in op set (registered by the ``ops_core`` plugin in ``ep_builtin``).

Each op carries its NumPy reference (the ``"cpu"`` kernel) and its ``"cuda"`` kernel from
`ep.ops.cuda`, which loads nothing of the device layer until it runs.
"""

from __future__ import annotations

from ep.errors import OpError
from ep.ops.cuda import with_cuda_kernels
from ep.ops.kv import KV_ATTENTION, KV_ATTENTION_PAGED, KV_COMMIT, KV_COMMIT_PAGED
from ep.ops.matmul import MATMUL, MATMUL_MXFP4, MATMUL_NBITS, MATMUL_NBITS_ZP
from ep.ops.mlp import SWIGLU, SWIGLU_PACKED
from ep.ops.norm import RMS_NORM, SKIP_RMS_NORM
from ep.ops.rotary import ROTARY, ROTARY_THETA
from ep.ops.sample import SAMPLE
from ep.ops.schema import OpDef

__all__ = ["CORE_OPS", "core_op"]

CORE_OPS: tuple[OpDef, ...] = with_cuda_kernels(
    (
        RMS_NORM,
        SKIP_RMS_NORM,
        ROTARY,
        ROTARY_THETA,
        KV_COMMIT,
        KV_COMMIT_PAGED,
        KV_ATTENTION,
        KV_ATTENTION_PAGED,
        MATMUL,
        MATMUL_NBITS,
        MATMUL_NBITS_ZP,
        MATMUL_MXFP4,
        SWIGLU,
        SWIGLU_PACKED,
        SAMPLE,
    )
)
_BY_NAME = {op.name: op for op in CORE_OPS}


def core_op(name: str) -> OpDef:
    """The built-in op called ``name``."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise OpError(
            f"no built-in op {name!r}; built-ins: {', '.join(sorted(_BY_NAME))}"
        ) from None
