"""HealthMonitor's report: discovery and event-bus failures make /health unhealthy."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from tests.support.instances import backend_instance

from tandem.frontend.observability.health import HealthMonitor
from tandem.protocols.discovery import ModelCard

pytestmark = pytest.mark.timeout(10)
CARD = ModelCard(name="m", context_length=64, block_size=16, num_total_blocks=8)


class Source:
    def __init__(self, *instances: Any) -> None:
        self.instances = {i.instance_id: i for i in instances}
        self.is_healthy, self.error = True, None

    def add_listener(self, callback: Any) -> None:
        pass


def _monitor(workers: Source, events: Any, clock: list[float]) -> HealthMonitor:
    model = SimpleNamespace(instances=workers, load_error=None, is_loaded=True)
    registry = SimpleNamespace(models={"m": model})
    return HealthMonitor(
        registry=registry,  # type: ignore[arg-type]
        workers=workers,
        prefill=None,
        events=events,
        subjects=[],
        stale_s=5.0,
        clock=lambda: clock[0],
    )


def test_frozen_discovery_and_failed_event_bus_are_unhealthy() -> None:
    workers = Source(backend_instance(0, CARD))
    events = SimpleNamespace(error=None)
    clock = [100.0]
    monitor = _monitor(workers, events, clock)
    healthy, body = monitor.health()
    assert healthy and body["models"]["m"]["status"] == "ready"

    workers.is_healthy, workers.error = False, "OSError: [Errno 24] Too many open files"
    healthy, body = monitor.health()
    assert not healthy and body["discovery"]["status"] == "failed"
    assert any("Too many open files" in m for m in body["missing"])

    workers.is_healthy, workers.error = True, None
    events.error = "publisher watch: OSError: boom"
    healthy, body = monitor.health()
    assert not healthy and body["event_bus"] == {"status": "failed", "error": events.error}

    events.error = None
    clock[0] += 6.0  # w0 has sent no load metrics since it joined
    healthy, body = monitor.health()
    assert not healthy and body["missing"] == [
        "model 'm': worker w0 is not alive: no load metrics for 6.0s (limit 5s)"
    ]


def test_no_worker_at_all_is_unhealthy() -> None:
    healthy, body = _monitor(Source(), None, [0.0]).health()
    assert not healthy and body["missing"] == ["no model is served: no worker has registered"]
