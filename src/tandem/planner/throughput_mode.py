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
A target the engine cannot meet even alone (S ≥ T, ITL(1) > target) falls back to ρ = 0.5
and b = 1: the forecast load is still served, as close to the target as the engine allows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.engines.profile import EngineProfile
from tandem.planner.predictor import Predictor, make_predictor

MIN_UTILISATION = 0.5  # when the target is unreachable


@dataclass(frozen=True, slots=True)
class Forecast:
    request_rate: float
    isl: float
    osl: float
    kv_hit_rate: float = 0.0


class TrafficForecaster:
    """One predictor each for rate, ISL, OSL and hit rate; `observe` once per interval."""

    def __init__(self, predictor: str) -> None:
        self._rate: Predictor = make_predictor(predictor)
        self._isl: Predictor = make_predictor(predictor)
        self._osl: Predictor = make_predictor(predictor)
        self._hit: Predictor = make_predictor(predictor)
        self.num_observed = 0

    def observe(self, rate: float, isl: float | None, osl: float | None, hit: float) -> None:
        self._rate.observe(rate)
        if isl is not None and osl is not None:  # lengths only from intervals that finished any
            self._isl.observe(isl)
            self._osl.observe(osl)
            self._hit.observe(hit)
        self.num_observed += 1

    def forecast(self) -> Forecast:
        return Forecast(
            request_rate=self._rate.predict(),
            isl=self._isl.predict(),
            osl=self._osl.predict(),
            kv_hit_rate=min(max(self._hit.predict(), 0.0), 1.0),
        )


def prefill_share(f: Forecast, profile: EngineProfile, ttft_target_ms: float) -> float:
    """Engines' worth of prefill work (unrounded) to keep TTFT under target."""
    isl_eff = f.isl * (1.0 - f.kv_hit_rate)
    if f.request_rate <= 0 or isl_eff <= 0:
        return 0.0
    service_s = profile.ttft_ms(isl_eff) / 1000.0
    target_s = ttft_target_ms / 1000.0
    if service_s >= target_s:
        rho = MIN_UTILISATION
    else:
        rho = min(2 * (target_s - service_s) / (2 * target_s - service_s), 0.95)
    return f.request_rate * service_s / rho


def best_decode_batch(f: Forecast, profile: EngineProfile, itl_target_ms: float) -> int:
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
    if f.request_rate <= 0 or f.osl <= 0:
        return 0.0
    batch = best_decode_batch(f, profile, itl_target_ms)
    itl_s = profile.itl_ms(batch, f.isl + f.osl / 2) / 1000.0
    concurrent = f.request_rate * f.osl * itl_s
    return concurrent / batch


def aggregated_share(
    f: Forecast, profile: EngineProfile, ttft_target_ms: float, itl_target_ms: float, margin: float
) -> float:
    if f.request_rate <= 0:
        return 0.0
    isl_eff = f.isl * (1.0 - f.kv_hit_rate)
    service_s = profile.ttft_ms(isl_eff) / 1000.0
    by_ttft = prefill_share(f, profile, ttft_target_ms * margin)
    rho_ttft = f.request_rate * service_s / by_ttft if by_ttft else 0.95
    context = f.isl + f.osl / 2
    n = max(by_ttft, 1.0)
    for _ in range(4):
        d_ms = profile.itl_ms(1, context)
        batch = max(f.request_rate * f.osl * d_ms / 1000.0 / n, 1.0)
        d_ms = profile.itl_ms(batch, context)
        rho_itl = max(1.0 - d_ms / (itl_target_ms * margin), 0.05)
        n = f.request_rate * service_s / min(rho_ttft, rho_itl)
    return max(n, decode_share(f, profile, itl_target_ms * margin))


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
