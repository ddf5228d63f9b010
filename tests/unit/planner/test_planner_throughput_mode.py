from __future__ import annotations

import pytest

from tandem.engines.profile import DecodeGrid, EngineProfile, PrefillCurve
from tandem.planner import throughput_mode as tm
from tandem.planner.throughput_mode import Forecast


def linear_profile() -> EngineProfile:
    """TTFT = 0.1 ms/token; ITL = 10 ms + 1 ms per sequence (context-independent)."""
    return EngineProfile(
        engine="test", model="m", block_size=16, num_total_blocks=10_000, max_num_seqs=64,
        max_num_batched_tokens=4096,
        prefill=PrefillCurve(isl=[100, 10_000], ttft_ms=[10.0, 1000.0]),
        decode=DecodeGrid(batch=[1, 64], context=[100, 10_000],
                          itl_ms=[[11.0, 11.0], [74.0, 74.0]]),
    )  # fmt: skip


def test_prefill_share_follows_md1_utilisation() -> None:
    # S = 100 ms, T = 300 ms: rho = 2·0.2 / (0.6 − 0.1) = 0.8; 10 req/s × 0.1 s / 0.8 = 1.25
    f = Forecast(request_rate=10.0, isl=1000.0, osl=0.0)
    assert tm.prefill_share(f, linear_profile(), 300.0) == pytest.approx(1.25)
    assert tm.replicas("prefill", f, linear_profile(), 300.0, 50.0) == 2


def test_kv_hit_rate_lowers_prefill_replicas() -> None:
    cold = Forecast(request_rate=10.0, isl=1000.0, osl=0.0, kv_hit_rate=0.0)
    warm = Forecast(request_rate=10.0, isl=1000.0, osl=0.0, kv_hit_rate=0.8)
    assert (
        tm.prefill_share(warm, linear_profile(), 300.0)
        < tm.prefill_share(cold, linear_profile(), 300.0) / 4
    )


def test_decode_batch_is_the_largest_under_the_itl_target() -> None:
    f = Forecast(request_rate=20.0, isl=100.0, osl=100.0)
    assert tm.best_decode_batch(f, linear_profile(), 50.0) == 40  # 10 + 40 = 50 ms
    # 20 req/s × 100 tokens × 0.05 s = 100 sequences at once / 40 per engine → 3 replicas
    assert tm.replicas("decode", f, linear_profile(), 300.0, 50.0) == 3


def test_decode_batch_limited_by_kv() -> None:
    f = Forecast(request_rate=1.0, isl=4000.0, osl=1000.0)  # 5000 tokens; 160k capacity → 32
    assert tm.best_decode_batch(f, linear_profile(), 1000.0) == 32


def test_aggregated_caps_prefill_utilisation_so_decode_steps_meet_the_itl_target() -> None:
    # S = 100 ms; TTFT (300 × 0.7) allows rho 0.70, but 11 ms steps under 50 × 0.7 = 35 ms
    # allow rho <= 1 − 11/35 ≈ 0.686 → 10 req/s × 0.1 s / 0.686 ≈ 1.46 engines
    f = Forecast(request_rate=10.0, isl=1000.0, osl=10.0)
    share = tm.aggregated_share(f, linear_profile(), 300.0, 50.0, 0.7)
    assert share == pytest.approx(1.0 / (1 - 11.0 / 35.0))  # batch per engine < 1 → d(1)
    assert tm.replicas("aggregated", f, linear_profile(), 300.0, 50.0) == 2
    loose = tm.aggregated_share(f, linear_profile(), 300.0, 1000.0, 0.7)
    # a loose ITL target leaves the TTFT bound: rho = 2·0.11 / (0.42 − 0.1) = 0.6875
    assert loose == pytest.approx(1.0 / 0.6875)


def test_zero_traffic_wants_zero() -> None:
    assert tm.replicas("aggregated", Forecast(0.0, 0.0, 0.0), linear_profile(), 300.0, 50.0) == 0


def test_unreachable_ttft_still_serves_the_load() -> None:
    f = Forecast(request_rate=4.0, isl=10_000.0, osl=0.0)  # S = 1 s > target
    assert tm.prefill_share(f, linear_profile(), 500.0) == pytest.approx(4.0 * 1.0 / 0.5)


def test_requests_counted_before_any_tokens_want_no_prefill_and_do_not_raise() -> None:
    # the planner's first intervals: a rate is counted before any request finished (ISL = OSL = 0)
    f = Forecast(request_rate=0.2, isl=0.0, osl=0.0)
    for kind in ("prefill", "decode", "aggregated"):
        assert tm.replicas(kind, f, linear_profile(), 1000.0, 50.0) == 0


def test_a_profile_that_prefills_in_no_time_is_sized_by_decode_alone() -> None:
    free = EngineProfile(
        engine="test", model="m", block_size=16, num_total_blocks=10_000, max_num_seqs=64,
        max_num_batched_tokens=4096,
        prefill=PrefillCurve(isl=[100, 10_000], ttft_ms=[0.0, 0.0]),
        decode=linear_profile().decode,
    )  # fmt: skip
    f = Forecast(request_rate=20.0, isl=100.0, osl=100.0)
    agg = tm.aggregated_share(f, free, 300.0, 50.0, 1.0)
    assert agg == pytest.approx(tm.decode_share(f, free, 50.0))
    assert tm.prefill_share(f, free, 300.0) == 0.0


def test_non_finite_forecast_fields_read_as_nothing() -> None:
    f = Forecast(request_rate=10.0, isl=float("nan"), osl=float("inf"), kv_hit_rate=float("nan"))
    assert tm.aggregated_share(f, linear_profile(), 300.0, 50.0, 0.7) == 0.0
    assert (
        tm.replicas("prefill", Forecast(float("inf"), 1000.0, 10.0), linear_profile(), 300.0, 50.0)
        == 0
    )


def test_prefill_never_planned_below_half_utilisation() -> None:
    # S = 0.9 s just under the 1 s target: M/D/1 allows rho = 0.2/1.1; planned at 0.5 instead,
    # the same as a prompt just over the target, so a longer prompt never wants fewer engines
    under = tm.prefill_share(Forecast(1.0, 9000.0, 0.0), linear_profile(), 1000.0)
    over = tm.prefill_share(Forecast(1.0, 10_000.0, 0.0), linear_profile(), 1000.0)
    assert under == pytest.approx(0.9 / 0.5)
    assert over == pytest.approx(1.0 / 0.5) and over >= under
