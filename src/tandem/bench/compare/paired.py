"""Paired per-round differences with a confidence interval, and a verdict read from it.

`tandem bench vllm` runs tandem and vLLM's own server on the same load, round by round (A-B-B-A
order, fresh prompts per round); each round gives one paired value per metric: tandem's TTFT
p50 minus vLLM's, tandem's output tokens/s over vLLM's. Round-to-round noise on a shared CPU
is large next to a 5 ms target (differences spread +-20 ms at concurrency 1 and -322..+180 ms
at 8 on a 2-core host), so a median of a few rounds decides nothing; the verdict comes from a
confidence interval of the paired values instead.

The interval is Student's t interval for the mean of n paired values, mean +- t(n-1) * s/sqrt(n):
exact for normal values at any n >= 2 and the usual choice for few pairs. Each value is a
difference (or ratio) of two medians of many requests, close to normal; the A-B-B-A order
cancels a linear drift between the systems. A bootstrap is not used: its percentile interval
covers far less than its nominal level below ~10 pairs. The verdict against a target bound:
met when the whole interval is on the right side of it, missed when the whole interval is on
the wrong side, unresolved while it straddles it. Checking after every round and stopping once
resolved (`tandem bench vllm`) looks several times, so the error rate is somewhat above
1 - confidence; `--confidence 0.99` makes it stricter.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

MET, MISSED, UNRESOLVED = "met", "missed", "unresolved"


@dataclass(frozen=True, slots=True)
class Interval:
    mean: float
    low: float
    high: float
    n: int
    confidence: float


def t_quantile(p: float, df: int) -> float:
    """The `p` quantile (0.5 < p < 1) of Student's t with `df` degrees of freedom: bisection on
    its distribution function, integrated by Simpson's rule (error < 1e-7 for df >= 1)."""
    if not 0.5 < p < 1 or df < 1:
        raise ValueError(f"t_quantile(p={p}, df={df}): expected 0.5 < p < 1 and df >= 1")
    low, high = 0.0, 1.0
    while _t_cdf(high, df) < p:
        high *= 2
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if _t_cdf(mid, df) < p else (low, mid)
    return (low + high) / 2


def _t_cdf(x: float, df: int, steps: int = 2000) -> float:
    """P(T <= x) for x >= 0."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def pdf(t: float) -> float:
        return math.exp(log_norm - (df + 1) / 2 * math.log1p(t * t / df))

    h = x / steps
    odd = sum(pdf((2 * i - 1) * h) for i in range(1, steps // 2 + 1))
    even = sum(pdf(2 * i * h) for i in range(1, steps // 2))
    return 0.5 + h / 3 * (pdf(0.0) + 4 * odd + 2 * even + pdf(x))


def paired_interval(values: Sequence[float], confidence: float = 0.95) -> Interval | None:
    """The t interval of the mean of `values` (one per round); None below 2 values."""
    if not 0 < confidence < 1:
        raise ValueError(f"confidence={confidence}: expected a value in (0, 1)")
    n = len(values)
    if n < 2:
        return None
    mean = statistics.fmean(values)
    half = t_quantile((1 + confidence) / 2, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, n, confidence)


def verdict(interval: Interval | None, target: float, *, at_most: bool) -> str:
    """`met` / `missed` / `unresolved` for "the mean is at most (at_most) / at least `target`"."""
    if interval is None:
        return UNRESOLVED
    good, bad = (interval.high, interval.low) if at_most else (-interval.low, -interval.high)
    bound = target if at_most else -target
    if good <= bound:
        return MET
    if bad > bound:
        return MISSED
    return UNRESOLVED


def combined(verdicts: Sequence[str]) -> str:
    """Missed if any is, met if all are, else unresolved."""
    if MISSED in verdicts:
        return MISSED
    return MET if verdicts and all(v == MET for v in verdicts) else UNRESOLVED
