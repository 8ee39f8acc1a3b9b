"""The persistent decoder-stack kernel (`ep.kernels.stack`): its weight layout, its NumPy
reference against the native executor, its compile for sm_90a (NVRTC, no GPU needed), and its
steps against the reference, bitwise stable over chunk sizes and replays: on the CPU device (the
NumPy twin: the host side of `StackStep`) and on an H200-class GPU (the kernel)."""

from __future__ import annotations

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
    SCORES,
    StackShape,
    StackStep,
    block_columns,
    default_chunk,
    pack_stack,
    reference_step,
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


@pytest.mark.parametrize("shape", [QWEN, SMALL], ids=["qwen0.5b", "small"])
def test_the_kernel_compiles_for_sm_90a(shape: StackShape) -> None:
    # NVRTC needs no GPU, so CI compiles the kernel the H200 runs
    compiled = compile_kernel(stack_kernel(shape, 132), "sm_90", use_cache=False)
    assert compiled.cubin


def test_unsupported_shapes_and_sizes_are_refused_with_the_reason() -> None:
    with pytest.raises(KernelArgumentError, match="head_dim 128"):
        stack_kernel(StackShape(896, 7, 1, 128, 4864, 2), 132)
    with pytest.raises(KernelArgumentError, match="14 heads over 3 KV heads"):
        stack_kernel(StackShape(896, 14, 3, 64, 4864, 2), 132)
    with pytest.raises(KernelArgumentError, match="chunk 4096 B must hold"):
        stack_kernel(QWEN, 132, chunk=4096)
    assert default_chunk(QWEN) == CW * 2 * 896
    head = get_device("cpu").alloc(1, BF16, stream=get_device("cpu").default_stream)
    with pytest.raises(KernelArgumentError, match=f"capacity {SCORES + 1}; expected 1 to"):
        StackStep(get_device("cpu"), SMALL, [], np.ones(128), np.ones(32), head, SCORES + 1,
                  stream=get_device("cpu").default_stream)  # fmt: skip


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
    kc = np.zeros((2, 1, 16, 64), np.float32)
    vc = np.zeros_like(kc)
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
    cap = 40
    steps = [
        StackStep(dev, shape, layers, final, inv_freq, head, cap, stream=s, chunk=chunk)
        for chunk in (None, 2 * default_chunk(shape))
    ]
    kc = np.zeros((shape.layers, shape.kv_heads, cap, 64), np.float32)
    vc = np.zeros_like(kc)
    ref_layers = [{k: np.asarray(v, np.float32) for k, v in w.items()} for w in layers]
    for t in range(cap):  # every position of the cache: attention over 1 .. 40 tokens
        x = rng.standard_normal(shape.hidden, np.float32).astype(BF16)
        logits = []
        for st in steps:
            dev.upload(st.x, x, stream=s)
            st.pos.copy_from_host(np.array([t], np.int32), stream=s)
            dev.fill(st.logits, float("nan"), stream=s)
            st.launch(stream=s)
            logits.append(st.logits.to_host(stream=s).view(np.uint16))
        assert np.array_equal(logits[0], logits[1]), f"chunk sizes disagree at position {t}"
        want = reference_step(shape, ref_layers, final, inv_freq, x.astype(np.float32), t, kc, vc)
        got = steps[0].y.to_host(stream=s).astype(np.float32)
        assert np.abs(got - want).max() <= 2e-2 * np.abs(want).max(), t
        head_ref = got @ table.astype(np.float32).T
        got_logits = logits[0].view(BF16).astype(np.float32)
        assert np.abs(got_logits - head_ref).max() <= 1e-2 * np.abs(head_ref).max(), t

    # a captured launch replays to the eager launch's bits (epochs differ, the step does not)
    st = steps[0]
    with dev.capture(stream=s) as cap_:
        st.launch(stream=s)
    eager = st.logits.to_host(stream=s).view(np.uint16).copy()
    for _ in range(3):
        dev.fill(st.logits, float("nan"), stream=s)
        cap_.graph.launch(stream=s)
        assert np.array_equal(st.logits.to_host(stream=s).view(np.uint16), eager)
    cap_.graph.close()
