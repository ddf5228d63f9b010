"""The KV-aware cost of DESIGN.md §7 and the choice among candidates. Pure functions.

prefill_blocks(w) = (active_prefill_tokens(w) + max(ISL − overlap_blocks(w)·B, 0)) / B
decode_blocks(w)  = active_blocks(w) + request blocks not already active on w
cost(w)           = overlap_weight · slowness(w) · prefill_blocks(w) + decode_blocks(w)

slowness(w): w's measured prefill ms per token over the fastest candidate's (router/step_speed.py;
1 for equal or unmeasured workers), so prefill blocks weigh what they take on w.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.router.fetch import FetchPlan


@dataclass(frozen=True, slots=True, kw_only=True)
class CandidateCost:
    worker_id: str
    overlap_blocks: float  # device prefix depth plus partial credit for host/disk tiers
    prefill_blocks: float
    decode_blocks: float
    cost: float
    cached_blocks: int  # size of the worker's cached set (tie-break: smaller first)
    is_busy: bool = False
    prefill_slowness: float = 1.0  # measured prefill ms/token over the fastest candidate's
    fetch: FetchPlan | None = None  # a peer KV fetch that pays (router/fetch.py), if any


def tiered_overlap(
    device: int, device_host: int, any_tier: int, *, host_credit: float, disk_credit: float
) -> float:
    """Prefix depth with partial credit: blocks that extend the device prefix from host
    count `host_credit`, from disk or remote `disk_credit`."""
    return device + host_credit * (device_host - device) + disk_credit * (any_tier - device_host)


def candidate_cost(
    *,
    worker_id: str,
    num_tokens: int,
    block_size: int,
    overlap_blocks: float,
    active_prefill_tokens: int,
    active_blocks: int,
    num_new_blocks: int,
    overlap_weight: float,
    prefill_slowness: float = 1.0,
    cached_blocks: int = 0,
    is_busy: bool = False,
    fetch: FetchPlan | None = None,
) -> CandidateCost:
    """`num_new_blocks`: request blocks (including a partial last one) not active on w.
    A `fetch` that pays adds its credit (fetched blocks net of the fetch's time) to the
    overlap; one that does not is dropped."""
    if fetch is not None and not fetch.pays:
        fetch = None
    if fetch is not None:
        overlap_blocks += fetch.credit_blocks
    uncached_tokens = max(num_tokens - overlap_blocks * block_size, 0.0)
    prefill = (active_prefill_tokens + uncached_tokens) / block_size
    decode = float(active_blocks + num_new_blocks)
    return CandidateCost(
        worker_id=worker_id,
        overlap_blocks=overlap_blocks,
        prefill_blocks=prefill,
        decode_blocks=decode,
        cost=overlap_weight * prefill_slowness * prefill + decode,
        cached_blocks=cached_blocks,
        is_busy=is_busy,
        prefill_slowness=prefill_slowness,
        fetch=fetch,
    )


def choose(costs: Sequence[CandidateCost], temperature: float, rng: random.Random) -> CandidateCost:
    """Temperature 0: the minimum cost; ties by the longer overlap (the prompt's prefix stays
    where it is, or is being, computed), then the smaller cached set, then at random.
    Temperature T > 0: sample softmax(−normalised_cost / T), costs min-max normalised to [0, 1].
    `costs` must be non-empty."""
    if not costs:
        raise ValueError("choose() needs at least one candidate")
    if temperature <= 0.0:
        best = min(c.cost for c in costs)
        tied = [c for c in costs if math.isclose(c.cost, best, rel_tol=1e-12, abs_tol=1e-12)]
        deepest = max(c.overlap_blocks for c in tied)
        tied = [c for c in tied if c.overlap_blocks == deepest]
        smallest = min(c.cached_blocks for c in tied)
        tied = [c for c in tied if c.cached_blocks == smallest]
        return tied[0] if len(tied) == 1 else rng.choice(tied)
    return costs[_sample(softmax_weights([c.cost for c in costs], temperature), rng)]


def softmax_weights(costs: Sequence[float], temperature: float) -> list[float]:
    low, high = min(costs), max(costs)
    span = high - low
    normalised = [(c - low) / span if span > 0 else 0.0 for c in costs]
    exps = [math.exp(-n / temperature) for n in normalised]
    total = sum(exps)
    return [e / total for e in exps]


def _sample(weights: Sequence[float], rng: random.Random) -> int:
    x = rng.random()
    acc = 0.0
    for i, w in enumerate(weights):
        acc += w
        if x < acc:
            return i
    return len(weights) - 1
