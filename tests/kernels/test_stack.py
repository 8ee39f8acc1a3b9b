"""The persistent decoder-stack kernel (`ep.kernels.stack`): its weight layout, its NumPy
reference against the native executor, its compile for sm_90a (NVRTC, no GPU needed), and its
steps against the reference, bitwise stable over chunk sizes and replays: on the CPU device (the
NumPy twin: the host side of `StackStep`) and on an H200-class GPU (the kernel)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from _devices import cuda_or_skip

from ep.device import Device, get_device, kernel_target
from ep.device._kernels import compile_kernel
from ep.errors import KernelArgumentError
from ep.kernels.stack import (
    CW,
    PICK_MASK,
    SCORES,
    SHARED,
    StackIO,
    StackShape,
    StackStep,
    StackTuning,
    attention_splits,
    block_columns,
    default_chunk,
    max_positions,
    pack_stack,
    reference_step,
    shared_bytes,
    stack_kernel,
    unpack_stack,
)
from ep.ops.rotary import _inv_freq

BF16 = np.dtype(ml_dtypes.bfloat16)
QWEN = StackShape(896, 14, 2, 64, 4864, 24)
SMALL = StackShape(128, 2, 1, 64, 256, 2)
THETA = 1e6


def random_layers(shape: StackShape, rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    """Weights scaled like `ep_graphs.random_weights` (activations stay O(1))."""

    def mat(k: int, n: int) -> np.ndarray:
        return (rng.standard_normal((k, n), np.float32) / np.sqrt(k)).astype(BF16)

    def vec(n: int, base: float) -> np.ndarray:
        return (base + 0.1 * rng.standard_normal(n, np.float32)).astype(BF16)

    h = shape.hidden
    return [
        {
            "input_norm": vec(h, 1.0),
            "post_norm": vec(h, 1.0),
            "qkv_bias": vec(shape.qkv, 0.0),
            "qkv": mat(h, shape.qkv),
            "o": mat(shape.heads * shape.head_dim, h),
            "gate_up": mat(h, 2 * shape.inter),
            "down": mat(shape.inter, h),
        }
        for _ in range(shape.layers)
    ]


@pytest.mark.parametrize("shape", [QWEN, SMALL], ids=["qwen0.5b", "small"])
def test_every_column_has_one_block_and_pairs_stay_together(shape: StackShape) -> None:
    cols = block_columns(shape, 132)  # SMALL: fewer QKV units than blocks, some blocks idle
    for s, n in enumerate((shape.qkv, shape.hidden, 2 * shape.inter, shape.hidden)):
        every = np.concatenate([cols[b][s] for b in range(132)])
        assert np.array_equal(np.sort(every), np.arange(n)), s
    half = shape.head_dim // 2
    for b in range(132):
        qkv, gate_up = cols[b][0].reshape(-1, 2), cols[b][2].reshape(-1, 2)
        assert np.all(qkv[:, 1] == qkv[:, 0] + half) and np.all(qkv[:, 0] % shape.head_dim < half)
        assert np.all(gate_up[:, 1] == gate_up[:, 0] + shape.inter)


def test_a_block_stream_is_its_columns_in_use_order(rng: np.random.Generator) -> None:
    shape = StackShape(32, 2, 1, 8, 48, 2)  # the layout only: no kernel for head_dim 8
    layers = random_layers(shape, rng)
    bits, starts = pack_stack(shape, layers, 5)
    cols = block_columns(shape, 5)
    ends = [*starts[1:].tolist(), bits.nbytes]
    for b in range(5):
        want = [
            np.ascontiguousarray(layer[name][:, cols[b][s]].T).view(np.uint16).reshape(-1)
            for layer in layers
            for s, name in enumerate(("qkv", "o", "gate_up", "down"))
        ]
        got = bits.view(np.uint8)[int(starts[b]) : ends[b]].view(np.uint16)
        assert np.array_equal(got, np.concatenate(want))
    assert bits.nbytes == sum(w[n].nbytes for w in layers for n in ("qkv", "o", "gate_up", "down"))
    back = unpack_stack(shape, bits, starts, 5)
    for layer, again in zip(layers, back, strict=True):
        for name in ("qkv", "o", "gate_up", "down"):
            assert np.array_equal(again[name].view(np.uint16), layer[name].view(np.uint16))


@pytest.mark.parametrize(
    ("shape", "tuning"),
    [(QWEN, StackTuning()), (SMALL, StackTuning()), (QWEN, StackTuning(warps=11, min_cols=1))],
    ids=["qwen0.5b", "small", "qwen0.5b-w11-m1"],
)
def test_the_kernel_compiles_for_sm_90a(shape: StackShape, tuning: StackTuning) -> None:
    # NVRTC needs no GPU, so CI compiles the kernel the H200 runs. Its static shared memory and
    # the dynamic part must fit a block together, or no block launches (a 256-byte static array
    # once took the kernel 128 bytes over): the cubin's .nv.shared section holds the static
    # part and the 1 KB an SM keeps for itself per block (on the H200: 1536 + 231808 bytes
    # launched, 1792 + 231808 did not; 228 KB in all)
    compiled = compile_kernel(stack_kernel(shape, 132, tuning), "sm_90", use_cache=False)
    static = elf_section_size(compiled.cubin, ".nv.shared.ep_stack_bf16")
    dynamic = shared_bytes(shape, 132, tuning.resolved(shape))
    assert static > 1024 and static + dynamic <= SHARED + 1024


def elf_section_size(elf: bytes, name: str) -> int:
    """The size of section ``name`` of a 64-bit little-endian ELF file (a cubin)."""
    import struct

    (shoff,) = struct.unpack_from("<Q", elf, 0x28)
    entsize, count, names = struct.unpack_from("<HHH", elf, 0x3A)

    def header(i: int) -> tuple[int, ...]:
        return struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * entsize)

    strtab = header(names)[4]
    for i in range(count):
        h = header(i)
        end = elf.index(b"\0", strtab + h[0])
        if elf[strtab + h[0] : end].decode() == name:
            return int(h[5])
    raise AssertionError(f"no section {name} in the cubin")


def test_unsupported_shapes_and_sizes_are_refused_with_the_reason() -> None:
    with pytest.raises(KernelArgumentError, match="head_dim 128"):
        stack_kernel(StackShape(896, 7, 1, 128, 4864, 2), 132)
    with pytest.raises(KernelArgumentError, match="14 heads over 3 KV heads"):
        stack_kernel(StackShape(896, 14, 3, 64, 4864, 2), 132)
    with pytest.raises(KernelArgumentError, match="chunk 2048 B must hold a column pair"):
        stack_kernel(QWEN, 132, StackTuning(chunk=2048, min_cols=1))
    with pytest.raises(KernelArgumentError, match="split -1"):
        stack_kernel(QWEN, 132, StackTuning(split=-1))
    assert (attention_splits(QWEN, 132), attention_splits(SMALL, 132)) == (9, 16)  # 16 at most
    assert attention_splits(QWEN, 20) == 1  # too few blocks: never split
    with pytest.raises(KernelArgumentError, match="16 consumer warps"):
        stack_kernel(QWEN, 132, StackTuning(warps=16))
    with pytest.raises(KernelArgumentError, match="at least two chunks of 116736 B"):
        stack_kernel(QWEN, 132, StackTuning(min_cols=12))  # 12 columns of K = 4864
    assert default_chunk(QWEN) == CW * 2 * 896
    assert StackTuning(min_cols=4).resolved(QWEN).chunk_bytes(4864) == 4 * 2 * 4864
    with pytest.raises(KernelArgumentError, match=f"split {SCORES + 1} "):
        stack_kernel(QWEN, 132, StackTuning(split=SCORES + 1))  # an unsplit context past SCORES
    # the longest context: SCORES a block of a split attention, SCORES unsplit
    assert max_positions(QWEN, 132, StackTuning()) == 9 * SCORES
    assert (
        max_positions(QWEN, 132, StackTuning(split=0))
        == max_positions(QWEN, 20, StackTuning())
        == SCORES
    )
    cpu = get_device("cpu")  # (the H200's 132 blocks)
    head = cpu.alloc(1, BF16, stream=cpu.default_stream)
    for tuning, most in ((StackTuning(), 16 * SCORES), (StackTuning(split=0), SCORES)):
        with pytest.raises(
            KernelArgumentError, match=f"capacity {most + 1}; expected 1 to {most} "
        ):
            StackStep(cpu, SMALL, [], np.ones(128), np.ones(32), head, most + 1,
                      stream=cpu.default_stream, tuning=tuning)  # fmt: skip


def test_the_reference_step_is_the_native_executors_decoder(
    tmp_path: Path, load_tool, rng: np.random.Generator
) -> None:
    """`reference_step`, position by position, against the native executor's prefill of the
    same prompt on a tiny bf16 Qwen2 model: the kernel's oracle is the model the graph runs."""
    from ep.model import load_model
    from ep.native import NativeBackend
    from ep_builtin.kv_seq_major import SeqMajorLayout
    from ep_graphs import ModelSpec, build_model, random_weights

    spec = ModelSpec.parse(
        "hidden=128,layers=2,heads=2,kv_heads=1,head_dim=64,intermediate=256,vocab=512,"
        "tie=true,bias=true,theta=1000000,eps=1e-6,dtype=bf16,type=qwen2"
    )
    build_model(spec, random_weights(spec, 3), flavour="ep", out_dir=tmp_path)
    layers, final, embed = load_tool("bench_stack").model_weights(tmp_path, spec.num_layers)
    prompt = rng.integers(3, 512, 9)
    kc = list(np.zeros((2, 1, 16, 64), np.float32))
    vc = list(np.zeros((2, 1, 16, 64), np.float32))
    for t, tok in enumerate(prompt):
        y = reference_step(SMALL, layers, final, _inv_freq(THETA, 64), embed[tok], t, kc, vc)
    ref = y @ embed.astype(np.float32).T
    backend = NativeBackend(load_model(tmp_path), SeqMajorLayout(fixed_stride=True), device="cpu")
    native = np.asarray(backend.prefill([prompt]), np.float32)[0]
    assert np.abs(ref - native).max() <= 3e-2 * np.abs(native).max()
    assert int(native.argmax()) in np.argsort(-ref)[:3]


# --- steps: the NumPy twin on the CPU device, the kernel on the GPU ---------------------------


def stack_device(kind: str) -> Device:
    """The CPU device (the kernel's NumPy twin) or a GPU with sm_90a (a skip on another)."""
    if kind == "cpu":
        return get_device("cpu")
    dev = cuda_or_skip()
    if kernel_target(stack_kernel(SMALL, 132), dev.arch) is None:
        pytest.skip(
            f"the stack kernel needs sm_90a (bulk copies, mbarriers); this GPU is {dev.arch}"
        )
    return dev


def seq_major_io(dev: Device, step: StackStep, capacity: int) -> StackIO:
    """A `StackIO` over per-layer K and V buffers in the seq_major layout ([capacity][kv
    head][head_dim], as the native executor's cache at batch 1), zeroed."""
    from ep.kernels.stack import kv_addresses

    s, shape = dev.default_stream, step.shape
    n = capacity * shape.kv_heads * shape.head_dim
    keys = [dev.alloc(n, BF16, stream=s) for _ in range(shape.layers)]
    values = [dev.alloc(n, BF16, stream=s) for _ in range(shape.layers)]
    for b in (*keys, *values):
        dev.fill(b, 0, stream=s)
    step.seq_major_buffers = (keys, values)  # kept alive with the step
    return StackIO(
        ids=dev.alloc(1, np.int64, stream=s), pos=dev.alloc(1, np.int64, stream=s),
        logits=dev.alloc(step.vocab, np.float32, stream=s),
        kv=dev.to_device(kv_addresses(keys, values), stream=s),
        token_stride=shape.kv_heads * shape.head_dim, head_stride=shape.head_dim,
        capacity=capacity,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "shape"),
    [
        ("cpu", SMALL),
        pytest.param("cuda", SMALL, marks=pytest.mark.cuda),
        pytest.param("cuda", StackShape(896, 14, 2, 64, 4864, 2), marks=pytest.mark.cuda),
    ],
    ids=["cpu-small", "cuda-small", "cuda-qwen-width"],
)
def test_steps_match_the_reference_and_are_bitwise_stable(
    kind: str, shape: StackShape, rng: np.random.Generator
) -> None:
    dev = stack_device(kind)
    s = dev.default_stream
    layers = random_layers(shape, rng)
    final = (1 + 0.1 * rng.standard_normal(shape.hidden, np.float32)).astype(BF16)
    table = (rng.standard_normal((1000, shape.hidden), np.float32)).astype(BF16)
    head = dev.to_device(table, stream=s)
    inv_freq = _inv_freq(THETA, 64)
    # the GPU's attention reads 256 K rows and 128 V rows ahead, then groups of 32 a warp: past
    # both there (the CPU twin is the reference itself: a few positions)
    cap = 40 if kind == "cpu" else 300
    # chunk sizes and how blocks poll change no bit; another warp count splits long columns'
    # sums otherwise; attention split over blocks from 17 positions (16 here), from 129 (the
    # default) or never (0): the same bits up to the split, another sum order past it
    tunings = (StackTuning(), StackTuning(chunk=2 * default_chunk(shape)),
               StackTuning(min_cols=1), StackTuning(warps=11), StackTuning(poll=-1),
               StackTuning(poll=50), StackTuning(kv_l2=0), StackTuning(split=16),
               StackTuning(split=0))  # fmt: skip
    differ: dict[int, list[int]] = {7: [], 8: []}  # positions where a split tuning's bits differ
    steps = [
        StackStep(dev, shape, layers, final, inv_freq, head, cap, stream=s, tuning=tuning)
        for tuning in tunings
    ]
    # the same step on the seq_major cache of the executor (other strides, per-layer buffers)
    runs = [(st, st.io) for st in steps] + [(steps[0], seq_major_io(dev, steps[0], cap))]
    kc = list(np.zeros((shape.layers, shape.kv_heads, cap, 64), np.float32))
    vc = list(np.zeros((shape.layers, shape.kv_heads, cap, 64), np.float32))
    ref_layers = [{k: np.asarray(v, np.float32) for k, v in w.items()} for w in layers]
    for t in range(cap):  # every position of the cache: attention over 1 .. cap tokens
        token = int(rng.integers(0, len(table)))
        logits = []
        for st, io in runs:
            io.ids.copy_from_host(np.array([token]), stream=s)
            io.pos.copy_from_host(np.array([t]), stream=s)
            dev.fill(io.logits, float("nan"), stream=s)
            st.launch(stream=s, io=io)
            logits.append(io.logits.to_host(stream=s).copy())
        for i in (1, 2, 4, 5, 6):
            assert np.array_equal(logits[0], logits[i]), f"tuning {i} disagrees at position {t}"
        assert np.array_equal(logits[0], logits[9]), f"the two KV layouts disagree at {t}"
        for i in (7, 8):
            if not np.array_equal(logits[0], logits[i]):
                differ[i].append(t)
        x = table[token].astype(np.float32)
        want = reference_step(shape, ref_layers, final, inv_freq, x, t, kc, vc)
        for st in (steps[3], steps[7], steps[8], steps[0]):  # 11 warps, split at 16, never
            got = st.y.to_host(stream=s).astype(np.float32)
            assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max(), t
        head_ref = got @ table.astype(np.float32).T
        assert np.array_equal(logits[0], logits[0].astype(BF16).astype(np.float32))  # bf16 values
        assert np.abs(logits[0] - head_ref).max() <= 1e-2 * np.abs(head_ref).max(), t
    assert int(steps[0].status.to_host(stream=s)[0]) == 0
    if kind == "cuda":  # the bits differ only past a split, and do there (the CPU twin: never)
        first = {7: 16, 8: StackTuning().split}  # contexts up to these are not split
        for i, positions in differ.items():
            assert positions and min(positions) + 1 > first[i], (i, positions[:5])

    # a captured launch replays to the eager launch's bits (epochs differ, the step does not)
    st = steps[0]
    with dev.capture(stream=s) as cap_:
        st.launch(stream=s)
    eager = st.io.logits.to_host(stream=s).copy()
    for _ in range(3):
        dev.fill(st.io.logits, float("nan"), stream=s)
        cap_.graph.launch(stream=s)
        assert np.array_equal(st.io.logits.to_host(stream=s), eager)
    cap_.graph.close()

    # a position outside the cache: nothing runs, the fault bit says why; a bad id: zeros
    st.io.pos.copy_from_host(np.array([cap]), stream=s)
    dev.fill(st.io.logits, 7.0, stream=s)
    st.launch(stream=s)
    assert np.all(st.io.logits.to_host(stream=s) == 7.0)
    assert int(st.status.to_host(stream=s)[0]) == 4  # KernelFault.KV_POSITION
    dev.fill(st.status, 0, stream=s)
    st.io.pos.copy_from_host(np.array([0]), stream=s)
    st.io.ids.copy_from_host(np.array([len(table)]), stream=s)
    st.launch(stream=s)
    assert int(st.status.to_host(stream=s)[0]) == 1  # KernelFault.TOKEN_ID
    assert np.isfinite(st.io.logits.to_host(stream=s)).all()


@pytest.mark.parametrize(
    "kind", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)], ids=["cpu", "cuda"]
)
def test_contexts_past_one_blocks_scores_split_their_attention(
    kind: str, rng: np.random.Generator
) -> None:
    """A context longer than the SCORES one block holds: each of a head's 16 blocks (SMALL's
    2 heads on 132 SMs) takes a share of it; the steps match the reference over a cache of
    random keys and values (as if earlier steps had written them)."""
    dev = stack_device(kind)
    s = dev.default_stream
    shape = SMALL
    cap = 3 * SCORES + 5
    layers = random_layers(shape, rng)
    final = (1 + 0.1 * rng.standard_normal(shape.hidden, np.float32)).astype(BF16)
    table = rng.standard_normal((300, shape.hidden), np.float32).astype(BF16)
    inv_freq = _inv_freq(THETA, 64)
    st = StackStep(dev, shape, layers, final, inv_freq, dev.to_device(table, stream=s), cap,
                   stream=s)  # fmt: skip
    assert st.io is not None and st.positions == 16 * SCORES
    keys, values = rng.standard_normal((2, shape.layers, shape.kv_heads, cap, 64)).astype(BF16)
    st.kc.copy_from_host(keys.reshape(-1), stream=s)
    st.vc.copy_from_host(values.reshape(-1), stream=s)
    kc, vc = list(keys.astype(np.float32)), list(values.astype(np.float32))
    ref_layers = [{k: np.asarray(v, np.float32) for k, v in w.items()} for w in layers]
    for t in (SCORES - 1, SCORES, 2 * SCORES + 7, cap - 1):
        token = int(rng.integers(0, len(table)))
        st.io.ids.copy_from_host(np.array([token]), stream=s)
        st.io.pos.copy_from_host(np.array([t]), stream=s)
        st.launch(stream=s)
        want = reference_step(shape, ref_layers, final, inv_freq, table[token].astype(np.float32),
                              t, kc, vc)  # fmt: skip
        got = st.y.to_host(stream=s).astype(np.float32)
        assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max(), t
    assert int(st.status.to_host(stream=s)[0]) == 0


@pytest.mark.parametrize(
    "kind", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)], ids=["cpu", "cuda"]
)
def test_a_picking_launch_takes_the_greedy_pick(kind: str, rng: np.random.Generator) -> None:
    """A device-loop step in one launch: while ``picking`` holds 1 + m, the argmax of its
    logits with the m ids after the flag masked (every logit twice, at 2i and 2i + 1, often in
    two blocks: the lower index wins, as np.argmax's; masked, the other one) becomes the next id
    and tokens[position + 1], the position moves on; eager and captured alike, and the same
    captured launch does nothing of it while ``picking`` holds 0."""
    import dataclasses

    dev = stack_device(kind)
    s = dev.default_stream
    shape = SMALL
    layers = random_layers(shape, rng)
    final = (1 + 0.1 * rng.standard_normal(shape.hidden, np.float32)).astype(BF16)
    table = np.repeat(rng.standard_normal((500, shape.hidden), np.float32).astype(BF16), 2, 0)
    head = dev.to_device(table, stream=s)
    st = StackStep(dev, shape, layers, final, _inv_freq(THETA, 64), head, 16, stream=s)
    assert st.io is not None
    tokens = dev.alloc(st.positions + 1, np.int64, stream=s)
    picking = dev.alloc(1 + PICK_MASK, np.int64, stream=s)
    dev.fill(tokens, -1, stream=s)
    dev.fill(picking, 0, stream=s)
    io = dataclasses.replace(st.io, tokens=tokens, picking=picking)
    st.check_io(io)
    io.ids.copy_from_host(np.array([3]), stream=s)

    def step(t: int, mask: list[int], launch: Callable[[], None]) -> int:
        """Position t with ``mask``: the pick checked against np.argmax of the logits."""
        io.pos.copy_from_host(np.array([t]), stream=s)
        flag = np.array([1 + len(mask), *mask])
        picking.view(shape=flag.size).copy_from_host(flag, stream=s)
        launch()
        logits = io.logits.to_host(stream=s)
        assert all(logits[m] == -np.inf for m in mask if 0 <= m < logits.size)  # as mask_ids
        token = int(np.argmax(logits))
        assert (token ^ 1) in mask or logits[token] == logits[token ^ 1]  # a row and its twin
        assert token % 2 == (1 if token - 1 in mask else 0)  # the lower of the two unless masked
        assert int(tokens.to_host(stream=s)[t + 1]) == token
        assert int(io.ids.to_host(stream=s)[0]) == token
        assert int(io.pos.to_host(stream=s)[0]) == t + 1
        return token

    eager = lambda: st.launch(stream=s, io=io)  # noqa: E731
    first = step(0, [], eager)
    assert step(0, [first], eager) == first + 1  # the best masked: its twin, one higher
    assert step(0, [first, first + 1], eager) not in (first, first + 1)
    with dev.capture(stream=s) as captured:  # records the launch, runs nothing
        st.launch(stream=s, io=io)
    replay = lambda: captured.graph.launch(stream=s)  # noqa: E731
    for t in (1, 2):
        best = step(t, [], replay)
        assert step(t, [best, 1000, -5], replay) == best + 1  # ids outside the table: no effect
    picking.view(shape=1).copy_from_host(np.array([0]), stream=s)
    io.pos.copy_from_host(np.array([5]), stream=s)
    captured.graph.launch(stream=s)  # position 5, nothing picked
    assert int(io.pos.to_host(stream=s)[0]) == 5
    assert int(tokens.to_host(stream=s)[6]) == -1
    assert np.isfinite(io.logits.to_host(stream=s)).all()  # and nothing masked
    assert int(st.status.to_host(stream=s)[0]) == 0
    captured.graph.close()
    with pytest.raises(KernelArgumentError, match="a pick needs both tokens and picking"):
        st.check_io(dataclasses.replace(st.io, tokens=tokens))
    with pytest.raises(KernelArgumentError, match=f"expected int64 \\[{st.positions + 1}\\]"):
        st.check_io(dataclasses.replace(io, tokens=dev.alloc(st.positions, np.int64, stream=s)))
