"""The layout gates on real ONNX Runtime sessions of the tiny Llama as an ep graph.

At fp32 every layout gives bitwise-identical logits and the same greedy tokens for a batch of 3
prompts of different lengths that crosses two growth boundaries, and each row equals its solo
run. Broken layouts (a skipped relocation, transposed growth copies) fail these comparisons: the
negative oracles. Paged: fork + copy-on-write keep both sequences right, pages go back.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from kv_gate_lib import DATA, PROMPTS, SkippedRelocation, TransposedCopies, greedy, layouts

import ep.ops as eo
from ep.errors import GenerationError
from ep.model import DecoderModel, load_model
from ep.ort import OrtBackend
from ep_builtin.kv_head_major import HeadMajorLayout
from ep_builtin.kv_paged import PagedLayout
from ep_graphs import build_model, load_hf_checkpoint

STEPS = 30  # prompts of 12, 7, 10 tokens + 30: buckets 16 -> 32 -> 64 (min_capacity 8)


@pytest.fixture(autouse=True)
def _no_leftover_op_state() -> Iterator[None]:
    resolver = eo.get_weight_resolver()
    yield
    eo.take_op_errors(all_threads=True)
    eo.set_weight_resolver(resolver)


@pytest.fixture(scope="module")
def tiny_ep(tmp_path_factory: pytest.TempPathFactory) -> DecoderModel:
    spec, weights = load_hf_checkpoint(DATA / "hf")
    out = tmp_path_factory.mktemp("kv_tiny_ep")
    build_model(spec, weights, flavour="ep", out_dir=out)
    return load_model(out)


def _run(model: DecoderModel, layout: object, prompts: list[list[int]], steps: int = STEPS):
    backend = OrtBackend(model, layout)  # type: ignore[arg-type]
    try:
        logits, tokens = greedy(backend, prompts, steps)
        return logits, tokens, backend.kv.stats()
    finally:
        backend.close()


@pytest.fixture(scope="module")
def reference(tiny_ep: DecoderModel) -> tuple[np.ndarray, np.ndarray]:
    logits, tokens, stats = _run(tiny_ep, HeadMajorLayout(min_capacity=8), PROMPTS[:3])
    assert stats.growths == 2 and stats.capacity == 64  # two growth boundaries crossed
    return logits, tokens


@pytest.mark.parametrize("name", ["seq_major", "seq_major_fixed", "paged"])
def test_every_layout_gives_bitwise_identical_logits(
    tiny_ep: DecoderModel, reference: tuple[np.ndarray, np.ndarray], name: str
) -> None:
    logits, tokens, stats = _run(tiny_ep, layouts()[name], PROMPTS[:3])
    assert stats.growths == 2
    np.testing.assert_array_equal(tokens, reference[1])
    assert np.array_equal(logits, reference[0])  # bitwise, every step, every row
    if name == "seq_major":
        assert stats.relocated_bytes > 0 and stats.moved_growths == 0
    if name == "seq_major_fixed":
        assert stats.relocated_bytes == 0 and stats.committed_bytes < stats.kv_bytes
    if name == "paged":
        assert stats.relocated_bytes == 0 and stats.pages_in_use == sum(
            -(-(n + STEPS) // 4) for n in (12, 7, 10)
        )


@pytest.mark.parametrize("name", ["head_major", "seq_major", "seq_major_fixed", "paged"])
def test_each_row_equals_its_solo_run(
    tiny_ep: DecoderModel, reference: tuple[np.ndarray, np.ndarray], name: str
) -> None:
    for b, prompt in enumerate(PROMPTS[:3]):
        logits, tokens, _ = _run(tiny_ep, layouts()[name], [prompt])
        np.testing.assert_array_equal(tokens[0], reference[1][b])
        np.testing.assert_allclose(logits[0], reference[0][b], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "broken", [SkippedRelocation(min_capacity=8), TransposedCopies(min_capacity=8)],
    ids=lambda x: x.name,
)  # fmt: skip
# the rows a broken growth leaves behind are fresh, unwritten memory: NaN or huge values,
# whatever bits it holds (NumPy warns of the invalid values or the overflow they make)
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_the_gate_catches_a_broken_growth(
    tiny_ep: DecoderModel, reference: tuple[np.ndarray, np.ndarray], broken: object
) -> None:
    """Negative oracle: the runtime's structural checks pass these plans; the logits do not."""
    logits, _, stats = _run(tiny_ep, broken, PROMPTS[:3])
    assert stats.growths == 2
    assert not np.allclose(logits, reference[0], atol=1e-3)
    if isinstance(broken, SkippedRelocation):
        # ... and batch 1 would never have shown it: nothing to relocate.
        solo, _, _ = _run(tiny_ep, broken, PROMPTS[:1])
        np.testing.assert_allclose(solo[0], reference[0][0], rtol=0, atol=1e-5)


# --- paged: prefix sharing, copy-on-write, pages returned --------------------------------------


def test_a_repeated_prompt_shares_its_pages_and_copies_on_write(tiny_ep: DecoderModel) -> None:
    """Rows 0, 1 and 3 repeat one 12-token prompt: it is prefilled once and its pages (8 tokens
    each: one full, one half) are shared; the first write into the half page copies it."""
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[1], PROMPTS[0]]
    want, want_tokens, _ = _run(tiny_ep, HeadMajorLayout(min_capacity=8), prompts, 20)
    backend = OrtBackend(tiny_ep, PagedLayout(page_size=8, min_capacity=8))
    backend.prefill([np.array(p) for p in prompts])
    shared = backend.kv.stats()
    assert (shared.pages_in_use, shared.shared_pages, shared.cow_bytes) == (3, 2, 0)
    logits, tokens = greedy(backend, prompts, 20)
    stats = backend.kv.stats()
    np.testing.assert_array_equal(tokens, want_tokens)
    assert np.array_equal(logits, want)  # both sharers stay right, bitwise
    token_page = 8 * 2 * 32 * 4 * 2 * 2  # page of 8 tokens, 2 heads of 32, fp32, K+V, 2 layers
    assert stats.cow_bytes == 2 * token_page  # rows 0 and 1 copied the half page; row 3 kept it
    assert stats.shared_pages == 1  # the full first page is still shared by three rows
    backend.close()


def test_ended_sequences_give_their_pages_back(tiny_ep: DecoderModel) -> None:
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[2]]
    full, full_tokens, _ = _run(tiny_ep, PagedLayout(page_size=4, min_capacity=8), prompts, 12)
    backend = OrtBackend(tiny_ep, PagedLayout(page_size=4, min_capacity=8))
    greedy(backend, prompts, 6)
    before = backend.kv.stats()
    assert before.shared_pages == 3  # rows 0 and 1 share the 12-token prompt's 3 pages
    private = int(backend.kv.pool.mapped[1]) - 3  # type: ignore[union-attr]
    backend.end_sequences([1])
    after = backend.kv.stats()
    assert private > 0 and after.pages_in_use == before.pages_in_use - private
    assert after.shared_pages == 0  # row 0 alone holds the prompt's pages now
    assert backend.lengths[1] == 0
    # The other rows go on exactly as if nothing had ended (bitwise).
    for step in range(6, 12):
        out = backend.step(full_tokens[:, step]).copy()
        for b in (0, 2):
            assert np.array_equal(out[b], full[b, step + 1])
    with pytest.raises(GenerationError, match=r"end_sequences: row 3 is not in the batch of 3"):
        backend.end_sequences([3])
    backend.prefill([np.array(PROMPTS[3])])  # a new batch: a fresh pool
    assert backend.kv.stats().pages_in_use == 1
    backend.close()
