"""The decision core over a fake clock: settling, never-ready, external changes, floor."""

from __future__ import annotations

from tandem.planner.config import PlannerConfig, PoolConfig
from tandem.planner.observation import PoolObservation, WorkerView
from tandem.planner.planner import Planner, choose_victim

CFG = PlannerConfig(
    pools=(PoolConfig(component="backend", min_workers=1, max_workers=4),),
    ttft_target_ms=300.0,
    itl_target_ms=50.0,
    cooldown_up_s=5.0,
    cooldown_down_s=10.0,
    scale_down_stable_s=0.0,  # its own test below
    ready_timeout_s=30.0,
)


def _obs(
    *ids: str, waiting: int = 0, kv: float = 0.0, draining: tuple[str, ...] = ()
) -> dict[str, PoolObservation]:
    ready = [
        WorkerView(worker_id=i, num_waiting=waiting, decode_kv_tokens=kv, num_total_blocks=1000)
        for i in ids
    ]
    return {"backend": PoolObservation(component="backend", ready=ready, draining=list(draining))}


def test_overload_adds_one_then_waits_for_it_to_settle() -> None:
    p = Planner(CFG)
    p.tick(0.0, _obs("a"))
    actions = p.tick(1.0, _obs("a", waiting=50))
    assert [a.kind for a in actions] == ["add"]
    p.on_added("backend", "b", 1.0)
    assert p.tick(20.0, _obs("a", waiting=50)) == []  # b not ready yet: no second add
    actions = p.tick(21.0, _obs("a", "b", waiting=50))  # b ready, cooldown passed → add again
    assert [a.kind for a in actions] == ["add"]


def test_never_ready_worker_is_given_up_on_and_counted() -> None:
    p = Planner(CFG)
    assert [a.kind for a in p.tick(0.0, _obs("a", waiting=50))] == ["add"]
    p.on_added("backend", "b", 0.0)
    assert p.tick(29.0, _obs("a", waiting=50)) == []
    actions = p.tick(31.0, _obs("a", waiting=50))
    # given up on, and replaced in the same tick (the pool is still overloaded)
    assert [(a.kind, a.worker_id) for a in actions] == [("abandon", "b"), ("add", None)]
    assert p.pools["backend"].num_never_ready == 1
    p.on_added("backend", "c", 31.0)  # the planner adds again after giving up
    actions = p.tick(40.0, _obs("a", waiting=50))
    assert actions == []  # c still settling


def test_a_worker_that_ends_before_it_is_ready_is_replaced_at_once() -> None:
    """E.g. a Ray actor placed on a node that was lost a moment later: the connector no longer
    runs it, so the planner does not wait out the ready timeout for it."""
    alive = {"b"}
    p = Planner(CFG, is_alive=alive.__contains__)
    assert [a.kind for a in p.tick(0.0, _obs("a", waiting=50))] == ["add"]
    p.on_added("backend", "b", 0.0)
    assert p.tick(1.0, _obs("a", waiting=50)) == []  # starting
    alive.clear()  # its actor died
    actions = p.tick(2.0, _obs("a", waiting=50))
    assert [(a.kind, a.worker_id) for a in actions] == [("abandon", "b")]
    assert "ended before it was ready" in actions[0].reason
    # replaced once the scale-up cooldown allows, long before the 30 s ready timeout
    assert [a.kind for a in p.tick(10.0, _obs("a", waiting=50))] == ["add"]


def test_external_change_is_reread_not_fought() -> None:
    p = Planner(CFG)
    # ITL 26 ms each (prior: 6 ms + 1e-4 ms per KV token): fine, but one survivor would not be
    assert p.tick(0.0, _obs("a", "b", kv=200_000)) == []
    # someone adds c and d: counted, cooldown restarts, and nothing is removed for it
    assert p.tick(1.0, _obs("a", "b", "c", "d", kv=100_000)) == []
    assert p.pools["backend"].num_external_changes == 1
    assert p.tick(5.0, _obs("a", "b", "c", "d", kv=100_000)) == []  # still in the cooldown
    # someone removes two: counted again, not replaced (they stay above the floor)
    assert p.tick(20.0, _obs("a", "b", kv=200_000)) == []
    assert p.pools["backend"].num_external_changes == 2


def test_traffic_to_zero_scales_to_the_floor_one_at_a_time() -> None:
    p = Planner(CFG)
    ids = ["a", "b", "c", "d"]
    now = 0.0
    while len(ids) > 1:
        now += 11.0
        actions = p.tick(now, _obs(*ids))
        assert [a.kind for a in actions] == ["remove"]
        ids.remove(actions[0].worker_id)
        now += 1.0
        assert p.tick(now, _obs(*ids)) == []  # settled, in cooldown
    assert p.tick(now + 100.0, _obs(*ids)) == []  # at the floor


def test_removing_waits_for_the_drain_to_finish() -> None:
    p = Planner(CFG)
    (rm,) = p.tick(11.0, _obs("a", "b"))
    other = "a" if rm.worker_id == "b" else "b"
    assert p.tick(30.0, _obs(other, draining=(rm.worker_id,))) == []  # still draining
    assert not p.pools["backend"].removing or p.tick(31.0, _obs(other)) == []
    assert p.pools["backend"].num_external_changes == 0


def test_below_the_floor_refills_at_once() -> None:
    cfg = PlannerConfig(pools=(PoolConfig(min_workers=3, max_workers=5),))
    p = Planner(cfg)
    actions = p.tick(0.0, _obs("a"))
    assert [a.kind for a in actions] == ["add", "add"]


def test_budget_caps_adds_over_all_pools() -> None:
    cfg = PlannerConfig(
        pools=(PoolConfig(component="backend", min_workers=1, max_workers=8),
               PoolConfig(component="prefill", kind="prefill", min_workers=1, max_workers=8)),
        max_total_workers=3,
    )  # fmt: skip
    p = Planner(cfg)
    busy = [WorkerView(worker_id=i, num_waiting=50, num_total_blocks=10) for i in ("a", "b")]
    obs = {
        "backend": PoolObservation(component="backend", ready=busy),
        "prefill": PoolObservation(
            component="prefill", ready=[WorkerView(worker_id="p", num_waiting=50)]
        ),
    }
    actions = p.tick(100.0, obs)
    assert len([a for a in actions if a.kind == "add"]) == 0  # 3 workers = the budget


def test_victim_has_fewest_inflight_then_least_cache() -> None:
    ws = [
        WorkerView(worker_id="a", num_inflight=3, num_cached_blocks=0),
        WorkerView(worker_id="b", num_inflight=1, num_cached_blocks=50),
        WorkerView(worker_id="c", num_inflight=1, num_cached_blocks=10),
    ]
    assert (victim := choose_victim(ws)) is not None and victim.worker_id == "c"
    assert choose_victim([WorkerView(worker_id="x", is_managed=False)]) is None


def test_measured_latency_over_the_prediction_calibrates_the_scale_down() -> None:
    """Two workers whose model says one survivor fits (ITL 6 + 1e-4·2·140000 = 34 ms < 35),
    while the frontends keep measuring ITL 1.5 × the model's: the calibration climbs
    above 1 and the planner keeps both (uncalibrated it would drain one and re-add it)."""
    from tandem.planner.observation import PoolTraffic

    cfg = PlannerConfig(
        pools=(PoolConfig(component="backend", min_workers=1, max_workers=4),),
        ttft_target_ms=3000.0, itl_target_ms=50.0, cooldown_down_s=0.0, scale_down_stable_s=0.0,
        interval_s=1.0, stats_window_s=4.0,
    )  # fmt: skip

    def obs(measured_itl: float) -> dict[str, PoolObservation]:
        ready = [WorkerView(worker_id=i, num_inflight=3, decode_kv_tokens=140_000,
                            num_total_blocks=100_000) for i in "ab"]  # fmt: skip
        traffic = PoolTraffic(interval_s=1.0, num_arrivals=3, num_finished=3, mean_isl=10.0,
                              mean_osl=10.0, mean_ttft_ms=50.0,
                              mean_itl_ms=measured_itl)  # fmt: skip
        return {"backend": PoolObservation(component="backend", ready=ready, traffic=traffic)}

    # each worker predicts 6 + 14 = 20 ms; measured 30 ms (× 1.5), still under 35 (target × margin)
    p = Planner(cfg)
    actions: list[str] = []
    for t in range(12):
        actions += [a.kind for a in p.tick(float(t), obs(30.0))]
    assert p.pools["backend"].calibration.itl > 1.4
    assert actions == []
    # the same fleet measured as the model predicts: drained to one
    p = Planner(cfg)
    assert [a.kind for a in p.tick(0.0, obs(20.0))] == ["remove"]


def test_scale_down_waits_for_a_stable_verdict() -> None:
    """One quiet interval between busy ones is noise: the remove needs `scale_down_stable_s`
    of verdicts that all asked for it."""
    from dataclasses import replace

    p = Planner(replace(CFG, scale_down_stable_s=3.0))
    busy = {"kv": 200_000.0}  # ITL 26 ms each; one survivor would be at 46 > 35
    assert p.tick(20.0, _obs("a", "b", **busy)) == []
    assert p.tick(21.0, _obs("a", "b")) == []  # quiet: the window starts
    assert p.tick(22.0, _obs("a", "b", **busy)) == []  # busy again: it restarts
    assert p.tick(23.0, _obs("a", "b")) == []
    assert p.tick(25.0, _obs("a", "b")) == []  # 2 s of quiet
    assert [a.kind for a in p.tick(26.0, _obs("a", "b"))] == ["remove"]  # 3 s


def test_calibration_from_a_burst_fades_once_nothing_is_measured() -> None:
    """A burst measured ~1.5 × the model's ITL; then the pool goes idle (no request measured,
    no busy worker): the factor returns to 1 over about the stats window and the idle pool is
    drained (with the burst's factor kept, the idle survivor's 6 ms × 1.5 > 12 × 0.7: never)."""
    from tandem.planner.observation import PoolTraffic

    cfg = PlannerConfig(
        pools=(PoolConfig(component="backend", min_workers=1, max_workers=2),),
        ttft_target_ms=3000.0, itl_target_ms=12.0, cooldown_down_s=0.0, scale_down_stable_s=0.0,
        interval_s=1.0, stats_window_s=4.0,
    )  # fmt: skip
    busy = [WorkerView(worker_id=i, num_inflight=3, decode_kv_tokens=10_000,
                       num_total_blocks=100_000) for i in "ab"]  # fmt: skip
    burst = PoolTraffic(interval_s=1.0, num_arrivals=3, num_finished=3, mean_isl=10.0,
                        mean_osl=10.0, mean_ttft_ms=50.0, mean_itl_ms=21.0)  # fmt: skip
    p = Planner(cfg)
    for t in range(8):
        p.tick(float(t), {"backend": PoolObservation(component="backend", ready=busy,
                                                     traffic=burst)})  # fmt: skip
    assert p.pools["backend"].calibration.itl > 1.4
    idle = [WorkerView(worker_id=i, num_total_blocks=100_000) for i in "ab"]
    quiet = PoolTraffic(interval_s=1.0)
    actions: list[str] = []
    for t in range(8, 30):
        obs = {"backend": PoolObservation(component="backend", ready=idle, traffic=quiet)}
        actions += [a.kind for a in p.tick(float(t), obs)]
    assert actions == ["remove"]
