"""MatMul on the device: dense, 4-bit block-quantized (MatMulNBits) and MXFP4, decode and prefill.

``y[M, N] = x[M, K] @ W^T`` with fp32, fp16 or bf16 activations (the output has x's dtype),
products accumulated in fp32 and rounded once. The CUDA source is ``_matmul_kernels.cu`` beside
this file; this module registers one kernel per (family, dtype) and picks one per call:

========================  =====================================================================
kernel                    what and launch geometry
========================  =====================================================================
``ep_gemv_nk_<dt>``       decode, dense W [N, K] (``transpose_b=1``, HF "out x in"): each output
                          reads one contiguous weight row. Block 256 threads = 8 warps; a warp
                          owns 8 output columns (weight rows) and one K slice; 4 lanes a row,
                          one 16-byte load each per step of 32 k, 5 steps in flight (fp16/bf16,
                          64 registers, 4 blocks an SM; its epilogue twins 4). fp16/bf16:
                          the weights are the B operand of ``mma.sync m16n8k16`` (x rows padded
                          to 16 as A); fp32: SIMT FMAs and two shuffles. Aligned rows with
                          K % 32 == 0 take a FULL path: predicated loads without bounds checks,
                          at M <= 8 a round's x chunks loaded at once (the same sums).
``ep_gemv_nk16_<dt>``     decode, dense W [N, K], fp16/bf16, 9..16 rows: ``nk``'s arithmetic with
                          a round's x chunks of rows g and g + 8 loaded at once, in a kernel of
                          its own (80 registers, 3 blocks an SM, 4 steps in flight; `_rows16`
                          says where); its SwiGLU twin issues a round's loads before its first
                          MMA (`row_gemv`'s ORDER).
``ep_gemv_nk_v2_<dt>``    decode, dense W [N, K], fp16/bf16, planned only with a size rule set
                          (see below): a tile is 8 weight rows (the MMA's B
                          operand, as in ``nk``), a block of kw = min(16, ceil(K/256)) warps works
                          on one tile, splitting its K steps between them and adding their
                          partial sums through shared memory (no split over blocks, no
                          workspace, no atomics); a persistent grid of ~16 warps an SM walks the
                          tiles. Each lane keeps a ring of 8 16-byte weight loads in flight across
                          rounds and tiles; x (16 rows) is staged once a block in shared memory.
``ep_gemv_kn_<dt>``       decode, dense W [K, N] (``transpose_b=0``, ONNX orientation): a warp
                          owns 64 output columns; lanes load 16-byte runs of 4 weight rows and
                          byte permutes pair the k values of one column for the MMA.
``ep_gemv_q4_<dt>``       decode, MatMulNBits 4-bit: a lane's 16 bytes are 32 weights of one row
                          (one block for block sizes >= 32), dequantized in registers without
                          int-to-float converts (each nibble becomes the low byte of a 16-bit
                          float whose high byte is a "magic" exponent: magic + q exactly).
                          fp16/bf16: the dequantized weights are the MMA's A operand, written
                          straight into its fragment registers: a warp owns 16 weight rows, x is
                          B (8 batch rows an MMA, no register shuffling); 3 blocks an SM.
``ep_gemv_mx4_<dt>``      decode, MXFP4: like ``q4``; a lane's 16 bytes are one MX block (32 E2M1
                          codes, one E8M0 scale), decoded with byte-permute tables held in two
                          registers (a 16-entry lookup without memory).
``ep_gemv_<fmt>_stream_`` decode, q4/mx4 fp16/bf16 over many columns (ceil(N/16) >= 20 warps x
``<dt>``                  SMs: the vocabulary projection): persistent, 5 blocks of 4 warps an SM,
                          a warp owns whole 16-row groups over all K (no K split), fed by a
                          per-warp cp.async ring of shared-memory stages 4 steps ahead; the
                          plan streams the formats in ``_STREAM_FORMATS`` (q4 only, as measured).
``ep_gemv_<fmt>_v2_<dt>`` decode, q4 (block >= 32) / mx4 fp16/bf16 over many columns (a 16-row
                          group for every warp: the vocabulary projection), the default there:
                          one persistent block of 16 warps an SM, a warp owns whole 16-row
                          groups over all K; 16-byte weight loads straight into a 4-step register
                          ring, x staged once per block in shared memory in the dequantized
                          weights' fragment order, magic-number dequantization with one LOP3 a
                          pair, weights as the MMA's A operand (~180 warp-instructions per KB of
                          weights against ~470 for ``_stream_``; the .cu file counts them).
``ep_gemv_<fmt>_swiglu_`` ``ep_gemv_<fmt>`` (nk, q4, mx4) with a SwiGLU epilogue (``swiglu=`` of
``<dt>``                  the wrappers): a block's columns are gate outputs and the up outputs
                          of the same indices; it stores ``silu(g) * u``, y [M, N/2], bitwise the
                          GEMV then ``SwiGLUPacked`` (same K split, one shared ``silu_mul``).
``ep_gemm_<fmt>_<dt>``    prefill: 64 x 64 output tiles. fp16/bf16: 128 threads (2 x 2 warps of
                          32 x 32), K tiles of 32 double-buffered in shared memory (cp.async for
                          dense, dequantize-into-shared for q4/mx4), ``mma.sync m16n8k16`` fed by
                          ``ldmatrix``. fp32: 256 threads, 4 x 4 outputs each, K tiles of 16.
========================  =====================================================================

``ep.kernels.q4p`` adds ``ep_gemv_q4p_<dt>``: the 4-bit decode GEMV over a weight repacked once
(`ep.kernels.q4p.pack_q4`) so that each MMA's k lie in one block and the scale is applied after
the MMAs (1.3x the v2 GEMV on the vocabulary projection; its module says what it needs), and
``ep_gemv_mx4p_<dt>``: its MXFP4 twin over a weight `ep.kernels.q4p.pack_mx4` repacked (exact
e2m1 pairs from XOR-encoded words, each block's E8M0 scale applied in fp32 after the MMAs; 1.5x
the v2 GEMV there). ``ep.kernels.mx4f8`` adds ``ep_gemv_mx4f8_bf16`` (sm_90a only): MXFP4 on the
FP8 tensor cores through wgmma, the codes as e4m3 bytes and bf16 x as two e4m3 columns (1.7x).

GEMV vs GEMM: ``M <= 16`` (`GEMV_MAX_ROWS`) runs the GEMV, which reads every weight byte once per
launch for all M rows; larger M runs the GEMM, whose weight traffic is amortised over 64-row
tiles (the prefill path for 4-bit/MXFP4 dequantizes each 64 x 32 weight tile into shared memory
once per 64 rows of x).

Split-K: a GEMV has far fewer output columns than the GPU has warps to keep memory busy, so K is
split over the 8 warps of a block (``kw`` slices) and, when a `MatmulWorkspace` is passed, over
blocks too (``gy``), as far as one wave of blocks allows. Each block writes fp32 partial sums to
the workspace; the last block of a column group adds them in a fixed order, writes y and zeroes
its counter again (so the workspace serves the next launch and captured graphs). The split
depends only on N, K, the format, the workspace size and the GPU's SM count, never on M or on
timing, so a row's result is bitwise the same at any M <= 16 and on every run. Use one workspace
per stream. Without a workspace (``gy = 1``) results differ from those with one in rounding only.

The v2 GEMVs and ``GENAI_EP_GEMV`` (`GEMV_ENV`, read at every plan: one switch for every
format). ``v1`` plans only the earlier GEMVs (split-K ``ep_gemv_<fmt>``, also at 9..16 rows, and
``_stream_``), for A/B runs (``tools/bench_kernels.py --gemv v1,v2`` times both in one run);
``v2`` or unset plans a ``_v2_`` kernel (and ``ep_gemv_nk16``) where the plan picks it, the
earlier kernels elsewhere (`MatmulPlan.reason` says why v2 was not taken). fp16/bf16 only,
16-byte aligned weights only (unaligned weights take the earlier kernels: other rounding of the
sums, same weights):

* q4 (block >= 32) / MXFP4: the whole weight has a 16-row group for each of the GPU's warps (the
  vocabulary projection) and x for 16 rows fits `_V2_MAX_SHARED`. A row's arithmetic depends on
  neither M nor N nor the grid.
* dense [N, K]: nowhere by default (`_V2_DENSE_MIN_ELEMENTS` is None: the H200 timings beside it
  show it losing at 16 rows more than it wins at 1, and the choice may not depend on M); with a
  size rule set (the benchmark's ``v2-any``), weights of at least that many elements, K % 8 == 0,
  K <= 6144 and whole N <= 16384, within the device's shared memory. Its K split (kw warps, R
  rounds of 8 steps) depends on K only, so a row's result does not depend on M, N or the grid.

Resident weights (``resident=True``): the split-K GEMVs (``ep_gemv_{nk,q4,mx4}_<dt>``) place
their own programmatic-dependent-launch wait (`ep.device.KernelSource.pdl_wait`). When the caller
says no kernel writes the weights while the call may run (a resident weight: the native plan
passes it for weights it binds once), each thread issues its first round of weight loads before
it waits for the previous kernel of the stream, so those bytes arrive while that kernel still
runs; x, the workspace and the output are touched only after the wait. The arithmetic is the
same either way. A streamed or paged weight (copied in by the offload store during the step)
must not pass it. Only resident blocks can load early, so a dense fp16/bf16 layer GEMV is planned
in one wave of blocks (`plan_matmul`: more column groups a block where its grid would exceed
one).

Weight orientation: store decode weights as [N, K] (``transpose_b=1``): ``ep_gemv_nk`` reads
rows; ``ep_gemv_kn`` gathers 4 rows per MMA and has 8x fewer column groups to spread over the GPU
(measured on the H200: about 0.6 of ``nk``'s bandwidth on the vocabulary projection). Both are
correct for any sizes; unaligned buffers or sizes that are not a multiple of 16 bytes take an
element-wise load path (slower, same results).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any, Literal

import ml_dtypes
import numpy as np

from ep.device import Buffer, CompileOptions, Device, KernelSource, Stream, register_kernel
from ep.errors import KernelArgumentError
from ep.kernels._common import SILU_MUL
from ep.ops import mlp as mlp_ref
from ep.ops.matmul import (
    MXFP4_BLOCK,
    dequantize_mxfp4,
    dequantize_nbits,
    matmul_mxfp4,
    matmul_nbits,
    matmul_nbits_zp,
)

__all__ = [
    "GEMV_ENV",
    "GEMV_MAX_ROWS",
    "MATMUL_KERNELS",
    "MatmulPlan",
    "MatmulWorkspace",
    "gemm",
    "gemm_mxfp4",
    "gemm_nbits",
    "gemv_version",
    "matmul_workspace",
    "plan_matmul",
    "sm_count",
    "split_k_gemv",
    "v2_geometry",
    "v2_shared_bytes",
]

GEMV_MAX_ROWS = 16  # the M rows of one m16n8k16 MMA
Format = Literal["nk", "kn", "q4", "mx4"]

_BF16 = np.dtype(ml_dtypes.bfloat16)
# dtype -> (kernel-name suffix, CUDA C type)
_DTYPES: dict[np.dtype, tuple[str, str]] = {
    np.dtype(np.float32): ("f32", "float"),
    np.dtype(np.float16): ("f16", "__half"),
    _BF16: ("bf16", "__nv_bfloat16"),
}
_FLAG_W16, _FLAG_X16, _FLAG_ZP, _FLAG_W8, _FLAG_EARLY = 1, 2, 4, 8, 16
_GEMV_THREADS = 256  # 8 warps; the .cu kernels assume it (launch bounds, shared arrays)
_DEFAULT_SMS = 132  # H200; used when the device does not say
_WARPS_PER_SM = (
    24  # resident warps a GEMV block of 8 warps leaves room for (3 blocks at <= 85 regs)
)
# The dense fp16/bf16 split-K GEMV (ep_gemv_nk_<dt>) is bounded to 64 registers: 4 blocks of 8
# warps an SM, so one wave of it is sm_count x 4 blocks.
_DENSE_BLOCKS_PER_SM = 4
# The streaming q4/mx4 GEMVs (``ep_gemv_<fmt>_stream_<dt>``): blocks of 4 warps, at most 5 blocks
# an SM (37.5 KB of shared memory and <= 102 registers a thread: 5 fit an H200 SM, 6 do not),
# one persistent wave.
_STREAM_WARPS = 4
_STREAM_BLOCKS_PER_SM = 5
# Formats the plan streams. MXFP4 is left out: on the H200 (K=896, N=151936, bf16) its streaming
# kernel took 47.8/48.1/65.0 us at M=1/4/16 against 40.7/42.5/74.2 for the split-K one; q4
# streaming took 45.7/46.0/68.8 against 45.9/47.9/96.9.
_STREAM_FORMATS: tuple[str, ...] = ("q4",)
# The dense fp16/bf16 GEMV at 9..16 rows (``ep_gemv_nk16_<dt>``): `row_gemv` with the round's
# x chunks of rows g and g + 8 loaded at once (AHEAD2), a kernel of its own so that its 80
# registers (3 blocks an SM) leave ``ep_gemv_nk``'s code at 1..8 rows as it was (the same
# cubin). H200, bf16, 16 rows, us a launch in a chain, nk / nk16 (docs/benchmarks/h200.md):
# 896x896 2.76 / 2.45, 896x1152 2.85 / 2.54, 896x9728 9.82 / 7.52, 896x151936 101.2 / 76.8;
# but 4864x896 6.46 / 8.1 (these loads in a first version): its 448 blocks are one wave at 4
# blocks an SM, not at 3, so a grid of that kind keeps ``ep_gemv_nk`` (`_rows16`). Bounded to 4
# blocks an SM (64 registers) nk16 lost elsewhere: the 0.5B decode graph at batch 16 took 0.819
# ms a step against 0.790.
_ROWS16_BLOCKS_PER_SM = 3
# The v2 GEMVs (``ep_gemv_<fmt>_v2_<dt>``, fp16/bf16; the .cu file has their designs).
# GENAI_EP_GEMV=v1 plans the earlier kernels only (split-K and streaming GEMVs), for A/B runs.
GEMV_ENV = "GENAI_EP_GEMV"
_GEMV_VERSIONS = ("v1", "v2")
_V2_WARPS = 16  # warps a block at most (__launch_bounds__(512, 1): <= 128 registers a thread)
_SM_SHARED = 228 * 1024  # shared memory an H100/H200 SM holds (1 KiB of it reserved a block)
_DEVICE_SHARED = 227 * 1024  # a block's opt-in maximum there (the plan's default)
# q4/mx4 v2: one persistent block of 16 warps an SM, x staged in shared memory for 16 rows
# (16 x (256 x steps + 64) bytes, steps = ceil(row bytes / 64)).
_V2_MAX_SHARED = 160 * 1024  # K up to ~4992 for 4-bit (q4 block 32 or MXFP4)
# Dense v2 (``ep_gemv_nk_v2``): blocks of kw <= 16 warps on 8-row tiles, a persistent grid.
_V2_SLOTS = 8  # weight loads in flight a lane (epk::V2_SLOTS)
_V2_WARPS_PER_SM = 16  # the persistent grid's target: 16 warps x 4 KB in flight an SM
_V2_MAX_N = 16384  # whole N above this (the vocabulary projection) keeps ep_gemv_nk
_V2_MAX_K = 6144  # 16 rows of x must fit shared memory: 16 x (6144 + 32) x 2 bytes = 193 KiB
# Where the dense v2 would run: measured on the H200 (bf16, us a GEMV, graph replays, v1 / v2):
#   K x N         M=1          M=4          M=16           weight elements
#   896x1152      3.27 / 3.27  3.34 / 3.31  3.89 / 3.84     1.0M  (v2 not planned below 4M)
#   896x4864      6.56 / 6.29  6.82 / 7.02  8.32 / 10.17    4.4M
#   4864x896      7.07 / 6.54  7.32 / 7.22  8.16 / 11.03    4.4M
#   896x9728      9.27 / 8.82  9.60 / 9.67 11.48 / 13.12    8.7M
# v2 wins 4-8 % at M = 1 on the weights of >= 4.4M elements and loses 14-35 % at M = 16. The
# choice may not depend on M (a row of a batch would be rounded differently from the same prompt
# run alone: DESIGN.md section 6, batch row identity), and a batch of 16 loses more than a single
# row gains, so the plan takes the dense v2 nowhere: None. `tools/bench_kernels.py --gemv
# v1,v2-any` times it on every shape (it sets this to 0: every weight of >= 0 elements).
_V2_DENSE_MIN_ELEMENTS: int | None = None


# --- source and registration -------------------------------------------------------------------


def _cuda_source() -> str:
    return resources.files("ep.kernels").joinpath("_matmul_kernels.cu").read_text()


_GEMV_ROWS = {
    "nk": (
        "const T* w",
        "const epk::DenseRows<T> p{w, K, (flags & EPK_W16) != 0};",
        "epk::DenseRows<T>",
    ),
    "q4": (
        "const u8* b, const T* scales, const u8* zp",
        "const epk::Q4Rows<T> p{b, scales, zp, kb, (kb << bs_shift) >> 1, (kb + 1) >> 1, "
        "bs_shift, (flags & EPK_W16) != 0, (flags & EPK_ZP) != 0};",
        "epk::Q4Rows<T>",
    ),
    "mx4": (
        "const u8* b, const u8* scales",
        "const epk::Mx4Rows<T> p{b, scales, K >> 5, K >> 1, (flags & EPK_W16) != 0};",
        "epk::Mx4Rows<T>",
    ),
}
_Q4_SIZES = "int M, int N, int K, int kb, int bs_shift"


# An epilogue of the split-K GEMV: (the kernel's parameters after the flags, as C, and the
# column map's declaration given the GEMV body's column-group width: 8 for `row_gemv`, 16 for
# `row_gemv_wt`). The map (`PlainCols`, `SwigluCols` in the .cu) decides which weight row each
# launch column reads and what the finishing block stores.
GemvEpilogue = tuple[str, Callable[[int], str]]

_SWIGLU_EPILOGUE: GemvEpilogue = (
    ", int inter, int interleaved",
    lambda cols: (
        f"const epk::SwigluCols<{cols}> oc{{inter, interleaved ? 2 : 1, interleaved ? 1 : inter}};"
    ),
)


def _gemv_entry(
    fmt: str,
    name: str,
    fp32: bool,
    epilogue: GemvEpilogue | None = None,
    rows16: bool = False,
    ordered: bool = False,
) -> str:
    """The split-K GEMV; with ``epilogue`` its twin with that column map and those parameters
    (`GemvEpilogue`); ``rows16``: the dense fp16/bf16 one for 9..16 rows (``ep_gemv_nk16``),
    ``ordered``: with each round's loads issued before its first MMA (`row_gemv`'s ORDER)."""
    sizes = _Q4_SIZES if fmt == "q4" else "int M, int N, int K"
    blocks = 3 if fmt in ("q4", "mx4") and not fp32 else 1  # 3 blocks an SM: <= 85 registers
    unroll = _UNROLL[(fmt, fp32)]
    if rows16:
        blocks, unroll = _ROWS16_BLOCKS_PER_SM, _DENSE_UNROLL_SHORT
    elif fmt == "nk" and not fp32 and epilogue is None:
        blocks = _DENSE_BLOCKS_PER_SM  # 5 steps a round in 64 registers
    elif fmt == "nk" and not fp32:
        unroll = _DENSE_UNROLL_SHORT
    head = f'extern "C" __global__ void __launch_bounds__({_GEMV_THREADS}, {blocks}) {name}('
    if fmt == "kn":
        return (
            f"{head}T* y, const T* x, const T* w, float* ws, u32* counters, {sizes}, int kw, "
            f"int gy, u32 flags) {{\n"
            f"  epk::col_gemv<T, {unroll}>(y, x, w, ws, counters, M, N, K, kw, gy, flags);\n}}\n"
        )
    weights, policy, ptype = _GEMV_ROWS[fmt]
    # 4-bit and MXFP4 on tensor cores: the dequantized weights are the MMA's A operand.
    body = "row_gemv" if fp32 or fmt == "nk" else "row_gemv_wt"
    extra, cols = "", "const epk::PlainCols oc{N};"
    if epilogue is not None:  # column groups of 8 (row_gemv) or 16 (row_gemv_wt)
        extra, cols = epilogue[0], epilogue[1](8 if body == "row_gemv" else 16)
    args = "(p, y, x, ws, counters, M, N, K, kw, gy, flags, oc);"
    general = f"epk::row_gemv<T, {ptype}, {unroll}, false, false>{args}"
    if fmt == "nk":  # aligned rows and K % 32 == 0: the branch-free FULL loads (the .cu)
        full = f"epk::row_gemv<T, {ptype}, {unroll}, true"
        if rows16:  # 9..16 rows: the x chunks of rows g and g + 8 of a round at once
            full = f"{full}, true, true{', true' if ordered else ''}>{args}"
        else:
            full = f"if (M > 8) {full}, true>{args}\n    else {full}, false>{args}"
        call = (
            "if ((flags & EPK_W16) && (flags & EPK_X16) && (K & 31) == 0) {\n"
            f"    {full}\n  }} else {{\n    {general}\n  }}"
        )
    elif body == "row_gemv":
        call = general
    else:
        call = f"epk::row_gemv_wt<T, {ptype}, {unroll}>{args}"
    return (
        f"{head}T* y, const T* x, {weights}, float* ws, u32* counters, {sizes}, int kw, int gy, "
        f"u32 flags{extra}) {{\n  {policy}\n  {cols}\n  {call}\n}}\n"
    )


def _rows16_entry(fmt: str, name: str) -> str:
    """``ep_gemv_nk16`` (dense fp16/bf16, 9..16 rows): the split-K GEMV's parameters."""
    return _gemv_entry(fmt, name, False, rows16=True)


def _stream_entry(fmt: str, name: str) -> str:
    """The streaming GEMV (fp16/bf16 q4/mx4): the parameters of ``ep_gemv_<fmt>``, kw/gy unused."""
    head = (
        f'extern "C" __global__ void __launch_bounds__({32 * _STREAM_WARPS}, '
        f"{_STREAM_BLOCKS_PER_SM}) {name}("
    )
    if fmt == "q4":
        weights = "const u8* b, const T* scales, const u8* zp"
        policy = "epk::q4_stream<T>(b, scales, zp, N, kb, bs_shift, flags)"
        sizes = _Q4_SIZES
    else:
        weights = "const u8* b, const u8* scales"
        policy = "epk::mx4_stream<T>(b, scales, N, K, flags)"
        sizes = "int M, int N, int K"
    return (
        f"{head}T* y, const T* x, {weights}, float* ws, u32* counters, {sizes}, int kw, int gy, "
        f"u32 flags) {{\n  (void)ws; (void)counters; (void)kw; (void)gy;\n"
        f"  epk::stream_gemv<T>({policy}, y, x, M, N, K, flags);\n}}\n"
    )


def _v2_entry(fmt: str, name: str) -> str:
    """The v2 GEMV (fp16/bf16 nk/q4/mx4): the parameters of ``ep_gemv_<fmt>``, kw/gy unused."""
    head = f'extern "C" __global__ void __launch_bounds__({32 * _V2_WARPS}, 1) {name}('
    if fmt == "nk":
        weights = "const T* w"
        sizes = "int M, int N, int K"
        body = "  epk::nk_ring_gemv<T>(y, x, w, M, N, K, flags);\n"
    elif fmt == "q4":
        weights = "const u8* b, const T* scales, const u8* zp"
        sizes = _Q4_SIZES
        call = (
            "epk::v2_gemv<T>(epk::q4_v2<T, {zp}>(b, scales, zp, N, kb, bs_shift), y, x, M, N, K, "
            "flags);"
        )
        body = (
            f"  if (flags & EPK_ZP) {{\n    {call.format(zp='true')}\n  }} else {{\n"
            f"    {call.format(zp='false')}\n  }}\n"
        )
    else:
        weights = "const u8* b, const u8* scales"
        sizes = "int M, int N, int K"
        body = "  epk::v2_gemv<T>(epk::mx4_v2<T>(b, scales, N, K), y, x, M, N, K, flags);\n"
    return (
        f"{head}T* y, const T* x, {weights}, float* ws, u32* counters, {sizes}, int kw, int gy, "
        f"u32 flags) {{\n  (void)ws; (void)counters; (void)kw; (void)gy;\n{body}}}\n"
    )


def _gemm_entry(fmt: str, name: str, fp32: bool) -> str:
    threads = 256 if fp32 else 128
    n0 = "blockIdx.x * epk::SN" if fp32 else "blockIdx.x * epk::TN"
    head = f'extern "C" __global__ void __launch_bounds__({threads}) {name}('
    w16 = "(flags & EPK_W16) != 0"
    w8 = "(flags & EPK_W8) != 0"
    zp = "(flags & EPK_ZP) != 0"
    if fmt in ("nk", "kn"):
        args = "T* y, const T* x, const T* w, int M, int N, int K, u32 flags"
        if fp32:
            tile = "F32NKTile" if fmt == "nk" else "F32KNTile"
            make = f"epk::{tile} bt{{w, N, K, {n0}, {w16}, {{}}}};"
        else:
            tile = "DenseNKTile" if fmt == "nk" else "DenseKNTile"
            make = f"epk::{tile}<T> bt(w, N, K, {n0}, {w16});"
    elif fmt == "q4":
        args = (
            f"T* y, const T* x, const u8* b, const T* scales, const u8* zp, {_Q4_SIZES}, u32 flags"
        )
        common = "b, scales, zp, N, kb, (kb << bs_shift) >> 1, (kb + 1) >> 1, bs_shift"
        if fp32:
            make = f"epk::F32Q4Tile bt{{{common}, {n0}, {zp}, {{}}}};"
        else:
            make = f"epk::Q4Tile<T> bt{{{common}, {n0}, {w8}, {zp}, {{}}}};"
    else:
        args = "T* y, const T* x, const u8* b, const u8* scales, int M, int N, int K, u32 flags"
        common = f"b, scales, N, K >> 5, K >> 1, {n0}"
        if fp32:
            make = f"epk::F32Mx4Tile bt{{{common}, {{}}}};"
        else:
            make = f"epk::Mx4Tile<T> bt{{{common}, {w8}, {{}}}};"
    call = (
        "epk::gemm_simt(y, x, bt, M, N, K, flags);"
        if fp32
        else ("epk::gemm_tc<T>(y, x, bt, M, N, K, flags);")
    )
    return f"{head}{args}) {{\n  {make}\n  {call}\n}}\n"


# Kernel parameter lists ("T*" is the activation pointer type of each dtype).
_GEMV_PARAMS: dict[str, tuple[str, ...]] = {
    "nk": ("T*", "T*", "T*", "void*", "void*", "i32", "i32", "i32", "i32", "i32", "u32"),
    "kn": ("T*", "T*", "T*", "void*", "void*", "i32", "i32", "i32", "i32", "i32", "u32"),
    "q4": ("T*", "T*", "u8*", "T*", "u8*", "void*", "void*", *["i32"] * 7, "u32"),
    "mx4": ("T*", "T*", "u8*", "u8*", "void*", "void*", *["i32"] * 5, "u32"),
}
_GEMM_PARAMS: dict[str, tuple[str, ...]] = {
    "nk": ("T*", "T*", "T*", "i32", "i32", "i32", "u32"),
    "kn": ("T*", "T*", "T*", "i32", "i32", "i32", "u32"),
    "q4": ("T*", "T*", "u8*", "T*", "u8*", *["i32"] * 5, "u32"),
    "mx4": ("T*", "T*", "u8*", "u8*", "i32", "i32", "i32", "u32"),
}
# A GEMV's arguments before its (workspace, counters): y, x and the weight buffers.
_ARGS_BEFORE_WS = {"nk": 3, "kn": 3, "q4": 5, "mx4": 4}
# Steps each warp keeps in flight (weight registers per lane: 16 bytes x unroll). The dense
# fp16/bf16 GEMV (``ep_gemv_nk``, bounded to 4 blocks an SM: 64 registers) takes 5, so a warp of
# the down projection (K 4864: 152 steps over 32 slices) walks its 4 or 5 steps in one round
# instead of two; its epilogue twins take 4 (at 5 the gate/up twin lost at one row: 6.22 -> 6.98
# us a call in the 0.5B batch-1 graph on the H200), and so does ``ep_gemv_nk16`` (80 registers).
_DENSE_UNROLL_SHORT = 4
_UNROLL: dict[tuple[str, bool], int] = {
    ("nk", False): 5,
    ("nk", True): 2,
    ("kn", False): 2,
    ("kn", True): 2,
    ("q4", False): 2,
    ("q4", True): 2,
    ("mx4", False): 2,
    ("mx4", True): 2,
}


# --- CPU twins: the NumPy references of ep.ops, whatever the grid ------------------------------
#
# The GEMV twins multiply row by row, so that (as on the GPU) a row's result does not depend on the
# other rows of the batch: a BLAS GEMM blocks its sums differently for different M.


def _product(a: np.ndarray, wt: np.ndarray, by_rows: bool) -> np.ndarray:
    """``a @ wt`` rounded to a's dtype, with the arithmetic of the ep.ops references (fp32)."""
    a32 = a.astype(np.float32, copy=False)
    w32 = wt.astype(np.float32, copy=False)
    if by_rows:
        out = np.concatenate([np.matmul(a32[i : i + 1], w32) for i in range(a.shape[0])])
    else:
        out = np.matmul(a32, w32)
    return out.astype(a.dtype, copy=False)


def _twin_dense(nk: bool, gemv: bool) -> Callable[..., None]:
    def twin(y: np.ndarray, x: np.ndarray, w: np.ndarray, *rest: np.generic) -> None:
        M, N, K = (int(v) for v in (rest[2:5] if gemv else rest[:3]))
        wt = w[: N * K].reshape((N, K) if nk else (K, N))
        # ep.ops.matmul.matmul_weight's arithmetic (it takes its weight from a resolver by name)
        y[: M * N] = _product(x[: M * K].reshape(M, K), wt.T if nk else wt, gemv).reshape(-1)

    return twin


def _twin_q4(gemv: bool) -> Callable[..., None]:
    def twin(
        y: np.ndarray,
        x: np.ndarray,
        b: np.ndarray,
        scales: np.ndarray,
        zp: np.ndarray,
        *rest: np.generic,
    ) -> None:
        sizes = rest[2:7] if gemv else rest[:5]
        M, N, K, kb, shift = (int(v) for v in sizes)
        block = 1 << shift
        a = x[: M * K].reshape(M, K)
        packed = b[: N * kb * block // 2].reshape(N, kb, block // 2)
        s = scales[: N * kb]
        z = zp[: N * ((kb + 1) // 2)] if int(rest[-1]) & _FLAG_ZP else None
        if not gemv:
            if z is not None:
                out = matmul_nbits_zp(a, packed, s, z, K=K, N=N, bits=4, block_size=block)
            else:
                out = matmul_nbits(a, packed, s, K=K, N=N, bits=4, block_size=block)
            y[: M * N] = out.reshape(-1)
            return
        w = dequantize_nbits(packed, s, z, K=K, N=N, block_size=block)
        y[: M * N] = _product(a, w.T, True).reshape(-1)  # matmul_nbits(_zp), row by row

    return twin


def _twin_mx4(gemv: bool) -> Callable[..., None]:
    def twin(
        y: np.ndarray, x: np.ndarray, b: np.ndarray, scales: np.ndarray, *rest: np.generic
    ) -> None:
        M, N, K = (int(v) for v in (rest[2:5] if gemv else rest[:3]))
        kb = K // MXFP4_BLOCK
        a = x[: M * K].reshape(M, K)
        packed = b[: N * K // 2].reshape(N, kb, MXFP4_BLOCK // 2)
        s = scales[: N * kb].reshape(N, kb)
        if gemv:  # matmul_mxfp4, row by row
            out = _product(a, dequantize_mxfp4(packed, s).T, True)
        else:
            out = matmul_mxfp4(a, packed, s, K=K, N=N)
        y[: M * N] = out.reshape(-1)

    return twin


def _twin(fmt: str, gemv: bool) -> Callable[..., None]:
    if fmt in ("nk", "kn"):
        return _twin_dense(fmt == "nk", gemv)
    return _twin_q4(gemv) if fmt == "q4" else _twin_mx4(gemv)


def _epilogue_twin(fmt: str, finish: Callable[..., None], extra: int) -> Callable[..., None]:
    """The twin of a GEMV with an epilogue: the GEMV's twin into a packed [M, N] product, then
    ``finish(y, product, *the epilogue's parameters)`` (the unfused op's twin on it)."""
    plain = _twin(fmt, True)
    at_m = _ARGS_BEFORE_WS[fmt] + 2  # M and N follow the workspace and the counters

    def twin(*args: Any) -> None:
        gemv, params = args[:-extra], args[-extra:]
        y = gemv[0]
        M, N = int(gemv[at_m]), int(gemv[at_m + 1])
        packed = np.empty(M * N, y.dtype)
        plain(packed, *gemv[1:])
        finish(y, packed.reshape(M, N), *params)

    return twin


def _swiglu_finish(y: np.ndarray, rows: np.ndarray, inter: Any, interleaved: Any) -> None:
    """`ep.ops.mlp.swiglu` on the gate and up halves (or interleaved columns) of the product."""
    inter = int(inter)
    if interleaved:
        gate, up = rows[:, 0::2], rows[:, 1::2]
    else:
        gate, up = rows[:, :inter], rows[:, inter:]
    y[: rows.shape[0] * inter] = mlp_ref.swiglu(gate, up).reshape(-1)


def _register() -> dict[str, KernelSource]:
    body = SILU_MUL + _cuda_source()  # silu_mul before the .cu: its SwiGLU epilogue calls it
    options = CompileOptions(cuda_headers=True)  # tolerance-tested: FMA contraction stays on
    out: dict[str, KernelSource] = {}
    for suffix, ctype in _DTYPES.values():
        fp32 = suffix == "f32"
        for fmt in ("nk", "kn", "q4", "mx4"):
            for kind in ("gemv", "gemm"):
                name = f"ep_{kind}_{fmt}_{suffix}"
                if kind == "gemv":
                    entry = _gemv_entry(fmt, name, fp32)
                    params = _GEMV_PARAMS[fmt]
                else:
                    entry = _gemm_entry(fmt, name, fp32)
                    params = _GEMM_PARAMS[fmt]
                source = f"{body}\ntypedef {ctype} T;\n{entry}"
                out[name] = register_kernel(
                    KernelSource(
                        name=name,
                        source=source,
                        params=tuple(p.replace("T*", f"{suffix}*") for p in params),
                        options=options,
                        cpu=_twin(fmt, kind == "gemv"),
                        # the split-K GEMVs place their own wait (EPK_EARLY: weights first)
                        pdl_wait="kernel" if kind == "gemv" and fmt != "kn" else "entry",
                    )
                )
            if fp32 or fmt == "kn":
                continue
            # dense [N, K]: 9..16 rows (waits for the previous kernel itself, as the split-K
            # GEMV does) and v2; q4/mx4: streaming and v2
            families: list[tuple[str, Callable[[str, str], str]]] = [("v2", _v2_entry)]
            if fmt != "nk":
                families.insert(0, ("stream", _stream_entry))
            kernels: list[tuple[str, Callable[[str, str], str], Literal["entry", "kernel"]]] = [
                (f"ep_gemv_{fmt}_{family}_{suffix}", make, "entry") for family, make in families
            ]
            if fmt == "nk":
                kernels.insert(0, (f"ep_gemv_nk16_{suffix}", _rows16_entry, "kernel"))
            for name, make, wait in kernels:
                out[name] = register_kernel(
                    KernelSource(
                        name=name,
                        source=f"{body}\ntypedef {ctype} T;\n{make(fmt, name)}",
                        params=tuple(p.replace("T*", f"{suffix}*") for p in _GEMV_PARAMS[fmt]),
                        options=options,
                        cpu=_twin(fmt, True),
                        pdl_wait=wait,
                    )
                )
    # the split-K GEMV with a SwiGLU epilogue (`SwigluCols` in the .cu): + inter, interleaved
    # ordered: H200, NVRTC 13.0, bf16 896 x 9728 at 16 rows, us a launch in a chain of 24
    # weights: 8.19 without, 7.19 with (the plain ep_gemv_nk16: 7.02 without, 7.23 with).
    out.update(
        register_gemv_epilogue(
            "swiglu", _SWIGLU_EPILOGUE, ("i32", "i32"), _swiglu_finish, ordered=True
        )
    )
    return out


def register_gemv_epilogue(
    kind: str,
    epilogue: GemvEpilogue,
    params: tuple[str, ...],
    finish: Callable[..., None],
    *,
    head: str = "",
    tail: str = "",
    options: CompileOptions | None = None,
    ordered: bool = False,
) -> dict[str, KernelSource]:
    """Register ``ep_gemv_<fmt>_<kind>_<dt>`` (nk, q4, mx4 × f32, f16, bf16): the split-K GEMV
    with ``epilogue`` (`GemvEpilogue`) and its extra ``params`` after the flags; the CPU twin is
    the GEMV's twin followed by ``finish(y, product [M, N], *params)``. ``head`` is compiled
    before the kernels' .cu, ``tail`` after ``typedef T`` (the column map's device code);
    `plan_matmul` (``epilogue=kind``) plans them at the plain split-K GEMV's K split.
    ``ordered``: the 9..16-row twin (``ep_gemv_nk16_<kind>``) issues each round's loads before
    its first MMA (`_gemv_entry`)."""
    options = options or CompileOptions(cuda_headers=True)
    body = head + SILU_MUL + _cuda_source()
    out: dict[str, KernelSource] = {}
    for suffix, ctype in _DTYPES.values():
        fp32 = suffix == "f32"
        for fmt, rows16 in [("nk", False), ("q4", False), ("mx4", False)] + (
            [] if fp32 else [("nk", True)]
        ):
            name = f"ep_gemv_{fmt}{'16' if rows16 else ''}_{kind}_{suffix}"
            entry = _gemv_entry(fmt, name, fp32, epilogue, rows16, ordered and rows16)
            out[name] = register_kernel(
                KernelSource(
                    name=name,
                    source=f"{body}\ntypedef {ctype} T;\n{tail}{entry}",
                    params=tuple(
                        p.replace("T*", f"{suffix}*") for p in (*_GEMV_PARAMS[fmt], *params)
                    ),
                    options=options,
                    cpu=_epilogue_twin(fmt, finish, len(params)),
                    pdl_wait="kernel",
                )
            )
    return out


MATMUL_KERNELS: dict[str, KernelSource] = _register()


# --- workspace -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class MatmulWorkspace:
    """Scratch for GEMVs split over blocks: fp32 partial sums and per-block arrival counters.

    The counters are zero between launches (each launch's last block resets its own), so one
    workspace serves every GEMV and every graph replay on one stream; do not share it between
    streams that run at the same time.
    """

    partials: Buffer  # float32
    counters: Buffer  # uint32

    @property
    def floats(self) -> int:
        return self.partials.size

    @property
    def slots(self) -> int:
        return self.counters.size


def matmul_workspace(
    dev: Device,
    *,
    stream: Stream,
    floats: int = 1 << 22,
    counters: int = 1 << 16,
    name: str = "matmul-workspace",
) -> MatmulWorkspace:
    """Allocate a workspace (default 16 MiB of partial sums, 65536 counters) and zero it."""
    _need(
        floats > 0 and counters > 0,
        "matmul_workspace",
        f"floats={floats} and counters={counters} must be positive",
    )
    partials = dev.alloc(floats, np.float32, stream=stream, name=f"{name}.partials")
    slots = dev.alloc(counters, np.uint32, stream=stream, name=f"{name}.counters")
    dev.fill(slots, 0, stream=stream)
    return MatmulWorkspace(partials, slots)


# --- planning ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MatmulPlan:
    """Which kernel a call runs and how it is launched, with the reason in words."""

    kernel: str
    kind: Literal["gemv", "gemm"]
    grid: tuple[int, int, int]
    block: int
    kw: int  # GEMV: K slices over the warps of a block
    gy: int  # GEMV: K slices over blocks (needs a workspace when > 1)
    reason: str
    shared: int = 0  # dynamic shared memory bytes of a block (the v2 GEMVs; never depends on M)


def _need(ok: bool, op: str, message: str) -> None:
    if not ok:
        raise KernelArgumentError(f"{op}: {message}")


def gemv_version() -> Literal["v1", "v2"]:
    """The GEMVs `GEMV_ENV` asks for, for every format: ``v1`` never plans a ``_v2_`` kernel;
    ``v2`` (also when unset or empty) plans one where `_plan_v2` picks it."""
    value = os.environ.get(GEMV_ENV, "").strip().lower() or "v2"
    _need(
        value in _GEMV_VERSIONS,
        "matmul",
        f"{GEMV_ENV}={value!r} is not a GEMV version; expected v1 (only the split-K and "
        "streaming GEMVs) or v2 (the default: the v2 GEMVs where the plan picks them); unset it "
        "for the default",
    )
    return "v1" if value == "v1" else "v2"


def _gemv_shape(fmt: Format, fp32: bool, N: int, K: int, block_size: int) -> tuple[int, int, int]:
    """(output columns per warp group, column groups, K steps per group) of a GEMV."""
    if fmt == "kn":
        return 64, -(-N // 64), -(-K // (4 if fp32 else 16))
    if fmt == "nk":
        return 8, -(-N // 8), -(-K // 32)
    if fmt == "q4":
        k_blocks = -(-K // block_size)
        steps = -(-(k_blocks * block_size // 2) // 64)
    else:
        steps = -(-K // 128)
    cols = 8 if fp32 else 16  # fp16/bf16: 16 weight rows, the MMA's A operand
    return cols, -(-N // cols), steps


def plan_matmul(
    fmt: Format,
    dtype: np.dtype,
    *,
    M: int,
    N: int,
    K: int,
    block_size: int = 32,
    workspace: MatmulWorkspace | None = None,
    sm_count: int = _DEFAULT_SMS,
    split_n: int | None = None,
    aligned: bool = True,
    max_shared: int = _DEVICE_SHARED,
    epilogue: str | None = None,
) -> MatmulPlan:
    """The kernel and launch geometry for one call.

    M decides GEMV vs GEMM, for dense weights whether the v2 GEMV runs (`_plan_v2`), and for
    dense fp16/bf16 past 8 rows ``ep_gemv_nk16`` (`_rows16`: the same sums as ``ep_gemv_nk``);
    nothing else looks at M. The GEMV's K split depends on N, K, the format, the workspace and
    ``sm_count`` only, so the arithmetic for a row is the same at every M <= `GEMV_MAX_ROWS`.
    ``split_n``: this call is N columns of a weight with ``split_n`` output columns (a
    streamed piece); the kernel and the K split are chosen as a launch of all ``split_n`` columns
    would choose them, so every column gets the arithmetic of the unsplit product. ``aligned``:
    the weight rows allow 16-byte loads (aligned base, row bytes a multiple of 16);
    ``max_shared``: a block's shared-memory limit on the device. Both only decide whether a v2
    GEMV may run; `GEMV_ENV` ``=v1`` plans the earlier GEMVs only. ``epilogue`` (``"swiglu"``,
    ``"rope"``): the split-K GEMV with that epilogue (``ep_gemv_<fmt>_<epilogue>_<dt>``; SwiGLU:
    y [M, N/2]; rope: `RopeEpilogue`) at the K split the plain split-K GEMV of these sizes gets
    (never a v2 or streaming GEMV; `_check_epilogue` says when it applies).
    """
    found = _DTYPES.get(np.dtype(dtype))
    _need(
        found is not None,
        "matmul",
        f"dtype {dtype} has no kernel; expected float32, float16 or bfloat16",
    )
    assert found is not None
    suffix = found[0]
    fp32 = suffix == "f32"
    if epilogue is not None:
        _check_epilogue("matmul", epilogue, fmt, M, N, split_n)
    if M > GEMV_MAX_ROWS:
        tiles_n, tiles_m = -(-N // 64), -(-M // 64)
        _need(tiles_m <= 65535, "matmul", f"M={M} needs {tiles_m} row tiles; at most 65535")
        return MatmulPlan(
            f"ep_gemm_{fmt}_{suffix}",
            "gemm",
            (tiles_n, tiles_m, 1),
            256 if fp32 else 128,
            1,
            1,
            f"M={M} > {GEMV_MAX_ROWS}: tiled GEMM, {tiles_n}x{tiles_m} tiles of 64x64"
            + ("" if fp32 else " on tensor cores"),
        )
    whole = N
    if split_n is not None:
        _need(
            isinstance(split_n, int | np.integer) and not isinstance(split_n, bool)
            and N <= split_n < 2**31,
            "matmul",
            f"split_n={split_n!r} must be an integer in [N={N}, 2^31): the output columns of the "
            "whole weight this call is a piece of",
        )  # fmt: skip
        whole = int(split_n)
    v2_skipped = ""
    if fmt != "kn" and not fp32 and epilogue is None:
        v2 = _plan_v2(fmt, suffix, M, N, whole, K, block_size, sm_count, aligned, max_shared)
        if isinstance(v2, MatmulPlan):
            return v2
        v2_skipped = f"; v2 not taken: {v2}"
    if fmt in _STREAM_FORMATS and not fp32 and epilogue is None:
        stream = _plan_stream(fmt, suffix, N, whole, K, sm_count)
        if stream is not None:
            return replace(stream, reason=stream.reason + v2_skipped)
    cols, groups, steps = _gemv_shape(fmt, fp32, whole, K, block_size)
    # As many K slices as keep one wave of blocks on the GPU (never more: a second wave is a
    # tail of mostly idle SMs) and at least one K step per slice.
    slices = max(1, min(steps, sm_count * _WARPS_PER_SM // groups))
    kw = 1
    while kw * 2 <= min(8, slices):
        kw *= 2
    # Dense [N, K] weights of up to a few waves of 8-warp blocks (a decoder layer's projections)
    # run faster with all 8 warps on K and a block split only where each warp would still walk
    # more than 4 steps: measured on the H200 over every (kw, gy), bf16, M = 1 and 16 (QKV
    # 896x1152: 3.5 us against 4.7 with kw 8 x gy 2; down 4864x896: gy 4 best).
    mid_dense = fmt == "nk" and groups * 8 <= sm_count * _WARPS_PER_SM * 4
    wave = sm_count * _DENSE_BLOCKS_PER_SM
    one_wave = mid_dense and not fp32
    whole_groups = groups  # the unsplit weight's column groups (8 // kw a block)
    if mid_dense:
        kw = 1
        while kw * 2 <= min(8, steps):
            kw *= 2
    if one_wave:
        # Blocks past the first wave start only as it drains, too late to load their weights
        # before the PDL wait: a long weight takes more column groups a block (kw halved) until
        # its grid is one wave, keeping 2 warps a group. H200, the 896 x 9728 gate/up projection
        # in the 0.5B decode graph, ms a step at batch 1 / 16 (same run, K split over blocks
        # off): kw 8 (1216 blocks) 0.706 / 0.881, kw 4 (608) 0.685 / 0.882, kw 2 (304) 0.683 /
        # 0.840, kw 1 (152) 0.745 / 0.941.
        while kw > 2 and -(-whole_groups // (8 // kw)) > wave:
            kw //= 2
    gy = 1
    why = "no workspace: K split over the warps of a block only"
    if workspace is not None:
        want = steps // (kw * 4) if mid_dense else slices // kw
        gy = max(1, min(want, 64, workspace.floats // (GEMV_MAX_ROWS * whole)))
        if one_wave:  # and so is a split over blocks
            gy = max(1, min(gy, wave // -(-whole_groups // (8 // kw))))
        if -(-groups // (8 // kw)) > workspace.slots:
            gy = 1
        why = f"workspace: K split over {gy} block(s) too"
    if whole != N:
        groups = _gemv_shape(fmt, fp32, N, K, block_size)[1]
        why += f"; K split of the whole {whole} columns"
    grid_x = -(-groups // (8 // kw))
    _need(grid_x <= 2**31 - 1, "matmul", f"N={N} needs {grid_x} blocks; too many")
    kernel_fmt: str = fmt
    if fmt == "nk" and not fp32 and M > 8 and gemv_version() == "v2":
        if _rows16(grid_x * gy, sm_count):
            kernel_fmt = "nk16"
            why += f"; {M} rows: x rows g and g + 8 of a round at once (nk16)"
        else:
            why += f"; nk16 not taken: {grid_x * gy} blocks are one wave at 4 blocks an SM only"
    if epilogue == "swiglu":
        why += f"; SwiGLU epilogue: y is [M, {N // 2}]"
    elif epilogue is not None:
        why += f"; {epilogue} epilogue"
    return MatmulPlan(
        f"ep_gemv_{kernel_fmt}{f'_{epilogue}' if epilogue else ''}_{suffix}",
        "gemv",
        (grid_x, gy, 1),
        _GEMV_THREADS,
        kw,
        gy,
        f"M={M} <= {GEMV_MAX_ROWS}: GEMV, {groups} groups of {cols} columns x {kw * gy} K slices "
        f"({kw} warps x {gy} blocks; {steps} steps of K per group); {why}{v2_skipped}",
    )


def _rows16(blocks: int, sm_count: int) -> bool:
    """Whether a dense fp16/bf16 GEMV of ``blocks`` blocks runs ``ep_gemv_nk16`` at 9..16 rows:
    unless its blocks are one wave of ``ep_gemv_nk`` (4 an SM) but not of nk16 (3 an SM), whose
    second wave would start only as the first drains (`_ROWS16_BLOCKS_PER_SM`)."""
    return not _ROWS16_BLOCKS_PER_SM * sm_count < blocks <= _DENSE_BLOCKS_PER_SM * sm_count


def split_k_gemv(plan: MatmulPlan) -> bool:
    """Whether ``plan`` runs a split-K GEMV ``ep_gemv_<fmt>_<dt>`` (with ``ep_gemv_nk16_<dt>``:
    the kernels that have epilogue twins), not a v2, streaming or epilogue GEMV nor a GEMM."""
    return plan.kind == "gemv" and plan.kernel.count("_") == 3


_EPILOGUE_WHAT = {
    "swiglu": ("a SwiGLU", "gate/up", "the SwiGLUPacked kernel"),
    "rope": ("a rotary/KV-commit", "QKV", "the QKVRotaryCommit kernel"),
}


def _check_epilogue(op: str, kind: str, fmt: Format, M: int, N: int, split_n: int | None) -> None:
    """The epilogues run in the split-K GEMVs of dense [N, K], 4-bit and MXFP4 weights over a
    whole packed weight (SwiGLU: whose halves fill whole 16-column groups; rope: `RopeEpilogue`
    checks its own columns)."""
    _need(
        kind in _EPILOGUE_WHAT, op, f"epilogue={kind!r}; expected one of {sorted(_EPILOGUE_WHAT)}"
    )
    a, what, unfused = _EPILOGUE_WHAT[kind]
    _need(
        fmt != "kn",
        op,
        f"{a} epilogue needs the weight as [N, K] (transpose_b=1); transpose it at load",
    )
    _need(
        M <= GEMV_MAX_ROWS,
        op,
        f"{a} epilogue runs in the GEMV only (M <= {GEMV_MAX_ROWS}); M={M}: run the GEMM "
        f"and {unfused}",
    )
    _need(
        kind != "swiglu" or N % 16 == 0,
        op,
        f"{a} epilogue needs N (gate and up outputs) a multiple of 16; got N={N}",
    )
    _need(split_n is None, op, f"{a} epilogue needs the whole {what} weight (no split_n)")


def _plan_stream(
    fmt: Format, suffix: str, N: int, whole: int, K: int, sm_count: int
) -> MatmulPlan | None:
    """The streaming q4/mx4 GEMV when the whole weight has a 16-row group for every warp.

    Then no K split is needed to fill the GPU, and the persistent kernel keeps every warp's loads
    in flight from its first group to its last. A row's arithmetic in it does not depend on N or
    the grid, so a piece of such a weight (``whole`` > N) takes it too. Else None: split-K GEMV.
    """
    blocks = max(1, sm_count) * _STREAM_BLOCKS_PER_SM
    if -(-whole // 16) < blocks * _STREAM_WARPS:
        return None
    groups = -(-N // 16)
    blocks = min(blocks, -(-groups // _STREAM_WARPS))
    return MatmulPlan(
        f"ep_gemv_{fmt}_stream_{suffix}",
        "gemv",
        (blocks, 1, 1),
        32 * _STREAM_WARPS,
        1,
        1,
        f"streaming GEMV: {groups} groups of 16 columns over {blocks} persistent blocks x "
        f"{_STREAM_WARPS} warps, each group all of K={K} in one warp (no K split)",
    )


def v2_geometry(K: int) -> tuple[int, int]:
    """(warps a block = K slices a tile, rounds of 8 steps a tile) of the dense GEMV v2.

    A function of K alone: this is the whole arithmetic contract of a row (see the .cu file).
    """
    steps = -(-K // 32)
    kw = max(1, min(_V2_WARPS, -(-steps // _V2_SLOTS)))
    return kw, -(-steps // (_V2_SLOTS * kw))


def v2_shared_bytes(fmt: Format, K: int, block_size: int = 32) -> int:
    """Dynamic shared memory of a v2 GEMV block (never depends on M: x is staged for 16 rows).

    q4/mx4: 16 rows of 256 bytes a step of 64 weight bytes, + 64 bytes a row. nk: 16 rows of
    ``roundup(K, 64) + 32`` elements (no bank conflicts; see the .cu file) and 1 KiB of partial
    sums a warp.
    """
    if fmt == "nk":
        ldx = -(-K // 64) * 64 + 32
        return v2_geometry(K)[0] * 1024 + GEMV_MAX_ROWS * ldx * 2
    _need(fmt in ("q4", "mx4"), "matmul", f"format {fmt!r} has no v2 GEMV; expected nk, q4 or mx4")
    row_bytes = (-(-K // block_size) * block_size // 2) if fmt == "q4" else K // 2
    return GEMV_MAX_ROWS * (256 * -(-row_bytes // 64) + 64)


def _plan_v2(
    fmt: Format,
    suffix: str,
    M: int,
    N: int,
    whole: int,
    K: int,
    block_size: int,
    sm_count: int,
    aligned: bool,
    max_shared: int,
) -> MatmulPlan | str:
    """The v2 GEMV (fp16/bf16 nk, q4, mx4) for this call, or why not, in words.

    Host-known facts only. The choice is made on the whole weight (``whole`` columns), so a
    piece of it (``split_n``) takes the whole weight's kernel, and both v2 kernels compute a
    row independently of N and the grid: a piece gets the unsplit product's bits. Only the dense
    rule looks at the weight's size (the H200 timings above `_V2_DENSE_MIN_ELEMENTS`); none at M.
    """
    if gemv_version() == "v1":
        return f"{GEMV_ENV}=v1"
    if fmt == "q4" and block_size < 32:
        return f"block_size={block_size} < 32: a 16-byte chunk would span two scales"
    if fmt == "nk" and K % 8:
        return f"K={K} is not a multiple of 8 (weight rows of whole 16-byte chunks)"
    if not aligned:
        return "the weight address is not 16-byte aligned"
    sms = max(1, sm_count)
    shared = v2_shared_bytes(fmt, K, block_size)
    if fmt == "nk":
        if K > _V2_MAX_K:
            return f"K={K} > {_V2_MAX_K}: x does not fit shared memory"
        if whole > _V2_MAX_N:
            return f"N={whole} > {_V2_MAX_N}: many columns, the one-wave split-K GEMV streams them"
        if _V2_DENSE_MIN_ELEMENTS is None:
            return "the dense v2 is planned nowhere (it loses at 16 rows: `_V2_DENSE_MIN_ELEMENTS`)"
        if whole * K < _V2_DENSE_MIN_ELEMENTS:
            return (
                f"N x K = {whole} x {K} < {_V2_DENSE_MIN_ELEMENTS} elements: the split-K GEMV "
                "measured faster on such weights"
            )
        limit = max_shared
    else:
        if -(-whole // 16) < sms * _V2_WARPS:
            return (
                f"N={whole}: {-(-whole // 16)} groups of 16 rows, fewer than the GPU's "
                f"{sms * _V2_WARPS} warps"
            )
        limit = min(max_shared, _V2_MAX_SHARED)
    if shared > limit:
        return f"needs {shared} bytes of shared memory a block; at most {limit} here"
    if fmt != "nk":
        groups = -(-N // 16)
        blocks = min(sms, -(-groups // _V2_WARPS))
        return MatmulPlan(
            f"ep_gemv_{fmt}_v2_{suffix}",
            "gemv",
            (blocks, 1, 1),
            32 * _V2_WARPS,
            1,
            1,
            f"v2 GEMV: {groups} groups of 16 columns over {blocks} persistent blocks x "
            f"{_V2_WARPS} warps, each group all of K={K} in one warp; x staged in {shared} bytes "
            "of shared memory",
            shared,
        )
    kw, rounds = v2_geometry(K)
    tiles = -(-N // 8)
    per_sm = max(1, min(_V2_WARPS_PER_SM // kw, _SM_SHARED // (shared + 1024)))
    cap = sms * per_sm
    # Persistent: at most one wave; as few blocks as give the same tiles a block (balanced).
    blocks = tiles if tiles <= cap else -(-tiles // -(-tiles // cap))
    _need(blocks <= 2**31 - 1, "matmul", f"N={N} needs {blocks} blocks; too many")
    return MatmulPlan(
        f"ep_gemv_nk_v2_{suffix}",
        "gemv",
        (blocks, 1, 1),
        32 * kw,
        kw,
        1,
        f"dense GEMV v2: {tiles} tiles of 8 rows over {blocks} blocks of {kw} warps (K={K}: "
        f"{-(-K // 32)} steps of 32 k, {rounds} round(s) of {_V2_SLOTS} a warp), no K split "
        f"over blocks, {shared} bytes of shared memory a block",
        shared,
    )


def sm_count(dev: Device) -> int:
    """The device's SM count (the H200's when it does not say): GEMV plans depend on it."""
    count = getattr(dev, "sm_count", None)
    if isinstance(count, int) and count > 0:
        return count
    core = getattr(dev, "_core", None)  # cuda.core's Device, on the CUDA device
    try:
        return int(core.properties.multiprocessor_count) if core is not None else _DEFAULT_SMS
    except Exception:  # an older cuda.core without the property: the H200's count
        return _DEFAULT_SMS


# --- argument checks ------------------------------------------------------------------------------


def _sizes(op: str, **sizes: int) -> None:
    for key, value in sizes.items():
        _need(
            isinstance(value, int | np.integer)
            and not isinstance(value, bool)
            and 0 < value < 2**31,
            op,
            f"{key}={value!r} must be an integer in [1, 2^31)",
        )


def _buffer(
    op: str, dev: Device, role: str, buffer: object, elements: int, dtype: np.dtype
) -> Buffer:
    # Plain ifs: the messages are formatted only on failure (every eager launch passes here).
    if not isinstance(buffer, Buffer):
        _need(False, op, f"{role} must be a Buffer, got {type(buffer).__name__}")
    assert isinstance(buffer, Buffer)
    if buffer.device is not dev:
        _need(
            False, op, f"{role} {buffer.name!r} is on {buffer.device.name}, the call on {dev.name}"
        )
    if buffer.dtype != dtype:
        _need(
            False,
            op,
            f"{role} {buffer.name!r} is {buffer.dtype}; expected {dtype}"
            + ("" if role != "out" else " (the output has the activations' dtype)"),
        )
    if buffer.size < elements:
        _need(
            False,
            op,
            f"{role} {buffer.name!r} holds {buffer.size} elements; these sizes need {elements}",
        )
    return buffer


def _disjoint(op: str, out: Buffer, inputs: dict[str, Buffer]) -> None:
    """The output may not share bytes with an input: blocks read inputs while others write."""
    a0 = out.offset
    a1 = a0 + out.nbytes
    for role, buf in inputs.items():
        if buf.root is out.root:
            b0 = buf.offset
            if a0 < b0 + buf.nbytes and b0 < a1:
                raise KernelArgumentError(
                    f"{op}: out {out.name!r} overlaps {role} {buf.name!r} in one allocation; "
                    "write the result to a separate buffer"
                )


def _activation_dtype(op: str, x: object) -> np.dtype:
    _need(isinstance(x, Buffer), op, f"x must be a Buffer, got {type(x).__name__}")
    assert isinstance(x, Buffer)
    _need(
        x.dtype in _DTYPES,
        op,
        f"x {x.name!r} is {x.dtype}; expected float32, float16 or bfloat16 activations",
    )
    return x.dtype


@dataclass(frozen=True)
class RopeEpilogue:
    """A QKV projection's rotary embedding and KV commit run as its GEMV's epilogue
    (``ep_gemv_<fmt>_rope_<dt>``), built and checked by `ep.kernels.attention.rope_epilogue`.

    The weight's N = ``columns`` outputs are the packed [q | k | v] heads of ``head_dim``; the
    finishing block of each pair of features stores q rotated into the epilogue's q buffer and
    the rotated k and v into the caches, as `ep.kernels.attention.kv_commit_rotary` stores them
    from the GEMV's output: the packed product never reaches memory. ``args``: the kernel's
    parameters after the flags; ``writes``: the buffers it stores (never x nor a weight).
    """

    columns: int
    tokens: int
    args: tuple[object, ...]
    writes: tuple[Buffer, ...]


_Epilogue = tuple[str, tuple[object, ...]]  # (kind, the kernel's parameters after the flags)


def _epilogue(
    op: str,
    fmt: Format,
    swiglu: object,
    rope: RopeEpilogue | None,
    M: int,
    N: int,
    split_n: int | None,
) -> tuple[int, _Epilogue | None]:
    """Output columns a row (N; N / 2 with a SwiGLU epilogue; 0 with rope: nothing is stored at
    out) and the checked epilogue (`_check_epilogue`)."""
    if rope is not None:
        _need(swiglu is None, op, "pass swiglu or rope, not both: one epilogue a GEMV")
        _need(
            isinstance(rope, RopeEpilogue),
            op,
            f"rope must be a RopeEpilogue (ep.kernels.attention.rope_epilogue), got "
            f"{type(rope).__name__}",
        )
        _need(
            rope.columns == N and rope.tokens == M,
            op,
            f"the rope epilogue covers {rope.tokens} tokens of {rope.columns} packed q/k/v "
            f"columns; this GEMV has M={M}, N={N}",
        )
        _check_epilogue(op, "rope", fmt, M, N, split_n)
        return 0, ("rope", rope.args)
    if swiglu is None:
        return N, None
    _need(
        swiglu in (0, 1) and not isinstance(swiglu, bool),
        op,
        f"swiglu={swiglu!r}; expected None (no epilogue), 0 ([gate | up] halves) or 1 "
        "(interleaved gate/up rows)",
    )
    _check_epilogue(op, "swiglu", fmt, M, N, split_n)
    return N // 2, ("swiglu", (N // 2, swiglu))


def _outputs(
    op: str,
    dev: Device,
    out: Buffer,
    elements: int,
    dtype: np.dtype,
    rope: RopeEpilogue | None,
    inputs: dict[str, Buffer],
) -> None:
    """out holds ``elements`` of ``dtype``; neither it nor what a rope epilogue writes overlaps
    an input."""
    _buffer(op, dev, "out", out, elements, dtype)
    for written in (out, *(rope.writes if rope is not None else ())):
        _disjoint(op, written, inputs)


def _x16(x: Buffer, K: int) -> int:
    return _FLAG_X16 if x.ptr % 16 == 0 and (K * x.dtype.itemsize) % 16 == 0 else 0


def _check_workspace(op: str, dev: Device, workspace: MatmulWorkspace | None) -> None:
    if workspace is None:
        return
    _need(
        isinstance(workspace, MatmulWorkspace),
        op,
        f"workspace must be a MatmulWorkspace (from matmul_workspace), got "
        f"{type(workspace).__name__}",
    )
    for role, buf, dtype in (
        ("workspace.partials", workspace.partials, np.dtype(np.float32)),
        ("workspace.counters", workspace.counters, np.dtype(np.uint32)),
    ):
        _buffer(op, dev, role, buf, 1, dtype)


def _plan_and_launch(
    dev: Device,
    fmt: Format,
    dtype: np.dtype,
    args: list[object],
    flags: int,
    *,
    M: int,
    N: int,
    K: int,
    workspace: MatmulWorkspace | None,
    split_n: int | None,
    resident: bool,
    out: Buffer,
    stream: Stream,
    block_size: int = 32,
    epilogue: _Epilogue | None = None,
) -> MatmulPlan:
    """Plan the call (`plan_matmul`) and launch it. ``args`` are the kernel's arguments before
    its flags; GEMV kernels also get (workspace, counters) after the weights and (kw, gy) before
    the flags, and an ``epilogue``'s parameters after them. ``resident`` adds EPK_EARLY to
    ``flags`` (the module docstring)."""
    flags |= _FLAG_EARLY if resident else 0
    plan = plan_matmul(
        fmt,
        dtype,
        M=M,
        N=N,
        K=K,
        block_size=block_size,
        workspace=workspace,
        sm_count=sm_count(dev),
        split_n=split_n,
        aligned=bool(flags & _FLAG_W16),
        max_shared=int(dev.limits["max_shared_mem"]),
        epilogue=None if epilogue is None else epilogue[0],
    )
    kernel = dev.kernel(plan.kernel)
    if plan.kind == "gemv":
        ws: Buffer = workspace.partials if workspace is not None else out  # unused when gy == 1
        cnt: Buffer = workspace.counters if workspace is not None else out
        n_weights = _ARGS_BEFORE_WS[fmt]
        full = [*args[:n_weights], ws, cnt, *args[n_weights:], plan.kw, plan.gy, flags]
        if epilogue is not None:
            full += epilogue[1]
        kernel.launch(plan.grid, plan.block, *full, stream=stream, shared_mem=plan.shared)
    else:
        kernel.launch(plan.grid, plan.block, *args, flags, stream=stream)
    return plan


# --- the wrappers ---------------------------------------------------------------------------------


def gemm(
    dev: Device,
    out: Buffer,
    x: Buffer,
    w: Buffer,
    *,
    M: int,
    N: int,
    K: int,
    transpose_b: int,
    stream: Stream,
    workspace: MatmulWorkspace | None = None,
    split_n: int | None = None,
    resident: bool = False,
    swiglu: int | None = None,
    rope: RopeEpilogue | None = None,
) -> MatmulPlan:
    """``out[M, N] = x[M, K] @ W``: W is [K, N] (``transpose_b=0``) or [N, K] (``transpose_b=1``).

    The same contract as `ep.ops.matmul.matmul_weight`. x, w and out share a float dtype.
    ``split_n``: W is an output-column piece of a weight of ``split_n`` columns (`plan_matmul`).
    ``resident``: no kernel writes W while this call may run (a resident weight), so the split-K
    GEMV loads it before it waits for the previous kernel (module docstring). ``swiglu`` (0: W's
    rows are [gate | up] halves, 1: interleaved g0, u0, g1, ...): ``out[M, N/2]`` is
    ``SwiGLUPacked(x @ W, interleaved=swiglu)``, bitwise the GEMV followed by
    `ep.kernels.mlp.swiglu_packed` where the plain call plans the split-K GEMV (`_check_swiglu`:
    M <= 16, W [N, K], N % 16 == 0). ``rope`` (`RopeEpilogue`, from
    `ep.kernels.attention.rope_epilogue`): W is a packed QKV projection whose rotary embedding and
    KV commit the GEMV stores instead of ``out`` (not written), bitwise the GEMV followed by
    `ep.kernels.attention.kv_commit_rotary`, under the same conditions. Returns the plan it ran.
    """
    op = "gemm"
    _sizes(op, M=M, N=N, K=K)
    _need(transpose_b in (0, 1), op, f"transpose_b={transpose_b!r} must be 0 or 1")
    dtype = _activation_dtype(op, x)
    _buffer(op, dev, "x", x, M * K, dtype)
    _buffer(op, dev, "w", w, N * K, dtype)
    fmt: Format = "nk" if transpose_b else "kn"
    cols, epilogue = _epilogue(op, fmt, swiglu, rope, M, N, split_n)
    _outputs(op, dev, out, M * cols, dtype, rope, {"x": x, "w": w})
    _check_workspace(op, dev, workspace)
    row = (K if transpose_b else N) * dtype.itemsize
    flags = _x16(x, K) | (_FLAG_W16 if w.ptr % 16 == 0 and row % 16 == 0 else 0)
    return _plan_and_launch(
        dev, fmt, dtype, [out, x, w, M, N, K], flags, M=M, N=N, K=K, workspace=workspace,
        split_n=split_n, resident=resident, out=out, stream=stream, epilogue=epilogue,
    )  # fmt: skip


def gemm_nbits(
    dev: Device,
    out: Buffer,
    x: Buffer,
    b: Buffer,
    scales: Buffer,
    zero_points: Buffer | None = None,
    *,
    M: int,
    N: int,
    K: int,
    block_size: int,
    stream: Stream,
    bits: int = 4,
    workspace: MatmulWorkspace | None = None,
    split_n: int | None = None,
    resident: bool = False,
    swiglu: int | None = None,
    rope: RopeEpilogue | None = None,
) -> MatmulPlan:
    """``out = x @ dequantize(B)^T`` for MatMulNBits weights (`ep.ops.matmul.matmul_nbits`).

    b: uint8 [N, ceil(K/block_size), block_size/2]; scales: x's dtype [N * k_blocks];
    zero_points: uint8 [N, ceil(k_blocks/2)] packed two per byte, or None for zero point 8.
    ``split_n``: the three are rows of a weight of ``split_n`` rows (`plan_matmul`).
    ``resident``: as in `gemm`, for b, scales and zero points. ``swiglu``, ``rope``: as in `gemm`.
    """
    op = "gemm_nbits"
    _sizes(op, M=M, N=N, K=K, block_size=block_size)
    _need(bits == 4, op, f"bits={bits}; only 4-bit weights have a kernel")
    _need(
        block_size >= 16 and block_size & (block_size - 1) == 0,
        op,
        f"block_size={block_size} must be a power of two >= 16",
    )
    dtype = _activation_dtype(op, x)
    k_blocks = -(-K // block_size)
    row_bytes = k_blocks * block_size // 2
    u8 = np.dtype(np.uint8)
    _buffer(op, dev, "x", x, M * K, dtype)
    _buffer(op, dev, "b", b, N * row_bytes, u8)
    _buffer(op, dev, "scales", scales, N * k_blocks, dtype)
    inputs = {"x": x, "b": b, "scales": scales}
    flags = _x16(x, K)
    if zero_points is not None:
        _buffer(op, dev, "zero_points", zero_points, N * ((k_blocks + 1) // 2), u8)
        inputs["zero_points"] = zero_points
        flags |= _FLAG_ZP
    cols, epilogue = _epilogue(op, "q4", swiglu, rope, M, N, split_n)
    _outputs(op, dev, out, M * cols, dtype, rope, inputs)
    _check_workspace(op, dev, workspace)
    if b.ptr % 16 == 0 and row_bytes % 16 == 0:
        flags |= _FLAG_W16
    if b.ptr % 8 == 0:
        flags |= _FLAG_W8
    shift = int(math.log2(block_size))
    zp = zero_points if zero_points is not None else b  # never read without EPK_ZP
    return _plan_and_launch(
        dev, "q4", dtype, [out, x, b, scales, zp, M, N, K, k_blocks, shift], flags, M=M, N=N,
        K=K, block_size=block_size, workspace=workspace, split_n=split_n, resident=resident,
        out=out, stream=stream, epilogue=epilogue,
    )  # fmt: skip


def gemm_mxfp4(
    dev: Device,
    out: Buffer,
    x: Buffer,
    b: Buffer,
    scales: Buffer,
    *,
    M: int,
    N: int,
    K: int,
    stream: Stream,
    workspace: MatmulWorkspace | None = None,
    split_n: int | None = None,
    resident: bool = False,
    swiglu: int | None = None,
    rope: RopeEpilogue | None = None,
) -> MatmulPlan:
    """``out = x @ dequantize_mxfp4(b, scales)^T`` (`ep.ops.matmul.matmul_mxfp4`).

    b: uint8 [N, K/32, 16] (E2M1 pairs, low nibble first); scales: uint8 [N, K/32] (E8M0).
    K must be a multiple of 32. For fp16 activations the dequantized weights are fp16, so a
    block whose scale puts them outside fp16's range overflows (as any fp16 product would).
    ``split_n``: b and scales are rows of a weight of ``split_n`` rows (`plan_matmul`).
    ``resident``: as in `gemm`, for b and scales. ``swiglu``, ``rope``: as in `gemm`.
    """
    op = "gemm_mxfp4"
    _sizes(op, M=M, N=N, K=K)
    _need(K % MXFP4_BLOCK == 0, op, f"K={K} must be a multiple of {MXFP4_BLOCK} (one MX block)")
    dtype = _activation_dtype(op, x)
    u8 = np.dtype(np.uint8)
    _buffer(op, dev, "x", x, M * K, dtype)
    _buffer(op, dev, "b", b, N * K // 2, u8)
    _buffer(op, dev, "scales", scales, N * K // MXFP4_BLOCK, u8)
    cols, epilogue = _epilogue(op, "mx4", swiglu, rope, M, N, split_n)
    _outputs(op, dev, out, M * cols, dtype, rope, {"x": x, "b": b, "scales": scales})
    _check_workspace(op, dev, workspace)
    flags = _x16(x, K) | (_FLAG_W16 if b.ptr % 16 == 0 else 0) | (_FLAG_W8 if b.ptr % 8 == 0 else 0)
    return _plan_and_launch(
        dev, "mx4", dtype, [out, x, b, scales, M, N, K], flags, M=M, N=N, K=K,
        workspace=workspace, split_n=split_n, resident=resident, out=out, stream=stream,
        epilogue=epilogue,
    )  # fmt: skip
