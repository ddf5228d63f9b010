from __future__ import annotations

import pytest

from tandem.planner import load_mode
from tandem.planner.config import PlannerConfig
from tandem.planner.observation import PoolObservation, PoolTraffic, WorkerView
from tandem.planner.regression import StepCoefficients

MODEL = StepCoefficients(base_ms=10.0, ms_per_prefill_token=0.1, ms_per_decode_kv_token=0.001)
CFG = PlannerConfig(ttft_target_ms=300.0, itl_target_ms=50.0, scale_down_margin=0.7)


def _traffic(isl: float = 1000.0, cached: float = 0.0) -> PoolTraffic:
    return PoolTraffic(interval_s=1.0, num_arrivals=5, num_finished=5, mean_isl=isl,
                       mean_osl=100.0, cached_fraction=cached)  # fmt: skip


def _pool(*workers: WorkerView, traffic: PoolTraffic | None = None) -> PoolObservation:
    return PoolObservation(component="backend", ready=list(workers), traffic=traffic or _traffic())


def test_ttft_includes_the_queue_ahead() -> None:
    # 3 waiting + the new one: 4000 tokens in chunks of 2048 → steps of 2048 and 1952 tokens
    ttft = load_mode.predict_ttft_ms(MODEL, num_waiting=3, isl=1000, decode_kv=0, chunk=2048)
    assert ttft == pytest.approx((10 + 204.8) + (10 + 195.2))
    alone = load_mode.predict_ttft_ms(MODEL, num_waiting=0, isl=1000, decode_kv=0, chunk=2048)
    assert alone == pytest.approx(110.0)


def test_scale_up_when_every_worker_is_over_the_ttft_target() -> None:
    busy = WorkerView(worker_id="a", num_waiting=3, num_total_blocks=100)
    idle = WorkerView(worker_id="b", num_waiting=0, num_total_blocks=100)
    assert load_mode.decide(_pool(busy, busy), MODEL, CFG).delta == +1
    assert load_mode.decide(_pool(busy, idle), MODEL, CFG).delta == 0  # b can still take it


def test_kv_hit_rate_lowers_the_effective_isl() -> None:
    w = WorkerView(worker_id="a", num_waiting=3, num_total_blocks=100)
    assert load_mode.decide(_pool(w, traffic=_traffic(cached=0.0)), MODEL, CFG).delta == +1
    assert load_mode.decide(_pool(w, traffic=_traffic(cached=0.9)), MODEL, CFG).delta == 0


def test_scale_up_on_itl() -> None:
    w = WorkerView(worker_id="a", decode_kv_tokens=50_000, num_total_blocks=10_000)
    v = load_mode.decide(_pool(w), MODEL, CFG)
    assert v.delta == +1 and "ITL" in v.reason


def test_scale_down_only_when_survivors_stay_under_target_times_margin() -> None:
    # 2 workers at ITL 10 + 0.001·14000 = 24 ms each; one survivor at 10 + 28 = 38 > 35 (50 × 0.7)
    w = [WorkerView(worker_id=i, decode_kv_tokens=14_000, num_total_blocks=10_000) for i in "ab"]
    assert load_mode.decide(_pool(*w), MODEL, CFG).delta == 0
    # at 12000 each: survivor 34 ms < 35 → remove one
    w = [WorkerView(worker_id=i, decode_kv_tokens=12_000, num_total_blocks=10_000) for i in "ab"]
    assert load_mode.decide(_pool(*w), MODEL, CFG).delta == -1


def test_scale_down_needs_the_kv_to_fit() -> None:
    w = [WorkerView(worker_id=i, num_active_blocks=60, num_total_blocks=100) for i in "ab"]
    v = load_mode.decide(_pool(*w), MODEL, CFG)
    assert v.delta == 0 and "KV" in v.reason


def test_idle_pool_scales_down() -> None:
    w = [WorkerView(worker_id=i, num_total_blocks=100) for i in "abc"]
    assert load_mode.decide(_pool(*w, traffic=None), MODEL, CFG).delta == -1


def test_a_model_slower_than_target_for_one_request_neither_adds_nor_keeps_idle_workers() -> None:
    # a starved host fits steps of 60 ms: one request alone predicts ITL 60 > 50 and TTFT
    # 60 + 1000·1 > 300, on every worker, with or without the others
    slow = StepCoefficients(base_ms=60.0, ms_per_prefill_token=1.0, ms_per_decode_kv_token=0.001)
    w = [WorkerView(worker_id=i, num_total_blocks=100) for i in "abc"]
    v = load_mode.decide(_pool(*w, traffic=None), slow, CFG)
    assert v.delta == -1 and "no load" in v.reason
    busy = WorkerView(worker_id="a", num_running=1, num_active_blocks=4, num_total_blocks=100)
    v = load_mode.decide(_pool(busy, w[1], traffic=None), slow, CFG)
    assert v.delta == 0, v  # b is idle: a new worker would predict what b does
    assert load_mode.decide(_pool(busy, busy, traffic=None), slow, CFG).delta == +1


def test_prefill_pool_ignores_itl_and_decode_pool_ignores_ttft() -> None:
    w = WorkerView(worker_id="a", num_waiting=3, decode_kv_tokens=50_000, num_total_blocks=10**6)
    assert load_mode.decide(_pool(w), MODEL, CFG, "prefill").reason.startswith(
        "every worker's predicted TTFT"
    )
    assert "ITL" in load_mode.decide(_pool(w), MODEL, CFG, "decode").reason


def test_no_scale_down_while_the_measured_latency_is_near_the_target() -> None:
    w = [WorkerView(worker_id=i, num_total_blocks=100) for i in "abc"]
    hot = PoolTraffic(interval_s=1.0, num_arrivals=5, num_finished=5, mean_isl=100.0,
                      mean_osl=10.0, mean_ttft_ms=250.0, mean_itl_ms=10.0)  # fmt: skip
    v = load_mode.decide(_pool(*w, traffic=hot), MODEL, CFG)
    assert v.delta == 0 and "measured mean TTFT" in v.reason


def test_itl_stretches_with_the_share_of_time_spent_on_prompts() -> None:
    # 10 + 0.001·10000 = 20 ms decode steps; 5000 prompt tokens/s × 0.1 ms = 500 ms/s busy
    assert load_mode.predict_itl_ms(MODEL, prefill_tokens_per_s=0, decode_kv=10_000) == 20.0
    assert load_mode.predict_itl_ms(MODEL, prefill_tokens_per_s=5000, decode_kv=10_000) == 40.0
    assert load_mode.predict_itl_ms(MODEL, prefill_tokens_per_s=10_000, decode_kv=0) == float("inf")


def test_scale_down_counts_the_prefill_the_survivors_inherit() -> None:
    # two workers at 3000 tokens/s each: 30 % busy, ITL 10/0.7 ≈ 14 ms; one survivor at 60 %:
    # 10/0.4 = 25 ms < 35 → remove; at 4000 each: 10/0.2 = 50 ms > 35 → keep
    w = [WorkerView(worker_id=i, prefill_tokens_per_s=3000, num_total_blocks=100) for i in "ab"]
    assert load_mode.decide(_pool(*w, traffic=None), MODEL, CFG).delta == -1
    w = [WorkerView(worker_id=i, prefill_tokens_per_s=4000, num_total_blocks=100) for i in "ab"]
    assert load_mode.decide(_pool(*w, traffic=None), MODEL, CFG).delta == 0


def test_calibration_scales_the_survivors_prediction() -> None:
    # 12000 KV tokens each: one survivor at 34 ms < 35 uncalibrated; the frontends measure
    # 1.2 × what the model predicts → 40.8 ms > 35: keep both
    w = [WorkerView(worker_id=i, decode_kv_tokens=12_000, num_total_blocks=10_000) for i in "ab"]
    assert load_mode.decide(_pool(*w), MODEL, CFG).delta == -1
    biased = load_mode.Calibration(itl=1.2)
    v = load_mode.decide(_pool(*w), MODEL, CFG, calibration=biased)
    assert v.delta == 0 and "survivors' ITL" in v.reason


def test_fleet_means_cover_the_busy_workers() -> None:
    busy = WorkerView(worker_id="a", num_inflight=2, decode_kv_tokens=10_000)
    idle = WorkerView(worker_id="b")
    ttft, itl = load_mode.fleet_means(_pool(busy, idle), MODEL)
    assert itl == pytest.approx(20.0)  # a alone: 10 + 0.001 · 10000
    assert ttft == pytest.approx(10 + 0.1 * 1000 + 0.001 * 10_000)
    assert load_mode.fleet_means(_pool(idle), MODEL) == (None, None)


def _queued(wait_ms: float | None) -> PoolTraffic:
    return PoolTraffic(interval_s=1.0, num_arrivals=5, num_finished=5, mean_isl=1000.0,
                       mean_osl=100.0, mean_queue_wait_ms=wait_ms)  # fmt: skip


def test_measured_queue_wait_before_dispatch_counts_in_every_workers_ttft() -> None:
    # alone each worker predicts 110 ms (< 300); requests held 250 ms in the router's queue
    # first: no worker can answer within 300 ms
    idle = [WorkerView(worker_id=i, num_inflight=1, num_total_blocks=100) for i in "ab"]
    assert load_mode.decide(_pool(*idle, traffic=_queued(None)), MODEL, CFG).delta != +1
    v = load_mode.decide(_pool(*idle, traffic=_queued(250.0)), MODEL, CFG)
    assert v.delta == +1 and "250 ms measured queue wait" in v.reason
    # a decode pool's TTFT is not its to meet
    assert load_mode.decide(_pool(*idle, traffic=_queued(250.0)), MODEL, CFG, "decode").delta != +1


def test_queue_wait_keeps_a_pool_from_scaling_down() -> None:
    idle = [WorkerView(worker_id=i, num_total_blocks=100) for i in "ab"]
    assert load_mode.decide(_pool(*idle, traffic=_queued(0.0)), MODEL, CFG).delta == -1
    # the survivor: 110 ms + 60 ms × 2/1 queued = 230 ms > 300 × 0.7
    v = load_mode.decide(_pool(*idle, traffic=_queued(60.0)), MODEL, CFG)
    assert v.delta == 0 and "survivors' TTFT 230 ms" in v.reason


def test_fleet_means_include_the_queue_wait_the_frontends_measured() -> None:
    busy = WorkerView(worker_id="a", num_inflight=1, num_total_blocks=100)
    ttft, _ = load_mode.fleet_means(_pool(busy, traffic=_queued(40.0)), MODEL)
    assert ttft == pytest.approx(110.0 + 40.0)
