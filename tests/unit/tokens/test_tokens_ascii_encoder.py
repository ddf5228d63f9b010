"""The ASCII word-cache encoder gives exactly the backend tokenizer's ids."""

from __future__ import annotations

import random
import string

from tokenizers import Tokenizer

from tandem.tokens.ascii_encoder import AsciiByteLevelEncoder
from tandem.tokens.tokenizer import ModelTokenizer

ALPHABET = (
    string.ascii_letters + string.digits + " \t\n\r\x0b\x0c" + string.punctuation + "\x00\x1f\x7f"
)
PIECES = ["'s", "'ll", "'ve", "'D", "  ", "\n\n", " \n ", "<|im_start|>", "<|im_end|>",
          "<|endoftext|>", "<|im_start", "|>", "ABC123", " 42", "...", "x'y"]  # fmt: skip


def _backend_ids(tok: ModelTokenizer, text: str) -> list[int]:
    return list(tok.backend.encode(text, add_special_tokens=False).ids)


def test_smollm2_gets_the_ascii_encoder(smollm2: ModelTokenizer) -> None:
    assert smollm2.ascii_encoder is not None


def test_random_ascii_texts_match_the_backend(smollm2: ModelTokenizer) -> None:
    encoder = smollm2.ascii_encoder
    assert encoder is not None
    rng = random.Random(7)
    for _ in range(400):
        parts = [
            rng.choice(PIECES)
            if rng.random() < 0.3
            else "".join(rng.choices(ALPHABET, k=rng.randint(1, 12)))
            for _ in range(rng.randint(1, 30))
        ]
        text = "".join(parts)
        assert encoder.encode(text) == _backend_ids(smollm2, text), repr(text)


def test_long_prose_and_code_match_the_backend(smollm2: ModelTokenizer) -> None:
    encoder = smollm2.ascii_encoder
    assert encoder is not None
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "that",
        "for",
        "it",
        "as",
        "was",
        "with",
        "be",
        "by",
        "on",
        "not",
        "he",
        "I'm",
        "don't",
    ]
    rng = random.Random(3)
    prose = " ".join(rng.choice(words) for _ in range(6000))
    code = (
        "def f(x):\n\tif x > 10:\n        return x ** 2  # sq\n\n\n    return {'a': [1, 2]}\n" * 50
    )
    for text in (prose, code, "<|im_start|>user\n" + prose + "<|im_end|>\n<|im_start|>assistant\n"):
        assert encoder.encode(text) == _backend_ids(smollm2, text)


def test_non_ascii_goes_to_the_backend(smollm2: ModelTokenizer) -> None:
    text = "héllo wörld 日本語 🎉 and plain words"
    assert smollm2.encode(text, add_special_tokens=False) == _backend_ids(smollm2, text)


def test_other_tokenizer_shapes_get_no_encoder(smollm2: ModelTokenizer) -> None:
    backend = Tokenizer.from_str(smollm2.backend.to_str())
    from tokenizers import pre_tokenizers

    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert AsciiByteLevelEncoder.build(backend) is None
