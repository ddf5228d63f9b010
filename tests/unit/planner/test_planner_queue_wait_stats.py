"""Queue wait in the frontend's request stats: collected per dispatch, carried by
`RequestStats` over the wire and merged into the planner's `PoolTraffic`."""

from __future__ import annotations

import pytest

from tandem.frontend.observability.request_stats import RequestStatsCollector
from tandem.planner.observation import PoolTraffic
from tandem.protocols import scaling


def test_collector_sums_queue_waits_per_dispatch_and_the_row_survives_the_wire() -> None:
    c = RequestStatsCollector("backend", clock=lambda: 0.0)
    c.queue_wait("m", 0.0)
    c.queue_wait("m", 0.3)
    (row,) = c.take()
    assert (row.num_dispatched, row.sum_queue_wait_ms, row.max_queue_wait_ms) == (
        2, pytest.approx(300.0), pytest.approx(300.0))  # fmt: skip
    decoded = scaling.decode_request_stats(scaling.encode(row))
    assert decoded.sum_queue_wait_ms == pytest.approx(300.0) and decoded.num_dispatched == 2


def test_pool_traffic_means_the_queue_wait_over_every_frontends_dispatches() -> None:
    rows = [
        scaling.RequestStats(
            frontend_id=f,
            model="m",
            pool="backend",
            start_s=0,
            end_s=1,
            num_dispatched=n,
            sum_queue_wait_ms=s,
        )
        for f, n, s in (("a", 3, 300.0), ("b", 1, 0.0))
    ]
    assert PoolTraffic.merge(rows, 1.0).mean_queue_wait_ms == pytest.approx(75.0)
    assert PoolTraffic.merge(rows[:0], 1.0).mean_queue_wait_ms is None  # nothing dispatched
