"""A small wrapper over the `tokenizers` library for a model folder's ``tokenizer.json``.

`tokenizers` is an optional dependency (``pip install 'genai-ep[tokenizers]'``): it is imported
only when a tokenizer is actually loaded, and its absence is then a `ModelError` saying how to
install it. Streaming uses `TokenStream`, which never emits half a UTF-8 character.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ep.errors import ModelError

__all__ = ["INSTALL_HINT", "TokenStream", "Tokenizer"]

INSTALL_HINT = "pip install 'genai-ep[tokenizers]'"

# Byte-level tokenizers decode an incomplete UTF-8 sequence to U+FFFD; hold such text back.
_REPLACEMENT = "\ufffd"


def _import_tokenizers() -> Any:
    try:
        return importlib.import_module("tokenizers")
    except ImportError as exc:
        raise ModelError(
            f"a tokenizer is needed (to turn text into token ids or back) but the `tokenizers` "
            f"library is not installed ({exc}); install it with: {INSTALL_HINT}, or pass token "
            "ids instead of text"
        ) from None


class Tokenizer:
    """Encode text to token ids and decode ids back, from a ``tokenizer.json`` file."""

    def __init__(self, path: str | Path) -> None:
        file = Path(path)
        if file.is_dir():
            file = file / "tokenizer.json"
        if not file.is_file():
            raise ModelError(
                f"no tokenizer file at {file}; expected a tokenizer.json (as written by Hugging "
                "Face tokenizers) in the model folder, or pass token ids instead of text"
            )
        lib = _import_tokenizers()
        try:
            self._tok = lib.Tokenizer.from_file(str(file))
        except Exception as exc:  # the library raises a plain Exception for malformed files
            raise ModelError(f"cannot read the tokenizer {file}: {exc}") from None
        self.path = file

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (with the tokenizer's own special-token template, if any)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens))

    def stream(
        self, *, context: Sequence[int] = (), skip_special_tokens: bool = True
    ) -> TokenStream:
        """An incremental decoder for one sequence of streamed tokens.

        ``context``: the ids before the first streamed token (the prompt), so that the first
        fragment carries the space or byte that joins it to the prompt.
        """
        return TokenStream(self, context=context, skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"Tokenizer({str(self.path)!r})"


class TokenStream:
    """Turns tokens arriving one by one into text fragments, never splitting a character.

    Decoding a token alone loses context (a leading space, a byte of a multi-byte character), so
    each push decodes a short window: the text of the tokens from ``_prefix`` on, minus the text
    already emitted from that window. Text ending in U+FFFD (an incomplete UTF-8 sequence) is held
    back until the next token completes it; `flush` releases whatever is left.
    """

    # Prompt tokens kept as decoding context: enough to join words and finish a character.
    CONTEXT_TOKENS = 4

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        context: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = [int(i) for i in context[-self.CONTEXT_TOKENS :]]
        self._prefix = 0  # start of the decoding window
        self._read = len(self._ids)  # tokens before this index have been emitted

    def push(self, token_id: int) -> str:
        """Add one token; return the newly completed text ("" while a character is incomplete)."""
        self._ids.append(int(token_id))
        return self._emit(final=False)

    def flush(self) -> str:
        """Return any text held back (an incomplete character at the end decodes to U+FFFD)."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        decode = self._tokenizer.decode
        seen = decode(self._ids[self._prefix : self._read], skip_special_tokens=self._skip)
        full = decode(self._ids[self._prefix :], skip_special_tokens=self._skip)
        if len(full) <= len(seen) or (full.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix = self._read
        self._read = len(self._ids)
        return full[len(seen) :]
