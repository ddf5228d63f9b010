"""The ASCII word-cache encoder gives exactly the backend tokenizer's ids."""

from __future__ import annotations

import random
import string
from typing import Any

import pytest
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


def _count_bpe(cache: Any) -> list[str]:
    """The words the cache runs BPE on from now on (its misses), in order."""
    calls: list[str] = []
    model = cache._model

    class Counting:
        def tokenize(self, word: str):  # type: ignore[no-untyped-def]
            calls.append(word)
            return model.tokenize(word)

    cache._model = Counting()
    return calls


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


def test_the_c_split_gives_the_patterns_words_on_random_spans() -> None:
    """ascii_split.c against SPLIT_PATTERN.findall(text, start, end): 5000 random texts of
    the characters the pattern tells apart, at random bounds (the end bounds the lookahead)."""
    from tandem.tokens.ascii_encoder import SPLIT_PATTERN, _c_split

    c = _c_split()
    assert c is not None, "the C split did not build here"
    rng = random.Random(11)
    alphabet = "aZ09 \t\n\r\x0b\x0c'.-_\x00\x7f" + "srtvemld" * 2
    for _ in range(5000):
        text = "".join(rng.choices(alphabet, k=rng.randint(0, 40)))
        start = rng.randint(0, len(text))
        end = rng.randint(start, len(text))
        assert c.split(text, start, end) == SPLIT_PATTERN.findall(text, start, end), (
            repr(text),
            start,
            end,
        )
    for bad in (("é", 0, 1), ("abc", 2, 1), ("abc", 0, 4), ("abc", -1, 2)):
        with pytest.raises(ValueError):
            c.split(*bad)


def test_without_the_c_split_the_re_path_gives_the_same_ids(
    smollm2: ModelTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tandem.tokens import ascii_encoder

    encoder = smollm2.ascii_encoder
    assert encoder is not None
    rng = random.Random(5)
    texts = ["".join(rng.choices(ALPHABET, k=rng.randint(0, 80))) for _ in range(300)]
    texts += [p + t for p, t in zip(PIECES * 20, texts, strict=False)]
    with_c = [encoder.encode(t) for t in texts]
    monkeypatch.setattr(ascii_encoder, "_c_state", [None])
    assert [encoder.encode(t) for t in texts] == with_c
    assert with_c == [_backend_ids(smollm2, t) for t in texts]


def test_the_word_cache_stays_bounded_under_endless_distinct_words(
    smollm2: ModelTokenizer,
) -> None:
    """Prompts bring words that never repeat (request numbers, ids): the cache's size and
    memory stay bounded (a soak of distinct prompts grew the frontend's RSS without end)."""
    import tracemalloc

    from tandem.tokens.ascii_encoder import MAX_CACHED_WORDS

    encoder = AsciiByteLevelEncoder.build(smollm2.backend)  # a cold cache of its own
    assert encoder is not None
    cache = encoder._cache
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        peak_several = 0
        for i in range(15_000):
            ids = encoder.encode(f"request {i}: user{i * 7919} asks about item{i}")
            if i % 997 == 0:
                assert ids == _backend_ids(
                    smollm2, f"request {i}: user{i * 7919} asks about item{i}"
                )
            peak_several = max(peak_several, cache.num_several)
        grown_mb = (tracemalloc.get_traced_memory()[1] - base) / 1e6  # the peak
    finally:
        tracemalloc.stop()
    assert MAX_CACHED_WORDS < peak_several <= 2 * MAX_CACHED_WORDS  # two generations, turned
    ones = [ids for ids in cache.values() if len(ids) == 1]
    assert len(ones) <= smollm2.backend.get_vocab_size(with_added_tokens=True)
    assert grown_mb < 8.0, f"the word cache reached {grown_mb:.1f} MB over 45k distinct words"


def test_one_token_words_stay_cached_however_many_conversations_interleave(
    smollm2: ModelTokenizer,
) -> None:
    """Conversations over the whole one-token vocabulary, each resent with its history,
    interleaved so that every word comes back only after all the others: the second pass
    runs BPE on no word (at 2**14 words a generation it ran BPE on most of them, a
    frontend's preprocessing 1.5 ms slower under 80 agent sessions)."""
    import re

    backend = smollm2.backend
    words = [
        " " + token[1:]
        for i in range(backend.get_vocab_size(with_added_tokens=True))
        if (token := backend.id_to_token(i) or "") and re.fullmatch("\u0120[A-Za-z]+", token)
    ]
    assert len(words) > 30_000  # more than one generation of the old 2**14 words
    encoder = AsciiByteLevelEncoder.build(backend)
    assert encoder is not None
    cache = encoder._cache
    calls = _count_bpe(cache)
    conversations = ["".join(words[i::50]) for i in range(50)]
    for text in conversations:
        encoder.encode(text)
    first = len(calls)
    assert len(words) - 50 <= first <= len(words)  # the probe text's words are cached at build
    for text in conversations:
        assert encoder.encode(text) == _backend_ids(smollm2, text)
    assert len(calls) == first


def test_words_in_use_stay_cached_when_the_cache_turns_over(smollm2: ModelTokenizer) -> None:
    """The cache fills up and turns over while the same words keep coming back: they never go
    through BPE again, where clearing the one dict sent every word of the next prompt
    through it."""
    encoder = AsciiByteLevelEncoder.build(smollm2.backend)
    assert encoder is not None
    cache = encoder._cache
    cache.max_words = 64
    calls = _count_bpe(cache)

    def word(prefix: str, i: int) -> str:  # letters only: one split word each
        return prefix + "".join(string.ascii_lowercase[int(d)] for d in str(i))

    hot = "".join(" " + word("q", i) for i in range(60))  # with 2 new words a prompt, the
    encoder.encode(hot)  # cache turns over every other prompt
    assert len(calls) == 60
    for i in range(20):
        text = f"{hot} {word('z', 2 * i)} {word('z', 2 * i + 1)}"
        assert encoder.encode(text) == _backend_ids(smollm2, text)
    assert len(calls) == 60 + 2 * 20  # only the new words
    assert cache.num_several <= 2 * 64


def test_prewarm_caches_the_one_token_words_as_a_miss_would(smollm2: ModelTokenizer) -> None:
    """A frontend fills the cache with the vocabulary's one-token words as it loads: a prompt
    of them then needs no BPE, and each entry is what a miss would have cached."""
    backend = smollm2.backend
    warm = AsciiByteLevelEncoder.build(backend)
    cold = AsciiByteLevelEncoder.build(backend)
    assert warm is not None and cold is not None
    num = warm.prewarm()
    assert num > 40_000 and warm.prewarm() == 0  # once
    rng = random.Random(3)
    sample = rng.sample(sorted(warm._cache), 2000)
    for word in sample:
        assert warm._cache[word] == cold._cache[word]  # cold: through __missing__ (BPE)
    calls = _count_bpe(warm._cache)
    text = "".join(w for w in sample if w.startswith(" ") and w[1:].isalpha())
    assert warm.encode(text) == _backend_ids(smollm2, text)
    assert calls == []


def test_threads_encoding_while_the_cache_turns_over_get_exact_ids(
    smollm2: ModelTokenizer,
) -> None:
    """A frontend encodes on its loop and in threads at once; turn-overs (every 64 new words
    here) happen while the other thread adds words, and every prompt's ids stay exact."""
    import sys
    import threading

    encoder = AsciiByteLevelEncoder.build(smollm2.backend)
    assert encoder is not None
    encoder._cache.max_words = 64
    failures: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for i in range(300):
                text = f"thread{k} request{i} user{i * 7919 + k} item{i}x{k} again"
                assert encoder.encode(text) == _backend_ids(smollm2, text)
        except BaseException as exc:
            failures.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        sys.setswitchinterval(interval)
    assert not failures, failures[0]
    assert encoder._cache.num_several <= 2 * 64 + 4  # each thread may add one past a turn-over
