"""ZmqEventBus in one process: two buses find each other through shared memory discovery."""

from __future__ import annotations

import asyncio

import pytest

from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.zmq import ZmqEventBus

pytestmark = pytest.mark.timeout(15)


async def publish_until_received(pub: ZmqEventBus, sub, subject: str) -> tuple[str, bytes]:
    """ZMQ drops what is published before the SUB connected: repeat until one arrives."""
    async with asyncio.timeout(5):
        while True:
            await pub.publish(subject, b"probe")
            try:
                return await asyncio.wait_for(anext(sub), 0.05)
            except TimeoutError:
                continue


async def test_pub_sub_between_two_buses_with_wildcards() -> None:
    disc = MemoryDiscovery()
    a, b = ZmqEventBus(disc, namespace="t"), ZmqEventBus(disc, namespace="t")
    try:
        kv = await b.subscribe("t.kv.*")
        assert await publish_until_received(a, kv, "t.kv.w1") == ("t.kv.w1", b"probe")
        other = await b.subscribe("t.load.>")
        await a.publish("t.kv.w1.extra", b"not for kv")  # '*' is one token only
        await a.publish("t.load.w1.dp0", b"L")
        for i in range(5):
            await a.publish("t.kv.w2", b"%d" % i)
        assert await asyncio.wait_for(anext(other), 2) == ("t.load.w1.dp0", b"L")
        got: list[tuple[str, bytes]] = []
        while len(got) < 5:  # skip probes still in flight
            item = await asyncio.wait_for(anext(kv), 2)
            if item[1] != b"probe":
                got.append(item)
        assert got == [("t.kv.w2", b"%d" % i) for i in range(5)]
        assert [i.component for i in await disc.list_instances("t._events")] == ["_events"]
    finally:
        await a.close()
        await b.close()
    assert await disc.list_instances() == []


async def test_closed_subscription_stops_receiving() -> None:
    disc = MemoryDiscovery()
    a, b = ZmqEventBus(disc, namespace="t"), ZmqEventBus(disc, namespace="t")
    try:
        s1 = await b.subscribe("x.y")
        await publish_until_received(a, s1, "x.y")
        await s1.close()
        assert await anext(s1, None) is None
    finally:
        await a.close()
        await b.close()
