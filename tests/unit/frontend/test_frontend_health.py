"""HealthMonitor's report: discovery and event-bus failures make /health unhealthy, and so does
a worker the request plane cannot reach or the stall watchdog excluded (issue 30), each named
with why it does not count."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from tests.support.eventually import eventually
from tests.support.instances import backend_instance
from tests.support.services import free_port

from tandem.frontend.observability.health import HealthMonitor
from tandem.protocols.discovery import ModelCard
from tandem.runtime.tcp import TcpRequestClient, TcpRequestServer

pytestmark = pytest.mark.timeout(10)
CARD = ModelCard(name="m", context_length=64, block_size=16, num_total_blocks=8)


class Source:
    def __init__(self, *instances: Any) -> None:
        self.instances = {i.instance_id: i for i in instances}
        self.is_healthy, self.error = True, None

    def add_listener(self, callback: Any) -> None:
        pass


def _monitor(workers: Source, events: Any, clock: list[float], **reach: Any) -> HealthMonitor:
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
        **reach,
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


async def test_workers_the_request_plane_cannot_reach_are_not_counted() -> None:
    """A worker advertising a loopback address from another host (here: nothing listens
    there) is unreachable: /health 503 naming why, where it said 200 before."""
    address = f"127.0.0.1:{free_port()}"
    workers = Source(backend_instance(0, CARD, address=address))
    client = TcpRequestClient(connect_timeout_s=2)
    monitor = _monitor(workers, None, [0.0], client=client)
    await monitor.start()
    try:
        healthy, body = monitor.health()
        assert not healthy  # not connected yet: not counted either
        await eventually(lambda: "unreachable" in str(monitor.health()[1]), timeout_s=5)
        healthy, body = monitor.health()
        assert not healthy
        why = body["models"]["m"]["not_counted"]["w0"]
        assert why.startswith(f"unreachable at {address} (it advertises a loopback address")
        assert "--advertise-host" in why  # names the flag that fixes it
        assert "cannot connect" in why
        assert body["missing"] == [f"model 'm': worker w0 is {why}"]
    finally:
        await monitor.close()
        await client.close()


async def test_a_reachable_worker_counts_unless_the_watchdog_excluded_it() -> None:
    server = TcpRequestServer()
    await server.start()
    workers = Source(backend_instance(0, CARD, address=server.address))
    client = TcpRequestClient(connect_timeout_s=2)
    excluded: set[str] = set()
    monitor = _monitor(workers, None, [0.0], client=client, excluded=lambda: frozenset(excluded))
    await monitor.start()
    try:
        await eventually(lambda: monitor.health()[0], timeout_s=5)  # connected at start
        excluded.add("w0")
        healthy, body = monitor.health()
        assert not healthy
        assert "excluded by the stall watchdog" in body["models"]["m"]["not_counted"]["w0"]
    finally:
        await monitor.close()
        await client.close()
        await server.stop(0)
