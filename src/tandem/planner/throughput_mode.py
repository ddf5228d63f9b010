"""Throughput (SLA) mode (DESIGN.md §11): forecast the next interval's request rate, ISL and
OSL, and turn a measured engine profile into replicas per pool.

- prefill: one engine serves prompts of effective ISL (ISL × (1 − KV hit rate)) in S = the
  profile's TTFT at that length. As an M/D/1 queue, TTFT = S + ρ·S / (2(1 − ρ)) stays under
  the target T while the utilisation ρ ≤ 2(T − S) / (2T − S); replicas = ⌈rate · S / ρ⌉.
- decode: the largest batch b whose profiled ITL at the mean context (ISL + OSL/2) meets the
  target, whose KV (b × (ISL + OSL)) fits and b ≤ max_num_seqs; by Little's law
  rate · OSL · ITL(b) sequences decode at once; replicas = ⌈that / b⌉.
- aggregated: prefill and decode share the engines' steps. A decode step of d ms stretches to
  d / (1 − ρ) when a share ρ of the time computes prompts, so ITL meets the target × margin
  only while ρ ≤ 1 − d / (target × margin); the prefill utilisation is capped by that and by
  the TTFT bound (M/D/1 at TTFT target × margin): replicas = ⌈rate · S / min(ρ_ttft, ρ_itl)⌉,
  d taken at the batch each replica then decodes (a few fixed-point rounds).
The prefill utilisation is never planned below ρ = 0.5: a target the engine meets only
below it (S > 2T/3) or cannot meet even alone (S ≥ T) runs at ρ = 0.5, and an ITL target
unmet at b = 1 decodes with b = 1, so the forecast load is still served as close to the
target as the engine allows, and longer prompts never ask for fewer replicas.
Degenerate forecasts are defined: a rate of 0 wants 0 engines, prompts of 0 tokens (or a
profile that prefills in 0 ms) want only the decode share, and NaN, ±inf or negative
fields read 0 (the hit rate is clamped into [0, 1]); every share is finite and ≥ 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.engines.profile import EngineProfile
from tandem.planner.predictor import Predictor, make_predictor

MIN_UTILISATION = 0.5  # when the target is unreachable
MAX_OBSERVED = 1e12  # req/s or tokens: beyond any real interval, far from float overflow
MAX_REPLICAS = 1_000_000  # a bound on any answer (the planner caps at the pool's max_workers)


@dataclass(frozen=True, slots=True)
class Forecast:
    request_rate: float
    isl: float
    osl: float
    kv_hit_rate: float = 0.0


def _observed(x: float) -> float:
    return min(max(x, 0.0), MAX_OBSERVED)


class TrafficForecaster:
    """One predictor each for rate, ISL, OSL and hit rate; `observe` once per interval."""

    def __init__(self, predictor: str) -> None:
        self._rate: Predictor = make_predictor(predictor)
        self._isl: Predictor = make_predictor(predictor)
        self._osl: Predictor = make_predictor(predictor)
        self._hit: Predictor = make_predictor(predictor)
        self.num_observed = 0

    def observe(self, rate: float, isl: float | None, osl: float | None, hit: float) -> None:
        """Non-finite values (a 0/0 upstream) are not observed, the others are clamped into
        [0, MAX_OBSERVED] (the hit rate into [0, 1]): every forecast stays finite."""
        if math.isfinite(rate):
            self._rate.observe(_observed(rate))
        if isl is not None and osl is not None:  # lengths only from intervals that finished any
            if math.isfinite(isl) and math.isfinite(osl):
                self._isl.observe(_observed(isl))
                self._osl.observe(_observed(osl))
            if math.isfinite(hit):
                self._hit.observe(min(max(hit, 0.0), 1.0))
        self.num_observed += 1

    def forecast(self) -> Forecast:
        return Forecast(
            request_rate=self._rate.predict(),
            isl=self._isl.predict(),
            osl=self._osl.predict(),
            kv_hit_rate=min(max(self._hit.predict(), 0.0), 1.0),
        )


def _amount(x: float) -> float:
    """A forecast quantity as a finite amount ≥ 0: NaN, ±inf and negatives carry no usable
    information (the forecaster never yields them; a caller's arithmetic might) and read 0."""
    return x if math.isfinite(x) and x > 0 else 0.0


def _bounded(share: float) -> float:
    """A share within [0, MAX_REPLICAS]: an overflow (a profile extrapolated far past its
    grid) asks for the most, never for an infinite or NaN count."""
    return share if 0.0 <= share <= MAX_REPLICAS else (0.0 if share < 0 else float(MAX_REPLICAS))


def _clean(f: Forecast) -> Forecast:
    hit = f.kv_hit_rate if math.isfinite(f.kv_hit_rate) else 0.0
    return Forecast(
        request_rate=_amount(f.request_rate),
        isl=_amount(f.isl),
        osl=_amount(f.osl),
        kv_hit_rate=min(max(hit, 0.0), 1.0),
    )


def _prefill_utilisation(service_s: float, target_s: float) -> float:
    """Largest M/D/1 utilisation whose mean TTFT stays under `target_s` (MIN_UTILISATION
    when even an idle engine misses it), within [MIN_UTILISATION, 0.95]."""
    if service_s >= target_s:
        return MIN_UTILISATION
    return min(max(2 * (target_s - service_s) / (2 * target_s - service_s), MIN_UTILISATION), 0.95)


def _decode_utilisation(step_ms: float, target_ms: float) -> float:
    """Largest share of time prefill may take while steps of `step_ms` stretched by it stay
    under `target_ms`, within [0.05, 1]."""
    if target_ms <= 0:
        return 0.05
    return min(max(1.0 - step_ms / target_ms, 0.05), 1.0)


def prefill_share(f: Forecast, profile: EngineProfile, ttft_target_ms: float) -> float:
    """Engines' worth of prefill work (unrounded, finite, ≥ 0) to keep TTFT under target."""
    f = _clean(f)
    service_s = profile.ttft_ms(f.isl * (1.0 - f.kv_hit_rate)) / 1000.0
    if f.request_rate <= 0 or service_s <= 0:
        return 0.0
    rho = _prefill_utilisation(service_s, ttft_target_ms / 1000.0)
    return _bounded(f.request_rate * service_s / rho)


def best_decode_batch(f: Forecast, profile: EngineProfile, itl_target_ms: float) -> int:
    """The largest batch (≥ 1) whose ITL at the mean context meets the target and whose KV fits."""
    f = _clean(f)
    context = f.isl + f.osl / 2
    per_seq_kv = max(f.isl + f.osl, 1.0)
    cap = min(profile.max_num_seqs, int(profile.kv_capacity_tokens // per_seq_kv))
    best = 1
    lo, hi = 1, max(cap, 1)
    while lo <= hi:  # ITL grows with the batch: bisect the largest batch under target
        mid = (lo + hi) // 2
        if profile.itl_ms(mid, context) <= itl_target_ms:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


def decode_share(f: Forecast, profile: EngineProfile, itl_target_ms: float) -> float:
    """Engines' worth of decode work (unrounded, finite, ≥ 0) to keep ITL under target."""
    f = _clean(f)
    if f.request_rate <= 0 or f.osl <= 0:
        return 0.0
    batch = best_decode_batch(f, profile, itl_target_ms)
    itl_s = profile.itl_ms(batch, f.isl + f.osl / 2) / 1000.0
    concurrent = f.request_rate * f.osl * itl_s
    return _bounded(concurrent / batch)


def aggregated_share(
    f: Forecast, profile: EngineProfile, ttft_target_ms: float, itl_target_ms: float, margin: float
) -> float:
    """Engines' worth of work (unrounded, finite, ≥ 0) when every engine both prefills and
    decodes: the least n with n ≥ g(n) = rate · S / min(ρ_ttft, ρ_itl(d(batch(n)))), where
    each of max(n, 1) engines decodes rate · OSL · d(1) / max(n, 1) sequences; and at least
    the decode pool's share. g falls as n grows (smaller batches, shorter steps), so the
    least fixed point is found by bisection and grows with the rate."""
    f = _clean(f)
    if f.request_rate <= 0:
        return 0.0
    decode = decode_share(f, profile, itl_target_ms * margin)
    service_s = profile.ttft_ms(f.isl * (1.0 - f.kv_hit_rate)) / 1000.0
    if service_s <= 0:  # no prompt work: decode alone sizes the pool
        return decode
    context = f.isl + f.osl / 2
    work = f.request_rate * service_s  # engines' worth of prefill at 100 % utilisation
    rho_ttft = _prefill_utilisation(service_s, ttft_target_ms * margin / 1000.0)
    in_flight = f.request_rate * f.osl * profile.itl_ms(1, context) / 1000.0

    def g(n: float) -> float:
        batch = max(in_flight / max(n, 1.0), 1.0)
        rho_itl = _decode_utilisation(profile.itl_ms(batch, context), itl_target_ms * margin)
        return work / min(rho_ttft, rho_itl)

    # at hi every engine decodes one sequence, so g(hi) = g(∞) ≤ hi: a fixed point lies below
    hi = max(in_flight, 1.0, g(math.inf))
    lo = 0.0
    for _ in range(64):
        mid = (lo + hi) / 2
        if mid >= g(mid):
            hi = mid
        else:
            lo = mid
    return _bounded(max(hi, decode))


def replicas(
    kind: str,
    f: Forecast,
    profile: EngineProfile,
    ttft_target_ms: float,
    itl_target_ms: float,
    margin: float = 0.7,
) -> int:
    """Replicas of a pool of `kind` (prefill, decode, aggregated) for forecast `f` (≥ 0)."""
    if kind == "prefill":
        share = prefill_share(f, profile, ttft_target_ms)
    elif kind == "decode":
        share = decode_share(f, profile, itl_target_ms)
    else:
        share = aggregated_share(f, profile, ttft_target_ms, itl_target_ms, margin)
    return math.ceil(share - 1e-9)
