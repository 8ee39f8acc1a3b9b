"""Our ops, run inside real ONNX Runtime sessions, against ONNX Runtime's own contrib ops.

Each test builds one model holding both our node and ORT's reference node on the same inputs
(fresh random data, several shapes) and compares the two outputs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import helper
from opsutil import ms_node, rel_err, run_nodes

import ep.ops as eo
from ep.ops.runtime import KV_CACHES
from ep.seams import KVStrides

RNG = np.random.default_rng(20241130)


def _randn(*shape: int, dtype: Any = np.float32) -> np.ndarray:
    return RNG.standard_normal(shape).astype(dtype)


# --- norms -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("shape", "eps"), [((2, 3, 8), 1e-5), ((1, 1, 64), 1e-6), ((4, 96), 1e-6)])
def test_rms_norm_matches_simplified_layer_normalization(
    shape: tuple[int, ...], eps: float
) -> None:
    feeds = {"x": _randn(*shape) * 3, "w": _randn(shape[-1])}
    nodes = [
        *eo.make_nodes("RMSNorm", ["x", "w"], ["ours"], name="rms", epsilon=eps),
        helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["ref"], epsilon=eps, axis=-1),
    ]
    ours, ref = run_nodes(nodes, feeds, ["ours", "ref"])
    assert ours.shape == ref.shape == shape and ours.dtype == np.float32
    np.testing.assert_allclose(ours, ref, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(2, 3, 16), (1, 7, 32), (5, 128)])
def test_skip_rms_norm_matches_skip_simplified_layer_normalization(shape: tuple[int, ...]) -> None:
    feeds = {"x": _randn(*shape), "skip": _randn(*shape), "w": _randn(shape[-1])}
    nodes = [
        *eo.make_nodes(
            "SkipRMSNorm", ["x", "skip", "w"], ["ours", "ours_sum"], name="skip", epsilon=1e-6
        ),
        ms_node(
            "SkipSimplifiedLayerNormalization",
            ["x", "skip", "w"],
            ["ref", "", "", "ref_sum"],
            epsilon=1e-6,
        ),
    ]
    ours, ours_sum, ref, ref_sum = run_nodes(nodes, feeds, ["ours", "ours_sum", "ref", "ref_sum"])
    np.testing.assert_array_equal(ours_sum, ref_sum)
    np.testing.assert_allclose(ours, ref, rtol=2e-6, atol=1e-6)


def test_norm_comparison_detects_a_wrong_epsilon() -> None:
    """Negative oracle: the comparison above fails when our epsilon differs from ORT's."""
    feeds = {"x": _randn(2, 4, 8) * 1e-3, "w": _randn(8)}
    nodes = [
        *eo.make_nodes("RMSNorm", ["x", "w"], ["ours"], name="rms", epsilon=1e-2),
        helper.make_node("SimplifiedLayerNormalization", ["x", "w"], ["ref"], epsilon=1e-6),
    ]
    ours, ref = run_nodes(nodes, feeds, ["ours", "ref"])
    assert rel_err(ours, ref) > 1e-2


# --- rotary ----------------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", [0, 1])
@pytest.mark.parametrize(
    ("batch", "seq", "heads", "head_dim", "rot"),
    [
        (2, 5, 4, 16, 16),
        (1, 9, 2, 32, 32),
        (3, 4, 3, 32, 16),  # partial rotary: the last 16 features pass through
    ],
)
def test_rotary_matches_rotary_embedding(
    interleaved: int, batch: int, seq: int, heads: int, head_dim: int, rot: int
) -> None:
    max_pos = 64
    cos, sin = eo.rope_cache(10000.0, rot, max_pos)
    x = _randn(batch, seq, heads, head_dim)
    pos = RNG.integers(0, max_pos, size=(batch, seq)).astype(np.int64)
    feeds = {
        "x": x,
        "x3": x.reshape(batch, seq, heads * head_dim),
        "pos": pos,
        "cos": cos,
        "sin": sin,
    }
    ref_attrs = {"interleaved": interleaved}
    if rot != head_dim:
        ref_attrs.update(num_heads=heads, rotary_embedding_dim=rot)
    nodes = [
        *eo.make_nodes(
            "Rotary", ["x", "pos", "cos", "sin"], ["ours"], name="rot", interleaved=interleaved
        ),
        ms_node("RotaryEmbedding", ["x3", "pos", "cos", "sin"], ["ref"], **ref_attrs),
    ]
    ours, ref = run_nodes(nodes, feeds, ["ours", "ref"])
    np.testing.assert_allclose(ours.reshape(ref.shape), ref, rtol=1e-6, atol=1e-6)
    if rot < head_dim:
        np.testing.assert_array_equal(ours[..., rot:], x[..., rot:])


def test_rotary_comparison_detects_the_wrong_pairing() -> None:
    """Negative oracle: half-split against ORT's interleaved mode disagrees."""
    cos, sin = eo.rope_cache(10000.0, 16, 32)
    x = _randn(1, 4, 2, 16)
    pos = np.arange(4, dtype=np.int64)[None] + 3
    feeds = {"x": x, "x3": x.reshape(1, 4, 32), "pos": pos, "cos": cos, "sin": sin}
    nodes = [
        *eo.make_nodes("Rotary", ["x", "pos", "cos", "sin"], ["ours"], name="rot", interleaved=0),
        ms_node("RotaryEmbedding", ["x3", "pos", "cos", "sin"], ["ref"], interleaved=1),
    ]
    ours, ref = run_nodes(nodes, feeds, ["ours", "ref"])
    assert rel_err(ours.reshape(ref.shape), ref) > 1e-2


# --- MatMulNBits -----------------------------------------------------------------------------


@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize(
    ("k", "n", "block"),
    [
        (64, 16, 16),
        (96, 24, 32),
        (128, 8, 64),
        (48, 5, 32),
        (256, 12, 128),
    ],
)
def test_matmul_nbits_matches_ort(zero_points: bool, k: int, n: int, block: int) -> None:
    k_blocks = -(-k // block)
    b = RNG.integers(0, 256, size=(n, k_blocks, block // 2), dtype=np.uint8)
    scales = (RNG.random(n * k_blocks).astype(np.float32) + 0.05) * 0.1
    a = _randn(2, 3, k)
    feeds = {"a": a, "b": b, "scales": scales}
    attrs: dict[str, Any] = {"K": k, "N": n, "bits": 4, "block_size": block}
    if zero_points:
        feeds["zp"] = RNG.integers(0, 256, size=(n * -(-k_blocks // 2),), dtype=np.uint8)
        names = ["a", "b", "scales", "zp"]
        ours_node = eo.make_nodes("MatMulNBitsZP", names, ["ours"], name="q4", **attrs)
    else:
        names = ["a", "b", "scales"]
        ours_node = eo.make_nodes("MatMulNBits", names, ["ours"], name="q4", **attrs)
    nodes = [*ours_node, ms_node("MatMulNBits", names, ["ref"], **attrs)]
    ours, ref = run_nodes(nodes, feeds, ["ours", "ref"])
    assert ours.shape == ref.shape == (2, 3, n)
    assert rel_err(ours, ref) < 2e-6
    # The dequantized weight agrees with the int4 numbers ORT multiplies with.
    w = eo.dequantize_nbits(b, scales, feeds.get("zp"), K=k, N=n, block_size=block)
    assert rel_err(a @ w.T, ref) < 2e-6


def test_matmul_nbits_comparison_detects_swapped_nibbles() -> None:
    """Negative oracle: reading the high nibble first does not match ORT."""
    k, n, block = 64, 8, 32
    b = RNG.integers(0, 256, size=(n, 2, 16), dtype=np.uint8)
    swapped = ((b << 4) | (b >> 4)).astype(np.uint8)
    scales = np.full(n * 2, 0.1, np.float32)
    attrs: dict[str, Any] = {"K": k, "N": n, "bits": 4, "block_size": block}
    nodes = [
        *eo.make_nodes("MatMulNBits", ["a", "bs", "s"], ["ours"], name="q4", **attrs),
        ms_node("MatMulNBits", ["a", "b", "s"], ["ref"], **attrs),
    ]
    feeds = {"a": _randn(1, k), "b": b, "bs": swapped, "s": scales}
    ours, ref = run_nodes(nodes, feeds, ["ours", "ref"])
    assert rel_err(ours, ref) > 1e-2


def test_quantize_nbits_packs_what_ort_reads() -> None:
    """Our quantizer's output, run by ORT's MatMulNBits, approximates the float weight."""
    k, n, block = 128, 16, 32
    w = _randn(n, k)
    for zp in (False, True):
        b, scales, zps = eo.quantize_nbits(w, block_size=block, zero_point=zp)
        feeds = {"a": _randn(4, k), "b": b, "s": scales}
        names = ["a", "b", "s"]
        if zps is not None:
            feeds["zp"] = zps
            names.append("zp")
        attrs: dict[str, Any] = {"K": k, "N": n, "bits": 4, "block_size": block}
        (ref,) = run_nodes([ms_node("MatMulNBits", names, ["ref"], **attrs)], feeds, ["ref"])
        assert rel_err(ref, feeds["a"] @ w.T) < 0.15
        deq = eo.dequantize_nbits(b, scales, zps, K=k, N=n, block_size=block)
        assert rel_err(feeds["a"] @ deq.T, ref) < 2e-6


@pytest.mark.parametrize("zero_points", [False, True])
@pytest.mark.parametrize(
    ("k", "n", "block"), [(128, 256, 32), (96, 24, 32), (200, 40, 32), (128, 16, 64), (64, 16, 16)]
)
def test_int8_blocks_reproduce_matmul_nbits_accuracy_level_4(
    zero_points: bool, k: int, n: int, block: int
) -> None:
    """ORT's MatMulNBits at accuracy_level 4 (int8 activations, B an initializer: MLAS packs it)
    equals the float product of `round_to_int8_blocks` activations to float summation order, and
    differs from the float product of the raw activations by ~1e-2 (the negative oracle)."""
    k_blocks = -(-k // block)
    inits = {
        "b": RNG.integers(0, 256, size=(n, k_blocks, block // 2), dtype=np.uint8),
        "s": (RNG.random(n * k_blocks).astype(np.float32) + 0.05) * 0.1,
    }
    if zero_points:
        inits["zp"] = RNG.integers(0, 256, size=(n * -(-k_blocks // 2),), dtype=np.uint8)
    a = _randn(2, 3, k) * 2
    a[0, 0, :block] = 0  # an all-zero block: scale 0, no division by zero
    names = ["a", *inits]
    attrs: dict[str, Any] = {"K": k, "N": n, "bits": 4, "block_size": block}
    nodes = [ms_node("MatMulNBits", names, [f"r{lv}"], accuracy_level=lv, **attrs) for lv in (4, 0)]
    int8, float32 = run_nodes(nodes, {"a": a}, ["r4", "r0"], initializers=inits)
    w = eo.dequantize_nbits(inits["b"], inits["s"], inits.get("zp"), K=k, N=n, block_size=block)
    rounded = eo.round_to_int8_blocks(a, block_size=block)
    assert rel_err(rounded @ w.T, int8) < 1e-6
    assert rel_err(a @ w.T, int8) > 1e-3 and rel_err(a @ w.T, float32) < 1e-6


def test_int8_blocks_are_int8_steps_of_each_blocks_amax() -> None:
    a = _randn(4, 70).astype(np.float16)
    got = eo.round_to_int8_blocks(a, block_size=32)
    assert got.dtype == np.float16 and got.shape == a.shape
    x = a.astype(np.float32)
    for lo in (0, 32, 64):  # the last block holds 6 values
        blk = x[:, lo : lo + 32]
        amax = np.abs(blk).max(axis=1, keepdims=True)
        scale = amax / np.float32(127)
        q = np.rint(blk * (np.float32(127) / amax))
        assert np.abs(q).max() <= 127
        np.testing.assert_array_equal(got[:, lo : lo + 32], (q * scale).astype(np.float16))


# --- GatherBlockQuantized ----------------------------------------------------------------------


def _gbq_case(
    vocab: int, middle: tuple[int, ...], hidden: int, block: int, zero_points: bool, dtype: Any
) -> dict[str, np.ndarray]:
    k_blocks = -(-hidden // block)
    feeds = {
        "data": RNG.integers(0, 256, size=(vocab, *middle, hidden // 2), dtype=np.uint8),
        "scales": ((RNG.random((vocab, *middle, k_blocks)) + 0.05) * 0.1).astype(dtype),
    }
    if zero_points:
        zp_cols = -(-k_blocks // 2)
        feeds["zp"] = RNG.integers(0, 256, size=(vocab, *middle, zp_cols), dtype=np.uint8)
    return feeds


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["f32", "f16"])
@pytest.mark.parametrize("zero_points", [False, True], ids=["zp8", "zp"])
@pytest.mark.parametrize(
    ("vocab", "middle", "hidden", "block", "id_shape"),
    [
        (512, (), 128, 32, (1, 4)),  # the genai-int4 embedding: [512, 64] bytes, 4 blocks a row
        (37, (), 200, 32, (2, 5)),  # a partial last block; 13 blocks: odd zero-point packing
        (20, (), 90, 16, (7,)),  # 45 bytes a row: no alignment to lean on
        (9, (3,), 64, 16, (2, 2)),  # rank-3 data: each gathered id is 3 rows of blocks
        (64, (), 256, 128, (3,)),
    ],
)
def test_gather_block_quantized_matches_ort(
    dtype: Any,
    zero_points: bool,
    vocab: int,
    middle: tuple[int, ...],
    hidden: int,
    block: int,
    id_shape: tuple[int, ...],
) -> None:
    feeds = _gbq_case(vocab, middle, hidden, block, zero_points, dtype)
    ids = RNG.integers(0, vocab, size=id_shape).astype(np.int64)
    ids.reshape(-1)[0] = vocab - 1
    ids.reshape(-1)[-1] = -1  # counts from the end, as in ONNX Gather
    feeds["ids"] = ids
    feeds["ids32"] = ids.astype(np.int32)
    names = ["data", "ids", "scales", *(["zp"] if zero_points else [])]
    attrs: dict[str, Any] = {"bits": 4, "block_size": block, "gather_axis": 0,
                             "quantize_axis": len(middle) + 1}  # fmt: skip
    nodes = [
        ms_node("GatherBlockQuantized", names, ["ref"], **attrs),
        ms_node("GatherBlockQuantized", ["data", "ids32", *names[2:]], ["ref32"], **attrs),
    ]
    ref, ref32 = run_nodes(nodes, feeds, ["ref", "ref32"])
    ours = eo.gather_block_quantized(
        feeds["data"], ids, feeds["scales"], feeds.get("zp"), bits=4, block_size=block,
        quantize_axis=attrs["quantize_axis"],
    )  # fmt: skip
    assert ours.shape == ref.shape == (*id_shape, *middle, hidden)
    assert ours.dtype == ref.dtype == np.dtype(dtype)
    # (q - zero) * scale in float32, rounded once to the scales' dtype: bit for bit
    np.testing.assert_array_equal(ours.view(np.uint8), ref.view(np.uint8))
    np.testing.assert_array_equal(ref32.view(np.uint8), ref.view(np.uint8))


def test_gather_block_quantized_out_of_range_ids_give_zero_rows_as_in_ort() -> None:
    feeds = _gbq_case(16, (), 64, 32, True, np.float32)
    feeds["ids"] = np.array([3, 16, -17, 15, -16, 2**40], dtype=np.int64)
    names = ["data", "ids", "scales", "zp"]
    attrs: dict[str, Any] = {"bits": 4, "block_size": 32, "gather_axis": 0, "quantize_axis": 1}
    (ref,) = run_nodes([ms_node("GatherBlockQuantized", names, ["ref"], **attrs)], feeds, ["ref"])
    ours = eo.gather_block_quantized(*(feeds[n] for n in names), bits=4, block_size=32)
    np.testing.assert_array_equal(ours, ref)
    assert not ours[[1, 2, 5]].any() and ours[[0, 3, 4]].any(axis=1).all()


def test_gather_block_quantized_is_matmul_nbits_rows() -> None:
    """A tied 4-bit head: gathering rows of its B/scales/zero points gives the rows of the
    weight MatMulNBits multiplies with (the genai builder's embedding reads the head this way)."""
    n, k, block = 24, 96, 32
    w = _randn(n, k)
    b, scales, zp = eo.quantize_nbits(w, block_size=block, zero_point=True)
    assert zp is not None
    full = eo.dequantize_nbits(b, scales, zp, K=k, N=n, block_size=block)
    ids = np.array([[5, 0, 23]])
    rows = eo.gather_block_quantized(
        b.reshape(n, k // 2), ids, scales.reshape(n, -1), zp.reshape(n, -1), block_size=block
    )
    np.testing.assert_array_equal(rows[0], full[ids[0]])


@pytest.mark.parametrize("wrong", ["swapped_nibbles", "zero_point_0"])
def test_gather_block_quantized_comparison_detects_wrong_unpacking(wrong: str) -> None:
    """Negative oracles: the high nibble first, or a default zero point of 0, disagree with ORT."""
    feeds = _gbq_case(32, (), 64, 32, False, np.float32)
    feeds["ids"] = np.arange(8, dtype=np.int64)
    attrs: dict[str, Any] = {"bits": 4, "block_size": 32, "gather_axis": 0, "quantize_axis": 1}
    names = ["data", "ids", "scales"]
    (ref,) = run_nodes([ms_node("GatherBlockQuantized", names, ["ref"], **attrs)], feeds, ["ref"])
    data, zp = feeds["data"], None
    if wrong == "swapped_nibbles":
        data = ((data << 4) | (data >> 4)).astype(np.uint8)
    else:
        zp = np.zeros((32, 1), np.uint8)
    ours = eo.gather_block_quantized(data, feeds["ids"], feeds["scales"], zp, block_size=32)
    assert rel_err(ours, ref) > 1e-2


def test_gather_block_quantized_refuses_what_it_does_not_implement() -> None:
    from ep.errors import OpError

    data = np.zeros((4, 8), np.uint8)
    scales = np.ones((4, 1), np.float32)
    ids = np.zeros(1, np.int64)
    with pytest.raises(OpError, match="bits=8"):
        eo.gather_block_quantized(data, ids, scales, bits=8, block_size=16)
    with pytest.raises(OpError, match="quantize_axis=0"):
        eo.gather_block_quantized(data, ids, scales, block_size=16, quantize_axis=0)
    with pytest.raises(OpError, match=r"scales has shape \[4, 2\]"):
        eo.gather_block_quantized(data, ids, np.ones((4, 2), np.float32), block_size=16)


# --- GroupQueryAttention vs KVCommit + KVAttention --------------------------------------------


def _gqa_node(hq: int, hkv: int, **extra: int) -> object:
    return ms_node(
        "GroupQueryAttention",
        ["q", "k", "v", "past_k", "past_v", "seqlens_k", "total"]
        + (["cos", "sin"] if extra.get("do_rotary") else []),
        ["ref", "present_k", "present_v"],
        num_heads=hq,
        kv_num_heads=hkv,
        **extra,
    )


def _ours_nodes(hkv: int, dtype: str = "float32") -> list[object]:
    return [
        *eo.make_nodes(
            "KVCommit",
            ["k4", "v4", "pos", "geometry", "cache"],
            ["lengths"],
            name="commit",
            dtype=dtype,
            layer=0,
        ),
        *eo.make_nodes(
            "KVAttention",
            ["q4", "pos", "lengths", "geometry", "cache"],
            ["ours"],
            name="attend",
            dtype=dtype,
            layer=0,
            kv_heads=hkv,
        ),
    ]


class Caches:
    """Head-major K/V buffers bound in KV_CACHES for one test (released afterwards)."""

    def __init__(self, batch: int, hkv: int, cap: int, d: int, dtype: Any = np.float32):
        self.k = np.zeros((batch, hkv, cap, d), dtype)
        self.v = np.zeros_like(self.k)
        self.handle = KV_CACHES.bind([(self.k, self.v)])
        self.geometry = eo.kv_geometry(KVStrides(hkv * cap * d, d, cap * d, 1), cap)

    def feeds(self) -> dict[str, np.ndarray]:
        return {"geometry": self.geometry, "cache": np.array(self.handle, dtype=np.int64)}


@pytest.fixture
def caches():
    made: list[Caches] = []

    def make(batch: int, hkv: int, cap: int, d: int, dtype: Any = np.float32) -> Caches:
        made.append(Caches(batch, hkv, cap, d, dtype=dtype))
        return made[-1]

    yield make
    for c in made:
        KV_CACHES.release(c.handle)


def _step(q, k, v):  # [B,S,H,D] → GQA's [B,S,H*D]
    b, s = q.shape[:2]
    return {"q": q.reshape(b, s, -1), "k": k.reshape(b, s, -1), "v": v.reshape(b, s, -1)}


@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 2), (6, 2), (8, 1)])
def test_kv_commit_attention_match_gqa_prefill_then_decode(caches, hq: int, hkv: int) -> None:
    batch, prompt, d, cap = 2, 6, 16, 16
    ours_cache = caches(batch, hkv, cap, d)
    past_k = np.zeros((batch, hkv, cap, d), np.float32)
    past_v = np.zeros_like(past_k)
    from opsutil import model, session

    ours_sess: Any = None
    ref_sess: Any = None
    for step, s in enumerate([prompt, 1, 1, 1]):
        start = 0 if step == 0 else prompt + step - 1
        q, k, v = _randn(batch, s, hq, d), _randn(batch, s, hkv, d), _randn(batch, s, hkv, d)
        pos = np.broadcast_to(np.arange(start, start + s, dtype=np.int64), (batch, s)).copy()
        ref_feeds = {
            **_step(q, k, v),
            "past_k": past_k,
            "past_v": past_v,
            "seqlens_k": np.full(batch, start + s - 1, np.int32),
            "total": np.array(start + s, np.int32),
        }
        our_feeds = {"q4": q, "k4": k, "v4": v, "pos": pos, **ours_cache.feeds()}
        if ours_sess is None:
            ours_sess = session(model(_ours_nodes(hkv), our_feeds, ["ours", "lengths"]))
            ref_sess = session(
                model([_gqa_node(hq, hkv)], ref_feeds, ["ref", "present_k", "present_v"])
            )
        ours, lengths = eo.run(ours_sess, ["ours", "lengths"], our_feeds)
        ref, past_k, past_v = ref_sess.run(None, ref_feeds)
        assert lengths.tolist() == [start + s] * batch
        assert rel_err(ours.reshape(ref.shape), ref) < 1e-5, f"step {step}"
        np.testing.assert_array_equal(ours_cache.k, past_k)
        np.testing.assert_array_equal(ours_cache.v, past_v)


def test_kv_ops_left_padded_batch_match_solo_gqa(caches) -> None:
    """A left-padded batch (rows of 5, 3 and 1 tokens) equals each row run alone by GQA."""
    hq, hkv, d, cap, width = 4, 2, 8, 12, 5
    lens = [5, 3, 1]
    batch = len(lens)
    ours_cache = caches(batch, hkv, cap, d)
    q, k, v = (
        _randn(batch, width, hq, d),
        _randn(batch, width, hkv, d),
        _randn(batch, width, hkv, d),
    )
    pos = np.array([[-1] * (width - n) + list(range(n)) for n in lens], dtype=np.int64)
    from opsutil import model, session

    feeds = {"q4": q, "k4": k, "v4": v, "pos": pos, **ours_cache.feeds()}
    sess = session(model(_ours_nodes(hkv), feeds, ["ours", "lengths"]))
    ours, lengths = eo.run(sess, ["ours", "lengths"], feeds)
    assert lengths.tolist() == lens
    gqa: Any = None
    ref_caches = []
    for row, n in enumerate(lens):
        sl = slice(width - n, width)
        ref_feeds = {
            **_step(q[row : row + 1, sl], k[row : row + 1, sl], v[row : row + 1, sl]),
            "past_k": np.zeros((1, hkv, cap, d), np.float32),
            "past_v": np.zeros((1, hkv, cap, d), np.float32),
            "seqlens_k": np.array([n - 1], np.int32),
            "total": np.array(n, np.int32),
        }
        if gqa is None:
            gqa = session(model([_gqa_node(hq, hkv)], ref_feeds, ["ref", "present_k", "present_v"]))
        ref, pk, pv = gqa.run(None, ref_feeds)
        assert rel_err(ours[row, sl].reshape(ref.shape), ref) < 1e-5
        assert not ours[row, : width - n].any(), "padding rows must come back as zeros"
        np.testing.assert_array_equal(ours_cache.k[row], pk[0])
        np.testing.assert_array_equal(ours_cache.v[row], pv[0])
        ref_caches.append((pk, pv))
    # One decode step for the whole batch: every row at its own position.
    q1, k1, v1 = _randn(batch, 1, hq, d), _randn(batch, 1, hkv, d), _randn(batch, 1, hkv, d)
    pos1 = np.array([[n] for n in lens], dtype=np.int64)
    feeds1 = {"q4": q1, "k4": k1, "v4": v1, "pos": pos1, **ours_cache.feeds()}
    ours1, _ = eo.run(sess, ["ours", "lengths"], feeds1)
    ref_feeds = {
        **_step(q1, k1, v1),
        "past_k": np.concatenate([c[0] for c in ref_caches]),
        "past_v": np.concatenate([c[1] for c in ref_caches]),
        "seqlens_k": np.array(lens, np.int32),
        "total": np.array(max(lens) + 1, np.int32),
    }
    ref1, _, _ = gqa.run(None, ref_feeds)
    assert rel_err(ours1.reshape(ref1.shape), ref1) < 1e-5


def test_rotary_then_kv_ops_match_gqa_with_fused_rotary(caches) -> None:
    """Rotary + KVCommit + KVAttention equals GQA's do_rotary=1 (the genai builder's form)."""
    hq, hkv, d, cap, prompt = 4, 2, 16, 16, 5
    cos, sin = eo.rope_cache(500000.0, d, cap)
    ours_cache = caches(1, hkv, cap, d)
    q, k, v = _randn(1, prompt, hq, d), _randn(1, prompt, hkv, d), _randn(1, prompt, hkv, d)
    pos = np.arange(prompt, dtype=np.int64)[None]
    nodes = [
        *eo.make_nodes("Rotary", ["q4", "pos", "cos", "sin"], ["q_rot"], name="rq"),
        *eo.make_nodes("Rotary", ["k4", "pos", "cos", "sin"], ["k_rot"], name="rk"),
        *eo.make_nodes(
            "KVCommit",
            ["k_rot", "v4", "pos", "geometry", "cache"],
            ["lengths"],
            name="commit",
            layer=0,
        ),
        *eo.make_nodes(
            "KVAttention",
            ["q_rot", "pos", "lengths", "geometry", "cache"],
            ["ours"],
            name="attend",
            layer=0,
            kv_heads=hkv,
        ),
    ]
    feeds = {"q4": q, "k4": k, "v4": v, "pos": pos, "cos": cos, "sin": sin, **ours_cache.feeds()}
    (ours,) = run_nodes(nodes, feeds, ["ours"])
    ref_feeds = {
        **_step(q, k, v),
        "past_k": np.zeros((1, hkv, cap, d), np.float32),
        "past_v": np.zeros((1, hkv, cap, d), np.float32),
        "seqlens_k": np.array([prompt - 1], np.int32),
        "total": np.array(prompt, np.int32),
        "cos": cos,
        "sin": sin,
    }
    ref, present_k, _ = run_nodes(
        [_gqa_node(hq, hkv, do_rotary=1)], ref_feeds, ["ref", "present_k", "present_v"]
    )
    assert rel_err(ours.reshape(ref.shape), ref) < 1e-5
    np.testing.assert_allclose(ours_cache.k, present_k, rtol=1e-6, atol=1e-6)


def test_kv_ops_float16_through_bitcast_match_gqa(caches) -> None:
    hq, hkv, d, cap, prompt = 4, 2, 16, 8, 4
    ours_cache = caches(1, hkv, cap, d, dtype=np.float16)
    q, k, v = (_randn(1, prompt, h, d, dtype=np.float16) for h in (hq, hkv, hkv))
    pos = np.arange(prompt, dtype=np.int64)[None]
    feeds = {"q4": q, "k4": k, "v4": v, "pos": pos, **ours_cache.feeds()}
    (ours,) = run_nodes(_ours_nodes(hkv, "float16"), feeds, ["ours"])
    assert ours.dtype == np.float16
    ref_feeds = {
        **_step(q, k, v),
        "past_k": np.zeros((1, hkv, cap, d), np.float16),
        "past_v": np.zeros((1, hkv, cap, d), np.float16),
        "seqlens_k": np.array([prompt - 1], np.int32),
        "total": np.array(prompt, np.int32),
    }
    ref, present_k, _ = run_nodes(
        [_gqa_node(hq, hkv)], ref_feeds, ["ref", "present_k", "present_v"]
    )
    assert rel_err(ours.reshape(ref.shape), ref) < 2e-3
    np.testing.assert_array_equal(ours_cache.k, present_k)


def test_gqa_comparison_detects_a_missing_causal_mask(caches) -> None:
    """Negative oracle: attending to future slots (positions all set to the last) disagrees."""
    hq, hkv, d, cap, prompt = 2, 1, 8, 8, 4
    ours_cache = caches(1, hkv, cap, d)
    q, k, v = _randn(1, prompt, hq, d), _randn(1, prompt, hkv, d), _randn(1, prompt, hkv, d)
    # Commit at the true positions, then attend as if every query sat at the last position.
    pos = np.arange(prompt, dtype=np.int64)[None]
    lengths = eo.kv_commit_into(
        ours_cache.k.reshape(-1), ours_cache.v.reshape(-1), k, v, pos, ours_cache.geometry
    )
    wrong = eo.kv_attention_from(
        ours_cache.k.reshape(-1),
        ours_cache.v.reshape(-1),
        q,
        np.full_like(pos, prompt - 1),
        lengths,
        ours_cache.geometry,
        kv_heads=hkv,
        scale=0.0,
    )
    ref_feeds = {
        **_step(q, k, v),
        "past_k": np.zeros((1, hkv, cap, d), np.float32),
        "past_v": np.zeros((1, hkv, cap, d), np.float32),
        "seqlens_k": np.array([prompt - 1], np.int32),
        "total": np.array(prompt, np.int32),
    }
    ref, _, _ = run_nodes([_gqa_node(hq, hkv)], ref_feeds, ["ref", "present_k", "present_v"])
    assert rel_err(wrong.reshape(ref.shape), ref) > 1e-2
