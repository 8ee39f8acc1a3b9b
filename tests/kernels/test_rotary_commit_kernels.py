"""The fused QKV commit (`attention.kv_commit_rotary`) against the launches it replaces.

The unfused chain, on the same device: the projection's bias Add (`ep.native._kernels.add_bias`),
q and k rotated in one launch (`rotary.rotary` / `rotary_theta`), then `attention.kv_commit` of
(rotated k, v), with q, k and v views into one packed projection as the native plan binds them.
The fused kernel must store the same bytes: q's rotation, both whole caches (poison included),
the lengths and the fault bits. On the CPU device both sides run NumPy twins; marked ``cuda``
they are the real kernels, and the fused CUDA kernel is also held to its NumPy twin within the
dtype's tolerance. Layouts come from the built-in layout plugins (paged: a shuffled table).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from ep.device import Buffer, Device, KernelCache, compile_kernel, get_device
from ep.errors import KernelArgumentError
from ep.kernels import KernelFault, attention, new_status, rotary
from ep.native import _kernels as nk
from ep.ops import rotary as ref
from ep.seams import KVGeometry, KVLayout, KVStrides
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_builtin.kv_paged import PagedLayout
from ep_builtin.kv_seq_major import SeqMajorLayout

BF16 = np.dtype(ml_dtypes.bfloat16)
F32 = np.dtype(np.float32)
DTYPES = [F32, np.dtype(np.float16), BF16]
# Fused CUDA against its NumPy twin: float32 cos/sin of one angle differ by an ulp or two (theta
# mode), and a one-ulp difference of a product can flip a rounding to fp16/bf16.
TOL = {F32: 1e-5, np.dtype(np.float16): 1e-2, BF16: 1e-2}
CAPACITY, CONTEXT, MAX_POS, THETA = 32, 48, 64, 10000.0
LAYOUTS: dict[str, Callable[[], KVLayout]] = {
    "head_major": HeadMajorLayout,
    "seq_major": SeqMajorLayout,
    "seq_major_fixed": lambda: SeqMajorLayout(fixed_stride=True),  # rows CONTEXT tokens apart
    "paged": lambda: PagedLayout(page_size=8),
}


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int
    rotary_dim: int  # 0: head_dim
    interleaved: int

    @property
    def width(self) -> int:  # the packed projection's features per token
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def offsets(self) -> tuple[int, int, int]:  # q, k, v inside a token of the projection
        d = self.head_dim
        return (0, self.heads * d, (self.heads + self.kv_heads) * d)


# odd head counts, a head_dim that is no multiple of 16 bytes in fp32, partial rotation
SHAPES = {
    "h7kv1d40i": Shape(7, 1, 40, 0, 1),
    "h14kv2d64r32": Shape(14, 2, 64, 32, 0),
}


@dataclass
class Inputs:
    """Host arrays of one case; `run_chain` uploads them fresh on each device."""

    dtype: np.dtype
    shape: Shape
    layout: str
    qkv: np.ndarray  # [batch*seq, width]
    bias: np.ndarray | None
    positions: np.ndarray  # [batch, seq]
    cos: np.ndarray
    sin: np.ndarray
    theta_mode: bool
    table: np.ndarray | None


def positions_for(phase: str, rng: np.random.Generator) -> np.ndarray:
    """Decode: one token a row at different positions, one padding row. Prefill: left-padded
    rows of different lengths starting at different positions, one all padding."""
    if phase == "decode":
        a, b = (int(x) for x in rng.choice(CAPACITY - 1, size=2, replace=False))
        return np.array([[a], [-1], [b]], dtype=np.int64)
    pos = np.full((3, 6), -1, dtype=np.int64)
    for row, n in enumerate((6, 3)):
        start = int(rng.integers(0, CAPACITY - n))
        pos[row, 6 - n :] = start + np.arange(n)
    return pos


def make_inputs(
    dtype: np.dtype, shape: Shape, layout: str, phase: str, theta_mode: bool, bias: bool,
    rng: np.random.Generator,
) -> Inputs:  # fmt: skip
    positions = positions_for(phase, rng)
    tokens = positions.size
    qkv = rng.standard_normal((tokens, shape.width)).astype(dtype)
    cos, sin = ref.rope_cache(THETA, shape.rotary_dim or shape.head_dim, MAX_POS, dtype)
    table = None
    if layout == "paged":
        pages, page_size = geometry_of(layout, dtype, shape).shape[:2]
        per_row = -(-CAPACITY // page_size)
        table = rng.permutation(pages)[: 3 * per_row].reshape(3, per_row).astype(np.int32)
    return Inputs(
        dtype, shape, layout, qkv,
        rng.standard_normal(shape.width).astype(dtype) if bias else None,
        positions, cos, sin, theta_mode, table,
    )  # fmt: skip


def geometry_of(layout: str, dtype: np.dtype, shape: Shape) -> KVGeometry:
    """The layout plugin's geometry of one layer at batch 3, capacity CAPACITY."""
    plugin = LAYOUTS[layout]()
    plugin.capacity_for(CAPACITY, context=CONTEXT)  # a fixed stride learns the context here
    return plugin.geometry(
        batch=3, capacity=CAPACITY, kv_heads=shape.kv_heads, head_dim=shape.head_dim,
        itemsize=dtype.itemsize,
    )  # fmt: skip


def run_chain(device: Device, case: Inputs, *, fused: bool) -> dict[str, np.ndarray]:
    """One step of the chain on ``device``, unfused or fused; every output, as host arrays."""
    s = device.default_stream
    dt, sh = case.dtype, case.shape
    batch, seq = case.positions.shape
    tokens, width, item = batch * seq, sh.width, dt.itemsize
    geometry = geometry_of(case.layout, dt, sh)
    strides, elements = geometry.strides, geometry.elements

    def up(array: np.ndarray) -> Buffer:
        return device.to_device(np.ascontiguousarray(array), stream=s)

    def poisoned(count: int, dtype: np.dtype) -> Buffer:
        buf = device.alloc(count, dtype, stream=s)
        device.fill(buf.view(np.uint8), 0xA5, stream=s)
        return buf

    qkv, pos = up(case.qkv.reshape(-1)), up(case.positions)
    bias = None if case.bias is None else up(case.bias)
    keys, values = poisoned(elements, dt), poisoned(elements, dt)
    lengths, status = poisoned(batch, np.dtype(np.int64)), new_status(device, stream=s)
    q_out = poisoned(tokens * width, dt)  # q's rotation keeps the projection's token stride
    table = None if case.table is None else up(case.table)
    if case.theta_mode:
        rot = sh.rotary_dim or sh.head_dim
        tables: dict[str, Any] = dict(
            inv_freq=rotary.rotary_inv_freq(device, THETA, rot, stream=s), theta=THETA,
            rotary_dim=rot,
        )  # fmt: skip
    else:
        cos = up(case.cos)
        tables = dict(
            cos_cache=cos, sin_cache=up(case.sin), max_positions=case.cos.shape[0],
            rotary_dim=2 * case.cos.shape[1],
        )  # fmt: skip
    commit: dict[str, Any] = dict(
        strides=strides, capacity=CAPACITY, block_table=table,
        table_cols=0 if case.table is None else case.table.shape[1], status=status, stream=s,
    )  # fmt: skip

    def views(source: Buffer) -> list[Buffer]:
        return [source.view(dt, offset=o * item) for o in sh.offsets]

    if fused:
        q, k, v = views(qkv)
        attention.kv_commit_rotary(
            device, keys, values, lengths, q_out, q, k, v, pos, batch=batch, seq=seq,
            heads=sh.heads, kv_heads=sh.kv_heads, head_dim=sh.head_dim, **tables,
            interleaved=sh.interleaved, bias=bias, bias_offsets=sh.offsets,
            q_token_stride=width, q_out_token_stride=width, k_token_stride=width,
            v_token_stride=width, **commit,
        )  # fmt: skip
    else:
        source = qkv
        if bias is not None:
            source = poisoned(tokens * width, dt)
            nk.add_bias(device, source, qkv, bias, rows=tokens, cols=width, stream=s)
        q, k, v = views(source)
        k_rot = poisoned(tokens * width, dt)
        pair = dict(
            batch=batch, seq=seq, heads=sh.heads, head_dim=sh.head_dim,
            interleaved=sh.interleaved, x_token_stride=width, out_token_stride=width, k_out=k_rot,
            k=k, kv_heads=sh.kv_heads, k_token_stride=width, k_out_token_stride=width,
            status=status, stream=s,
        )  # fmt: skip
        if case.theta_mode:
            rotary.rotary_theta(device, q_out, q, pos, **tables, **pair)
        else:
            rotary.rotary(device, q_out, q, pos, **tables, **pair)
        attention.kv_commit(
            device, keys, values, lengths, k_rot, v, pos, batch=batch, seq=seq,
            kv_heads=sh.kv_heads, head_dim=sh.head_dim, src_token_stride=width, **commit,
        )  # fmt: skip
    return {
        name: buf.to_host(stream=s).copy()
        for name, buf in (
            ("q_out", q_out), ("keys", keys), ("values", values), ("lengths", lengths),
            ("status", status),
        )
    }  # fmt: skip


def assert_same_bytes(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for name, array in want.items():
        assert got[name].tobytes() == array.tobytes(), f"{name} differs from the unfused chain"


CASES = [
    pytest.param(dt, shape, layout, phase, theta, bias, id=f"{dt}-{shape}-{layout}-{phase}-"
                 f"{'theta' if theta else 'caches'}-{'bias' if bias else 'nobias'}")
    for dt in DTYPES
    for shape in SHAPES
    for layout in LAYOUTS
    for phase in ("decode", "prefill")
    for theta in (False, True)
    for bias in (True, False)
]  # fmt: skip


@pytest.mark.parametrize(("dtype", "shape", "layout", "phase", "theta", "bias"), CASES)
def test_fused_stores_what_the_unfused_chain_stores(
    device: Device, rng: np.random.Generator, dtype: np.dtype, shape: str, layout: str,
    phase: str, theta: bool, bias: bool,
) -> None:  # fmt: skip
    case = make_inputs(dtype, SHAPES[shape], layout, phase, theta, bias, rng)
    unfused = run_chain(device, case, fused=False)
    fused = run_chain(device, case, fused=True)
    assert_same_bytes(fused, unfused)
    assert int(fused["status"][0]) == 0
    live = case.positions >= 0
    want_lengths = np.where(live, case.positions, -1).max(axis=1) + 1
    np.testing.assert_array_equal(fused["lengths"], want_lengths)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("layout", ["seq_major", "paged"])
@pytest.mark.parametrize("phase", ["decode", "prefill"])
@pytest.mark.parametrize("theta", [False, True], ids=["caches", "theta"])
def test_cuda_fused_matches_its_numpy_twin(
    cuda_device: Device, rng: np.random.Generator, dtype: np.dtype, shape: str, layout: str,
    phase: str, theta: bool,
) -> None:  # fmt: skip
    case = make_inputs(dtype, SHAPES[shape], layout, phase, theta, True, rng)
    got = run_chain(cuda_device, case, fused=True)
    want = run_chain(get_device("cpu"), case, fused=True)
    for name in ("lengths", "status"):
        np.testing.assert_array_equal(got[name], want[name])
    for name in ("q_out", "keys", "values"):
        written = want[name].view(np.uint8).reshape(-1, dtype.itemsize) != 0xA5
        mask = written.any(axis=1)  # elements the kernel wrote (poison elsewhere)
        np.testing.assert_array_equal(
            mask, (got[name].view(np.uint8).reshape(-1, dtype.itemsize) != 0xA5).any(axis=1)
        )
        g = got[name][mask].astype(np.float64)
        w = want[name][mask].astype(np.float64)
        err = float(np.abs(g - w).max() / max(float(np.abs(w).max()), 1e-30))
        assert err <= TOL[dtype], f"{name}: relative error {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_faults_and_pass_through_match_the_unfused_chain(
    device: Device, rng: np.random.Generator, bias: bool
) -> None:
    """A position outside the cos/sin cache (stored unrotated, ROTARY_POSITION) and one past the
    KV capacity (not committed, KV_POSITION): the same bytes and bits as the three launches."""
    case = make_inputs(F32, SHAPES["h7kv1d40i"], "seq_major", "decode", False, bias, rng)
    small = 8  # cos/sin for positions 0..7 only
    case.cos, case.sin = case.cos[:small], case.sin[:small]
    case.positions = np.array([[3], [20], [CAPACITY + 5]], dtype=np.int64)
    unfused = run_chain(device, case, fused=False)
    fused = run_chain(device, case, fused=True)
    assert_same_bytes(fused, unfused)
    bits = KernelFault(int(fused["status"][0]))
    assert bits == KernelFault.ROTARY_POSITION | KernelFault.KV_POSITION


def test_argument_errors_name_the_fix() -> None:
    dev = get_device("cpu")
    s = dev.default_stream
    sh = SHAPES["h14kv2d64r32"]
    width, d = sh.width, sh.head_dim
    qkv = dev.alloc(3 * width, F32, stream=s)  # a spare token: room for a shifted view
    keys = dev.alloc(2 * 64 * 2 * d, F32, stream=s)
    values = dev.alloc(2 * 64 * 2 * d, F32, stream=s)
    lengths = dev.alloc(2, np.int64, stream=s)
    pos = dev.to_device(np.zeros((2, 1), np.int64), stream=s)
    q_out = dev.alloc(2 * width, F32, stream=s)
    freq = rotary.rotary_inv_freq(dev, THETA, 32, stream=s)
    q, k, v = (qkv.view(F32, offset=o * 4) for o in sh.offsets)
    common: dict[str, Any] = dict(
        batch=2, seq=1, heads=sh.heads, kv_heads=sh.kv_heads, head_dim=d,
        strides=KVStrides(64 * 2 * d, 2 * d, d, 1), capacity=64, rotary_dim=32,
        q_token_stride=width, q_out_token_stride=width, k_token_stride=width,
        v_token_stride=width, status=new_status(dev, stream=s), stream=s,
    )  # fmt: skip
    args = (dev, keys, values, lengths)
    with pytest.raises(KernelArgumentError, match="q_out must be q itself"):
        shifted = qkv.view(F32, offset=4)  # one element into q: overlaps q, k and v
        attention.kv_commit_rotary(
            *args, shifted, q, k, v, pos, inv_freq=freq, theta=THETA, **common
        )  # fmt: skip
    with pytest.raises(KernelArgumentError, match="or inv_freq and theta"):
        attention.kv_commit_rotary(
            *args, q_out, q, k, v, pos, inv_freq=freq, theta=THETA, cos_cache=freq,
            sin_cache=freq, max_positions=1, **common,
        )  # fmt: skip
    with pytest.raises(KernelArgumentError, match="bias"):
        short = dev.alloc(width - 1, F32, stream=s)
        attention.kv_commit_rotary(
            *args, q_out, q, k, v, pos, inv_freq=freq, theta=THETA, bias=short,
            bias_offsets=sh.offsets, **common,
        )  # fmt: skip
    with pytest.raises(KernelArgumentError, match="must not overlap the caches"):
        attention.kv_commit_rotary(
            dev, keys, values, lengths, q_out, keys, k, v, pos, inv_freq=freq, theta=THETA,
            **{**common, "q_token_stride": 0},
        )  # fmt: skip


def test_every_rotary_commit_kernel_compiles_to_sm90_cubin(tmp_path: Path) -> None:
    cache = KernelCache(tmp_path)
    names = []
    for suffix, source in attention.ROTARY_COMMIT_KERNELS.items():
        report = compile_kernel(source, "sm_90", cache=cache).report
        assert report.cubin_bytes > 0, suffix
        names.append(source.name)
    assert sorted(names) == [
        "kv_commit_rotary_bf16",
        "kv_commit_rotary_f16",
        "kv_commit_rotary_f32",
    ]
