"""Sampling kernels: greedy argmax and seeded temperature/top-k/top-p/min-p sampling with the
reference's own random numbers; ids must equal `ep.ops.sample.sample`'s."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from ep.device import Buffer, Device
from ep.errors import KernelArgumentError, KernelFaultError
from ep.kernels import KernelFault, check_faults, new_status, sample
from ep.ops import sample as ref
from ep.sampling import SamplingParams
from ep.sampling import sample as sample_reference

BF16 = np.dtype(ml_dtypes.bfloat16)
SETTINGS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=50),
    dict(temperature=0.8, top_p=0.9),
    dict(temperature=1.3, min_p=0.05),
    dict(temperature=0.6, top_k=40, top_p=0.95, min_p=0.02),
    dict(temperature=2.0, top_k=1),
    dict(temperature=1.0, top_p=0.3),
]


def upload(device: Device, array: np.ndarray) -> Buffer:
    return device.to_device(np.ascontiguousarray(array), stream=device.default_stream)


def poisoned_ids(device: Device, batch: int) -> Buffer:
    buf = device.alloc(batch, np.int64, stream=device.default_stream)
    device.fill(buf, -7, stream=device.default_stream)
    return buf


def logits_like_a_model(rng: np.random.Generator, batch: int, vocab: int) -> np.ndarray:
    """Peaked rows (a few tokens far above the rest) with ties and ±0, as float32."""
    x = rng.standard_normal((batch, vocab)).astype(np.float32) * 2
    for b in range(batch):
        hot = rng.choice(vocab, 5, replace=False)
        x[b, hot] += rng.uniform(4, 9, 5).astype(np.float32)
    x[0, 3] = x[0, 10] = x[0].max() + 1  # a tie at the top: the lower index wins greedy
    x[1, :4] = [0.0, -0.0, 0.0, -0.0]
    return x


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16, np.dtype(np.float16)], ids=str)
@pytest.mark.parametrize("vocab", [32003, 151936])
def test_greedy_is_numpy_argmax(device: Device, dtype: np.dtype, vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    batch = 4
    values = logits_like_a_model(rng, batch, vocab).astype(dtype)
    values[2, 77] = values[2, 5] = np.nan  # NumPy's argmax picks the first NaN
    ids = poisoned_ids(device, batch)
    status = new_status(device, stream=device.default_stream)
    sample.sample(
        device,
        ids,
        upload(device, values),
        None,
        None,
        batch=batch,
        vocab=vocab,
        temperature=0.0,
        status=status,
        stream=device.default_stream,
    )
    want = np.argmax(values.astype(np.float32), axis=-1)
    np.testing.assert_array_equal(ids.to_host(stream=device.default_stream), want)
    assert want[0] == 3 and want[2] == 5


def test_argmax_of_strided_rows(device: Device) -> None:
    """Logits of the last token of each row: rows ``seq * vocab`` apart in [B, S, V]."""
    rng = np.random.default_rng(3)
    batch, seq, vocab = 3, 4, 1001
    all_logits = rng.standard_normal((batch, seq, vocab)).astype(np.float32)
    last = upload(device, all_logits).view(np.float32, offset=(seq - 1) * vocab * 4)
    ids = poisoned_ids(device, batch)
    sample.argmax(
        device,
        ids,
        last,
        batch=batch,
        vocab=vocab,
        row_stride=seq * vocab,
        stream=device.default_stream,
    )
    want = np.argmax(all_logits[:, -1], axis=-1)
    np.testing.assert_array_equal(ids.to_host(stream=device.default_stream), want)


@pytest.mark.parametrize("dtype", [np.dtype(np.float32), BF16], ids=str)
def test_argmax_over_many_blocks_of_a_row(device: Device, dtype: np.dtype) -> None:
    """A row split over blocks (`ARGMAX_SPAN` entries each) meets in the scratch: the top value
    in a late block, ties between blocks (the lower index wins), NaNs in two blocks (the first),
    and a row whose last, short block holds the top."""
    span = sample.ARGMAX_SPAN
    batch, vocab = 5, 9 * span + 17
    rng = np.random.default_rng(11)
    values = rng.standard_normal((batch, vocab)).astype(np.float32)
    values[0, 7 * span + 3] = 50.0
    values[1, [2 * span + 1, 6 * span + 9, 2 * span + 5]] = 40.0
    values[2, [8 * span, 3 * span + 2]] = np.nan
    values[3, vocab - 1] = 30.0
    values[4, :] = -np.inf
    values = values.astype(dtype)
    scratch = sample.argmax_scratch(device, batch, stream=device.default_stream)
    ids = poisoned_ids(device, batch)
    for _ in range(2):  # the second call proves the first left the scratch zero
        sample.argmax(device, ids, upload(device, values), batch=batch, vocab=vocab,
                      scratch=scratch, stream=device.default_stream)  # fmt: skip
        got = ids.to_host(stream=device.default_stream)
        np.testing.assert_array_equal(got, [7 * span + 3, 2 * span + 1, 3 * span + 2, vocab - 1, 0])
        np.testing.assert_array_equal(got, np.argmax(values.astype(np.float32), axis=-1))
        assert not scratch.to_host(stream=device.default_stream).any()


def test_argmax_replays_in_a_graph_with_its_scratch(device: Device) -> None:
    """A captured argmax over a persistent scratch gives each replay's own argmax."""
    s = device.default_stream
    batch, vocab = 3, 151936
    logits = device.alloc((batch, vocab), np.float32, stream=s)
    ids = poisoned_ids(device, batch)
    scratch = sample.argmax_scratch(device, batch, stream=s)
    device.kernel(sample.ARGMAX_KERNELS["f32"].name).load()
    with device.capture(stream=s) as cap:
        sample.argmax(device, ids, logits, batch=batch, vocab=vocab, scratch=scratch, stream=s)
    rng = np.random.default_rng(5)
    for _ in range(3):
        values = rng.standard_normal((batch, vocab)).astype(np.float32)
        logits.copy_from_host(values, stream=s)
        cap.graph.launch(stream=s)
        np.testing.assert_array_equal(ids.to_host(stream=s), np.argmax(values, axis=-1))


def test_argmax_refuses_a_bad_scratch(device: Device) -> None:
    s = device.default_stream
    values = upload(device, np.zeros((4, 8), np.float32))
    ids = poisoned_ids(device, 4)
    common = dict(batch=4, vocab=8, stream=s)
    with pytest.raises(KernelArgumentError, match=r"scratch .* holds 6 elements; .* need 8"):
        sample.argmax(device, ids, values, scratch=device.alloc(6, np.uint64, stream=s), **common)
    with pytest.raises(KernelArgumentError, match=r"scratch .* is int64; expected uint64"):
        sample.argmax(device, ids, values, scratch=device.alloc(8, np.int64, stream=s), **common)


@pytest.mark.parametrize(
    "settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items())
)
def test_sampling_matches_the_reference_ids(device: Device, settings: dict) -> None:
    rng = np.random.default_rng(17)
    batch, vocab = 48, 5003
    values = logits_like_a_model(rng, batch, vocab)
    keys = np.stack([np.full(batch, 1234), np.arange(batch)], axis=1).astype(np.int64)
    steps = rng.integers(0, 50, batch).astype(np.int64)
    ids = poisoned_ids(device, batch)
    status = new_status(device, stream=device.default_stream)
    sample.sample(
        device,
        ids,
        upload(device, values),
        upload(device, keys),
        upload(device, steps),
        batch=batch,
        vocab=vocab,
        status=status,
        stream=device.default_stream,
        **settings,
    )
    want = ref.sample(
        values,
        keys,
        steps,
        temperature=settings["temperature"],
        top_k=settings.get("top_k", 0),
        top_p=settings.get("top_p", 1.0),
        min_p=settings.get("min_p", 0.0),
    )
    np.testing.assert_array_equal(ids.to_host(stream=device.default_stream), want)
    check_faults(device, status, stream=device.default_stream)


@pytest.mark.parametrize("dtype", [BF16, np.dtype(np.float16)], ids=str)
def test_sampling_half_precision_logits_at_full_vocab(device: Device, dtype: np.dtype) -> None:
    rng = np.random.default_rng(21)
    batch, vocab = 3, 151936
    values = logits_like_a_model(rng, batch, vocab).astype(dtype)
    keys = np.array([[7, 0], [7, 1], [2**40 + 5, 2]], dtype=np.int64)  # a two-word seed too
    steps = np.array([0, 3, 1000], dtype=np.int64)
    ids = poisoned_ids(device, batch)
    status = new_status(device, stream=device.default_stream)
    sample.sample(
        device,
        ids,
        upload(device, values),
        upload(device, keys),
        upload(device, steps),
        batch=batch,
        vocab=vocab,
        temperature=0.9,
        top_k=100,
        top_p=0.9,
        status=status,
        stream=device.default_stream,
    )
    want = ref.sample(
        values.astype(np.float32), keys, steps, temperature=0.9, top_k=100, top_p=0.9, min_p=0.0
    )
    np.testing.assert_array_equal(ids.to_host(stream=device.default_stream), want)


def test_advancing_steps_draws_the_next_numbers(device: Device) -> None:
    """With advance_steps the kernel bumps each row's step: a replayed call samples afresh."""
    rng = np.random.default_rng(4)
    batch, vocab = 6, 257
    values = np.zeros((batch, vocab), np.float32)  # uniform: the id is the random number itself
    keys = np.stack([np.full(batch, 99), np.arange(batch)], axis=1).astype(np.int64)
    steps0 = rng.integers(0, 10, batch).astype(np.int64)
    dsteps = upload(device, steps0)
    dvalues, dkeys = upload(device, values), upload(device, keys)
    status = new_status(device, stream=device.default_stream)
    seen = []
    for call in range(3):
        ids = poisoned_ids(device, batch)
        sample.sample(
            device,
            ids,
            dvalues,
            dkeys,
            dsteps,
            batch=batch,
            vocab=vocab,
            temperature=1.0,
            advance_steps=True,
            status=status,
            stream=device.default_stream,
        )
        want = ref.sample(
            values, keys, steps0 + call, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0
        )
        got = ids.to_host(stream=device.default_stream)
        np.testing.assert_array_equal(got, want)
        seen.append(got)
    np.testing.assert_array_equal(dsteps.to_host(stream=device.default_stream), steps0 + 3)
    assert not np.array_equal(seen[0], seen[1])


def test_bad_rows_fall_back_to_argmax_with_a_fault(device: Device) -> None:
    batch, vocab = 4, 64
    values = np.linspace(-1, 1, batch * vocab, dtype=np.float32).reshape(batch, vocab)
    values[0, 9] = np.nan
    values[1, :] = -np.inf
    values[2, 5] = np.inf
    keys = np.array([[1], [1], [1], [-3]], dtype=np.int64)
    ids = poisoned_ids(device, batch)
    status = new_status(device, stream=device.default_stream)
    sample.sample(
        device,
        ids,
        upload(device, values),
        upload(device, keys),
        upload(device, np.zeros(batch, np.int64)),
        batch=batch,
        vocab=vocab,
        temperature=1.0,
        status=status,
        stream=device.default_stream,
    )
    np.testing.assert_array_equal(ids.to_host(stream=device.default_stream), [9, 0, 5, vocab - 1])
    with pytest.raises(KernelFaultError) as info:
        check_faults(device, status, stream=device.default_stream)
    assert info.value.faults == KernelFault.SAMPLE_LOGITS | KernelFault.SAMPLE_KEY


def test_sample_refuses_bad_settings(device: Device) -> None:
    values = upload(device, np.zeros((2, 8), np.float32))
    ids = poisoned_ids(device, 2)
    status = new_status(device, stream=device.default_stream)
    keys, steps = upload(device, np.zeros((2, 1), np.int64)), upload(device, np.zeros(2, np.int64))
    common = dict(batch=2, vocab=8, status=status, stream=device.default_stream)
    with pytest.raises(KernelArgumentError, match="top_p"):
        sample.sample(device, ids, values, keys, steps, temperature=1.0, top_p=0.0, **common)
    with pytest.raises(KernelArgumentError, match="needs rng_keys and steps"):
        sample.sample(device, ids, values, None, None, temperature=1.0, **common)
    with pytest.raises(KernelArgumentError, match=r"ids .* is int32"):
        sample.sample(
            device,
            upload(device, np.zeros(2, np.int32)),
            values,
            keys,
            steps,
            temperature=0.0,
            **common,
        )
    assert (ids.to_host(stream=device.default_stream) == -7).all()


def _sample_call(device: Device, values: np.ndarray, keys: np.ndarray, steps: Buffer, **kw):
    """ids of `sample.sample` over ``values`` (uploaded), with ``kw`` passed on."""
    batch, vocab = values.shape
    ids = poisoned_ids(device, batch)
    status = new_status(device, stream=device.default_stream)
    sample.sample(device, ids, upload(device, values), upload(device, keys), steps, batch=batch,
                  vocab=vocab, status=status, stream=device.default_stream, **kw)  # fmt: skip
    check_faults(device, status, stream=device.default_stream)
    return ids.to_host(stream=device.default_stream)


def _assert_scratch_ready(device: Device, scratch: Buffer) -> None:
    """What every launch must leave: zeros but each row's barrier counter (word 0), which its
    epoch (word 1) has caught up with."""
    words = scratch.to_host(stream=device.default_stream)
    np.testing.assert_array_equal(words[:, 0], words[:, 1])
    assert not words[:, 2:].any()


def test_sampling_reuses_its_scratch_across_calls_and_settings(device: Device) -> None:
    """One scratch, many calls (other settings, fewer rows, the vocabulary over many blocks):
    each call's ids are the reference's, and each leaves the scratch ready for the next."""
    rng = np.random.default_rng(8)
    batch, vocab = 4, 5 * sample.ARGMAX_SPAN + 123
    scratch = sample.sample_scratch(device, batch, stream=device.default_stream)
    keys = np.stack([np.full(batch, 31), np.arange(batch)], axis=1).astype(np.int64)
    for call, settings in enumerate(SETTINGS[:5] * 2):
        rows = batch - call % 2  # a call over fewer rows leaves the last row's scratch alone
        values = logits_like_a_model(rng, rows, vocab)
        steps = np.full(rows, call, np.int64)
        got = _sample_call(device, values, keys[:rows], upload(device, steps), scratch=scratch,
                           **settings)  # fmt: skip
        want = ref.sample(values, keys[:rows], steps, temperature=settings["temperature"],
                          top_k=settings.get("top_k", 0), top_p=settings.get("top_p", 1.0),
                          min_p=settings.get("min_p", 0.0))  # fmt: skip
        np.testing.assert_array_equal(got, want)
        _assert_scratch_ready(device, scratch)


def test_sampling_in_several_launches_when_the_blocks_do_not_fit(
    device: Device, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device that holds only 5 blocks at once: 12 rows go in 3 launches of one block a row
    (the kernel's blocks wait for each other, so a launch must fit), same ids."""
    kernel = device.kernel(sample.SAMPLE_KERNELS["f32"].name)
    monkeypatch.setattr(kernel, "resident_blocks", lambda block, shared_mem=0: 5)
    rng = np.random.default_rng(3)
    batch, vocab = 12, 3 * sample.ARGMAX_SPAN
    values = logits_like_a_model(rng, batch, vocab)
    keys = np.stack([np.full(batch, 5), np.arange(batch)], axis=1).astype(np.int64)
    steps = np.arange(batch, dtype=np.int64)
    scratch = sample.sample_scratch(device, batch, stream=device.default_stream)
    got = _sample_call(device, values, keys, upload(device, steps), scratch=scratch,
                       temperature=0.9, top_p=0.8)  # fmt: skip
    want = ref.sample(values, keys, steps, temperature=0.9, top_k=0, top_p=0.8, min_p=0.0)
    np.testing.assert_array_equal(got, want)
    _assert_scratch_ready(device, scratch)


def test_sample_grid_fits_the_device() -> None:
    """Launches cover every row once; no launch holds more blocks than the device runs at once;
    every row's blocks cover its vocabulary."""
    span = sample.ARGMAX_SPAN
    assert sample.sample_grid(264, 1, 151936) == [(0, 1, 38, 3999)]
    assert sample.sample_grid(264, 16, 151936) == [(0, 16, 16, 9496)]
    assert sample.sample_grid(264, 8, 100) == [(0, 8, 1, 100)]
    for resident, batch, vocab in [(264, 300, 151936), (5, 12, 3 * span), (1, 3, 7), (7, 7, 9)]:
        launches = sample.sample_grid(resident, batch, vocab)
        rows = [r for row0, n, _, _ in launches for r in range(row0, row0 + n)]
        assert rows == list(range(batch))
        for _, n, parts, span_ in launches:
            assert n * parts <= resident
            assert parts * span_ >= vocab > (parts - 1) * span_ - span_
    with pytest.raises(KernelArgumentError, match="cannot run a single block"):
        sample.sample_grid(0, 1, 10)


def test_sampling_replays_in_a_graph_with_its_scratch(device: Device) -> None:
    """A captured sample over a persistent scratch, advancing the steps: each replay draws the
    reference's next ids."""
    s = device.default_stream
    batch, vocab = 3, 151936
    keys = np.stack([np.full(batch, 77), np.arange(batch)], axis=1).astype(np.int64)
    logits = device.alloc((batch, vocab), np.float32, stream=s)
    dkeys, dsteps = upload(device, keys), upload(device, np.zeros(batch, np.int64))
    ids = poisoned_ids(device, batch)
    status = new_status(device, stream=s)
    scratch = sample.sample_scratch(device, batch, stream=s)
    device.kernel(sample.SAMPLE_KERNELS["f32"].name).load()
    with device.capture(stream=s) as cap:
        sample.sample(device, ids, logits, dkeys, dsteps, batch=batch,
                      vocab=vocab, temperature=0.8, top_p=0.9, advance_steps=True,
                      scratch=scratch, status=status, stream=s)  # fmt: skip
    rng = np.random.default_rng(6)
    for step in range(3):
        values = logits_like_a_model(rng, batch, vocab)
        logits.copy_from_host(values, stream=s)
        cap.graph.launch(stream=s)
        want = ref.sample(values, keys, np.full(batch, step, np.int64), temperature=0.8,
                          top_k=0, top_p=0.9, min_p=0.0)  # fmt: skip
        np.testing.assert_array_equal(ids.to_host(stream=s), want)
    check_faults(device, status, stream=s)
    _assert_scratch_ready(device, scratch)


def test_sample_refuses_a_bad_scratch(device: Device) -> None:
    s = device.default_stream
    values = upload(device, np.zeros((2, 8), np.float32))
    keys, steps = upload(device, np.zeros((2, 1), np.int64)), upload(device, np.zeros(2, np.int64))
    ids = poisoned_ids(device, 2)
    common = dict(batch=2, vocab=8, temperature=1.0, status=new_status(device, stream=s), stream=s)
    small = device.alloc(sample.SAMPLE_SCRATCH_WORDS, np.uint64, stream=s)
    with pytest.raises(KernelArgumentError, match=r"scratch .* holds 2312 elements; .* need 4624"):
        sample.sample(device, ids, values, keys, steps, scratch=small, **common)
    assert (ids.to_host(stream=s) == -7).all()


# --- the device arithmetic, in NumPy, against the float64 reference -----------------------------


@pytest.mark.parametrize(
    "settings", SETTINGS, ids=lambda s: ",".join(f"{k}={v}" for k, v in s.items())
)
def test_fixed_point_twin_picks_the_reference_ids(settings: dict) -> None:
    """The kernel's integer-weight arithmetic (`sample_fixed_point`) and `ep.sampling.sample`
    agree on every row, with the very uniforms the reference draws."""
    rng = np.random.default_rng(99)
    batch, vocab = 200, 3001
    values = logits_like_a_model(rng, batch, vocab)
    values[5, :] = values[5, 0]  # a row of ties
    rngs = [ref.rng_at([42, row], 0) for row in range(batch)]
    uniforms = np.array([ref.rng_at([42, row], 0).random() for row in range(batch)])
    params = SamplingParams(**settings)
    want = sample_reference(values, params, rngs)
    got = sample.sample_fixed_point(values, uniforms, **settings)
    np.testing.assert_array_equal(got, want)


def test_fixed_point_twin_is_sensitive_to_the_uniform() -> None:
    """A negative oracle: shifting the uniforms changes ids, so the agreement above is not luck."""
    rng = np.random.default_rng(5)
    values = rng.standard_normal((50, 100)).astype(np.float32)
    uniforms = rng.random(50)
    base = sample.sample_fixed_point(values, uniforms, temperature=1.0)
    moved = sample.sample_fixed_point(values, (uniforms + 0.5) % 1.0, temperature=1.0)
    assert (base != moved).sum() > 25
