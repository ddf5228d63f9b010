"""ZmqEventBus in one process: two buses find each other through shared memory discovery."""

from __future__ import annotations

import asyncio
import secrets

import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from tandem.protocols.discovery import Instance
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events import curve
from tandem.runtime.events.zmq import DRAIN_BATCH, ZmqEventBus

pytestmark = pytest.mark.timeout(15)


async def publish_until_received(pub: ZmqEventBus, sub, subject: str) -> tuple[str, bytes]:
    """ZMQ drops what is published before the SUB connected: repeat until one arrives
    (a CURVE handshake on a loaded 2-core box can take seconds)."""
    async with asyncio.timeout(30):
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


async def test_a_burst_past_several_drain_batches_arrives_whole_and_in_order() -> None:
    """The receive loop reads what is queued without awaiting, `DRAIN_BATCH` at a time: the
    messages left after a full batch (no new one arrives to wake it) and those after a
    malformed one are all delivered, in order."""
    disc = MemoryDiscovery()
    b = ZmqEventBus(disc, namespace="t")
    raw = zmq.asyncio.Context().socket(zmq.PUB)
    raw.setsockopt(zmq.LINGER, 0)
    raw.setsockopt(zmq.SNDHWM, 0)  # nothing of the burst dropped at the publisher
    port = raw.bind_to_random_port("tcp://127.0.0.1")
    try:
        sub = await b.subscribe("t.kv")
        await disc.register(Instance(instance_id="raw", namespace="t", component="_events",
                                     endpoint="pub", address=f"127.0.0.1:{port}"))  # fmt: skip
        async with asyncio.timeout(30):  # connected once a probe comes through
            while True:
                await raw.send_multipart([b"t.kv", b"probe"])
                try:
                    await asyncio.wait_for(anext(sub), 0.05)
                    break
                except TimeoutError:
                    continue
        count = 3 * DRAIN_BATCH + 7
        for i in range(count):  # queued before the receive loop runs again
            raw.send_multipart([b"t.kv", b"%d" % i], flags=zmq.NOBLOCK)
            if i % DRAIN_BATCH == 5:
                raw.send_multipart([b"t.kv", b"one", b"frame too many"], flags=zmq.NOBLOCK)
        got: list[bytes] = []
        while len(got) < count:
            _, payload = await asyncio.wait_for(anext(sub), 2)
            if payload != b"probe":
                got.append(payload)
        assert got == [b"%d" % i for i in range(count)]
        assert b.num_malformed == 4
    finally:
        raw.close(linger=0)
        await b.close()


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


SECRET = secrets.token_hex(32)  # as `openssl rand -hex 32` makes one
HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


async def handshake_failed(sock: zmq.asyncio.Socket) -> None:
    """Return once `sock` reports a failed ZMTP handshake with a peer."""
    mon = sock.get_monitor_socket(HANDSHAKE_FAILED)
    try:
        parse_monitor_message(await asyncio.wait_for(mon.recv_multipart(), 30))
    finally:
        sock.disable_monitor()
        mon.close(linger=0)


async def test_buses_sharing_the_secret_exchange_events() -> None:
    disc = MemoryDiscovery()
    a = ZmqEventBus(disc, namespace="t", secret=SECRET)
    b = ZmqEventBus(disc, namespace="t", secret=SECRET)
    try:
        sub = await b.subscribe("t.kv.*")
        assert await publish_until_received(a, sub, "t.kv.w1") == ("t.kv.w1", b"probe")
    finally:
        await a.close()
        await b.close()


@pytest.mark.parametrize("forger_secret", [None, "another-clusters-secret-0123456789"])
async def test_publisher_without_the_secret_is_never_heard(forger_secret) -> None:
    """A process without the secret registers a publisher in discovery and sends events in
    a worker's name: the subscriber's CURVE handshake with it fails, nothing it sends is
    delivered, and events of the real publisher still are."""
    disc = MemoryDiscovery()
    a = ZmqEventBus(disc, namespace="t", secret=SECRET)
    b = ZmqEventBus(disc, namespace="t", secret=SECRET)
    ctx = zmq.asyncio.Context()
    forger = ctx.socket(zmq.PUB)
    forger.setsockopt(zmq.LINGER, 0)
    if forger_secret is not None:  # a CURVE server with keys of another cluster
        curve.make_server(forger, curve.curve_keys(forger_secret))
    forger.bind("tcp://127.0.0.1:0")
    port = forger.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    try:
        failed = asyncio.create_task(handshake_failed(forger))
        kv = await b.subscribe("t.kv.*")
        await disc.register(Instance(instance_id="evil", namespace="t", component="_events",
                                     endpoint="pub", address=f"127.0.0.1:{port}"))  # fmt: skip
        await failed  # the subscriber tried the forger and the handshake failed
        for _ in range(20):
            await forger.send_multipart([b"t.kv.w1", b"forged"])
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


async def test_subscriber_without_the_secret_reads_nothing() -> None:
    """KV events carry prompt token ids: a local process that connects to a publisher
    without the secret must not read them."""
    disc = MemoryDiscovery()
    a = ZmqEventBus(disc, namespace="t", secret=SECRET)
    b = ZmqEventBus(disc, namespace="t", secret=SECRET)
    ctx = zmq.asyncio.Context()
    spy = ctx.socket(zmq.SUB)
    spy.setsockopt(zmq.LINGER, 0)
    spy.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        kv = await b.subscribe("t.kv.*")
        assert await publish_until_received(a, kv, "t.kv.w1") == ("t.kv.w1", b"probe")
        [pub] = await disc.list_instances("t._events.pub")
        failed = asyncio.create_task(handshake_failed(spy))
        spy.connect(f"tcp://{pub.address}")
        await failed
        await a.publish("t.kv.w1", b"secret prompt tokens")
        while (item := await asyncio.wait_for(anext(kv), 2))[1] == b"probe":
            pass
        assert item == ("t.kv.w1", b"secret prompt tokens")
        assert await spy.poll(timeout=100) == 0  # the spy never got a message
    finally:
        spy.close(linger=0)
        ctx.term()
        await a.close()
        await b.close()


async def test_a_publisher_binds_the_pinned_port_and_advertises_its_address() -> None:
    """`--events-port` pins the PUB port (a firewall opens it); bound to every interface it
    advertises the address peers dial, never 0.0.0.0."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    disc = MemoryDiscovery()
    bus = ZmqEventBus(disc, namespace="t", host="0.0.0.0", advertise_host="127.0.0.1", port=port)
    try:
        await bus.publish("t.kv.w1", b"x")
        [record] = await disc.list_instances("t._events")
        assert record.address == f"127.0.0.1:{port}"
    finally:
        await bus.close()
