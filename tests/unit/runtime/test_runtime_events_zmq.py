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


SECRET = "event-plane-secret-of-this-test-0123"


async def test_forged_events_are_dropped_with_a_secret() -> None:
    """A process without the secret registers a publisher in discovery and sends events in
    the name of a worker (unsealed, sealed with another secret, or malformed): every one is
    dropped, the subscriber's receive loop lives on, and sealed events still arrive."""
    import zmq
    import zmq.asyncio

    from tandem.protocols.discovery import Instance
    from tandem.runtime.events.envelope import EventSealer

    disc = MemoryDiscovery()
    a = ZmqEventBus(disc, namespace="t", secret=SECRET)
    b = ZmqEventBus(disc, namespace="t", secret=SECRET)
    ctx = zmq.asyncio.Context()
    forger = ctx.socket(zmq.PUB)
    forger.setsockopt(zmq.LINGER, 0)
    forger.bind("tcp://127.0.0.1:0")
    port = forger.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    await disc.register(Instance(instance_id="evil", namespace="t", component="_events",
                                 endpoint="pub", address=f"127.0.0.1:{port}"))  # fmt: skip
    other_cluster = EventSealer("another-clusters-secret-0123456789")
    forged = [
        [b"t.kv.w1", b"forged"],
        [b"t.kv.w1", other_cluster.seal("t.kv.w1", b"forged")],
        [b"t.kv.w1", b"x", b"three frames"],
        [b"\xff\xfe", b"bad subject"],
    ]
    try:
        kv = await b.subscribe("t.kv.*")

        async def forge_until_dropped() -> None:
            while b.num_rejected < 4 * len(forged):
                for msg in forged:
                    await forger.send_multipart(msg)
                await asyncio.sleep(0.01)

        await asyncio.wait_for(forge_until_dropped(), 10)
        assert await publish_until_received(a, kv, "t.kv.w1") == ("t.kv.w1", b"probe")
        await a.publish("t.kv.w1", b"real")
        while (item := await asyncio.wait_for(anext(kv), 2))[1] == b"probe":
            pass
        assert item == ("t.kv.w1", b"real")
        assert not kv._buf  # nothing forged was ever delivered
    finally:
        forger.close(linger=0)
        ctx.term()
        await a.close()
        await b.close()


async def test_subscriber_with_secret_drops_unsealed_publisher() -> None:
    disc = MemoryDiscovery()
    plain, sealed = ZmqEventBus(disc, namespace="t"), ZmqEventBus(disc, namespace="t",
                                                                  secret=SECRET)  # fmt: skip
    try:
        sub = await sealed.subscribe("x.y")
        async with asyncio.timeout(10):
            while sealed.num_rejected == 0:
                await plain.publish("x.y", b"unsealed")
                await asyncio.sleep(0.01)
        assert not sub._buf  # nothing was delivered
    finally:
        await plain.close()
        await sealed.close()
