"""Property tests of throughput mode's arithmetic: for any profile and any forecast, including
degenerate ones (0 tokens, 0 rate, a profile that prefills in 0 ms, NaN / inf / negative
fields), every share is finite and within [0, MAX_REPLICAS] and nothing raises; with a
profile whose times grow with length and batch, the answers grow with the load."""

from __future__ import annotations

import math
from itertools import accumulate

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.engines.profile import DecodeGrid, EngineProfile, PrefillCurve
from tandem.planner import throughput_mode as tm
from tandem.planner.throughput_mode import Forecast, TrafficForecaster

pytestmark = pytest.mark.timeout(120)
SETTINGS = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KINDS = ("prefill", "decode", "aggregated")

_ms = st.floats(0.0, 1e5, allow_nan=False)
_step = st.floats(0.0, 1e3, allow_nan=False)


@st.composite
def _axis(draw: st.DrawFn) -> list[int]:
    gaps = draw(st.lists(st.integers(1, 5000), min_size=2, max_size=4))
    return list(accumulate(gaps))


@st.composite
def profiles(draw: st.DrawFn, monotone: bool) -> EngineProfile:
    """Any profile (times in any order, zeros, extrapolating below 0), or with `monotone` one
    whose TTFT grows with the prompt and ITL with batch and context."""
    isl, batch, context = draw(_axis()), draw(_axis()), draw(_axis())
    if monotone:
        ttft = list(accumulate(draw(st.lists(_step, min_size=len(isl), max_size=len(isl)))))
        col = list(accumulate(draw(st.lists(_step, min_size=len(batch), max_size=len(batch)))))
        row = list(accumulate(draw(st.lists(_step, min_size=len(context), max_size=len(context)))))
        itl = [[b + c for c in row] for b in col]
    else:
        ttft = draw(st.lists(_ms, min_size=len(isl), max_size=len(isl)))
        itl = [draw(st.lists(_ms, min_size=len(context), max_size=len(context))) for _ in batch]
    return EngineProfile(
        engine="test", model="m", block_size=draw(st.integers(1, 64)),
        num_total_blocks=draw(st.integers(1, 100_000)), max_num_seqs=draw(st.integers(1, 512)),
        max_num_batched_tokens=4096,
        prefill=PrefillCurve(isl=isl, ttft_ms=ttft),
        decode=DecodeGrid(batch=batch, context=context, itl_ms=itl),
    )  # fmt: skip


_any = st.floats(allow_nan=True, allow_infinity=True)
_rate = st.floats(0.0, 1e4, allow_nan=False)
_tokens = st.floats(0.0, 1e5, allow_nan=False)
_hit = st.floats(0.0, 1.0)
_target = st.floats(0.001, 1e7)
_margin = st.floats(0.05, 1.0)
degenerate = st.builds(
    Forecast,
    request_rate=st.one_of(_any, st.just(0.0), _rate),
    isl=st.one_of(_any, st.just(0.0), _tokens),
    osl=st.one_of(_any, st.just(0.0), _tokens),
    kv_hit_rate=st.one_of(_any, _hit),
)


def _shares(f: Forecast, p: EngineProfile, ttft: float, itl: float, m: float) -> list[float]:
    return [
        tm.prefill_share(f, p, ttft),
        tm.decode_share(f, p, itl),
        tm.aggregated_share(f, p, ttft, itl, m),
    ]


@SETTINGS
@given(profiles(monotone=False), degenerate, _target, _target, _margin)
def test_any_forecast_gives_finite_bounded_answers(
    p: EngineProfile, f: Forecast, ttft: float, itl: float, margin: float
) -> None:
    for share in _shares(f, p, ttft, itl, margin):
        assert math.isfinite(share) and 0.0 <= share <= tm.MAX_REPLICAS
    for kind in KINDS:
        n = tm.replicas(kind, f, p, ttft, itl, margin)
        assert isinstance(n, int) and 0 <= n <= tm.MAX_REPLICAS
    assert 1 <= tm.best_decode_batch(f, p, itl) <= max(p.max_num_seqs, 1)


@SETTINGS
@given(profiles(monotone=False), st.one_of(_any, _tokens), st.one_of(_any, _tokens), _hit)
def test_no_requests_want_no_engines(p: EngineProfile, isl: float, osl: float, hit: float) -> None:
    for rate in (0.0, -1.0, math.nan):
        f = Forecast(request_rate=rate, isl=isl, osl=osl, kv_hit_rate=hit)
        assert _shares(f, p, 500.0, 50.0, 0.7) == [0.0, 0.0, 0.0]


@SETTINGS
@given(profiles(monotone=True), _rate, _rate, _tokens, _tokens, _hit, _target, _target, _margin)
def test_more_requests_never_want_fewer_engines(
    p: EngineProfile, r1: float, r2: float, isl: float, osl: float, hit: float,
    ttft: float, itl: float, margin: float,
) -> None:  # fmt: skip
    lo, hi = sorted((r1, r2))
    a, b = Forecast(lo, isl, osl, hit), Forecast(hi, isl, osl, hit)
    for x, y in zip(
        _shares(a, p, ttft, itl, margin), _shares(b, p, ttft, itl, margin), strict=True
    ):
        assert x <= y * (1 + 1e-9) + 1e-12
    for kind in KINDS:
        assert tm.replicas(kind, a, p, ttft, itl, margin) <= tm.replicas(
            kind, b, p, ttft, itl, margin
        )


@SETTINGS
@given(profiles(monotone=True), _rate, _tokens, _tokens, _tokens, _hit, _target, _target, _margin)
def test_longer_prompts_never_want_fewer_prefill_engines(
    p: EngineProfile, rate: float, i1: float, i2: float, osl: float, hit: float,
    ttft: float, itl: float, margin: float,
) -> None:  # fmt: skip
    lo, hi = sorted((i1, i2))
    a, b = Forecast(rate, lo, osl, hit), Forecast(rate, hi, osl, hit)
    assert tm.prefill_share(a, p, ttft) <= tm.prefill_share(b, p, ttft) * (1 + 1e-9) + 1e-12
    x, y = (
        tm.aggregated_share(a, p, ttft, itl, margin),
        tm.aggregated_share(b, p, ttft, itl, margin),
    )
    assert x <= y * (1 + 1e-9) + 1e-12


@SETTINGS
@given(profiles(monotone=True), _rate, _tokens, _tokens, _hit, _hit, _target)
def test_cache_hits_never_want_more_prefill_engines(
    p: EngineProfile, rate: float, isl: float, osl: float, h1: float, h2: float, ttft: float
) -> None:
    lo, hi = sorted((h1, h2))
    cold, warm = Forecast(rate, isl, osl, lo), Forecast(rate, isl, osl, hi)
    assert tm.prefill_share(warm, p, ttft) <= tm.prefill_share(cold, p, ttft) * (1 + 1e-9) + 1e-12


@SETTINGS
@given(profiles(monotone=False), degenerate, _target, _target, _margin)
def test_aggregated_covers_its_prefill_and_decode_work(
    p: EngineProfile, f: Forecast, ttft: float, itl: float, margin: float
) -> None:
    agg = tm.aggregated_share(f, p, ttft, itl, margin)
    assert agg >= tm.prefill_share(f, p, ttft * margin) * (1 - 1e-9)
    assert agg >= tm.decode_share(f, p, itl * margin) * (1 - 1e-9)


@SETTINGS
@given(st.lists(st.tuples(_any, st.one_of(st.none(), _any), _any, _any), max_size=12))
def test_the_forecaster_never_forecasts_a_non_finite_or_negative_value(
    intervals: list[tuple[float, float | None, float, float]],
) -> None:
    for name in ("constant", "moving_average", "holt"):
        fc = TrafficForecaster(name)
        for rate, isl, osl, hit in intervals:
            fc.observe(rate, isl, None if isl is None else osl, hit)
            f = fc.forecast()
            for v in (f.request_rate, f.isl, f.osl, f.kv_hit_rate):
                assert math.isfinite(v) and v >= 0
