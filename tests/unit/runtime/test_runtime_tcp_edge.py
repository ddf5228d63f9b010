"""Request plane at its edge: per-stream flow control, frame size limits, the cluster secret."""

from __future__ import annotations

import asyncio
import logging
import secrets
import struct
from collections.abc import AsyncIterator, Callable

import msgpack
import pytest
from tests.support.eventually import eventually

from tandem import errors
from tandem.runtime.tcp import StreamContext, TcpRequestClient, TcpRequestServer

pytestmark = pytest.mark.timeout(30)
SECRET = secrets.token_hex(32)  # as `openssl rand -hex 32` makes one


async def echo_n(payload: bytes, ctx: StreamContext) -> AsyncIterator[bytes]:
    for i in range(int(payload)):
        yield b"%d" % i


async def collect(it: AsyncIterator[bytes]) -> list[bytes]:
    return [x async for x in it]


@pytest.fixture
async def server() -> AsyncIterator[TcpRequestServer]:
    srv = TcpRequestServer()
    srv.register("ns.c.echo", echo_n)
    await srv.start()
    yield srv
    await srv.stop(grace_s=0)


# ---------------------------------------------------------------- per-stream flow control


class Firehose:
    """A handler that yields `num_items` 1 KiB payloads as fast as it is allowed to."""

    def __init__(self, num_items: int) -> None:
        self.num_items = num_items
        self.num_produced = 0
        self.stopped = asyncio.Event()  # the server closed the handler early

    async def __call__(self, payload: bytes, ctx: StreamContext) -> AsyncIterator[bytes]:
        i = 0
        try:
            for i in range(self.num_items):
                self.num_produced += 1
                yield b"%08d" % i + b"x" * 1016
        finally:
            if i < self.num_items - 1:
                self.stopped.set()


async def stalled(count: Callable[[], int], num_polls: int = 3) -> None:
    """Return once `count()` stopped moving for `num_polls` polls 50 ms apart."""
    last, same = -1, 0
    async with asyncio.timeout(20):
        while same < num_polls:
            now = count()
            same = same + 1 if now == last else 0
            last = now
            await asyncio.sleep(0.05)


async def test_stalled_consumer_never_holds_up_another_stream(server) -> None:
    client = TcpRequestClient(stream_window=16)
    hose = Firehose(20_000)  # 20 MB: far more than socket buffers hold
    server.register("ns.c.hose", hose)
    try:
        long = client.stream(server.address, "ns.c.hose", b"", request_id="long")
        first = await anext(long)
        assert first.startswith(b"00000000")
        # the consumer of `long` stops reading; wait until its producer is held back
        await stalled(lambda: hose.num_produced)
        # held back by its own window (+1 item in hand), not by the connection's buffers
        assert hose.num_produced <= 1 + 16 + 1
        # a short request on the same connection is answered in full meanwhile
        short = client.stream(server.address, "ns.c.echo", b"4", request_id="short")
        assert await asyncio.wait_for(collect(short), 10) == [b"0", b"1", b"2", b"3"]
        assert len(client._conns) == 1 and len(server._connections) == 1
        assert hose.num_produced <= 1 + 16 + 1  # and `long` did not move meanwhile
        # reading resumes the long stream, in order, to the end
        rest = await asyncio.wait_for(collect(long), 20)
        assert [int(x[:8]) for x in rest] == list(range(1, 20_000))
    finally:
        await client.close()


async def test_stream_stalled_past_timeout_is_cancelled() -> None:
    srv = TcpRequestServer(stream_stall_timeout_s=0.3)
    hose = Firehose(10_000)
    srv.register("ns.c.hose", hose)
    await srv.start()
    client = TcpRequestClient(stream_window=8)
    try:
        it = client.stream(srv.address, "ns.c.hose", b"", request_id="lazy")
        await anext(it)
        await asyncio.wait_for(hose.stopped.wait(), 10)  # the consumer never read again
        await eventually(lambda: srv.num_inflight == 0)
        with pytest.raises(errors.DeadlineExceeded, match=r"request_id=lazy.*stalled"):
            await collect(it)  # what was in the window comes first, then the reason
    finally:
        await client.close()
        await srv.stop(grace_s=0)


# ---------------------------------------------------------------- frame size limits


async def raw_handshake(address: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Open a raw connection and complete the handshake of a server without a secret."""
    host, _, port = address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    hello = await asyncio.wait_for(read_frame(reader), 5)
    assert hello[0] == 10 and hello[1] == 2  # HELLO, protocol v2
    write_frame(writer, [11, 2, b"n" * 16, None])  # AUTH without proof
    assert (await asyncio.wait_for(read_frame(reader), 5))[0] == 12  # WELCOME
    return reader, writer


async def read_frame(reader: asyncio.StreamReader) -> list:
    (size,) = struct.unpack(">I", await reader.readexactly(4))
    return msgpack.unpackb(await reader.readexactly(size), raw=False)


def write_frame(writer: asyncio.StreamWriter, frame: list) -> None:
    body = msgpack.packb(frame, use_bin_type=True)
    writer.write(struct.pack(">I", len(body)) + body)


async def test_oversize_length_prefix_closes_connection_before_body(server, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="tandem.runtime.tcp")
    reader, writer = await raw_handshake(server.address)
    writer.write(struct.pack(">I", 200 << 20) + b"\x95")  # claims 200 MB, sends 1 byte
    await writer.drain()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed without waiting for the rest
    writer.close()
    assert "exceeds max_frame_bytes=16777216" in caplog.text
    client = TcpRequestClient()
    try:  # the server stays healthy
        assert await collect(client.stream(server.address, "ns.c.echo", b"2", request_id="r")) == [
            b"0",
            b"1",
        ]
    finally:
        await client.close()


async def test_request_over_max_frame_bytes_is_refused_worker_stays_healthy(caplog) -> None:
    caplog.set_level(logging.WARNING, logger="tandem.runtime.tcp")
    srv = TcpRequestServer(max_frame_bytes=64 << 10)
    srv.register("ns.c.echo", echo_n)
    await srv.start()
    client = TcpRequestClient()
    try:
        with pytest.raises(errors.PeerGone, match="request_id=big"):
            await collect(client.stream(srv.address, "ns.c.echo", b"1" * (100 << 10),
                                        request_id="big"))  # fmt: skip
        assert "exceeds max_frame_bytes=65536" in caplog.text
        assert await collect(client.stream(srv.address, "ns.c.echo", b"1", request_id="ok")) == [
            b"0"
        ]
        assert srv.num_inflight == 0
    finally:
        await client.close()
        await srv.stop(grace_s=0)


# ---------------------------------------------------------------- cluster secret


@pytest.fixture
async def secured() -> AsyncIterator[tuple[TcpRequestServer, list[bytes]]]:
    seen: list[bytes] = []

    async def record(payload: bytes, ctx: StreamContext) -> AsyncIterator[bytes]:
        seen.append(payload)
        yield b"ok"

    srv = TcpRequestServer(secret=SECRET)
    srv.register("ns.c.record", record)
    await srv.start()
    yield srv, seen
    await srv.stop(grace_s=0)


@pytest.mark.parametrize("secret", [None, "the-wrong-secret-of-another-cluster"])
async def test_server_with_secret_refuses_client_without_it(secured, secret) -> None:
    srv, seen = secured
    client = TcpRequestClient(secret=secret)
    try:
        with pytest.raises(errors.PeerGone, match=r"authentication failed.*cluster secret"):
            await collect(client.stream(srv.address, "ns.c.record", b"hi", request_id="r"))
    finally:
        await client.close()
    assert seen == [] and srv.num_refused == 1


async def test_client_with_the_secret_is_served(secured) -> None:
    srv, seen = secured
    client = TcpRequestClient(secret=SECRET)
    try:
        out = await collect(client.stream(srv.address, "ns.c.record", b"hi", request_id="r"))
    finally:
        await client.close()
    assert out == [b"ok"] and seen == [b"hi"]


async def test_unauthenticated_request_is_never_read(secured) -> None:
    srv, seen = secured
    host, _, port = srv.address.rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    # a client that skips the handshake and sends a request at once (as protocol v1 did)
    write_frame(writer, [0, 1, "ns.c.record", "r", None, 8, b"sneaky"])
    await writer.drain()
    frames = []
    with pytest.raises(asyncio.IncompleteReadError):
        while True:
            frames.append(await asyncio.wait_for(read_frame(reader), 5))
    writer.close()
    assert [f[0] for f in frames] == [10, 13]  # HELLO, REFUSED; never a DATA frame
    assert "expected an AUTH frame" in frames[1][1]
    assert seen == []


async def test_client_with_secret_refuses_server_without_one(server) -> None:
    client = TcpRequestClient(secret=SECRET)
    try:
        with pytest.raises(errors.PeerGone, match="does not authenticate"):
            await collect(client.stream(server.address, "ns.c.echo", b"1", request_id="r"))
    finally:
        await client.close()


async def test_silent_connection_is_closed_after_handshake_timeout() -> None:
    srv = TcpRequestServer(handshake_timeout_s=0.2)
    await srv.start()
    try:
        host, _, port = srv.address.rpartition(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        assert (await asyncio.wait_for(read_frame(reader), 5))[0] == 10
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, never answered
        writer.close()
        assert srv.num_refused == 1
    finally:
        await srv.stop(grace_s=0)


async def test_connections_over_the_cap_are_closed_at_accept(server) -> None:
    server.max_connections = 1
    host, _, port = server.address.rpartition(":")
    r1, w1 = await asyncio.open_connection(host, int(port))
    assert (await asyncio.wait_for(read_frame(r1), 5))[0] == 10
    r2, w2 = await asyncio.open_connection(host, int(port))
    assert await asyncio.wait_for(r2.read(), 5) == b""
    w1.close()
    w2.close()


async def test_response_item_over_the_limit_fails_that_stream_only() -> None:
    async def huge(payload: bytes, ctx: StreamContext) -> AsyncIterator[bytes]:
        yield b"small"
        yield b"x" * (100 << 10)

    srv = TcpRequestServer(max_frame_bytes=64 << 10)
    srv.register("ns.c.huge", huge)
    srv.register("ns.c.echo", echo_n)
    await srv.start()
    client = TcpRequestClient(max_frame_bytes=64 << 10)
    try:
        it = client.stream(srv.address, "ns.c.huge", b"", request_id="h")
        assert await anext(it) == b"small"
        with pytest.raises(errors.ServingError, match=r"102400 bytes .* max_frame_bytes=65536"):
            await anext(it)
        # the connection survived: the next request uses it
        assert await collect(client.stream(srv.address, "ns.c.echo", b"1", request_id="n")) == [
            b"0"
        ]
        assert len(srv._connections) == 1
    finally:
        await client.close()
        await srv.stop(grace_s=0)
