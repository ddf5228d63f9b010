"""KvbmMetrics: hit rates over a sliding time window, drops, Prometheus lines; the manager's
periodic summary line."""

from __future__ import annotations

import logging
import threading

import pytest

from tandem.kvbm.base import BlockMeta, KvbmConfig
from tandem.kvbm.manager import BlockManager
from tandem.kvbm.metrics import KvbmMetrics


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_hit_rates_forget_samples_older_than_the_window() -> None:
    clock = FakeClock()
    metrics = KvbmMetrics(window_s=10.0, clock=clock)
    metrics.record_lookup(num_blocks=4, host=4)
    clock.now = 5.0
    metrics.record_lookup(num_blocks=4, device=1, disk=1)
    assert metrics.hit_rates() == {"device": 1 / 8, "host": 4 / 8, "disk": 1 / 8}
    clock.now = 12.0  # the first sample left the window
    assert metrics.hit_rates() == {"device": 1 / 4, "host": 0.0, "disk": 1 / 4}
    clock.now = 100.0
    assert metrics.hit_rates() == {"device": 0.0, "host": 0.0, "disk": 0.0}


def test_prometheus_lines_cover_every_family() -> None:
    metrics = KvbmMetrics()
    metrics.record_transfer("host_to_disk", num_blocks=2, num_bytes=8192, seconds=0.5)
    metrics.record_drop("offload_queue_full", 3)
    lines = metrics.prometheus_lines({"host": (3, 10)})
    assert 'tandem_kvbm_bytes_transferred_total{direction="host_to_disk"} 8192' in lines
    assert 'tandem_kvbm_transfer_seconds_total{direction="host_to_disk"} 0.5' in lines
    assert 'tandem_kvbm_dropped_total{reason="offload_queue_full"} 3' in lines
    assert 'tandem_kvbm_tier_blocks{tier="host"} 3' in lines
    families = {line.split()[2] for line in lines if line.startswith("# TYPE")}
    assert {f"tandem_kvbm_{n}" for n in ("hit_rate", "tier_capacity_blocks")} <= families


@pytest.mark.timeout(10)
def test_manager_logs_a_summary_on_its_timer() -> None:
    clock = FakeClock()
    logged = threading.Event()

    class Flag(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "hit_rate" in record.getMessage():
                logged.set()

    handler = Flag()
    logger = logging.getLogger("tandem.kvbm.manager")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        config = KvbmConfig(host_blocks=2, block_bytes=8, log_interval_s=30.0)
        with BlockManager(config, clock=clock) as manager:
            manager.offload(1, b"12345678", BlockMeta(block_size=2))
            assert manager.flush(5)
            manager.onboard([1])
            assert not logged.is_set()
            clock.now = 31.0  # the lane's next tick sees the interval passed
            assert logged.wait(5)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert manager.metrics.summary(manager.occupancy()).startswith(
        "hit_rate device=0.0% host=100.0%"
    )
