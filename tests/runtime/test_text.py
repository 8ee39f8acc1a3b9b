"""ep.tokenizer: encode/decode, and streamed decoding that never splits a character."""

from __future__ import annotations

from pathlib import Path

import pytest

from ep.errors import ModelError
from ep.tokenizer import Tokenizer

DATA = Path(__file__).parents[1] / "data" / "genai-llama-tiny"
TEXT = "naïve café — 日本語のテキスト 🙂🚀 straße, ĳ and ørsted"


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A byte-level BPE with a tiny vocabulary: multi-byte characters span several tokens."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(["hello world, plain ascii text only"] * 20, trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return Tokenizer(path.parent)


def test_encode_decode_round_trip_on_the_model_tokenizer() -> None:
    tok = Tokenizer(DATA / "genai-fp32")
    assert tok.encode("w3 w4 w100") == [3, 4, 100]
    assert tok.decode([1, 3, 4, 100, 2]) == "w3 w4 w100"
    assert tok.decode([1, 3, 2], skip_special_tokens=False) == "<s> w3 </s>"
    assert tok.vocab_size == 512


def test_streamed_text_is_whole_characters_and_joins_to_the_full_text(
    byte_level: Tokenizer,
) -> None:
    ids = byte_level.encode(TEXT)
    assert byte_level.decode(ids) == TEXT
    # Negative oracle: decoding tokens one by one does break characters here.
    assert any("\ufffd" in byte_level.decode([i]) for i in ids)
    stream = byte_level.stream()
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces[:-1], "an incomplete character must be held back"
    assert "".join(pieces) == TEXT


def test_flush_releases_an_incomplete_tail(byte_level: Tokenizer) -> None:
    ids = byte_level.encode("ok 🙂")
    stream = byte_level.stream()
    pieces = [stream.push(i) for i in ids[:-1]]  # the emoji's last byte never comes
    tail = stream.flush()
    assert "".join(pieces) + tail == byte_level.decode(ids[:-1])
    assert tail.endswith("\ufffd")


def test_missing_or_broken_tokenizer_files(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="no tokenizer file"):
        Tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(ModelError, match="cannot read the tokenizer"):
        Tokenizer(tmp_path)
