"""Incremental detokenization: token ids in, text deltas out, never a broken UTF-8 character.

A token may end mid-character (byte-level BPE splits multi-byte characters); the incomplete
bytes are held back until the character completes. Byte-level tokenizers use a per-id byte
table and an incremental UTF-8 decoder (O(new tokens) per step); other tokenizers re-decode a
short window with prefix/read offsets, as vLLM does. One detokenizer per sequence; not
thread-safe.
"""

from __future__ import annotations

import codecs
from typing import Protocol

from tandem.tokens.tokenizer import ModelTokenizer

REPLACEMENT = "\ufffd"


class Detokenizer(Protocol):
    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the text that is now complete (may be "")."""
        ...

    def flush(self) -> str:
        """Text for bytes still held back at the end of the sequence (U+FFFD for an
        incomplete character, as a full decode would give)."""
        ...


class ByteDetokenizer:
    """Byte-level BPE: look up each id's raw bytes and feed an incremental UTF-8 decoder.

    With `id_text` (each id's bytes as text when they are complete UTF-8 on their own, else
    None), one token arriving while the decoder holds no partial character is looked up
    rather than decoded: the same text, without the decoder's Python-level call per token."""

    __slots__ = ("_decoder", "_table", "_text")

    def __init__(
        self, id_bytes: tuple[bytes, ...], id_text: tuple[str | None, ...] | None = None
    ) -> None:
        self._table = id_bytes
        self._text = id_text
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_ids: list[int]) -> str:
        table = self._table
        if len(token_ids) == 1:
            id_text, decoder = self._text, self._decoder
            if id_text is not None and not decoder.buffer:
                text = id_text[token_ids[0]]
                if text is not None:
                    return text
            data = table[token_ids[0]]
        else:
            data = b"".join([table[i] for i in token_ids])
        return str(self._decoder.decode(data))

    def flush(self) -> str:
        return str(self._decoder.decode(b"", final=True))


class OffsetDetokenizer:
    """Any tokenizer: decode tokens[prefix:] against tokens[prefix:read] and emit the
    difference once it no longer ends in an incomplete character."""

    __slots__ = ("_prefix", "_read", "_skip", "_tok", "_tokens")

    def __init__(self, tokenizer: ModelTokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._tokens: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token_ids: list[int]) -> str:
        self._tokens.extend(token_ids)
        return self._step(final=False)

    def flush(self) -> str:
        return self._step(final=True)

    def _step(self, *, final: bool) -> str:
        decode = self._tok.decode
        prefix_text = decode(
            self._tokens[self._prefix : self._read], skip_special_tokens=self._skip
        )
        new_text = decode(self._tokens[self._prefix :], skip_special_tokens=self._skip)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT) and not final):
            return ""
        self._prefix, self._read = self._read, len(self._tokens)
        return new_text[len(prefix_text) :]


def make_detokenizer(
    tokenizer: ModelTokenizer, *, skip_special_tokens: bool = True
) -> ByteDetokenizer | OffsetDetokenizer:
    """The cheapest correct detokenizer for `tokenizer`."""
    if tokenizer.id_bytes is not None and skip_special_tokens:
        return ByteDetokenizer(tokenizer.id_bytes, tokenizer.id_text)
    return OffsetDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
