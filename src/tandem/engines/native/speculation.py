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

How many tokens a draft carries (`Speculator.draft`, `--spec-length`): "fixed" drafts what the
match offers up to k. "adaptive" (the default) drafts the length, 0..k, that maximises the
step's expected tokens per millisecond: the sequence's recent odds (`DraftOdds`: how often a
draft's first token holds, how often a token holds once the one before it did) against what a
verified row costs beside the step it rides on (`StepCost`: the engine's own decode steps fitted
as fixed + per-row ms). At batch 1 a copied span drafts long and free text short; in a large
batch, where a row costs about what a plain token does, only a sequence whose drafts hold
nearly always drafts. Before the engine has timed two step sizes, drafts are k long.

Which requests draft (`can_speculate`): only where every row's distribution is the same
function of the logits whatever position it samples at. Penalties and logit_bias (the batched
penalty pass counts output tokens a draft has not committed), logprobs (one value per emitted
token is reported by the sampler), structured output (the grammar advances per token) and a
pending min_tokens decode without speculation; they are correct, just not faster.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from tandem.engines.native.draft_odds import expected_tokens
from tandem.engines.native.penalties import has_penalties

if TYPE_CHECKING:
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


class StepCost:
    """A decode step's wall time as fixed + per_row · rows, from the engine's own steps that
    only decoded (plain and verifying): what a draft's rows add to the step they ride on.
    Per row count the median of its last `window` steps (a step the host stole the CPU from
    does not move it), at most `max_sizes` row counts (least recently seen dropped), and a
    least-squares line through those medians. Engine thread only."""

    def __init__(self, window: int = 8, max_sizes: int = 32) -> None:
        self._window = window
        self._max_sizes = max_sizes
        self._steps: OrderedDict[int, deque[float]] = OrderedDict()
        self._medians: dict[int, float] = {}
        self._line: tuple[float, float] | None = None
        self._stale = False

    def observe(self, rows: int, ms: float) -> None:
        if rows < 1 or not ms > 0:
            return
        steps = self._steps.get(rows)
        if steps is None:
            steps = self._steps[rows] = deque(maxlen=self._window)
            if len(self._steps) > self._max_sizes:
                old, _ = self._steps.popitem(last=False)
                del self._medians[old]
        self._steps.move_to_end(rows)
        steps.append(ms)
        self._medians[rows] = statistics.median(steps)
        self._stale = True

    def line(self) -> tuple[float, float] | None:
        """(fixed ms, ms per row); None until two row counts were timed, or when the fit
        says a row is free or a 1-row step takes no time (nothing to weigh drafts by)."""
        if self._stale:
            self._stale = False
            self._line = None
            if len(self._medians) >= 2:
                rows = list(self._medians)
                ms = list(self._medians.values())
                mean_r, mean_ms = statistics.fmean(rows), statistics.fmean(ms)
                var = sum((r - mean_r) ** 2 for r in rows)
                slope = (
                    sum((r - mean_r) * (m - mean_ms) for r, m in zip(rows, ms, strict=True)) / var
                )
                fixed = mean_ms - slope * mean_r
                if slope > 0 and fixed + slope > 0:
                    self._line = (fixed, slope)
        return self._line


def best_length(
    rates: tuple[float, float], length: int, line: tuple[float, float], seqs: int, rows: int
) -> int:
    """The draft length, 0..`length`, with the most expected tokens per ms for the whole step
    at the draft's (p_first, p_next) `rates`: `seqs` sequences in the step, `rows` rows before
    this draft, each draft token one row more."""
    fixed, per_row = line
    best, best_rate = 0, 0.0
    for k, tokens in enumerate(expected_tokens(rates, length)):
        rate = (seqs - 1 + tokens) / (fixed + per_row * (rows + k))
        if rate > best_rate:
            best, best_rate = k, rate
    return best


class Speculator:
    """What the scheduler asks for a decoding sequence's draft, within the request's limits.
    Not thread-safe (engine thread)."""

    def __init__(
        self,
        proposer: NgramProposer,
        *,
        max_model_len: int,
        capacity_tokens: int,
        adaptive: bool = True,
    ) -> None:
        self.proposer = proposer
        self.max_model_len = max_model_len
        self.capacity_tokens = capacity_tokens
        self.adaptive = adaptive
        self.cost = StepCost()
        self.stats = SpecStats()

    def draft(self, seq: Sequence, budget: int, *, seqs: int = 1, rows: int = 1) -> list[int]:
        """Draft tokens for `seq`'s next step using at most `budget` extra positions, capped so
        the step cannot emit past max_tokens or the model's length ([] when none fit); the
        step has `seqs` sequences and `rows` rows so far (this sequence's own included)."""
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
        if self.adaptive and (line := self.cost.line()) is not None:
            odds = seq.spec_odds
            rates = odds.rates()
            room = min(room, best_length(rates, room, line, seqs, rows))
            if room == 0:
                if odds.idle < MAX_BACKOFF_STEPS:
                    odds.idle += 1
                    return []
                room = 1  # a one-token probe now and then: the odds move only by drafting
        return self.proposer.propose(seq.token_ids, room)

    def prometheus_lines(self) -> list[str]:
        """The counters (SpecStats) and, once fitted, what the draft length weighs: a step's
        fixed ms and ms per row."""
        lines = self.stats.prometheus_lines()
        line = self.cost.line()
        if line is None:
            return lines
        p = "tandem_native_spec"
        for name, value, what in (
            ("step_fixed_ms", line[0], "fixed ms of a decode step (fit of recent steps)"),
            ("step_row_ms", line[1], "ms a decode step adds per row, draft rows included"),
        ):
            lines += [
                f"# HELP {p}_{name} {what}",
                f"# TYPE {p}_{name} gauge",
                f"{p}_{name} {value}",
            ]
        return lines

    def observe_step(self, rows: int, ms: float) -> None:
        """A step that only decoded (plain or verifying) ran `rows` rows in `ms`."""
        self.cost.observe(rows, ms)

    def record(self, seq: Sequence, num_emitted: int) -> None:
        """Count a decoding step of `seq` that emitted `num_emitted` tokens (its draft, if
        any, still in `draft_token_ids`) and add it to the sequence's odds. A draft of which
        nothing was accepted doubles the sequence's backoff (1, 2, 4, ... MAX_BACKOFF_STEPS
        plain steps before it drafts again); an accepted token resets it. Free chat, where
        n-grams recur by chance and drafts fail, then pays a verification about once every
        MAX_BACKOFF_STEPS steps."""
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
        seq.spec_odds.add(drafted, accepted)
        seq.spec_odds.idle = 0
        if accepted > 0:
            seq.spec_backoff = 0
        else:
            seq.spec_backoff = min(2 * seq.spec_backoff or 1, MAX_BACKOFF_STEPS)
            seq.spec_skip = seq.spec_backoff
