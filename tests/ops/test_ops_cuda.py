"""The core ops' CUDA kernels (`ep.ops.cuda`) inside ONNX Runtime sessions, and the switch that
picks them (`ep.ops.placement`, ``decode.device``).

Every op runs in a real session under a placement, on fresh random inputs, against its NumPy
reference: ``twin`` runs the very CUDA kernel functions on the CPU device, whose kernels are the
NumPy twins of the CUDA ones (the whole host round trip, in CI); ``cuda`` (marked) runs them on
the GPU. Each run also checks that the device launched kernels, so a switch that silently ran the
reference fails. The whole tiny model runs the same way and must give the greedy tokens of
onnxruntime-genai.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
import pytest
from _devices import cuda_or_skip
from onnx import TensorProto, helper
from opsutil import model, session

import ep.ops as eo
from ep.cli import main
from ep.device import CACHE_ENV, cuda_available, get_device
from ep.errors import ConfigError, DeviceUnavailableError, KernelFaultError, OpError
from ep.kernels import KernelFault
from ep.model import DecoderModel, load_model
from ep.ops import cuda as ops_cuda
from ep.ops.runtime import KV_CACHES
from ep.ops.schema import np_dtype
from ep.rewrite import rewrite_model
from ep.runtime import GenerationOptions, Generator, create_backend
from ep.runtime.backend import OpsOnDevice
from ep.seams import KVStrides
from ep_builtin.kv_head_major import HeadMajorLayout

DATA = Path(__file__).parents[1] / "data" / "genai-llama-tiny"
EXPECTED = json.loads((DATA / "expected_tokens.json").read_text())
NEW = 48  # expected_tokens.json: 48 greedy tokens, EOS masked until then

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = ["float32", "float16", "bfloat16"]
# Max |device - reference| / max |reference|: float32 differs in summation order only.
TOL = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 1e-2}
_ONNX_ELEM = {"float16": TensorProto.FLOAT16, "bfloat16": TensorProto.BFLOAT16}


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _kernel_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Kernels compiled by these tests go to a temporary cache, not the user's ~/.cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CACHE_ENV, str(tmp_path_factory.mktemp("kernel-cache")))
        yield


@pytest.fixture(autouse=True)
def _placement_restored() -> Iterator[None]:
    """No test leaves the process running ops anywhere but on their references."""
    before = eo.current_placement()
    yield
    after = eo.current_placement()
    eo.set_placement(before)
    assert after == before, f"the test left the op placement at {after}"


@pytest.fixture(scope="module", params=["twin", pytest.param("cuda", marks=pytest.mark.cuda)])
def placement(request: pytest.FixtureRequest) -> eo.OpPlacement:
    """The CUDA kernel functions on the CPU device's NumPy twins, and (marked) on the GPU."""
    if request.param == "cuda":
        cuda_or_skip()
        return eo.placement_for("cuda")
    return eo.placement_for("cpu", kernels="cuda")


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """Seeded from the test's id: fixed per test, different between tests."""
    digest = hashlib.sha256(request.node.nodeid.encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


@pytest.fixture(scope="module")
def rewritten(tmp_path_factory: pytest.TempPathFactory) -> DecoderModel:
    """genai-llama-tiny fp32, rewritten into this project's ops (runtime-owned KV)."""
    out = tmp_path_factory.mktemp("rewritten") / "genai-fp32-ep"
    rewrite_model(DATA / "genai-fp32", out)
    return load_model(out)


# --- helpers -----------------------------------------------------------------------------------


def normal(rng: np.random.Generator, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32).astype(np_dtype(dtype))


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape, f"shape {got.shape}, expected {want.shape}"
    assert got.dtype == want.dtype, f"dtype {got.dtype}, expected {want.dtype}"
    g, w = got.astype(np.float64), want.astype(np.float64)
    assert not np.isnan(g).any() or np.isnan(w).any(), "NaN in the device result"
    return float(np.abs(g - w).max() / max(float(np.abs(w).max()), 1e-30))


def launches(placement: eo.OpPlacement) -> int:
    return get_device(placement.device).counters().launches


def run_graph(
    placement: eo.OpPlacement,
    nodes: list[Any],
    feeds: Mapping[str, np.ndarray],
    fetch: Sequence[str],
    carried: Mapping[str, np.dtype] | None = None,
) -> list[np.ndarray]:
    """Run ``nodes`` in a fresh session under ``placement``. float16/bfloat16 feeds and the
    ``carried`` outputs cross the graph's edge as uint16 (ONNX Runtime's Python API has no
    bfloat16); the device must have launched kernels."""
    carried = dict(carried or {})
    edge_in: list[Any] = []
    graph_feeds: dict[str, np.ndarray] = {}
    for name, array in feeds.items():
        dt = str(array.dtype)
        if dt in _ONNX_ELEM:
            graph_feeds[f"{name}_u16"] = array.view(np.uint16)
            edge_in.append(helper.make_node("BitCast", [f"{name}_u16"], [name], to=_ONNX_ELEM[dt]))
        else:
            graph_feeds[name] = array
    edge_out = [
        helper.make_node("BitCast", [name], [f"{name}_u16"], to=TensorProto.UINT16)
        for name in fetch
        if name in carried
    ]
    names = [f"{n}_u16" if n in carried else n for n in fetch]
    sess = session(model([*edge_in, *nodes, *edge_out], graph_feeds, names))
    before = launches(placement)
    with eo.use_placement(placement):
        outs = eo.run(sess, names, graph_feeds)
    assert launches(placement) > before, "no kernel ran: the session ran the references"
    return [o.view(carried[n]) if n in carried else o for o, n in zip(outs, fetch, strict=True)]


def run_op(
    placement: eo.OpPlacement,
    op: str,
    inputs: Sequence[np.ndarray],
    *,
    dtype: str = "float32",
    **attrs: Any,
) -> list[np.ndarray]:
    """One node of built-in ``op`` at dtype T = ``dtype``, run under ``placement``."""
    schema = eo.core_op(op).schema
    sig = {schema.type_vars[0][0]: dtype}
    in_names = [t.name for t in schema.inputs]
    out_names = [f"{t.name}_out" for t in schema.outputs]
    nodes = eo.make_nodes(op, in_names, out_names, name=f"{op}_node", dtype=dtype, **attrs)
    carried = {
        name: np_dtype(schema.resolve(t, sig))
        for t, name in zip(schema.outputs, out_names, strict=True)
        if schema.resolve(t, sig) in _ONNX_ELEM
    }
    feeds = dict(zip(in_names, inputs, strict=True))
    return run_graph(placement, nodes, feeds, out_names, carried)


def assert_close(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    err = rel_err(got, want)
    assert err <= TOL[dtype], f"relative error {err:.3g} > {TOL[dtype]}"


# --- every core op, through a session ----------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 50])  # 16-byte vectors, and element by element
def test_rms_norm(
    placement: eo.OpPlacement, rng: np.random.Generator, dtype: str, hidden: int
) -> None:
    x, w = normal(rng, (2, 5, hidden), dtype), normal(rng, (hidden,), dtype)
    (y,) = run_op(placement, "RMSNorm", [x, w], dtype=dtype, epsilon=1e-5)
    assert_close(y, eo.core_op("RMSNorm")(x, w, epsilon=1e-5), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_skip_rms_norm(placement: eo.OpPlacement, rng: np.random.Generator, dtype: str) -> None:
    x, skip = normal(rng, (3, 96), dtype), normal(rng, (3, 96), dtype)
    w = normal(rng, (96,), dtype)
    y, total = run_op(placement, "SkipRMSNorm", [x, skip, w], dtype=dtype, epsilon=1e-6)
    want_y, want_sum = eo.core_op("SkipRMSNorm")(x, skip, w, epsilon=1e-6)
    assert_close(y, want_y, dtype)
    assert_close(total, want_sum, dtype)


def _positions(rng: np.random.Generator, batch: int, seq: int, top: int) -> np.ndarray:
    """Rows of increasing positions below ``top``; row 0 left-padded (-1) by one token."""
    pos = np.empty((batch, seq), dtype=np.int64)
    for b in range(batch):
        start = int(rng.integers(0, top - seq))
        pos[b] = start + np.arange(seq)
    pos[0, 0] = -1
    return pos


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rotary_dim", [32, 16])
def test_rotary(
    placement: eo.OpPlacement,
    rng: np.random.Generator,
    dtype: str,
    interleaved: int,
    rotary_dim: int,
) -> None:
    x = normal(rng, (2, 4, 3, 32), dtype)
    pos = _positions(rng, 2, 4, 256)
    cos, sin = eo.rope_cache(10000.0, rotary_dim, 256, np_dtype(dtype))
    (y,) = run_op(placement, "Rotary", [x, pos, cos, sin], dtype=dtype, interleaved=interleaved)
    assert_close(y, eo.core_op("Rotary")(x, pos, cos, sin, interleaved=interleaved), dtype)
    np.testing.assert_array_equal(y[0, 0], x[0, 0])  # padding passes through


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize("rotary_dim", [0, 16])
def test_rotary_theta(
    placement: eo.OpPlacement,
    rng: np.random.Generator,
    dtype: str,
    interleaved: int,
    rotary_dim: int,
) -> None:
    x = normal(rng, (2, 5, 2, 32), dtype)
    pos = _positions(rng, 2, 5, 2048)
    attrs = dict(theta=500000.0, rotary_dim=rotary_dim, interleaved=interleaved)
    (y,) = run_op(placement, "RotaryTheta", [x, pos], dtype=dtype, **attrs)
    assert_close(y, eo.core_op("RotaryTheta")(x, pos, **attrs), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose_b", [0, 1])
@pytest.mark.parametrize("rows", [(2, 3), (40,)], ids=["gemv", "gemm"])
def test_matmul_on_a_named_weight(
    placement: eo.OpPlacement,
    rng: np.random.Generator,
    dtype: str,
    transpose_b: int,
    rows: tuple[int, ...],
) -> None:
    K, N = 72, 48
    a = normal(rng, (*rows, K), dtype)
    w = (normal(rng, (N, K) if transpose_b else (K, N), "float32") / np.sqrt(K)).astype(
        np_dtype(dtype)
    )
    attrs = dict(weight="layer0.proj", N=N, transpose_b=transpose_b)
    with eo.use_weights(eo.DictWeights({"layer0.proj": w})):
        (y,) = run_op(placement, "MatMul", [a], dtype=dtype, **attrs)
        want = eo.core_op("MatMul")(a, **attrs)
    assert_close(y, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("zero_point", [False, True], ids=["zp8", "zp"])
@pytest.mark.parametrize("M", [3, 20])  # GEMV, tiled GEMM
def test_matmul_nbits(
    placement: eo.OpPlacement, rng: np.random.Generator, dtype: str, zero_point: bool, M: int
) -> None:
    K, N, block = 100, 37, 32  # K not a multiple of the block: a padded last block
    a = normal(rng, (M, K), dtype)
    w = normal(rng, (N, K), "float32") / np.sqrt(K)
    b, scales, zp = eo.quantize_nbits(w, block_size=block, zero_point=zero_point)
    scales = scales.astype(np_dtype(dtype))
    attrs = dict(K=K, N=N, bits=4, block_size=block)
    if zp is None:
        (y,) = run_op(placement, "MatMulNBits", [a, b, scales], dtype=dtype, **attrs)
        want = eo.core_op("MatMulNBits")(a, b, scales, **attrs)
    else:
        (y,) = run_op(placement, "MatMulNBitsZP", [a, b, scales, zp], dtype=dtype, **attrs)
        want = eo.core_op("MatMulNBitsZP")(a, b, scales, zp, **attrs)
    assert_close(y, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [3, 20])
def test_matmul_mxfp4(
    placement: eo.OpPlacement, rng: np.random.Generator, dtype: str, M: int
) -> None:
    K, N = 96, 37
    a = normal(rng, (M, K), dtype)
    # Block magnitudes 2^-6 .. 2^3: inside float16's range once decoded.
    spread = np.exp2(rng.integers(-6, 4, size=(N, K // 32, 1))).astype(np.float32)
    w = (rng.standard_normal((N, K // 32, 32)).astype(np.float32) * spread).reshape(N, K)
    b, scales = eo.quantize_mxfp4(w)
    (y,) = run_op(placement, "MatMulMXFP4", [a, b, scales], dtype=dtype, K=K, N=N)
    assert_close(y, eo.core_op("MatMulMXFP4")(a, b, scales, K=K, N=N), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu(placement: eo.OpPlacement, rng: np.random.Generator, dtype: str) -> None:
    gate, up = normal(rng, (2, 3, 40), dtype), normal(rng, (2, 3, 40), dtype)
    (y,) = run_op(placement, "SwiGLU", [gate, up], dtype=dtype)
    assert_close(y, eo.core_op("SwiGLU")(gate, up), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [0, 1])
def test_swiglu_packed(
    placement: eo.OpPlacement, rng: np.random.Generator, dtype: str, interleaved: int
) -> None:
    gate_up = normal(rng, (2, 3, 80), dtype)
    (y,) = run_op(placement, "SwiGLUPacked", [gate_up], dtype=dtype, interleaved=interleaved)
    assert_close(y, eo.core_op("SwiGLUPacked")(gate_up, interleaved=interleaved), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "settings",
    [dict(), dict(temperature=0.8, top_k=20), dict(temperature=1.3, top_p=0.9, min_p=0.02)],
    ids=["greedy", "top_k", "top_p_min_p"],
)
def test_sample(
    placement: eo.OpPlacement, rng: np.random.Generator, dtype: str, settings: dict[str, Any]
) -> None:
    logits = (rng.standard_normal((4, 1000)) * 3).astype(np.float32).astype(np_dtype(dtype))
    keys = np.stack([np.full(4, 1234), np.arange(4)], axis=1).astype(np.int64)
    steps = rng.integers(0, 50, 4).astype(np.int64)
    (ids,) = run_op(placement, "Sample", [logits, keys, steps], dtype=dtype, **settings)
    want = eo.core_op("Sample")(logits, keys, steps, **settings)
    assert ids.dtype == np.int64 and ids.tolist() == want.tolist()


# --- the KV ops: commit then attend, over a runtime-owned cache in every layout ----------------


def _cache(
    rng: np.random.Generator, layout: str, batch: int, hkv: int, cap: int, d: int, dtype: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """(key buffer, value buffer, geometry, block table) holding stale random data."""
    page = 4
    table = None
    if layout == "head_major":
        strides, size = KVStrides(hkv * cap * d, d, cap * d, 1), batch * hkv * cap * d
    elif layout == "seq_major":
        strides, size = KVStrides(cap * hkv * d, hkv * d, d, 1), batch * cap * hkv * d
    else:  # paged, pages handed out in a shuffled order with spares
        pages = batch * (cap // page) + 3
        strides = KVStrides(0, hkv * d, d, 1, page=page * hkv * d, page_size=page)
        size = pages * page * hkv * d
        table = rng.permutation(pages)[: batch * (cap // page)].reshape(batch, -1)
        table = table.astype(np.int32)
    key, value = normal(rng, (size,), dtype), normal(rng, (size,), dtype)
    return key, value, eo.kv_geometry(strides, cap), table


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["head_major", "seq_major", "paged"])
def test_kv_commit_then_attention(
    placement: eo.OpPlacement, rng: np.random.Generator, layout: str, dtype: str
) -> None:
    batch, hq, hkv, d, cap = 2, 4, 2, 32, 16
    key, value, geometry, table = _cache(rng, layout, batch, hkv, cap, d, dtype)
    want_key, want_value = key.copy(), value.copy()  # the reference's own cache
    paged = "Paged" if table is not None else ""
    commit_in = ["k", "v", "pos", "geo", *(["table"] if paged else []), "cache"]
    attend_in = ["q", "pos", "lengths", "geo", *(["table"] if paged else []), "cache"]
    nodes = [
        *eo.make_nodes(
            f"KVCommit{paged}", commit_in, ["lengths"], name="commit", dtype=dtype, layer=0
        ),
        *eo.make_nodes(
            f"KVAttention{paged}",
            attend_in,
            ["out"],
            name="attend",
            dtype=dtype,
            layer=0,
            kv_heads=hkv,
        ),
    ]
    steps = [np.array([[-1, -1, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5]]), np.array([[4], [6]])]
    steps.append(np.array([[5], [7]]))
    handle = KV_CACHES.bind([(key, value)])
    try:
        for positions in steps:
            pos = positions.astype(np.int64)
            s = pos.shape[1]
            q = normal(rng, (batch, s, hq, d), dtype)
            k, v = normal(rng, (batch, s, hkv, d), dtype), normal(rng, (batch, s, hkv, d), dtype)
            feeds = {"k": k, "v": v, "q": q, "pos": pos, "geo": geometry}
            if table is not None:
                feeds["table"] = table
            feeds["cache"] = np.array([handle], np.int64)
            carried = {"out": np_dtype(dtype)} if dtype in _ONNX_ELEM else {}
            out, lengths = run_graph(placement, nodes, feeds, ["out", "lengths"], carried)
            want_lengths = eo.kv_commit_into(want_key, want_value, k, v, pos, geometry, table)
            want = eo.kv_attention_from(
                want_key,
                want_value,
                q,
                pos,
                want_lengths,
                geometry,
                kv_heads=hkv,
                scale=0.0,
                block_table=table,
            )
            assert lengths.tolist() == want_lengths.tolist()
            assert_close(out, want, dtype)
            assert not out[0, : int((pos[0] < 0).sum())].any()  # padding rows are zeros
            # A commit is a copy: the runtime's cache, written slots and untouched ones, is
            # bit for bit the reference's.
            np.testing.assert_array_equal(key.view(np.uint8), want_key.view(np.uint8))
            np.testing.assert_array_equal(value.view(np.uint8), want_value.view(np.uint8))
    finally:
        KV_CACHES.release(handle)


def test_bad_kv_input_fails_as_the_reference_does_and_leaves_the_cache_alone() -> None:
    key = np.arange(16, dtype=np.float32)
    value = -key
    geometry = eo.kv_geometry(KVStrides(8, 2, 8, 1), 4)  # head-major, batch 2, 1 head, d 2
    handle = KV_CACHES.bind([(key, value)])
    commit = ops_cuda.device_kernel("KVCommit", "cpu")
    new = np.ones((2, 1, 1, 2), np.float32)
    cache = np.array([handle], np.int64)
    try:
        for pos, message in [
            (np.array([[4], [0]]), "does not fit the cache capacity 4"),
            (np.array([[1, 1], [0, 1]]), "positions must increase"),
        ]:
            pos = pos.astype(np.int64)
            kv = np.ones((2, pos.shape[1], 1, 2), np.float32)
            with pytest.raises(OpError, match=message) as info:
                commit(kv, kv, pos, geometry, cache, layer=0)
            with pytest.raises(OpError) as ref_info:
                eo.core_op("KVCommit").reference(kv, kv, pos, geometry, cache, layer=0)
            assert str(info.value) == str(ref_info.value)
        np.testing.assert_array_equal(key, np.arange(16))
        np.testing.assert_array_equal(value, -np.arange(16))
        attend = ops_cuda.device_kernel("KVAttention", "cpu")
        q = np.ones((2, 1, 1, 2), np.float32)
        short = np.array([1, 1], np.int64)  # a query at position 2 with 1 token committed
        with pytest.raises(OpError, match="KVCommit reported only 1 tokens"):
            attend(q, np.array([[2], [0]], np.int64), short, geometry, cache, layer=0,
                   kv_heads=1, scale=0.0)  # fmt: skip
        lengths = commit(new, new, np.array([[0], [3]], np.int64), geometry, cache, layer=0)
        assert lengths.tolist() == [1, 4]  # and a good call still works
        assert key[[0, 1, 14, 15]].tolist() == [1, 1, 1, 1]
    finally:
        KV_CACHES.release(handle)


def test_a_kernel_fault_raises_before_anything_reaches_the_cache() -> None:
    """The fault check comes before the write-back: a flagged fault leaves the cache alone."""
    key = np.zeros(16, np.float32)
    value = np.zeros(16, np.float32)
    geometry = eo.kv_geometry(KVStrides(8, 2, 8, 1), 4)
    handle = KV_CACHES.bind([(key, value)])
    commit = ops_cuda.device_kernel("KVCommit", "cpu")
    new = np.ones((2, 1, 1, 2), np.float32)
    args = (new, new, np.array([[0], [1]], np.int64), geometry, np.array([handle], np.int64))
    try:
        # A fault a kernel flagged: the bit in this thread's status buffer on the CPU device.
        ctx = ops_cuda._context("cpu")
        ctx.device.fill(ctx.status, int(KernelFault.KV_PAGE), stream=ctx.stream)
        with pytest.raises(KernelFaultError, match="block-table column or page"):
            commit(*args, layer=0)
        assert not key.any() and not value.any()
        commit(*args, layer=0)  # the status was reset: the same call now writes
        assert key.any() and value.any()
    finally:
        KV_CACHES.release(handle)


# --- the switch --------------------------------------------------------------------------------


def _rms_session() -> tuple[Any, dict[str, np.ndarray]]:
    rng = np.random.default_rng(3)
    feeds = {
        "x": rng.standard_normal((2, 16)).astype(np.float32),
        "w": rng.standard_normal(16).astype(np.float32),
    }
    nodes = eo.make_nodes("RMSNorm", ["x", "w"], ["y"], name="final_norm")
    return session(model(nodes, feeds, ["y"])), feeds


def test_the_default_placement_runs_the_references_and_touches_no_device() -> None:
    assert eo.current_placement() == eo.OpPlacement()
    sess, feeds = _rms_session()
    cpu = get_device("cpu")
    before = cpu.counters()
    (y,) = eo.run(sess, None, feeds)
    np.testing.assert_array_equal(y, eo.core_op("RMSNorm")(feeds["x"], feeds["w"], epsilon=1e-6))
    assert cpu.counters() == before  # no upload, no launch
    with eo.use_device("cpu", kernels="cuda"):  # the oracle: the device path does move bytes
        eo.run(sess, None, feeds)
    after = cpu.counters()
    assert after.launches > before.launches and after.htod_bytes > before.htod_bytes


def test_use_device_installs_and_restores_and_set_device_returns_the_previous() -> None:
    twin = eo.OpPlacement(kernels="cuda", device="cpu")
    with eo.use_device("cpu", kernels="cuda") as placed:
        assert placed == twin and eo.current_placement() == twin
        with eo.use_device("cpu"):
            assert eo.current_placement() == eo.OpPlacement()
        assert eo.current_placement() == twin
    assert eo.current_placement() == eo.OpPlacement()
    with pytest.raises(RuntimeError), eo.use_device("cpu", kernels="cuda"):
        raise RuntimeError("a failing run")
    assert eo.current_placement() == eo.OpPlacement()  # restored on the way out of an error
    previous = eo.set_device("CPU", kernels="cuda")
    try:
        assert previous == eo.OpPlacement() and eo.current_placement() == twin
    finally:
        assert eo.set_device("cpu") == twin
    assert "NumPy references" in eo.OpPlacement().describe()
    assert "'cuda' kernels on device 'cpu'" in twin.describe()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(device="gpu"), "not a device name"),
        (dict(device="cpu:1"), "not a device name"),
        (dict(device=3), "neither a device name"),
        (dict(device="cpu", kernels="CUDA!"), "not a kernel set name"),
        (dict(device="cpu", fallback="yes"), "True or False"),
    ],
)
def test_bad_placements_are_config_errors(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        eo.placement_for(**kwargs)
    with pytest.raises(ConfigError, match=r"ep\.ops\.OpPlacement"):
        eo.set_placement("cuda")  # type: ignore[arg-type]
    assert eo.current_placement() == eo.OpPlacement()


def test_cuda_without_a_gpu_fails_at_the_switch_in_plain_words() -> None:
    ok, reason = cuda_available()
    if ok:
        pytest.skip("this machine has a GPU")
    with pytest.raises(DeviceUnavailableError) as info:
        eo.use_device("cuda").__enter__()
    assert str(info.value) == reason
    assert eo.current_placement() == eo.OpPlacement()
    # A direct call of a CUDA kernel says the same, as an OpError naming the op.
    x = np.ones((1, 4), np.float32)
    with pytest.raises(OpError, match=re.escape(f"RMSNorm on cuda: {reason}")):
        eo.core_op("RMSNorm")(x, np.ones(4, np.float32), device="cuda", epsilon=1e-6)


def test_an_op_without_a_kernel_of_the_chosen_set_is_a_clear_error() -> None:
    sess, feeds = _rms_session()
    with eo.use_device("cpu", kernels="rocm"), pytest.raises(OpError) as info:
        eo.run(sess, None, feeds)
    text = str(info.value)
    assert "ai.genai_ep::RMSNorm" in text and "'final_norm'" in text
    assert "no 'rocm' kernel (it has: cpu, cuda)" in text
    assert "with_kernel('rocm', fn)" in text and "fallback=True" in text
    (y,) = eo.run(sess, None, feeds)  # the next run, on the references, works
    np.testing.assert_array_equal(y, eo.core_op("RMSNorm")(feeds["x"], feeds["w"], epsilon=1e-6))


def test_fallback_runs_the_reference_and_says_so_once() -> None:
    sess, feeds = _rms_session()
    want = eo.core_op("RMSNorm")(feeds["x"], feeds["w"], epsilon=1e-6)
    with eo.use_device("cpu", kernels="metal", fallback=True):
        with pytest.warns(RuntimeWarning, match="RMSNorm .* has no 'metal' kernel"):
            (y,) = eo.run(sess, None, feeds)
        np.testing.assert_array_equal(y, want)
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a second run warns no more
            eo.run(sess, None, feeds)


def test_core_ops_carry_cuda_kernels_and_ep_ops_loads_no_device_code() -> None:
    for op in eo.CORE_OPS:
        assert op.kernel("cpu") is op.reference
        assert isinstance(op.kernel("cuda"), ops_cuda.DeviceKernel), op.name
    with pytest.raises(OpError, match="no device kernel for op 'Nope'"):
        ops_cuda.device_kernel("Nope", "cpu")
    code = (
        "import sys, ep.ops\n"
        "def device_code():\n"
        "    return [m for m in sys.modules if m.split('.')[0] == 'cuda'"
        " or m.startswith(('ep.kernels', 'ep.device'))]\n"
        "assert not device_code(), device_code()\n"
        "import ep.runtime\n"  # the runtime's KV cache uses ep.device; no kernels, no cuda
        "assert not [m for m in device_code() if not m.startswith('ep.device')], device_code()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the whole model ---------------------------------------------------------------------------


def _options() -> GenerationOptions:
    return GenerationOptions(max_new_tokens=NEW, min_new_tokens=NEW, decode_text=False)


def test_the_whole_model_through_the_kernel_glue_gives_genai_tokens(
    rewritten: DecoderModel,
) -> None:
    """Every op of the rewritten model through the CUDA kernel functions on the CPU device's
    twins, under the backend wrapper decode.device=cuda uses: onnxruntime-genai's tokens."""
    inner = create_backend("ort", rewritten, HeadMajorLayout())
    wrapped = OpsOnDevice(inner, eo.placement_for("cpu", kernels="cuda"))
    gen = Generator(rewritten, layout=HeadMajorLayout(), backend=wrapped, options=_options())
    before = get_device("cpu").counters().launches
    solo = [list(gen.generate([p]).tokens[0]) for p in EXPECTED["prompts"]]
    assert solo == EXPECTED["genai-fp32"]
    assert get_device("cpu").counters().launches > before
    assert [list(t) for t in gen.generate(EXPECTED["prompts"]).tokens] == solo
    assert eo.current_placement() == eo.OpPlacement()  # only during prefill and steps
    assert gen.backend.kv is inner.kv and wrapped.name == "ort"
    assert wrapped.session is inner.session  # the rest is the wrapped backend's


def test_device_cuda_without_a_gpu_fails_in_plain_words(
    rewritten: DecoderModel, capsys: pytest.CaptureFixture[str]
) -> None:
    ok, reason = cuda_available()
    if ok:
        pytest.skip("this machine has a GPU")
    with pytest.raises(DeviceUnavailableError, match="no CUDA"):
        create_backend("ort", rewritten, HeadMajorLayout(), device="cuda")
    with pytest.raises(DeviceUnavailableError, match="no CUDA"):  # a contrib graph too
        create_backend("ort", load_model(DATA / "genai-fp32"), HeadMajorLayout(), device="cuda")
    code = main(["run", "--model", str(rewritten.folder), "--device", "cuda",
                 "--prompt-ids", "5,6,7", "--max-new-tokens", "2"])  # fmt: skip
    assert code == 2
    assert reason in capsys.readouterr().err


@pytest.mark.cuda
def test_the_whole_model_on_cuda_gives_genai_tokens(rewritten: DecoderModel) -> None:
    cuda_or_skip()
    gen = Generator(rewritten, layout=HeadMajorLayout(), device="cuda", options=_options())
    assert isinstance(gen.backend, OpsOnDevice)
    gpu = get_device("cuda")
    before = gpu.counters().launches
    solo = [list(gen.generate([p]).tokens[0]) for p in EXPECTED["prompts"]]
    assert solo == EXPECTED["genai-fp32"]
    assert gpu.counters().launches > before
    assert eo.current_placement() == eo.OpPlacement()


@pytest.mark.cuda
def test_the_whole_model_on_cuda_batched_gives_genai_tokens(rewritten: DecoderModel) -> None:
    cuda_or_skip()
    gen = Generator(rewritten, layout=HeadMajorLayout(), device="cuda", options=_options())
    assert [list(t) for t in gen.generate(EXPECTED["prompts"]).tokens] == EXPECTED["genai-fp32"]


@pytest.mark.cuda
def test_cli_run_device_cuda_gives_genai_tokens(
    rewritten: DecoderModel, capsys: pytest.CaptureFixture[str]
) -> None:
    cuda_or_skip()
    n = str(NEW)
    prompt = ",".join(map(str, EXPECTED["prompts"][0]))
    code = main(["run", "--json", "--model", str(rewritten.folder), "--device", "cuda",
                 "--prompt-ids", prompt, "--max-new-tokens", n, "--min-new-tokens", n])  # fmt: skip
    out, err = capsys.readouterr()
    assert code == 0, err
    assert json.loads(out)["tokens"] == [EXPECTED["genai-fp32"][0]]
