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


@pytest.mark.parametrize("kind", ["byte", "offset"])
@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode_and_pieces_are_valid_utf8(
    smollm2: ModelTokenizer, kind: str, text: str
) -> None:
    ids = smollm2.encode(text)
    rng = random.Random(len(text))
    detok = ByteDetokenizer(smollm2.id_bytes) if kind == "byte" else OffsetDetokenizer(smollm2)
    pieces = _stream(detok, ids, _chunking(len(ids), rng))
    assert "".join(pieces) + detok.flush() == smollm2.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("kind", ["byte", "offset"])
def test_multibyte_character_split_over_tokens_is_held_back(
    smollm2: ModelTokenizer, kind: str
) -> None:
    ids = smollm2.encode("🎉")
    assert len(ids) > 1, "emoji must span several byte-level tokens for this test"
    detok = ByteDetokenizer(smollm2.id_bytes) if kind == "byte" else OffsetDetokenizer(smollm2)
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
