"""The core ops' CUDA kernels as ONNX Runtime runs them: one host round trip per call.

Inside an ONNX Runtime session an op receives NumPy arrays and returns NumPy arrays. Each kernel
here takes exactly what the op's NumPy reference takes, uploads the inputs to the device, launches
the op's wrapper from `ep.kernels`, downloads the outputs and checks the kernels' fault status
(`ep.kernels.check_faults`). It is the correctness path for the CUDA kernels; the native executor
calls the `ep.kernels` wrappers on device buffers directly, without the round trips.

`CORE_OPS <ep.ops.core.CORE_OPS>` carry these as their ``"cuda"`` kernels (`with_cuda_kernels`);
sessions run them under ``ep.ops.use_device("cuda")`` (`ep.ops.placement`).

The KV ops
----------
The cache lives in the runtime's NumPy arrays behind a `KV_CACHES` handle, and the host copy stays
the only authoritative one (growth, reordering and resets happen there). Each call moves the part
of the flat buffers it touches:

- ``KVCommit``: the range of elements from the first to the last one it writes goes up, the kernel
  writes into it, and the range comes back into the runtime's arrays. Elements in between that it
  does not write make the round trip unchanged.
- ``KVAttention``: the range holding every slot its queries read (slots 0..p of each row) goes up;
  only the attention output comes back.

Elements below the range are zeros on the device, never read. Every check the reference makes on
host data (geometry, dtypes, capacity, position order, block table, bounds, committed lengths)
runs first, on the host, with the reference's message, so bad input fails exactly as it does on
the CPU and never reaches a kernel. A fault a kernel flags anyway raises before anything is
written back: the runtime's cache is never left half-written.

Which device
------------
A kernel runs on the device of the current `ep.ops.placement` when that placement selects the
``"cuda"`` kernels (so ``use_device("cpu", kernels="cuda")`` runs them on the CPU device's NumPy
twins), else on ``"cuda"`` (a direct ``op(..., device="cuda")`` call). `device_kernel` binds one
kernel to a device. Each thread gets its own stream, fault status buffer and rotary inverse
frequencies on first use. Neither cuda-python nor `ep.kernels` is imported before a kernel runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

from ep.errors import EPError, OpError
from ep.ops import kv as kv_ref
from ep.ops import matmul as matmul_ref
from ep.ops import mlp as mlp_ref
from ep.ops import norm as norm_ref
from ep.ops import rotary as rotary_ref
from ep.ops import sample as sample_ref
from ep.ops.placement import ACTIVE
from ep.ops.runtime import KV_CACHES, KVLayerBuffers, resolve_weight
from ep.ops.schema import OpDef
from ep.seams import KVStrides

if TYPE_CHECKING:
    from ep.device import Buffer, Device, Stream

__all__ = [
    "CUDA_KERNELS",
    "DeviceKernel",
    "device_kernel",
    "with_cuda_kernels",
]

# An op's device implementation: (context, *the reference's inputs, **its attributes).
Impl = Callable[..., Any]


# --- per-thread device state ------------------------------------------------------------------


@dataclass
class _Context:
    """One thread's working state on one device."""

    device: Device
    stream: Stream
    status: Buffer  # uint32[1] fault bits, zero between calls
    inv_freq: dict[tuple[float, int], Buffer] = field(default_factory=dict)


_LOCAL = threading.local()


def _context(name: str) -> _Context:
    contexts: dict[str, _Context] | None = getattr(_LOCAL, "contexts", None)
    if contexts is None:
        contexts = _LOCAL.contexts = {}
    ctx = contexts.get(name)
    if ctx is None:
        import ep.kernels  # registers every kernel; loaded on the first device call only
        from ep.device import get_device

        dev = get_device(name)
        dev.set_current()  # CUDA: once per thread (ONNX Runtime may call from its own threads)
        stream = dev.create_stream(name=f"ops-roundtrip-{threading.get_ident()}")
        ctx = _Context(dev, stream, ep.kernels.new_status(dev, stream=stream))
        contexts[name] = ctx
    return ctx


def _target_device() -> str:
    # The placement's device when sessions run the "cuda" kernels, else the GPU itself.
    return ACTIVE.device if ACTIVE.kernels == "cuda" else "cuda"


class DeviceKernel:
    """An op's device kernel with the reference's signature: a host round trip per call.

    Device-layer failures (no CUDA device, a compile error, a wrapper refusing its arguments)
    come out as an `OpError` naming the op and the device; a kernel fault as the
    `ep.errors.KernelFaultError` (an OpError) that `ep.kernels.check_faults` raises.
    """

    def __init__(self, op: str, impl: Impl, device: str | None = None) -> None:
        self.op = op
        self.impl = impl
        self.device = device  # None: follow the placement (see the module docstring)

    def __repr__(self) -> str:
        where = self.device or "the placement's device"
        return f"<DeviceKernel {self.op} on {where}>"

    def on(self, device: str | Device) -> DeviceKernel:
        """This kernel bound to ``device`` ("cpu", "cuda", "cuda:N" or a Device)."""
        name = device if isinstance(device, str) else device.name
        return DeviceKernel(self.op, self.impl, name)

    def __call__(self, *inputs: Any, **attrs: Any) -> Any:
        name = self.device or _target_device()
        try:
            return self.impl(_context(name), *inputs, **attrs)
        except OpError:
            raise
        except EPError as exc:
            raise OpError(f"{self.op} on {name}: {exc}") from exc


# --- round-trip helpers ------------------------------------------------------------------------


def _up(ctx: _Context, array: np.ndarray, name: str) -> Buffer:
    return ctx.device.to_device(np.ascontiguousarray(array), stream=ctx.stream, name=name)


def _alloc(ctx: _Context, shape: tuple[int, ...], dtype: Any, name: str) -> Buffer:
    return ctx.device.alloc(shape, dtype, stream=ctx.stream, name=name)


def _results(ctx: _Context, *outputs: Buffer) -> list[np.ndarray]:
    """The outputs on the host, after the fault check (a flagged fault raises instead)."""
    from ep.kernels import check_faults

    arrays = [out.to_host(stream=ctx.stream) for out in outputs]
    check_faults(ctx.device, ctx.status, stream=ctx.stream)
    return arrays


# --- norms -------------------------------------------------------------------------------------


def _rms_norm(ctx: _Context, x: np.ndarray, weight: np.ndarray, *, epsilon: float) -> np.ndarray:
    if x.size == 0:  # nothing to compute
        return norm_ref.rms_norm(x, weight, epsilon=epsilon)
    from ep.kernels import norm

    hidden = int(x.shape[-1])
    y = _alloc(ctx, x.shape, x.dtype, "RMSNorm.y")
    norm.rms_norm(
        ctx.device,
        y,
        _up(ctx, x, "RMSNorm.x"),
        _up(ctx, weight, "RMSNorm.weight"),
        rows=x.size // hidden,
        hidden=hidden,
        epsilon=float(epsilon),
        stream=ctx.stream,
    )
    return _results(ctx, y)[0]


def _skip_rms_norm(
    ctx: _Context, x: np.ndarray, skip: np.ndarray, weight: np.ndarray, *, epsilon: float
) -> tuple[np.ndarray, np.ndarray]:
    if x.size == 0:
        return norm_ref.skip_rms_norm(x, skip, weight, epsilon=epsilon)
    from ep.kernels import norm

    hidden = int(x.shape[-1])
    y = _alloc(ctx, x.shape, x.dtype, "SkipRMSNorm.y")
    total = _alloc(ctx, x.shape, x.dtype, "SkipRMSNorm.sum")
    norm.skip_rms_norm(
        ctx.device,
        y,
        total,
        _up(ctx, x, "SkipRMSNorm.x"),
        _up(ctx, skip, "SkipRMSNorm.skip"),
        _up(ctx, weight, "SkipRMSNorm.weight"),
        rows=x.size // hidden,
        hidden=hidden,
        epsilon=float(epsilon),
        stream=ctx.stream,
    )
    out_y, out_sum = _results(ctx, y, total)
    return out_y, out_sum


# --- rotary ------------------------------------------------------------------------------------


def _rotary(
    ctx: _Context,
    x: np.ndarray,
    position_ids: np.ndarray,
    cos_cache: np.ndarray,
    sin_cache: np.ndarray,
    *,
    interleaved: int,
) -> np.ndarray:
    # The reference's check and message: the kernel would pass such a token unrotated and flag it.
    rotary_ref._positions(position_ids, cos_cache.shape[0], "Rotary")
    if x.size == 0 or cos_cache.size == 0:
        return rotary_ref.rotary(x, position_ids, cos_cache, sin_cache, interleaved=interleaved)
    from ep.kernels import rotary

    batch, seq, heads, head_dim = (int(n) for n in x.shape)
    out = _alloc(ctx, x.shape, x.dtype, "Rotary.y")
    rotary.rotary(
        ctx.device,
        out,
        _up(ctx, x, "Rotary.x"),
        _up(ctx, position_ids, "Rotary.position_ids"),
        _up(ctx, cos_cache, "Rotary.cos_cache"),
        _up(ctx, sin_cache, "Rotary.sin_cache"),
        batch=batch,
        seq=seq,
        heads=heads,
        head_dim=head_dim,
        max_positions=int(cos_cache.shape[0]),
        rotary_dim=2 * int(cos_cache.shape[1]),
        interleaved=int(interleaved),
        status=ctx.status,
        stream=ctx.stream,
    )
    return _results(ctx, out)[0]


def _rotary_theta(
    ctx: _Context,
    x: np.ndarray,
    position_ids: np.ndarray,
    *,
    theta: float,
    rotary_dim: int,
    interleaved: int,
) -> np.ndarray:
    if x.size == 0:
        return rotary_ref.rotary_theta(
            x, position_ids, theta=theta, rotary_dim=rotary_dim, interleaved=interleaved
        )
    from ep.kernels import rotary

    batch, seq, heads, head_dim = (int(n) for n in x.shape)
    rot = int(rotary_dim) or head_dim
    key = (float(theta), rot)
    inv_freq = ctx.inv_freq.get(key)
    if inv_freq is None:  # the reference's own float32 values, uploaded once per thread
        inv_freq = rotary.rotary_inv_freq(ctx.device, float(theta), rot, stream=ctx.stream)
        ctx.inv_freq[key] = inv_freq
    out = _alloc(ctx, x.shape, x.dtype, "RotaryTheta.y")
    rotary.rotary_theta(
        ctx.device,
        out,
        _up(ctx, x, "RotaryTheta.x"),
        _up(ctx, position_ids, "RotaryTheta.position_ids"),
        inv_freq,
        theta=float(theta),
        batch=batch,
        seq=seq,
        heads=heads,
        head_dim=head_dim,
        rotary_dim=rot,
        interleaved=int(interleaved),
        status=ctx.status,
        stream=ctx.stream,
    )
    return _results(ctx, out)[0]


# --- matmuls -----------------------------------------------------------------------------------


def _matmul(ctx: _Context, a: np.ndarray, *, weight: str, N: int, transpose_b: int) -> np.ndarray:
    w = resolve_weight(weight)
    k = int(a.shape[-1])
    want = (N, k) if transpose_b else (k, N)
    if w.shape != want or w.dtype != a.dtype:  # the reference's check, word for word
        raise OpError(
            f"MatMul: weight {weight!r} is {w.dtype}{list(w.shape)}; the node needs "
            f"{a.dtype}{list(want)} (K={k} from the input, N={N}, transpose_b={transpose_b})"
        )
    if a.size == 0 or k == 0:
        return matmul_ref.matmul_weight(a, weight=weight, N=N, transpose_b=transpose_b)
    from ep.kernels import matmul

    out = _alloc(ctx, (*a.shape[:-1], int(N)), a.dtype, "MatMul.y")
    matmul.gemm(
        ctx.device,
        out,
        _up(ctx, a, "MatMul.a"),
        _up(ctx, w, f"MatMul.{weight}"),
        M=a.size // k,
        N=int(N),
        K=k,
        transpose_b=int(transpose_b),
        stream=ctx.stream,
    )
    return _results(ctx, out)[0]


def _gemm_nbits(
    ctx: _Context,
    op: str,
    a: np.ndarray,
    b: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray | None,
    *,
    K: int,
    N: int,
    bits: int,
    block_size: int,
) -> np.ndarray:
    if a.size == 0:
        if zero_points is None:
            return matmul_ref.matmul_nbits(a, b, scales, K=K, N=N, bits=bits, block_size=block_size)
        return matmul_ref.matmul_nbits_zp(
            a, b, scales, zero_points, K=K, N=N, bits=bits, block_size=block_size
        )
    from ep.kernels import matmul

    out = _alloc(ctx, (*a.shape[:-1], int(N)), a.dtype, f"{op}.y")
    zp = None if zero_points is None else _up(ctx, zero_points, f"{op}.zero_points")
    matmul.gemm_nbits(
        ctx.device,
        out,
        _up(ctx, a, f"{op}.a"),
        _up(ctx, b, f"{op}.b"),
        _up(ctx, scales, f"{op}.scales"),
        zp,
        M=a.size // int(K),
        N=int(N),
        K=int(K),
        block_size=int(block_size),
        bits=int(bits),
        stream=ctx.stream,
    )
    return _results(ctx, out)[0]


def _matmul_nbits(
    ctx: _Context,
    a: np.ndarray,
    b: np.ndarray,
    scales: np.ndarray,
    *,
    K: int,
    N: int,
    bits: int,
    block_size: int,
) -> np.ndarray:
    return _gemm_nbits(
        ctx, "MatMulNBits", a, b, scales, None, K=K, N=N, bits=bits, block_size=block_size
    )


def _matmul_nbits_zp(
    ctx: _Context,
    a: np.ndarray,
    b: np.ndarray,
    scales: np.ndarray,
    zero_points: np.ndarray,
    *,
    K: int,
    N: int,
    bits: int,
    block_size: int,
) -> np.ndarray:
    return _gemm_nbits(
        ctx, "MatMulNBitsZP", a, b, scales, zero_points, K=K, N=N, bits=bits, block_size=block_size
    )


def _matmul_mxfp4(
    ctx: _Context, a: np.ndarray, b: np.ndarray, scales: np.ndarray, *, K: int, N: int
) -> np.ndarray:
    if a.size == 0:
        return matmul_ref.matmul_mxfp4(a, b, scales, K=K, N=N)
    from ep.kernels import matmul

    out = _alloc(ctx, (*a.shape[:-1], int(N)), a.dtype, "MatMulMXFP4.y")
    matmul.gemm_mxfp4(
        ctx.device,
        out,
        _up(ctx, a, "MatMulMXFP4.a"),
        _up(ctx, b, "MatMulMXFP4.b"),
        _up(ctx, scales, "MatMulMXFP4.scales"),
        M=a.size // int(K),
        N=int(N),
        K=int(K),
        stream=ctx.stream,
    )
    return _results(ctx, out)[0]


# --- SwiGLU ------------------------------------------------------------------------------------


def _swiglu(ctx: _Context, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    if gate.size == 0:
        return mlp_ref.swiglu(gate, up)
    from ep.kernels import mlp

    inter = int(gate.shape[-1])
    out = _alloc(ctx, gate.shape, gate.dtype, "SwiGLU.y")
    mlp.swiglu(
        ctx.device,
        out,
        _up(ctx, gate, "SwiGLU.gate"),
        _up(ctx, up, "SwiGLU.up"),
        rows=gate.size // inter,
        inter=inter,
        stream=ctx.stream,
    )
    return _results(ctx, out)[0]


def _swiglu_packed(ctx: _Context, gate_up: np.ndarray, *, interleaved: int) -> np.ndarray:
    if gate_up.size == 0:
        return mlp_ref.swiglu_packed(gate_up, interleaved=interleaved)
    from ep.kernels import mlp

    inter = int(gate_up.shape[-1]) // 2
    out = _alloc(ctx, (*gate_up.shape[:-1], inter), gate_up.dtype, "SwiGLUPacked.y")
    mlp.swiglu_packed(
        ctx.device,
        out,
        _up(ctx, gate_up, "SwiGLUPacked.gate_up"),
        rows=gate_up.size // (2 * inter),
        inter=inter,
        interleaved=int(interleaved),
        stream=ctx.stream,
    )
    return _results(ctx, out)[0]


# --- Sample ------------------------------------------------------------------------------------


def _sample(
    ctx: _Context,
    logits: np.ndarray,
    rng_keys: np.ndarray,
    steps: np.ndarray,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    min_p: float,
) -> np.ndarray:
    # The reference's checks and messages first.
    params = sample_ref.checked_params(
        rng_keys, steps, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
    )
    batch, vocab = (int(n) for n in logits.shape)
    if batch == 0:
        return sample_ref.sample(
            logits, rng_keys, steps, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p
        )
    from ep.kernels import sample

    ids = _alloc(ctx, (batch,), np.int64, "Sample.ids")
    data = _up(ctx, logits, "Sample.logits")
    if params.greedy:  # argmax; the generators are not read
        sample.sample(
            ctx.device,
            ids,
            data,
            None,
            None,
            batch=batch,
            vocab=vocab,
            temperature=0.0,
            status=ctx.status,
            stream=ctx.stream,
        )
    else:
        sample.sample(
            ctx.device,
            ids,
            data,
            _up(ctx, rng_keys, "Sample.rng_keys"),
            _up(ctx, steps, "Sample.steps"),
            batch=batch,
            vocab=vocab,
            temperature=float(temperature),
            top_k=int(top_k),
            top_p=float(top_p),
            min_p=float(min_p),
            status=ctx.status,
            stream=ctx.stream,
        )
    return _results(ctx, ids)[0]


# --- KV ops ------------------------------------------------------------------------------------


def _kv_region(
    op: str,
    strides: KVStrides,
    rows: np.ndarray,
    tokens: np.ndarray,
    table: np.ndarray | None,
    heads: int,
    head_dim: int,
    size: int,
) -> tuple[int, int]:
    """``[lo, hi)``: the flat elements that (row, token) pairs' heads and features occupy.

    The block table and page checks are the reference's (`ep.ops.kv._token_offsets`), and so is
    the bounds message.
    """
    base = kv_ref._token_offsets(rows, tokens, strides, table, op)
    span = (heads - 1) * strides.head + (head_dim - 1) * strides.dim + 1
    lo = int(base.min())
    hi = int(base.max()) + span
    if lo < 0 or hi > size:
        raise OpError(
            f"{op}: the geometry addresses element {hi - 1} of a buffer of {size} "
            "elements; the strides, capacity or batch do not match the bound buffers"
        )
    return lo, hi


def _cache_region(ctx: _Context, flat: np.ndarray, lo: int, hi: int, name: str) -> Buffer:
    """A device buffer of ``hi`` elements holding ``flat[lo:hi]`` at the same offsets (the
    kernels address it as the whole cache); elements below ``lo`` are zeros, never read."""
    buf = _alloc(ctx, (hi,), flat.dtype, name)
    if lo:
        ctx.device.fill(buf.view(shape=(lo,)), 0, stream=ctx.stream)
    _region_view(buf, lo, hi).copy_from_host(flat[lo:hi], stream=ctx.stream)
    return buf


def _region_view(buf: Buffer, lo: int, hi: int) -> Buffer:
    return buf.view(offset=lo * buf.dtype.itemsize, shape=(hi - lo,))


def _check_cache_dtype(op: str, bufs: KVLayerBuffers, new: np.ndarray) -> None:
    for kind, buf in (("key", bufs.key), ("value", bufs.value)):
        if buf.dtype != new.dtype:
            raise OpError(
                f"{op}: the {kind} cache holds {buf.dtype} but the new keys are {new.dtype}"
            )


def _commit(
    ctx: _Context,
    bufs: KVLayerBuffers,
    new_key: np.ndarray,
    new_value: np.ndarray,
    positions: np.ndarray,
    geometry: np.ndarray,
    block_table: np.ndarray | None,
) -> np.ndarray:
    op = "KVCommit"
    # The reference's checks, in its order, before anything moves.
    strides, capacity = kv_ref.parse_kv_geometry(geometry)
    _check_cache_dtype(op, bufs, new_key)
    kv_ref._check_positions(positions, capacity, op)
    batch, seq, heads, head_dim = (int(n) for n in new_key.shape)
    valid = positions >= 0
    order = np.where(valid, positions, -1)
    if seq > 1 and np.any((np.diff(order, axis=1) <= 0) & valid[:, 1:]):
        raise OpError(
            f"{op}: positions must increase along each row (padding first): {positions.tolist()}"
        )
    rows, cols = np.nonzero(valid)
    if rows.size == 0 or heads * head_dim == 0:  # nothing to write: only the lengths
        return kv_ref.kv_commit_into(
            bufs.key, bufs.value, new_key, new_value, positions, geometry, block_table
        )
    lo, hi = _kv_region(
        op, strides, rows, positions[rows, cols], block_table, heads, head_dim, bufs.key.size
    )
    from ep.kernels import attention

    key = _cache_region(ctx, bufs.key, lo, hi, "KVCommit.key_cache")
    value = _cache_region(ctx, bufs.value, lo, hi, "KVCommit.value_cache")
    lengths = _alloc(ctx, (batch,), np.int64, "KVCommit.lengths")
    table = None if block_table is None else _up(ctx, block_table, "KVCommit.block_table")
    attention.kv_commit(
        ctx.device,
        key,
        value,
        lengths,
        _up(ctx, new_key, "KVCommit.new_key"),
        _up(ctx, new_value, "KVCommit.new_value"),
        _up(ctx, positions, "KVCommit.positions"),
        batch=batch,
        seq=seq,
        kv_heads=heads,
        head_dim=head_dim,
        strides=strides,
        capacity=capacity,
        block_table=table,
        table_cols=0 if block_table is None else int(block_table.shape[1]),
        status=ctx.status,
        stream=ctx.stream,
    )
    out, new_keys, new_values = _results(
        ctx, lengths, _region_view(key, lo, hi), _region_view(value, lo, hi)
    )
    # Only now, with the fault check passed, into the runtime's cache.
    bufs.key[lo:hi] = new_keys
    bufs.value[lo:hi] = new_values
    return out


def _attend(
    ctx: _Context,
    bufs: KVLayerBuffers,
    query: np.ndarray,
    positions: np.ndarray,
    lengths: np.ndarray,
    geometry: np.ndarray,
    block_table: np.ndarray | None,
    *,
    kv_heads: int,
    scale: float,
) -> np.ndarray:
    op = "KVAttention"
    strides, capacity = kv_ref.parse_kv_geometry(geometry)
    if bufs.key.dtype != query.dtype or bufs.value.dtype != query.dtype:
        raise OpError(
            f"{op}: the cache holds {bufs.key.dtype}/{bufs.value.dtype} but the queries are "
            f"{query.dtype}"
        )
    kv_ref._check_positions(positions, capacity, op)
    batch, seq, heads, head_dim = (int(n) for n in query.shape)
    if query.size == 0:
        return np.zeros(query.shape, dtype=query.dtype)
    rows: list[np.ndarray] = []
    tokens: list[np.ndarray] = []
    for b in range(batch):
        live = positions[b] >= 0
        if not live.any():
            continue
        span = int(positions[b][live].max()) + 1
        if span > int(lengths[b]):
            raise OpError(
                f"{op}: row {b} has a query at position {span - 1} but its KVCommit reported "
                f"only {int(lengths[b])} tokens; feed KVCommit's lengths output"
            )
        rows.append(np.full(span, b, dtype=np.int64))
        tokens.append(np.arange(span, dtype=np.int64))
    if not rows:  # every row is padding: zeros, as the reference gives
        return np.zeros(query.shape, dtype=query.dtype)
    lo, hi = _kv_region(
        op,
        strides,
        np.concatenate(rows),
        np.concatenate(tokens),
        block_table,
        int(kv_heads),
        head_dim,
        bufs.key.size,
    )
    from ep.kernels import attention

    out = _alloc(ctx, query.shape, query.dtype, "KVAttention.output")
    table = None if block_table is None else _up(ctx, block_table, "KVAttention.block_table")
    attention.kv_attention(
        ctx.device,
        out,
        _up(ctx, query, "KVAttention.query"),
        _up(ctx, positions, "KVAttention.positions"),
        _up(ctx, lengths, "KVAttention.lengths"),
        _cache_region(ctx, bufs.key, lo, hi, "KVAttention.key_cache"),
        _cache_region(ctx, bufs.value, lo, hi, "KVAttention.value_cache"),
        batch=batch,
        seq=seq,
        heads=heads,
        kv_heads=int(kv_heads),
        head_dim=head_dim,
        strides=strides,
        capacity=capacity,
        scale=float(scale),
        block_table=table,
        table_cols=0 if block_table is None else int(block_table.shape[1]),
        status=ctx.status,
        stream=ctx.stream,
    )  # no workspace: one split, the plan chosen from the sizes
    return _results(ctx, out)[0]


def _kv_commit(
    ctx: _Context,
    new_key: np.ndarray,
    new_value: np.ndarray,
    positions: np.ndarray,
    geometry: np.ndarray,
    cache: np.ndarray,
    *,
    layer: int,
) -> np.ndarray:
    bufs = KV_CACHES.layer(kv_ref._handle(cache), layer)
    return _commit(ctx, bufs, new_key, new_value, positions, geometry, None)


def _kv_commit_paged(
    ctx: _Context,
    new_key: np.ndarray,
    new_value: np.ndarray,
    positions: np.ndarray,
    geometry: np.ndarray,
    block_table: np.ndarray,
    cache: np.ndarray,
    *,
    layer: int,
) -> np.ndarray:
    bufs = KV_CACHES.layer(kv_ref._handle(cache), layer)
    return _commit(ctx, bufs, new_key, new_value, positions, geometry, block_table)


def _kv_attention(
    ctx: _Context,
    query: np.ndarray,
    positions: np.ndarray,
    lengths: np.ndarray,
    geometry: np.ndarray,
    cache: np.ndarray,
    *,
    layer: int,
    kv_heads: int,
    scale: float,
) -> np.ndarray:
    bufs = KV_CACHES.layer(kv_ref._handle(cache), layer)
    return _attend(
        ctx, bufs, query, positions, lengths, geometry, None, kv_heads=kv_heads, scale=scale
    )


def _kv_attention_paged(
    ctx: _Context,
    query: np.ndarray,
    positions: np.ndarray,
    lengths: np.ndarray,
    geometry: np.ndarray,
    block_table: np.ndarray,
    cache: np.ndarray,
    *,
    layer: int,
    kv_heads: int,
    scale: float,
) -> np.ndarray:
    bufs = KV_CACHES.layer(kv_ref._handle(cache), layer)
    return _attend(
        ctx,
        bufs,
        query,
        positions,
        lengths,
        geometry,
        block_table,
        kv_heads=kv_heads,
        scale=scale,
    )


# --- the table ---------------------------------------------------------------------------------

_IMPLS: dict[str, Impl] = {
    "RMSNorm": _rms_norm,
    "SkipRMSNorm": _skip_rms_norm,
    "Rotary": _rotary,
    "RotaryTheta": _rotary_theta,
    "KVCommit": _kv_commit,
    "KVCommitPaged": _kv_commit_paged,
    "KVAttention": _kv_attention,
    "KVAttentionPaged": _kv_attention_paged,
    "MatMul": _matmul,
    "MatMulNBits": _matmul_nbits,
    "MatMulNBitsZP": _matmul_nbits_zp,
    "MatMulMXFP4": _matmul_mxfp4,
    "SwiGLU": _swiglu,
    "SwiGLUPacked": _swiglu_packed,
    "Sample": _sample,
}

# Op name -> its "cuda" kernel (following the placement's device).
CUDA_KERNELS: Mapping[str, DeviceKernel] = MappingProxyType(
    {name: DeviceKernel(name, impl) for name, impl in _IMPLS.items()}
)


def device_kernel(op: str, device: str | Device) -> DeviceKernel:
    """The device kernel of built-in op ``op`` bound to ``device`` (for example the CPU device,
    whose kernels are NumPy twins: the round trip runs without a GPU)."""
    found = CUDA_KERNELS.get(op)
    if found is None:
        raise OpError(f"no device kernel for op {op!r}; there are: {', '.join(CUDA_KERNELS)}")
    return found.on(device)


def with_cuda_kernels(ops: Iterable[OpDef]) -> tuple[OpDef, ...]:
    """``ops`` with their ``"cuda"`` kernel attached (ops this module has none for unchanged)."""
    return tuple(
        op.with_kernel("cuda", CUDA_KERNELS[op.name]) if op.name in CUDA_KERNELS else op
        for op in ops
    )
