"""A word-cache encoder for ASCII text under GPT-2-style byte-level BPE (SmolLM2, GPT-2, ...).

Why: `tokenizers` 0.2x spends most of a long prompt's encode in its regex pre-tokenizer, and
grows faster than linearly with the text (docs/perf-frontend.md: ~3.5 µs per token at 6000
tokens, more at 32000). For ASCII text the GPT-2 split pattern needs no Unicode tables, so the
stdlib `re` splits it in C, and a word → ids cache replaces BPE for every word seen before; the
ids of a prompt are then one `chain` over cached tuples, with no per-word Python frame.

Exactness: the same added-token extraction (leftmost-longest), the same split pattern (its
ASCII reading: `\\p{L}` = A-Za-z, `\\p{N}` = 0-9, `\\s` = the six ASCII White_Space chars) and the
model's own BPE for a word not in the cache. `ascii_split.c` runs the split and the lookups
in one C pass (~4x faster than `re`, which costs ~140 ns a word); without a compiler or the
Python headers the `re` path stands in. `AsciiByteLevelEncoder.build` accepts only
tokenizers of exactly that shape (no normalizer or post-processor, ByteLevel without prefix
space, plain added tokens) and checks itself against the backend on a probe text; non-ASCII
text always goes to the backend. Thread-safe: the cache is a dict filled under the GIL.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import re
import sysconfig
import threading
from itertools import chain
from pathlib import Path
from types import ModuleType
from typing import Any

from tokenizers import Tokenizer

from tandem.tokens.byte_level import BYTE_TO_CHAR, token_bytes

logger = logging.getLogger(__name__)

# Every distinct word of every prompt lands here (numbers, ids, names: most never repeat),
# ~190 B each with its ids: 2**17 words grew a frontend by ~25 MB before the first clear,
# which a soak saw as RSS rising without levelling. So the words of several tokens turn over
# in two generations of 2**14 (~6 MB), which hold those that do repeat, and a miss costs one
# BPE call. A word of one token is kept for good: there are at most as many as the
# vocabulary has tokens (each is its token's text), so they are bounded without turning over,
# and a conversation's words stay cached from one turn to the next however many conversations
# interleave (in one generation of 2**14 words of any kind, a frontend serving 80 agent
# sessions ran BPE again on ~1000 history words a turn: 1.5 ms more preprocessing a request
# than four frontends serving 20 sessions each).
MAX_CACHED_WORDS = 1 << 14
_WS = " \\t\\n\\x0b\\x0c\\r"  # ASCII White_Space, as the backend's \s
SPLIT_PATTERN = re.compile(
    "'s|'t|'re|'ve|'m|'ll|'d"
    f"| ?[A-Za-z]+| ?[0-9]+| ?[^{_WS}A-Za-z0-9]+|[{_WS}]+(?![^{_WS}])|[{_WS}]+"
)
_TO_BYTE_LEVEL = {b: BYTE_TO_CHAR[b] for b in range(128)}
PROBE_TEXT = (
    "Hello, world! It's 2026-11-24T00:05 and we've 3.14159 reasons; you'll see. "
    "<|im_start|>user\nWhat's   up?\t\tTabs\r\n\n  spaces   <|im_end|>\n"
    "def f(x):\n    return x**2  # comment\n\n\nfinal_line_123abc ABC'S 'd 'll\x0b\x0c\x01~`"
)


class OverBudget(Exception):
    """An `encode` with a `miss_budget` met more words to run BPE on than its budget."""


_budget = threading.local()  # per thread: an inline encode's budget is not a thread's


class _WordCache(dict[str, tuple[int, ...]]):
    """word (ASCII, as split) → its BPE ids; a miss runs the model's BPE once.

    A word of one token stays (at most one per token of the vocabulary). Words of several
    tokens come in two generations, each at most `max_words`: the ones in the dict itself
    (the one lookups hit first) and the previous ones. A word found only in the previous
    generation moves back in; a full generation becomes the previous one. A word that comes
    back before two turn-overs therefore stays cached, where clearing one dict sent every word
    of the next prompts through BPE at once (a 5000-word prompt: ~16 ms of BPE against 0.4 ms
    cached, on whichever requests came after the clear, whenever the words in use
    outnumbered the bound)."""

    def __init__(self, backend: Tokenizer) -> None:
        super().__init__()
        self._model = backend.model
        self._previous: dict[str, tuple[int, ...]] = {}
        self._num_words = 0  # words of several tokens in the current generation
        self.max_words = MAX_CACHED_WORDS

    def __missing__(self, word: str) -> tuple[int, ...]:
        ids = self._previous.get(word)
        if ids is None:
            left = getattr(_budget, "misses", None)
            if left is not None:
                if left <= 0:
                    raise OverBudget(word)
                _budget.misses = left - 1
            ids = self.bpe(word)
        if len(ids) > 1:
            if self._num_words >= self.max_words:
                self._turn_over()
            self._num_words += 1
        self[word] = ids
        return ids

    def bpe(self, word: str) -> tuple[int, ...]:
        """The model's BPE of one ASCII word (what a miss caches)."""
        return tuple(t.id for t in self._model.tokenize(word.translate(_TO_BYTE_LEVEL)))

    def _turn_over(self) -> None:
        """The generation's words of several tokens become the previous one (the older is
        dropped); the words of one token stay. The items are copied in one C call first: the
        comprehensions run bytecode, where another thread's encode may add a word."""
        items = list(self.items())
        self._previous = {w: ids for w, ids in items if len(ids) > 1}
        ones = {w: ids for w, ids in items if len(ids) == 1}
        self.clear()
        self.update(ones)
        self._num_words = 0

    @property
    def num_several(self) -> int:
        """Words of several tokens held, both generations."""
        return self._num_words + len(self._previous)


class AsciiByteLevelEncoder:
    """`encode(text)` equals `backend.encode(text, add_special_tokens=False).ids` for ASCII."""

    def __init__(self, backend: Tokenizer, added: dict[str, int]) -> None:
        self._backend = backend
        self._prewarmed = False
        self._cache = _WordCache(backend)
        self._added = added
        names = sorted(added, key=len, reverse=True)  # first alternative = longest match
        self._added_pattern = re.compile("|".join(map(re.escape, names))) if names else None

    def prewarm(self) -> int:
        """Cache every word of one token: each vocabulary token whose text is one ASCII word
        of the split and whose BPE is itself. A frontend does it as it loads the model
        (~0.2 s, ~9 MB for SmolLM2's 48k), so the first prompts after a start need BPE only
        for their words of several tokens: a cold 4000-word prompt costs ~15 ms of BPE, and
        a burst of them at start queued behind one another on the GIL. Returns the count."""
        if self._prewarmed:  # a process's tokenizer serves every model that loads it
            return 0
        self._prewarmed = True
        cache, num = self._cache, 0
        for spelled in self._backend.get_vocab(with_added_tokens=False):
            raw = token_bytes(spelled)
            if raw is None or not raw.isascii():
                continue
            word = raw.decode("ascii")
            if word in self._added or not SPLIT_PATTERN.fullmatch(word):
                continue
            ids = cache.bpe(word)
            if len(ids) == 1:  # what a miss would cache; one-token words are kept for good
                cache[word] = ids
                num += 1
        return num

    @classmethod
    def build(cls, backend: Tokenizer) -> AsciiByteLevelEncoder | None:
        """The encoder for `backend`, or None when its shape is not the one this mirrors."""
        config = json.loads(backend.to_str())
        if not _is_plain_byte_level(config):
            return None
        added = {t["content"]: int(t["id"]) for t in config.get("added_tokens") or ()}
        encoder = cls(backend, added)
        if encoder.encode(PROBE_TEXT) != backend.encode(PROBE_TEXT, add_special_tokens=False).ids:
            logger.warning("ASCII word-cache encoder disagrees with the tokenizer; not used")
            return None
        return encoder

    def encode(self, text: str, *, miss_budget: int | None = None) -> list[int]:
        """Token ids of ASCII `text` (the caller checks `text.isascii()`): added tokens by
        their id, the text between them word by word through the cache. With `miss_budget`,
        OverBudget once more than that many words need BPE (the words done stay cached)."""
        _budget.misses = miss_budget
        try:
            return self._encode(text)
        finally:
            _budget.misses = None

    def _encode(self, text: str) -> list[int]:
        c = _c_split()
        encode_span = c.encode if c is not None else _encode_span
        out: list[int] = []
        cache, pattern, start = self._cache, self._added_pattern, 0
        if pattern is not None:
            for match in pattern.finditer(text):
                if match.start() > start:
                    encode_span(text, start, match.start(), cache, out)
                out.append(self._added[match.group()])
                start = match.end()
        if start < len(text):
            encode_span(text, start, len(text), cache, out)
        return out


def _encode_span(
    text: str, start: int, end: int, cache: dict[str, tuple[int, ...]], out: list[int]
) -> None:
    """`ascii_split.c`'s encode in Python: out += cache[w] for each word w of text[start:end]."""
    out.extend(chain.from_iterable(map(cache.__getitem__, SPLIT_PATTERN.findall(text, start, end))))


_C_SOURCE = Path(__file__).with_name("ascii_split.c")
_c_lock = threading.Lock()
_c_state: list[ModuleType | None] = []  # [] until tried; [None] when it did not build


def _c_split() -> ModuleType | None:
    """ascii_split.c as a module, built once (cached on disk by source and flags); None with
    one log line when there is no compiler or no Python headers."""
    if not _c_state:
        with _c_lock:
            if not _c_state:
                _c_state.append(_load_c())
    return _c_state[0]


def _load_c() -> ModuleType | None:
    from tandem.cbuild import CBuildError, compile_c

    include = sysconfig.get_paths()["include"]
    flags = ("-O2", "-shared", "-fPIC", "-std=c11", f"-I{include}")
    try:
        if not (Path(include) / "Python.h").exists():
            raise CBuildError(f"no Python.h under {include}")
        path = compile_c(_C_SOURCE, "ascii_split", flags)
        spec = importlib.util.spec_from_file_location("tandem_ascii_split", path)
        if spec is None or spec.loader is None:
            raise CBuildError(f"{path} is not loadable as an extension module")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except (CBuildError, ImportError, OSError) as exc:
        logger.warning("ASCII prompts are split by `re` (the C split did not build): %s", exc)
        return None
    return module


def load_c_split() -> bool:
    """Build and load the C split now (at startup, not on the first request); whether it did."""
    return _c_split() is not None


def _is_plain_byte_level(config: dict[str, Any]) -> bool:
    pre = config.get("pre_tokenizer") or {}
    model = config.get("model") or {}
    added_plain = all(
        not (t.get("lstrip") or t.get("rstrip") or t.get("single_word"))
        for t in config.get("added_tokens") or ()
    )
    return (
        config.get("normalizer") is None
        and config.get("post_processor") is None
        and config.get("truncation") is None
        and config.get("padding") is None
        and pre.get("type") == "ByteLevel"
        and not pre.get("add_prefix_space")
        and pre.get("use_regex", True)
        and model.get("type") == "BPE"
        and not model.get("dropout")
        and added_plain
    )
