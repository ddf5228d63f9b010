"""Workloads: what the load generator sends, as a list of `RequestSpec`, and the text a chat
endpoint is sent for a prompt of token ids.

A workload is deterministic for a given seed: the same arguments give the same prompts (token
ids, or text for chat endpoints) in the same order. Sources: random ISL/OSL prompts, the
synthetic shared-prefix generator (groups × prompts per group) and Mooncake trace replay
(`tandem.bench.trace`). Send times, when a workload has them, are seconds from the run's start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from tandem.config_check import check_range

# Low ids are special tokens in most vocabularies (SmolLM2: 0..16); prompts never use them.
FIRST_PLAIN_TOKEN_ID = 32
DEFAULT_VOCAB_SIZE = 49152


class PromptSource(Protocol):
    """Builds a prompt's token ids on demand (trace prompts are too big to hold all at once)."""

    @property
    def input_length(self) -> int: ...

    def token_ids(self) -> list[int]: ...


@dataclass(slots=True, kw_only=True)
class RequestSpec:
    """One request to send: a prompt (token ids, a lazy `source` of them, or text), an output
    budget, an optional send time."""

    token_ids: list[int] = field(default_factory=list)
    source: PromptSource | None = None
    text: str | None = None
    max_tokens: int = 16
    ignore_eos: bool = True
    send_at_s: float | None = None
    group_id: int | None = None

    def prompt_token_ids(self) -> list[int]:
        return self.source.token_ids() if self.source is not None else self.token_ids

    @property
    def input_length(self) -> int:
        if self.source is not None:
            return self.source.input_length
        return len(self.token_ids) if self.token_ids else len((self.text or "").split())


@dataclass(frozen=True, slots=True, kw_only=True)
class SyntheticConfig:
    """Random prompts of `isl` tokens, or `num_groups` shared prefixes × `prompts_per_group`."""

    isl: int = 128
    osl: int = 32
    num_groups: int = 0
    prompts_per_group: int = 1
    prefix_len: int = 0
    suffix_len: int = 0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    seed: int = 0

    def __post_init__(self) -> None:
        check_range("isl", self.isl, low=1)
        check_range("osl", self.osl, low=1)
        check_range("prompts_per_group", self.prompts_per_group, low=1)
        check_range("num_groups", self.num_groups, low=0)
        check_range("prefix_len", self.prefix_len, low=0)
        check_range("suffix_len", self.suffix_len, low=0)
        check_range("vocab_size", self.vocab_size, low=FIRST_PLAIN_TOKEN_ID, low_open=True)
        if self.num_groups and self.prefix_len + self.suffix_len < 1:
            raise ValueError("prefix_len + suffix_len must be >= 1 with num_groups > 0")


def random_tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    """`n` token ids uniform over the plain (non-special) part of the vocabulary."""
    ids: list[int] = rng.integers(FIRST_PLAIN_TOKEN_ID, vocab_size, size=n, dtype=np.int64).tolist()
    return ids


def synthetic_requests(config: SyntheticConfig, num_requests: int) -> list[RequestSpec]:
    """`num_requests` prompts. With groups, request i belongs to group i % num_groups and uses
    prompt (i // num_groups) % prompts_per_group of that group: a group's prompts share its prefix,
    and the schedule cycles through groups so prefixes interleave as they do in real traffic."""
    rng = np.random.default_rng(config.seed)
    if not config.num_groups:
        return [
            RequestSpec(
                token_ids=random_tokens(rng, config.isl, config.vocab_size),
                max_tokens=config.osl,
            )
            for _ in range(num_requests)
        ]
    prefixes = [
        random_tokens(rng, config.prefix_len, config.vocab_size) for _ in range(config.num_groups)
    ]
    suffixes = [
        [
            random_tokens(rng, config.suffix_len, config.vocab_size)
            for _ in range(config.prompts_per_group)
        ]
        for _ in range(config.num_groups)
    ]
    specs = []
    for i in range(num_requests):
        group = i % config.num_groups
        prompt = (i // config.num_groups) % config.prompts_per_group
        specs.append(
            RequestSpec(
                token_ids=prefixes[group] + suffixes[group][prompt],
                max_tokens=config.osl,
                group_id=group,
            )
        )
    return specs


def poisson_send_times(rate_per_s: float, num_requests: int, seed: int = 0) -> list[float]:
    """Arrival times (s from start) of a Poisson process: exponential gaps with mean 1/rate.
    The first request goes at t=0."""
    if rate_per_s <= 0:
        raise ValueError(f"rate_per_s={rate_per_s} must be > 0")
    if num_requests <= 0:
        return []
    gaps = np.random.default_rng(seed).exponential(1.0 / rate_per_s, size=num_requests - 1)
    return [0.0, *np.cumsum(gaps).tolist()]


# Text prompts for chat endpoints, which take no token ids: `tokens_to_text` maps each token id
# to one common English word (most are a single token in BPE vocabularies with the leading
# space), so a prompt of n ids becomes roughly n tokens and prompts sharing a token-id prefix
# share a text prefix. Lengths are approximate; use `/v1/completions` with token-id prompts for
# exact lengths.
_WORDS_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there one all we their has been will more "
    "when would who so if out up no can its time only new some about could these two may "
    "first then do any like my now over such our man me even most made after also did "
    "many before must through back years where much your way well down should because "
    "each just those people how too little state good very make world still own see men "
    "work long get here between both life being under never day same another know while "
    "last might us great old year off come since against go came right used take three "
    "place house light water side city small home hand part high left large next early "
    "young point often world open room word car book line name game door food tree bird "
    "fish road hill ship wind rain snow sun "
)
WORDS = tuple(_WORDS_TEXT.split())


def tokens_to_text(token_ids: list[int]) -> str:
    words = WORDS
    n = len(words)
    return " ".join(words[t % n] for t in token_ids)
