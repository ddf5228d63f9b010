from __future__ import annotations

import pytest

from tandem.frontend.request_stats import RequestStatsCollector
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
