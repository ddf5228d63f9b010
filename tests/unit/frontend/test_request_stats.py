from __future__ import annotations

import pytest

from tandem.frontend.observability.request_stats import RequestStatsCollector
from tandem.planner.observation import PoolTraffic


def test_collector_cuts_intervals_and_merges_across_frontends() -> None:
    now = [100.0]
    a = RequestStatsCollector("backend", clock=lambda: now[0])
    b = RequestStatsCollector("backend", clock=lambda: now[0])
    for c, ttft in ((a, 0.1), (b, 0.3)):
        c.arrived("m")
        c.ttft("m", ttft)
        c.itl("m", 0.01)
        c.itl("m", 0.03)
        c.finished("m", isl=100, osl=10)
        c.cached("m", 50)
    a.arrived("m")
    a.failed("m")
    now[0] = 101.0
    rows = a.take() + b.take()
    assert [(r.start_s, r.end_s, r.num_arrivals) for r in rows] == [
        (100.0, 101.0, 2),
        (100.0, 101.0, 1),
    ]
    t = PoolTraffic.merge(rows, 1.0)
    assert t.request_rate == 3.0 and t.num_finished == 2
    assert t.mean_ttft_ms == pytest.approx(200.0) and t.mean_itl_ms == pytest.approx(20.0)
    assert t.mean_isl == 100 and t.cached_fraction == pytest.approx(0.5)
    assert a.take() == []  # a fresh interval with no traffic


def test_token_timer_puts_each_itl_in_its_interval_and_histogram(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TokenTimer's inline ITL path: what observe_itl records, and a stream that spans an
    interval cut counts its later ITLs in the new interval, none in the published one."""
    from tandem.frontend.observability import metrics as metrics_module
    from tandem.frontend.observability.metrics import FrontendMetrics, TokenTimer

    clock = [10.0]
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: clock[0])
    collector = RequestStatsCollector("backend", clock=lambda: 0.0)
    m = FrontendMetrics(interval=collector)
    timer = TokenTimer(m, "m")
    for step in (0.5, 0.002, 0.003):  # TTFT, then two ITLs
        clock[0] += step
        timer.token()
    [first] = collector.take()
    assert (first.num_ttft, first.num_itl) == (1, 2)
    assert first.sum_itl_ms == pytest.approx(5.0)
    clock[0] += 0.004
    timer.token()
    [second] = collector.take()
    assert (second.num_ttft, second.num_itl, second.sum_itl_ms) == (0, 1, pytest.approx(4.0))
    assert first.num_itl == 2  # the published row was not touched
    ref = FrontendMetrics()
    for s in (0.002, 0.003, 0.004):
        ref.observe_itl("m", s)
    assert m.itl.child("m") == pytest.approx(ref.itl.child("m"))
