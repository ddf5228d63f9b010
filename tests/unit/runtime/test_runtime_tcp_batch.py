"""BATCH frames on the request plane: a client that asks for them gets its streams' DATA and
END in one frame per server loop iteration, in order; a large payload still goes as its own
DATA; a client that does not ask (an older tandem) gets DATA and END frames as before; a
malformed BATCH drops the connection."""

from __future__ import annotations

import asyncio
import copy
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import pytest

from tandem import errors
from tandem.runtime.tcp import StreamContext, TcpRequestClient, TcpRequestServer
from tandem.runtime.tcp import frame as fr

pytestmark = pytest.mark.timeout(20)


async def echo_n(payload: bytes, ctx: StreamContext) -> AsyncIterator[bytes]:
    for i in range(int(payload)):
        yield b"%d" % i


async def big_in_the_middle(payload: bytes, ctx: StreamContext) -> AsyncIterator[bytes]:
    yield b"a"
    yield b"x" * (fr.BATCH_MAX_PAYLOAD_BYTES + 1)
    yield b"b"


@pytest.fixture
async def server() -> AsyncIterator[TcpRequestServer]:
    srv = TcpRequestServer(max_inflight_per_connection=64)
    srv.register("ns.c.echo", echo_n)
    srv.register("ns.c.big", big_in_the_middle)
    await srv.start()
    yield srv
    await srv.stop(grace_s=0)


@pytest.fixture
def frames(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every frame encoded in this process (server's and client's), as it was then."""
    seen: list[Any] = []
    encode = fr.encode
    monkeypatch.setattr(fr, "encode", lambda f: seen.append(copy.copy(f)) or encode(f))
    return seen


async def collect(it: AsyncIterator[bytes]) -> list[bytes]:
    return [x async for x in it]


def _sent_by_server(frames: list[Any]) -> list[Any]:
    return [f for f in frames if f[0] in (fr.DATA, fr.END, fr.BATCH)]


async def test_streams_of_a_client_that_takes_batches_share_batch_frames(server, frames) -> None:
    client = TcpRequestClient(connect_timeout_s=2)
    try:
        outs = await asyncio.gather(
            *(
                collect(client.stream(server.address, "ns.c.echo", b"30", request_id=f"r{i}"))
                for i in range(20)
            )
        )
    finally:
        await client.close()
    assert all(o == [b"%d" % i for i in range(30)] for o in outs)
    sent = _sent_by_server(frames)
    assert sent and all(f[0] == fr.BATCH for f in sent)  # no DATA or END of their own
    pairs = [(f[i], f[i + 1]) for f in sent for i in range(1, len(f), 2)]
    assert len(pairs) == 20 * 31  # 30 payloads and an END per stream
    assert max(len({sid for sid, _ in zip(f[1::2], f[2::2], strict=True)}) for f in sent) > 1
    for sid in {sid for sid, _ in pairs}:  # each stream's own pairs: in order, END last
        mine = [payload for s, payload in pairs if s == sid]
        assert mine == [*(b"%d" % i for i in range(30)), None]


async def test_a_large_payload_goes_as_its_own_data_frame_in_its_place(server, frames) -> None:
    client = TcpRequestClient(connect_timeout_s=2)
    try:
        out = await collect(client.stream(server.address, "ns.c.big", b"", request_id="r"))
    finally:
        await client.close()
    assert out == [b"a", b"x" * (fr.BATCH_MAX_PAYLOAD_BYTES + 1), b"b"]
    kinds = [(f[0], len(f)) for f in _sent_by_server(frames)]
    assert kinds == [(fr.BATCH, 3), (fr.DATA, 3), (fr.BATCH, 5)]  # a | big | b, END


async def test_a_batch_closes_past_its_byte_budget(server, frames) -> None:
    async def chunks(payload: bytes, ctx: StreamContext) -> AsyncIterator[bytes]:
        for i in range(12):
            yield bytes([i]) * (fr.BATCH_MAX_PAYLOAD_BYTES // 2)

    server.register("ns.c.chunks", chunks)
    client = TcpRequestClient(connect_timeout_s=2)
    try:
        out = await collect(client.stream(server.address, "ns.c.chunks", b"", request_id="r"))
    finally:
        await client.close()
    assert out == [bytes([i]) * (fr.BATCH_MAX_PAYLOAD_BYTES // 2) for i in range(12)]
    for f in _sent_by_server(frames):
        payloads = [p for p in f[2::2] if p is not None]
        assert sum(map(len, payloads)) < fr.BATCH_MAX_BYTES + fr.BATCH_MAX_PAYLOAD_BYTES


async def _read_frame(reader: asyncio.StreamReader) -> list[Any]:
    size = int.from_bytes(await reader.readexactly(4), "big")
    frame: list[Any] = msgpack.unpackb(await reader.readexactly(size), raw=False)
    return frame


async def test_a_client_that_does_not_ask_gets_data_and_end_frames(server) -> None:
    """An older client (its REQUEST without the trailing field) reads the protocol as before."""
    host, port = server.address.rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        hello = await _read_frame(reader)
        assert hello[0] == fr.HELLO
        writer.write(fr.encode((fr.AUTH, fr.PROTOCOL_VERSION, b"n" * 16, None)))
        assert (await _read_frame(reader))[0] == fr.WELCOME
        writer.write(fr.encode((fr.REQUEST, 1, "ns.c.echo", "old", None, 64, b"5")))
        got = [await _read_frame(reader) for _ in range(6)]
        assert got == [*([fr.DATA, 1, b"%d" % i] for i in range(5)), [fr.END, 1]]
    finally:
        writer.close()


async def test_a_malformed_batch_drops_the_connection() -> None:
    """A BATCH whose pairs do not pair up breaks the protocol: the client drops the
    connection and the stream fails as from a lost peer."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(fr.encode((fr.HELLO, fr.PROTOCOL_VERSION, b"s" * 16, False)))
        await _read_frame(reader)  # AUTH
        writer.write(fr.encode((fr.WELCOME, None)))
        request = await _read_frame(reader)
        assert request[0] == fr.REQUEST and request[8] is True  # asks for batches
        writer.write(fr.encode((fr.BATCH, request[1], b"ok", request[1])))
        await reader.read()  # until the client hangs up

    bad = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = bad.sockets[0].getsockname()[1]
    client = TcpRequestClient(connect_timeout_s=2)
    try:
        with pytest.raises(errors.PeerGone, match="lost"):
            await collect(client.stream(f"127.0.0.1:{port}", "p", b"", request_id="r"))
    finally:
        await client.close()
        bad.close()
        await bad.wait_closed()


async def test_batches_stay_within_the_smallest_frame_limit(monkeypatch) -> None:
    """At --max-frame-bytes 64 KiB (the least allowed) on both sides, thousands of tiny
    payloads and payloads just under and over a quarter of the limit all arrive, and no frame
    the server encodes exceeds the limit (the pairs' msgpack overhead counted too)."""
    limit = 64 << 10
    sizes: list[int] = []
    encode = fr.encode

    def measured(frame: Any) -> bytes:
        data = encode(frame)
        sizes.append(len(data))
        return data

    monkeypatch.setattr(fr, "encode", measured)

    async def mixed(payload: bytes, ctx: StreamContext) -> AsyncIterator[bytes]:
        if payload == b"tiny":
            for i in range(250):
                yield bytes([i % 256])
        else:
            for size in (limit // 4 - 64, limit // 4 + 64, limit // 4 - 64, 1):
                yield b"z" * size

    srv = TcpRequestServer(max_frame_bytes=limit, max_inflight_per_connection=64)
    srv.register("ns.c.mixed", mixed)
    await srv.start()
    client = TcpRequestClient(connect_timeout_s=2, max_frame_bytes=limit)
    try:
        kinds = [b"tiny"] * 30 + [b"big"] * 4
        outs = await asyncio.gather(
            *(
                collect(client.stream(srv.address, "ns.c.mixed", k, request_id=f"r{i}"))
                for i, k in enumerate(kinds)
            )
        )
    finally:
        await client.close()
        await srv.stop(grace_s=0)
    for kind, out in zip(kinds, outs, strict=True):
        if kind == b"tiny":
            assert out == [bytes([i % 256]) for i in range(250)]
        else:
            assert [len(p) for p in out] == [limit // 4 - 64, limit // 4 + 64, limit // 4 - 64, 1]
    assert max(sizes) <= limit


async def test_a_large_request_is_written_at_once_a_small_one_with_the_iteration(
    server,
) -> None:
    """A REQUEST of FLUSH_NOW_BYTES or more (a long prompt) reaches the socket before the
    loop runs anything else (that wait would be its TTFT); a small one is written with the
    rest of the iteration's frames."""
    client = TcpRequestClient(connect_timeout_s=2)
    try:
        assert await collect(client.stream(server.address, "ns.c.echo", b"1", request_id="w"))
        (conn,) = client._conns.values()
        writes: list[int] = []
        write = conn.transport.write
        conn.transport.write = lambda data: writes.append(len(data)) or write(data)
        small = client.stream(server.address, "ns.c.echo", b"3", request_id="s")
        big = client.stream(
            server.address, "ns.c.echo", b"4" + b" " * fr.FLUSH_NOW_BYTES, request_id="b"
        )
        first_small, first_big = (
            asyncio.ensure_future(anext(small)),
            asyncio.ensure_future(anext(big)),
        )
        await asyncio.sleep(0)  # both open their streams in this step; nothing else has run
        assert writes and writes[0] > fr.FLUSH_NOW_BYTES  # the big one (and the small one with it)
        assert await first_small == b"0" and await first_big == b"0"
        assert await collect(small) == [b"1", b"2"] and len(await collect(big)) == 3
    finally:
        await client.close()
