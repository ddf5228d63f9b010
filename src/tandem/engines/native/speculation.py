"""Prompt-lookup speculative decoding: n-gram drafts from the sequence's own tokens, verified
by the target model in one forward of k+1 positions.

Drafting (`NgramProposer`): the longest suffix of the sequence's tokens (prompt + output), n
from `ngram_max` down to `ngram_min`, that occurred earlier in the sequence; its most recent
earlier occurrence proposes the (up to) k tokens that followed it. No second model.

Verification (`accept_greedy`, `accept_sampled`): the sequence's last token and its k draft
tokens run as k+1 query positions (the chunked-prefill attention path); row j gives the
target's distribution after draft token j-1. Greedy keeps the longest prefix where the
target's argmax equals the draft, plus the target's own next token. Temperature > 0 is
speculative sampling with the draft as a point-mass proposal: draft token x is accepted with
probability p(x); on rejection the token is drawn from p with x removed (renormalised), which
leaves the output distribution exactly p. Either way a step yields 1..k+1 tokens.

Which requests draft (`can_speculate`): only where every row's distribution is the same
function of the logits whatever position it samples at. Penalties and logit_bias (the batched
penalty pass counts output tokens a draft has not committed), logprobs (one value per emitted
token is reported by the sampler), structured output (the grammar advances per token) and a
pending min_tokens decode without speculation; they are correct, just not faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tandem.engines.native.penalties import has_penalties
from tandem.engines.native.sequence import Sequence


class NgramProposer:
    """Stateless apart from its limits; thread-compatible (no shared mutable state)."""

    def __init__(self, num_tokens: int, ngram_min: int, ngram_max: int) -> None:
        self.num_tokens = num_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to min(k, max_tokens) tokens that followed the longest recent match of the
        sequence's suffix; [] when no n-gram of at least `ngram_min` tokens recurs."""
        k = self.num_tokens if max_tokens is None else min(self.num_tokens, max_tokens)
        n = len(token_ids)
        if k <= 0 or n <= self.ngram_min:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        # ends of earlier occurrences of the last token (the suffix itself excluded)
        ends = np.flatnonzero(arr[: n - 1] == arr[n - 1])
        if ends.size == 0:
            return []
        length = np.ones(ends.size, dtype=np.int64)
        alive = np.ones(ends.size, dtype=bool)
        for m in range(1, min(self.ngram_max, n - 1)):
            back = ends - m
            alive &= back >= 0
            alive[alive] = arr[back[alive]] == arr[n - 1 - m]
            if not alive.any():
                break
            length += alive
        best = int(length.max())
        if best < self.ngram_min:
            return []
        end = int(ends[np.flatnonzero(length == best)[-1]])  # most recent of the longest
        draft: list[int] = arr[end + 1 : end + 1 + k].tolist()
        return draft


def can_speculate(seq: Sequence) -> bool:
    """True when `seq` may decode with a draft (see the module docstring for why not)."""
    params = seq.sampling
    return (
        params.logprobs is None
        and seq.grammar is None
        and not has_penalties(params)
        and seq.num_output_tokens >= seq.stop.min_tokens
    )


def accept_greedy(draft: list[int], target: list[int]) -> list[int]:
    """Tokens a greedy step emits: the draft's prefix the target's argmaxes (`target`, one
    per verified row, len(draft) + 1) agree with, then the target's next token."""
    assert len(target) == len(draft) + 1, "one target token per draft token plus one"
    out: list[int] = []
    for x, t in zip(draft, target, strict=False):
        if x != t:
            break
        out.append(x)
    out.append(target[len(out)])
    return out


def accept_sampled(
    probs: torch.Tensor, draft: list[int], generator: torch.Generator | None
) -> list[int]:
    """Tokens a sampled step emits, from the target's distributions `probs` [len(draft) + 1,
    vocab] (CPU, rows sum to 1): draft token x at row j is kept with probability p_j(x); the
    first rejection draws from p_j without x instead and ends the step; a fully accepted
    draft adds a draw from the last row."""
    assert probs.shape[0] == len(draft) + 1, "one distribution per draft token plus one"
    out: list[int] = []
    for j, x in enumerate(draft):
        p = probs[j]
        if float(torch.rand(1, generator=generator)) < float(p[x]):
            out.append(x)
            continue
        residual = p.clone()
        residual[x] = 0.0  # p(x) < 1 here (u < 1 always accepts p(x) = 1): mass remains
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=generator)))
    return out


@dataclass(slots=True)
class SpecStats:
    """Counters since start, per sequence-step; written by the engine thread only (a scrape
    reads plain ints)."""

    num_decode_steps: int = 0  # sequence-steps that decoded (with or without a draft)
    num_decode_tokens: int = 0  # tokens those steps emitted
    num_drafts: int = 0  # sequence-steps that verified a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0  # draft tokens the target agreed with

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def tokens_per_step(self) -> float:
        return self.num_decode_tokens / self.num_decode_steps if self.num_decode_steps else 0.0

    def prometheus_lines(self) -> list[str]:
        p = "tandem_native_spec"
        lines: list[str] = []
        for name, value, what in (
            ("decode_steps", self.num_decode_steps, "sequence-steps that decoded"),
            ("decode_tokens", self.num_decode_tokens, "tokens emitted by decoding steps"),
            ("drafts", self.num_drafts, "sequence-steps that verified an n-gram draft"),
            ("draft_tokens", self.num_draft_tokens, "draft tokens verified"),
            ("accepted_tokens", self.num_accepted_tokens, "draft tokens accepted"),
        ):
            lines += [
                f"# HELP {p}_{name}_total {what}",
                f"# TYPE {p}_{name}_total counter",
                f"{p}_{name}_total {value}",
            ]
        for name, rate, what in (
            ("acceptance_rate", self.acceptance_rate, "accepted / verified draft tokens"),
            ("tokens_per_step", self.tokens_per_step, "tokens per decoding sequence-step"),
        ):
            lines += [
                f"# HELP {p}_{name} {what}, since start",
                f"# TYPE {p}_{name} gauge",
                f"{p}_{name} {rate}",
            ]
        return lines


MAX_BACKOFF_STEPS = 32  # the longest run of plain steps after drafts that failed in a row


class Speculator:
    """What the scheduler asks for a decoding sequence's draft, within the request's limits.
    Not thread-safe (engine thread)."""

    def __init__(
        self, proposer: NgramProposer, *, max_model_len: int, capacity_tokens: int
    ) -> None:
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.capacity_tokens = capacity_tokens
        self.stats = SpecStats()

    def draft(self, seq: Sequence, budget: int) -> list[int]:
        """Draft tokens for `seq`'s next step using at most `budget` extra positions, capped so
        the step cannot emit past max_tokens or the model's length ([] when none fit)."""
        if not can_speculate(seq):
            return []
        if seq.spec_skip > 0:
            seq.spec_skip -= 1
            return []
        room = min(
            budget,
            seq.stop.max_tokens - seq.num_output_tokens - 1,
            min(self.max_model_len, self.capacity_tokens) - len(seq.token_ids) - 1,
        )
        if room <= 0:
            return []
        return self.proposer.propose(seq.token_ids, room)

    def record(self, seq: Sequence, num_emitted: int) -> None:
        """Count a decoding step of `seq` that emitted `num_emitted` tokens (its draft, if
        any, still in `draft_token_ids`). A draft of which nothing was accepted doubles the
        sequence's backoff (1, 2, 4, ... MAX_BACKOFF_STEPS plain steps before it drafts
        again); an accepted token resets it. Free chat, where n-grams recur by chance and
        drafts fail, then pays a verification about once every MAX_BACKOFF_STEPS steps."""
        stats = self.stats
        stats.num_decode_steps += 1
        stats.num_decode_tokens += num_emitted
        drafted = len(seq.draft_token_ids)
        if not drafted:
            return
        accepted = num_emitted - 1  # the last token is the target's own
        stats.num_drafts += 1
        stats.num_draft_tokens += drafted
        stats.num_accepted_tokens += accepted
        if accepted > 0:
            seq.spec_backoff = 0
        else:
            seq.spec_backoff = min(2 * seq.spec_backoff or 1, MAX_BACKOFF_STEPS)
            seq.spec_skip = seq.spec_backoff
