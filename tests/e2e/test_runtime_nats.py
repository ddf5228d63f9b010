"""NatsEventBus against a real nats-server started on a free loopback port."""

from __future__ import annotations

import asyncio
import secrets
from collections import deque

import pytest
from tests.support.eventually import eventually
from tests.support.services import Service

from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.registry import make_event_bus

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(30)]


async def test_pub_sub_with_wildcards_and_bounded_buffer(nats_server: Service) -> None:
    cfg = RuntimeConfig(events="nats", nats_url=nats_server.url, event_buffer_size=3)
    a, b = make_event_bus(cfg, MemoryDiscovery()), make_event_bus(cfg, MemoryDiscovery())
    assert type(a).__name__ == "NatsEventBus"
    try:
        kv = await b.subscribe("t.kv.*")
        load = await b.subscribe("t.load.>")
        await a.publish("t.kv.w1.extra", b"no")
        await a.publish("t.load.w1.dp0", b"L")
        await a.publish("t.kv.w1", b"yes")
        assert await asyncio.wait_for(anext(kv), 5) == ("t.kv.w1", b"yes")
        assert await asyncio.wait_for(anext(load), 5) == ("t.load.w1.dp0", b"L")
        for i in range(10):  # nobody reads kv meanwhile: oldest are dropped and counted
            await a.publish("t.kv.w2", b"%d" % i)
        await a.publish("t.load.done", b"")
        assert (await asyncio.wait_for(anext(load), 5))[0] == "t.load.done"
        assert kv.num_dropped == 7
        assert [(await anext(kv))[1] for _ in range(3)] == [b"7", b"8", b"9"]
        await kv.close()
        assert await anext(kv, None) is None
    finally:
        await a.close()
        await b.close()


async def test_forged_messages_are_dropped_with_a_secret(nats_server: Service) -> None:
    """The NATS server has no auth: anyone can publish. With the cluster secret only sealed
    messages reach subscribers."""
    import nats

    from tandem.runtime.events.envelope import EventSealer

    secret = secrets.token_hex(32)  # as `openssl rand -hex 32` makes one
    cfg = RuntimeConfig(events="nats", nats_url=nats_server.url, cluster_secret=secret)
    a, b = make_event_bus(cfg, MemoryDiscovery()), make_event_bus(cfg, MemoryDiscovery())
    forger = await nats.connect(nats_server.url)
    try:
        kv = await b.subscribe("t.kv.*")
        # a first real message through proves the subscription reached the server (a forged
        # message published before that would be dropped by the server, not by the secret)
        await a.publish("t.kv.w1", b"warm")
        assert await asyncio.wait_for(anext(kv), 5) == ("t.kv.w1", b"warm")
        await forger.publish("t.kv.w1", b"forged")
        await forger.publish(
            "t.kv.w1", EventSealer("another-secret-0123456789").seal("t.kv.w1", b"x")
        )
        await forger.flush()
        await a.publish("t.kv.w1", b"real")
        assert await asyncio.wait_for(anext(kv), 5) == ("t.kv.w1", b"real")
        await eventually(lambda: b.num_rejected == 2)  # type: ignore[attr-defined]
        assert kv._buf == deque()  # type: ignore[attr-defined]
    finally:
        await forger.close()
        await a.close()
        await b.close()
