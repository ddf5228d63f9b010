from __future__ import annotations

import random

import pytest

from tandem.tokens.detokenizer import (
    ByteDetokenizer,
    OffsetDetokenizer,
    make_detokenizer,
)
from tandem.tokens.tokenizer import ModelTokenizer

TEXTS = [
    "plain ascii text with spaces",
    "日本語のテキストと絵文字🎉👩‍👩‍👧 mixed with ascii",
    "accents: héllo wörld — ñandú ⊕ ∑ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    'code:\n\tfor (i = 0; i < 10; i++) { printf("%d\\n", i); }',
]


def _stream(detok, ids: list[int], chunks: list[int]) -> list[str]:
    out, pos = [], 0
    for size in chunks:
        out.append(detok.add(ids[pos : pos + size]))
        pos += size
    return out


def _chunking(n: int, rng: random.Random) -> list[int]:
    sizes, left = [], n
    while left:
        sizes.append(min(left, rng.choice([1, 1, 1, 2, 3])))
        left -= sizes[-1]
    return sizes


def _detok(smollm2: ModelTokenizer, kind: str) -> ByteDetokenizer | OffsetDetokenizer:
    assert smollm2.id_bytes is not None
    if kind == "byte":
        return ByteDetokenizer(smollm2.id_bytes)
    if kind == "byte+text":  # with the per-token text shortcut (what make_detokenizer builds)
        return ByteDetokenizer(smollm2.id_bytes, smollm2.id_text)
    return OffsetDetokenizer(smollm2)


@pytest.mark.parametrize("kind", ["byte", "byte+text", "offset"])
@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode_and_pieces_are_valid_utf8(
    smollm2: ModelTokenizer, kind: str, text: str
) -> None:
    ids = smollm2.encode(text)
    rng = random.Random(len(text))
    detok = _detok(smollm2, kind)
    pieces = _stream(detok, ids, _chunking(len(ids), rng))
    assert "".join(pieces) + detok.flush() == smollm2.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("kind", ["byte", "byte+text", "offset"])
def test_multibyte_character_split_over_tokens_is_held_back(
    smollm2: ModelTokenizer, kind: str
) -> None:
    ids = smollm2.encode("🎉")
    assert len(ids) > 1, "emoji must span several byte-level tokens for this test"
    detok = _detok(smollm2, kind)
    assert [detok.add([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1:]) == "🎉"


def test_incomplete_tail_flushes_as_replacement(smollm2: ModelTokenizer) -> None:
    ids = smollm2.encode("ok🎉")
    detok = make_detokenizer(smollm2)
    assert detok.add(ids[:-1]) == "ok"
    assert "ok" + detok.flush() == smollm2.decode(ids[:-1])
    assert detok.flush() == ""


def test_special_tokens_are_skipped(smollm2: ModelTokenizer) -> None:
    ids = smollm2.encode("hi<|im_end|>there")
    assert 2 in ids
    assert isinstance(make_detokenizer(smollm2), ByteDetokenizer)
    detok = make_detokenizer(smollm2)
    assert "".join(detok.add([i]) for i in ids) == "hithere"
    keep = make_detokenizer(smollm2, skip_special_tokens=False)
    assert "".join(keep.add([i]) for i in ids) == "hi<|im_end|>there"


def test_text_shortcut_gives_the_decoders_pieces_for_any_ids(smollm2: ModelTokenizer) -> None:
    """Random ids one or a few at a time (broken UTF-8 included: ids that are lone
    continuation bytes, cut characters): the per-token text table changes no piece."""
    assert smollm2.id_bytes is not None and smollm2.id_text is not None
    assert make_detokenizer(smollm2)._text is smollm2.id_text  # type: ignore[union-attr]
    partial = [i for i, t in enumerate(smollm2.id_text) if t is None]
    assert partial, "the vocabulary must have ids that hold part of a character"
    rng = random.Random(7)
    for _ in range(200):
        ids = [
            rng.choice(partial) if rng.random() < 0.3 else rng.randrange(smollm2.vocab_size)
            for _ in range(rng.randrange(1, 12))
        ]
        chunks = _chunking(len(ids), rng)
        plain, fast = _detok(smollm2, "byte"), _detok(smollm2, "byte+text")
        assert _stream(fast, ids, chunks) == _stream(plain, ids, chunks), ids
        assert fast.flush() == plain.flush()
