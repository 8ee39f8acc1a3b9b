"""The weight store under every built-in policy: byte-exact weights, balanced ledgers, budgets."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import pytest

from ep.config import parse_budget
from ep.device import Buffer, Device, Stream
from ep.errors import OffloadBudgetError, OffloadError
from ep.offload import WeightStore, decoder_use_order, footprint
from ep.seams import OffloadPolicy, WeightInfo
from ep_builtin.offload_lru import LRUPolicy
from ep_builtin.offload_resident import ResidentPolicy
from ep_builtin.offload_scan_resistant import ScanResistantPolicy
from ep_builtin.offload_stream import StreamPolicy

POLICIES: dict[str, type] = {
    "resident": ResidentPolicy,
    "stream": StreamPolicy,
    "scan_resistant": ScanResistantPolicy,
    "lru": LRUPolicy,
}
STEPS = 6


def _same_bytes(
    buffer: Buffer, array: np.ndarray, dev: Device, stream: Stream | None = None
) -> bool:
    got = buffer.to_host(stream=stream or dev.default_stream)
    return (
        got.dtype == array.dtype and got.shape == array.shape and got.tobytes() == array.tobytes()
    )


def run_steps(
    store: WeightStore,
    dev: Device,
    weights: Mapping[str, np.ndarray],
    order: Sequence[str],
    *,
    steps: int = STEPS,
    batch: int = 1,
    stream: Stream | None = None,
) -> dict[str, set[int]]:
    """Simulated decode steps: get every weight in order of use, check its bytes, note addresses."""
    stream = stream or dev.default_stream
    addresses: dict[str, set[int]] = {name: set() for name in order}
    for _ in range(steps):
        store.begin_step()
        for name in order:
            buffer = store.get(name, stream=stream)
            assert _same_bytes(buffer, weights[name], dev, stream), name
            addresses[name].add(buffer.ptr)
        store.end_step(batch)
    return addresses


def check_ledger(store: WeightStore, dev: Device, htod_before: int, alloc_before: int) -> None:
    c = store.counters()
    assert all(v >= 0 for v in c.to_dict().values()), c
    # Every byte the device copied host->device for the store is counted exactly once.
    assert dev.counters().htod_bytes - htod_before == store.loaded_bytes + c.htod_bytes
    assert dev.counters().allocated_bytes - alloc_before == store.device_bytes
    assert c.peak_device_bytes <= c.budget_bytes
    assert c.page_ins == c.misses
    assert 0.0 <= c.hit_rate <= 1.0 and 0.0 <= c.byte_hit_rate <= 1.0


CASES = [
    (policy, share)
    for policy in ("resident", "stream", "scan_resistant", "lru")
    for share in ("100%", "50%", "25%")
    if policy != "resident" or share == "100%"
]


@pytest.mark.parametrize(("policy", "share"), CASES)
def test_every_policy_serves_exact_bytes_and_balances_its_ledger(
    policy: str,
    share: str,
    cpu: Device,
    weights: Mapping[str, np.ndarray],
    infos: tuple[WeightInfo, ...],
) -> None:
    order = [w.name for w in sorted(infos, key=lambda w: w.order)]
    total_bytes = sum(w.nbytes for w in infos)
    htod0, alloc0 = cpu.counters().htod_bytes, cpu.counters().allocated_bytes
    store = WeightStore(
        cpu, weights, infos, POLICIES[policy](), parse_budget(share), stream=cpu.default_stream
    )
    budget = store.layout.budget_bytes
    assert budget == int(sum(footprint(w.nbytes) for w in infos) * float(share[:-1]) / 100)
    addresses = run_steps(store, cpu, weights, order)
    check_ledger(store, cpu, htod0, alloc0)
    c = store.counters()
    assert c.hits + c.misses == STEPS * len(order)
    assert c.budget_bytes == budget

    streamed = [n for n in order if store.placement(n) == "stream"]
    if policy in ("resident", "stream", "scan_resistant"):
        assert store.plan.capture_safe
        # Fixed slots and arena: one address per weight across every step.
        assert all(len(a) == 1 for a in addresses.values())
        per_step = sum(weights[n].nbytes for n in streamed)
        assert c.htod_bytes == STEPS * per_step  # exactly the streamed weights, every step
        assert c.evictions == 0
        resident_raw = total_bytes - per_step
        assert c.byte_hit_rate == pytest.approx(resident_raw / total_bytes)
    if policy == "resident" or (policy == "scan_resistant" and share == "100%"):
        assert c.htod_bytes == 0 and c.misses == 0 and store.loaded_bytes == total_bytes
    if policy == "stream":
        assert c.resident_bytes == 0 and c.hits == 0 and c.byte_hit_rate == 0.0
        assert len(streamed) == len(order)
    if policy == "scan_resistant" and share != "100%":
        assert 0 < c.resident_bytes <= budget and streamed
        # Residents come first in order of use until the first one that does not fit.
        assert store.placement(order[0]) == "resident"
    if policy == "lru":
        assert not store.plan.capture_safe and store.plan.dynamic
        if share == "100%":
            # Everything fits: one cold miss per weight, then only hits.
            assert c.misses == len(order) and c.evictions == 0
        else:
            # A scan over more than the cache: every access misses, addresses move.
            assert c.misses == STEPS * len(order) and c.evictions > 0
            assert c.htod_bytes == STEPS * total_bytes
            assert any(len(a) > 1 for a in addresses.values())
    store.close()
    assert cpu.counters().allocated_bytes == alloc0


def test_scan_resistant_beats_lru_on_bytes_per_token(
    cpu: Device, weights: Mapping[str, np.ndarray], infos: tuple[WeightInfo, ...]
) -> None:
    order = decoder_use_order(list(weights))
    result = {}
    for name in ("scan_resistant", "lru"):
        store = WeightStore(
            cpu, weights, infos, POLICIES[name](), parse_budget("50%"), stream=cpu.default_stream
        )
        run_steps(store, cpu, weights, order, steps=3)
        result[name] = store.counters()
        store.close()
    assert result["scan_resistant"].htod_bytes_per_token < result["lru"].htod_bytes_per_token
    assert result["scan_resistant"].byte_hit_rate > result["lru"].byte_hit_rate


def test_htod_bytes_per_token_falls_as_one_over_batch(
    cpu: Device, weights: Mapping[str, np.ndarray], infos: tuple[WeightInfo, ...]
) -> None:
    order = decoder_use_order(list(weights))
    per_token = {}
    for batch in (1, 2, 4, 8):
        store = WeightStore(
            cpu, weights, infos, ScanResistantPolicy(), parse_budget("50%"),
            stream=cpu.default_stream,
        )  # fmt: skip
        run_steps(store, cpu, weights, order, steps=3, batch=batch)
        per_token[batch] = store.counters().htod_bytes_per_token
        store.close()
    assert per_token[1] > 0
    for batch, value in per_token.items():
        assert value == pytest.approx(per_token[1] / batch)


def test_resident_over_budget_fails_with_numbers_and_fix(
    cpu: Device, weights: Mapping[str, np.ndarray], infos: tuple[WeightInfo, ...]
) -> None:
    total = sum(footprint(w.nbytes) for w in infos)
    alloc0 = cpu.counters().allocated_bytes
    with pytest.raises(OffloadBudgetError) as caught:
        WeightStore(
            cpu, weights, infos, ResidentPolicy(), parse_budget("50%"), stream=cpu.default_stream
        )
    text = str(caught.value)
    assert f"needs {total} device bytes" in text
    assert f"allows {total // 2}" in text and "'50%'" in text
    assert "raise offload.budget to at least" in text and "scan_resistant" in text
    assert "'resident'" in text
    assert cpu.counters().allocated_bytes == alloc0  # nothing allocated for a refused plan


@pytest.mark.parametrize("policy", ["stream", "scan_resistant", "lru"])
def test_budget_below_the_minimum_fails_with_numbers_and_fix(
    policy: str, cpu: Device, weights: Mapping[str, np.ndarray], infos: tuple[WeightInfo, ...]
) -> None:
    largest = max(footprint(w.nbytes) for w in infos)
    with pytest.raises(OffloadBudgetError) as caught:
        WeightStore(cpu, weights, infos, POLICIES[policy](), largest, stream=cpu.default_stream)
    text = str(caught.value)
    assert f"allows {largest}" in text
    assert f"raise offload.budget to at least {2 * largest} bytes" in text


def test_scan_resistant_capture_replays_streamed_weights_exactly(
    cpu: Device, weights: Mapping[str, np.ndarray], infos: tuple[WeightInfo, ...]
) -> None:
    """A captured streaming step replays byte-exact, and each replay is counted once."""
    order = decoder_use_order(list(weights))
    stream = cpu.default_stream
    htod0 = cpu.counters().htod_bytes
    store = WeightStore(
        cpu, weights, infos, ScanResistantPolicy(), parse_budget("25%"), stream=stream
    )
    streamed = [n for n in order if store.placement(n) == "stream"]
    assert streamed
    outs = {n: cpu.alloc(weights[n].shape, weights[n].dtype, stream=stream, name=f"out:{n}")
            for n in order}  # fmt: skip
    run_steps(store, cpu, weights, order, steps=1)  # an eager warm-up step

    store.begin_step()
    store.begin_capture()
    with cpu.capture(stream=stream) as cap:
        for name in order:
            cpu.copy(outs[name], store.get(name, stream=stream), stream=stream)  # the "kernel"
    trace = store.end_capture()
    assert trace.misses == len(streamed)
    assert trace.htod_bytes == sum(weights[n].nbytes for n in streamed)
    assert cap.graph.check()  # every bound buffer keeps its address

    for step in range(4):  # the captured step runs its graph too, then three replays
        if step:
            store.begin_step()
        for out in outs.values():
            cpu.fill(out.view(np.uint8), 0xAB, stream=stream)  # poison
        cap.graph.launch(stream=stream)
        store.replayed(trace)
        store.end_step(1)
        for name in order:
            assert _same_bytes(outs[name], weights[name], cpu), name
    assert cpu.counters().captures == 1
    c = store.counters()
    assert cpu.counters().htod_bytes - htod0 == store.loaded_bytes + c.htod_bytes
    assert c.htod_bytes == 5 * trace.htod_bytes  # warm-up + 4 launches, not the capture itself
    assert c.htod_bytes_per_token == pytest.approx(trace.htod_bytes)
    store.close()


def test_lru_refuses_capture_with_its_reason(
    cpu: Device, weights: Mapping[str, np.ndarray], infos: tuple[WeightInfo, ...]
) -> None:
    stream = cpu.default_stream
    store = WeightStore(cpu, weights, infos, LRUPolicy(), parse_budget("50%"), stream=stream)
    assert not store.capture_safe
    with pytest.raises(OffloadError, match=r"not capture-safe: offload policy 'lru'.*LRU"):
        store.begin_capture()
    name = next(iter(weights))
    with cpu.capture(stream=stream), pytest.raises(OffloadError, match="begin_capture"):
        store.get(name, stream=stream)
    store.close()


def test_misuse_is_refused_with_a_sentence(
    cpu: Device, weights: Mapping[str, np.ndarray], infos: tuple[WeightInfo, ...]
) -> None:
    stream = cpu.default_stream
    store = WeightStore(cpu, weights, infos, StreamPolicy(), parse_budget("50%"), stream=stream)
    with pytest.raises(OffloadError, match=r"did you mean 'model.norm.weight'"):
        store.get("model.norm.weigth", stream=stream)
    with pytest.raises(OffloadError, match=r"expected a count of 0 or more"):
        store.end_step(-1)
    with pytest.raises(OffloadError, match=r"end_capture\(\) without begin_capture"):
        store.end_capture()
    store.close()
    with pytest.raises(OffloadError, match="closed"):
        store.get("model.norm.weight", stream=stream)
    with pytest.raises(OffloadError, match="at least 2 staging slots"):
        WeightStore(cpu, weights, infos, StreamPolicy(), 10**7, stream=stream, slots=1)
    with pytest.raises(OffloadError, match="WeightInfo says"):
        bad = dict(weights)
        bad["model.norm.weight"] = np.zeros(3, np.float32)
        WeightStore(cpu, bad, infos, StreamPolicy(), 10**7, stream=stream)
    with pytest.raises(OffloadBudgetError, match="not a byte count"):
        WeightStore(cpu, weights, infos, StreamPolicy(), 0, stream=stream)


def test_more_slots_keep_more_buffers_valid(
    cpu: Device, weights: Mapping[str, np.ndarray], infos: tuple[WeightInfo, ...]
) -> None:
    """With slots=3, an op may read the buffers of its last two gets together."""
    stream = cpu.default_stream
    order = decoder_use_order(list(weights))
    store = WeightStore(cpu, weights, infos, StreamPolicy(), 10**7, stream=stream, slots=3)
    store.begin_step()
    previous: tuple[str, Buffer] | None = None
    for name in order:
        buffer = store.get(name, stream=stream)
        if previous is not None:  # the earlier buffer still holds its weight
            assert _same_bytes(previous[1], weights[previous[0]], cpu)
        previous = (name, buffer)
    store.end_step(1)
    store.close()


def test_weight_infos_follow_the_decoder_order(infos: tuple[WeightInfo, ...]) -> None:
    ordered = [w for w in sorted(infos, key=lambda w: w.order)]
    names = [w.name for w in ordered]
    assert names[0] == "model.embed_tokens.weight" and ordered[0].op == "Gather"
    assert names[-2:] == ["model.norm.weight", "lm_head.weight"]
    layer0 = [n.split("layers.0.")[1] for n in names if ".layers.0." in n]
    assert layer0[:4] == [
        "input_layernorm.weight",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
    ]
    assert layer0[-1] == "mlp.down_proj.weight"
    assert {w.layer for w in ordered if "layers.3." in w.name} == {3}
    assert ordered[0].layer == -1


def test_builtin_policies_load_from_config() -> None:
    from ep.config import load_config
    from ep.plugins import PluginHost

    host = PluginHost(environ={})
    for name in POLICIES:
        config = load_config(host.registry, cli={"decode.offload": (name, "command line")})
        policy = config.create("offload")
        assert isinstance(policy, OffloadPolicy) and policy.name == name


@pytest.mark.cuda
@pytest.mark.parametrize("policy", ["stream", "scan_resistant", "lru"])
def test_cuda_store_serves_exact_bytes_and_balances(
    policy: str, cuda_dev: Device, weights: Mapping[str, np.ndarray], infos: tuple[WeightInfo, ...]
) -> None:
    order = decoder_use_order(list(weights))
    stream = cuda_dev.create_stream(name="compute")
    htod0, alloc0 = cuda_dev.counters().htod_bytes, cuda_dev.counters().allocated_bytes
    store = WeightStore(
        cuda_dev, weights, infos, POLICIES[policy](), parse_budget("50%"), stream=stream
    )
    assert store.copy_stream is not None and store.copy_stream is not stream
    run_steps(store, cuda_dev, weights, order, steps=3, stream=stream)
    check_ledger(store, cuda_dev, htod0, alloc0)
    store.close()


def _step(
    store: WeightStore, dev: Device, weights: Mapping[str, np.ndarray], order: Sequence[str]
) -> int:
    """One eager step as the executor runs it (start and finish are its first and last calls);
    the copies issued by ``start``, before any get."""
    stream = dev.default_stream
    store.begin_step()
    store.start(stream)
    ahead = store._issued
    for name in order:
        assert _same_bytes(store.get(name, stream=stream), weights[name], dev), name
    store.finish(stream)
    store.end_step(1)
    return ahead


def test_streamed_weights_are_copied_ahead_in_the_order_last_used(
    cpu: Device, weights: Mapping[str, np.ndarray], infos: tuple[WeightInfo, ...]
) -> None:
    order = decoder_use_order(list(weights))
    htod0 = cpu.counters().htod_bytes
    store = WeightStore(cpu, weights, infos, StreamPolicy(), 10**7, stream=cpu.default_stream)
    total = sum(weights[n].nbytes for n in order)
    assert _step(store, cpu, weights, order) == 0  # nothing to predict yet: it learns the order
    assert store._sequence == tuple(order)
    assert _step(store, cpu, weights, order) == 2  # both slots filled before the first get
    assert store.counters().htod_bytes == 2 * total
    # Another order: the first get finds a wrong prediction; every get still gets its bytes,
    # the two copies made in vain are counted (they crossed the bus), and the new order is next.
    wasted = weights[order[0]].nbytes + weights[order[1]].nbytes
    backwards = order[::-1]
    _step(store, cpu, weights, backwards)
    assert store.counters().htod_bytes == 3 * total + wasted
    assert store._sequence == tuple(backwards)
    assert _step(store, cpu, weights, backwards) == 2
    c = store.counters()
    assert cpu.counters().htod_bytes - htod0 == store.loaded_bytes + c.htod_bytes
    assert c.misses == 4 * len(order)
    store.close()


def test_a_captured_step_holds_the_copy_stream_and_replays_exactly(
    cpu: Device, weights: Mapping[str, np.ndarray], infos: tuple[WeightInfo, ...]
) -> None:
    """Predicted copies inside a capture: the copy stream forks into it and joins back."""
    order = decoder_use_order(list(weights))
    stream = cpu.default_stream
    store = WeightStore(cpu, weights, infos, StreamPolicy(), 10**7, stream=stream)
    outs = {n: cpu.alloc(weights[n].shape, weights[n].dtype, stream=stream, name=f"out:{n}")
            for n in order}  # fmt: skip
    _step(store, cpu, weights, order)  # learns the order
    store.begin_step()
    store.begin_capture()
    with cpu.capture(stream=stream) as cap:
        store.start(stream)
        assert store.copy_stream is not None and store.copy_stream.capturing  # forked in
        for name in order:
            cpu.copy(outs[name], store.get(name, stream=stream), stream=stream)
        store.finish(stream)
    trace = store.end_capture()
    assert not store.copy_stream.capturing
    assert trace.htod_bytes == sum(weights[n].nbytes for n in order)
    for _ in range(3):
        for out in outs.values():
            cpu.fill(out.view(np.uint8), 0xAB, stream=stream)  # poison
        cap.graph.launch(stream=stream)
        store.replayed(trace)
        for name in order:
            assert _same_bytes(outs[name], weights[name], cpu), name
    store.end_step(1)
    store.close()


def test_copies_ahead_never_overwrite_a_buffer_still_valid(
    cpu: Device, weights: Mapping[str, np.ndarray], infos: tuple[WeightInfo, ...]
) -> None:
    """With slots=3 the last two gets stay valid while predictions are copied ahead (on the CPU
    device a copy lands when issued, so one issued a slot too early would show here)."""
    stream = cpu.default_stream
    order = decoder_use_order(list(weights))
    store = WeightStore(cpu, weights, infos, StreamPolicy(), 10**7, stream=stream, slots=3)
    _step(store, cpu, weights, order)  # learns the order
    store.begin_step()
    store.start(stream)
    assert store._issued == 3
    held: list[tuple[str, Buffer]] = []
    for name in order:
        held = [*held[-1:], (name, store.get(name, stream=stream))]
        for kept, buffer in held:
            assert _same_bytes(buffer, weights[kept], cpu), kept
    store.finish(stream)
    store.end_step(1)
    store.close()
