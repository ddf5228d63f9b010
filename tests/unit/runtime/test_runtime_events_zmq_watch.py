"""The ZMQ bus keeps following its publishers after its discovery watch fails (it used to stop
for good: a publisher that registered later was never connected, its events never arrived)."""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator

import pytest
from tests.support.eventually import eventually
from tests.unit.runtime.test_runtime_events_zmq import publish_until_received

from tandem.protocols.discovery import InstanceEvent
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.zmq import ZmqEventBus

pytestmark = pytest.mark.timeout(15)


class FailingOnceDiscovery(MemoryDiscovery):
    """The first watch fails at once with EMFILE (as when descriptors ran out)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_watches = 0

    async def watch(self, prefix: str = "") -> AsyncIterator[InstanceEvent]:  # type: ignore[override]
        self.num_watches += 1
        if self.num_watches == 1:
            raise OSError(errno.EMFILE, "Too many open files")
        async for event in super().watch(prefix):
            yield event


async def test_publisher_watch_is_retried_after_a_failure() -> None:
    disc = FailingOnceDiscovery()
    sub_bus, pub_bus = ZmqEventBus(disc, namespace="t"), ZmqEventBus(disc, namespace="t")
    try:
        sub = await sub_bus.subscribe("t.kv.>")
        await eventually(lambda: disc.num_watches >= 2)  # the failed watch was retried
        received = await publish_until_received(pub_bus, sub, "t.kv.w1")
        assert received == ("t.kv.w1", b"probe")
        assert sub_bus.error is None
    finally:
        await sub_bus.close()
        await pub_bus.close()
