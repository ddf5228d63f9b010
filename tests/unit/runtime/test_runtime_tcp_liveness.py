"""Liveness of pooled request-plane connections (issue 30, "Recovery and truth"): TCP
keepalive on every socket; a server that stops answering (frozen: its kernel still holds the
connection) is found by PING within the client's limit and its streams fail with PeerGone; a
connection is dropped on request; a server that predates PING is never sent one."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest

from tandem import errors
from tandem.runtime.tcp import StreamContext, TcpRequestClient, TcpRequestServer, transport
from tandem.runtime.tcp import frame as fr

pytestmark = pytest.mark.timeout(30)


async def _read_frame(reader: asyncio.StreamReader) -> list[Any]:
    size = int.from_bytes(await reader.readexactly(4), "big")
    frame: list[Any] = msgpack.unpackb(await reader.readexactly(size), raw=False)
    return frame


async def _fake_server(answers_pings: bool, frames: list[list[Any]]) -> asyncio.Server:
    """Handshakes, then records every frame and answers none (a frozen worker)."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(fr.encode((fr.HELLO, fr.PROTOCOL_VERSION, b"s" * 16, False)))
        await _read_frame(reader)  # AUTH
        welcome = (fr.WELCOME, None, True) if answers_pings else (fr.WELCOME, None)
        writer.write(fr.encode(welcome))
        try:
            while True:
                frames.append(await _read_frame(reader))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass

    return await asyncio.start_server(serve, "127.0.0.1", 0)


async def _drain(stream: Any) -> list[bytes]:
    return [p async for p in stream]


async def slow(payload: bytes, ctx: StreamContext) -> AsyncIterator[bytes]:
    yield b"first"
    await asyncio.sleep(60)
    yield b"never"


async def test_a_silent_server_is_pinged_and_its_connection_aborted() -> None:
    frames: list[list[Any]] = []
    server = await _fake_server(True, frames)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = TcpRequestClient(connect_timeout_s=2, dead_after_s=2.5)
    try:
        stream = client.stream(address, "p", b"", request_id="r")
        task = asyncio.create_task(_drain(stream))
        with pytest.raises(errors.PeerGone, match="answered nothing, not even a PING"):
            await asyncio.wait_for(task, 10)
        assert any(f[0] == fr.PING for f in frames)
        assert client.peer_silent_s(address) is None  # gone from the pool
        assert not await client.answers(address, 0.5)
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


async def test_a_frozen_server_does_not_answer() -> None:
    server = await _fake_server(True, [])
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = TcpRequestClient(connect_timeout_s=2)
    try:
        await client.connect(address)
        assert not await client.answers(address, 0.3)
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


async def test_a_server_that_predates_ping_is_never_pinged() -> None:
    frames: list[list[Any]] = []
    server = await _fake_server(False, frames)
    address = f"127.0.0.1:{server.sockets[0].getsockname()[1]}"
    client = TcpRequestClient(connect_timeout_s=2, dead_after_s=2.5)
    try:
        await client.connect(address)
        await asyncio.sleep(3.0)  # past dead_after_s: an old server keeps its connection
        assert client.peer_silent_s(address) == 0.0
        assert not any(f[0] == fr.PING for f in frames)  # it would drop us on an unknown kind
    finally:
        await client.close()
        server.close()
        await server.wait_closed()


async def test_a_live_server_answers_pings_and_a_dropped_connection_is_replaced() -> None:
    server = TcpRequestServer()
    server.register("ns.c.slow", slow)
    await server.start()
    client = TcpRequestClient(connect_timeout_s=2, dead_after_s=2.5)
    try:
        stream = client.stream(server.address, "ns.c.slow", b"", request_id="r")
        assert await anext(stream) == b"first"
        await asyncio.sleep(3.5)  # idle past dead_after_s: PONGs keep it alive
        silent_s = client.peer_silent_s(server.address)
        assert silent_s is not None and silent_s < 2.0
        assert await client.answers(server.address, 5.0)
        client.drop(server.address, "worker w0 left discovery and stopped answering")
        with pytest.raises(errors.PeerGone, match="left discovery"):
            await anext(stream)
        assert client.peer_silent_s(server.address) is None
        again = client.stream(server.address, "ns.c.slow", b"", request_id="r2")
        assert await anext(again) == b"first"  # a fresh connection
        await again.aclose()
    finally:
        await client.close()
        await server.stop(0)


async def test_request_plane_sockets_have_tcp_keepalive() -> None:
    server = TcpRequestServer()
    server.register("ns.c.slow", slow)
    await server.start()
    client = TcpRequestClient(connect_timeout_s=2)
    try:
        await client.connect(server.address)
        conn = await client.connection(server.address, 2)
        assert conn.transport is not None
        sock = conn.transport.get_extra_info("socket")
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == transport.KEEPIDLE_S
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == transport.KEEPINTVL_S
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == transport.KEEPCNT
    finally:
        await client.close()
        await server.stop(0)


def test_dead_after_must_leave_room_for_pings() -> None:
    with pytest.raises(ValueError, match="dead_after_s"):
        TcpRequestClient(dead_after_s=1.0)
