"""Request plane over real loopback TCP: streaming, errors, cancel, deadline, bounds, peer gone."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from tandem import errors
from tandem.runtime.tcp import StreamContext, TcpRequestClient, TcpRequestServer

pytestmark = pytest.mark.timeout(20)


async def echo_n(payload: bytes, ctx: StreamContext) -> AsyncIterator[bytes]:
    for i in range(int(payload)):
        yield b"%d" % i


@pytest.fixture
async def server() -> AsyncIterator[TcpRequestServer]:
    srv = TcpRequestServer(max_inflight_per_connection=4)
    srv.register("ns.c.echo", echo_n)
    await srv.start()
    yield srv
    await srv.stop(grace_s=0)


@pytest.fixture
async def client() -> AsyncIterator[TcpRequestClient]:
    c = TcpRequestClient(connect_timeout_s=2)
    yield c
    await c.close()


async def collect(it: AsyncIterator[bytes]) -> list[bytes]:
    return [x async for x in it]


async def test_streams_all_items_in_order(server, client) -> None:
    out = await collect(client.stream(server.address, "ns.c.echo", b"1000", request_id="r1"))
    assert out == [b"%d" % i for i in range(1000)]


async def test_many_concurrent_streams_share_one_connection(server, client) -> None:
    server.max_inflight_per_connection = 100
    outs = await asyncio.gather(
        *(
            collect(client.stream(server.address, "ns.c.echo", b"50", request_id=f"r{i}"))
            for i in range(50)
        )
    )
    assert all(o == [b"%d" % i for i in range(50)] for o in outs)
    assert len(client._conns) == 1 and len(server._connections) == 1


async def test_serving_error_is_reraised_by_class(server, client) -> None:
    async def bad(payload: bytes, ctx: StreamContext) -> AsyncIterator[bytes]:
        yield b"first"
        raise errors.ContextLengthExceeded("prompt of 9000 tokens exceeds 4096")

    server.register("ns.c.bad", bad)
    it = client.stream(server.address, "ns.c.bad", b"", request_id="r")
    assert await anext(it) == b"first"
    with pytest.raises(errors.ContextLengthExceeded, match="9000 tokens"):
        await anext(it)


async def test_overloaded_keeps_retry_after(server, client) -> None:
    async def busy(payload: bytes, ctx: StreamContext) -> AsyncIterator[bytes]:
        raise errors.Overloaded("queue full", retry_after_s=7.5)
        yield b""  # pragma: no cover

    server.register("ns.c.busy", busy)
    with pytest.raises(errors.Overloaded) as info:
        await collect(client.stream(server.address, "ns.c.busy", b"", request_id="r"))
    assert info.value.retry_after_s == 7.5


async def test_unexpected_exception_becomes_serving_error(server, client) -> None:
    async def boom(payload: bytes, ctx: StreamContext) -> AsyncIterator[bytes]:
        raise KeyError("x")
        yield b""  # pragma: no cover

    server.register("ns.c.boom", boom)
    with pytest.raises(errors.ServingError, match="KeyError"):
        await collect(client.stream(server.address, "ns.c.boom", b"", request_id="r"))


async def test_unknown_endpoint_names_what_is_served(server, client) -> None:
    with pytest.raises(errors.NoWorkersAvailable, match=r"ns\.c\.echo"):
        await collect(client.stream(server.address, "ns.c.nope", b"", request_id="r"))


class Gate:
    """A handler that yields once, then waits forever; records cancellation."""

    def __init__(self) -> None:
        self.started = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.ctx_cancelled_seen = False

    async def __call__(self, payload: bytes, ctx: StreamContext) -> AsyncIterator[bytes]:
        yield b"hello"
        self.started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            self.ctx_cancelled_seen = ctx.cancelled.is_set()
            self.cancelled.set()
            raise


async def test_aclose_cancels_handler_on_server(server, client) -> None:
    gate = Gate()
    server.register("ns.c.gate", gate)
    it = client.stream(server.address, "ns.c.gate", b"", request_id="r")
    assert await anext(it) == b"hello"
    await asyncio.wait_for(gate.started.wait(), 5)
    await it.aclose()
    await asyncio.wait_for(gate.cancelled.wait(), 5)
    assert gate.ctx_cancelled_seen
    await asyncio.wait_for(server._idle.wait(), 5)
    assert server.num_inflight == 0


async def test_break_out_of_loop_cancels_handler(server, client) -> None:
    gate = Gate()
    server.register("ns.c.gate", gate)
    async for item in client.stream(server.address, "ns.c.gate", b"", request_id="r"):
        assert item == b"hello"
        break
    await asyncio.wait_for(gate.cancelled.wait(), 5)


async def test_task_cancel_cancels_handler(server, client) -> None:
    gate = Gate()
    server.register("ns.c.gate", gate)

    async def consume() -> None:
        await collect(client.stream(server.address, "ns.c.gate", b"", request_id="r"))

    task = asyncio.create_task(consume())
    await asyncio.wait_for(gate.started.wait(), 5)
    task.cancel()
    await asyncio.wait_for(gate.cancelled.wait(), 5)


async def test_deadline_cancels_handler_and_raises(server, client) -> None:
    gate = Gate()
    server.register("ns.c.gate", gate)
    it = client.stream(
        server.address, "ns.c.gate", b"", request_id="r", deadline_s=time.time() + 0.3
    )
    assert await anext(it) == b"hello"
    with pytest.raises(errors.DeadlineExceeded, match="request_id=r"):
        await anext(it)
    await asyncio.wait_for(gate.cancelled.wait(), 5)


async def test_past_deadline_fails_without_sending(server, client) -> None:
    with pytest.raises(errors.DeadlineExceeded):
        await collect(
            client.stream(
                server.address, "ns.c.echo", b"3", request_id="r", deadline_s=time.time() - 1
            )
        )


async def test_inflight_bound_per_connection_answers_overloaded(server, client) -> None:
    gate = Gate()
    server.register("ns.c.gate", gate)
    held = [client.stream(server.address, "ns.c.gate", b"", request_id=f"h{i}") for i in range(4)]
    for it in held:
        assert await anext(it) == b"hello"
    with pytest.raises(errors.Overloaded, match="limit 4"):
        await collect(client.stream(server.address, "ns.c.echo", b"1", request_id="over"))
    await held[0].aclose()
    await asyncio.wait_for(gate.cancelled.wait(), 5)  # the CANCEL frame was processed
    assert await collect(client.stream(server.address, "ns.c.echo", b"2", request_id="ok")) == [
        b"0",
        b"1",
    ]
    for it in held[1:]:
        await it.aclose()


async def test_peer_gone_when_server_connection_drops(server, client) -> None:
    gate = Gate()
    server.register("ns.c.gate", gate)
    it = client.stream(server.address, "ns.c.gate", b"", request_id="r7")
    assert await anext(it) == b"hello"
    for conn in list(server._connections):
        conn.transport.abort()
    with pytest.raises(errors.PeerGone, match=server.address) as info:
        await anext(it)
    assert "request_id=r7" in str(info.value)
    # the pool reconnects for the next request
    assert await collect(client.stream(server.address, "ns.c.echo", b"1", request_id="n")) == [b"0"]


async def test_connect_refused_is_peer_gone_naming_address(client) -> None:
    srv = TcpRequestServer()
    await srv.start()
    address = srv.address
    await srv.stop(grace_s=0)
    with pytest.raises(errors.PeerGone, match=f"cannot connect to {address}"):
        await collect(client.stream(address, "ns.c.echo", b"1", request_id="r"))


async def test_stop_drains_inflight_then_refuses(server, client) -> None:
    release = asyncio.Event()

    async def slow(payload: bytes, ctx: StreamContext) -> AsyncIterator[bytes]:
        yield b"a"
        await release.wait()
        yield b"b"

    server.register("ns.c.slow", slow)
    it = client.stream(server.address, "ns.c.slow", b"", request_id="r")
    assert await anext(it) == b"a"
    stopping = asyncio.create_task(server.stop(grace_s=5))
    await asyncio.sleep(0)
    with pytest.raises(errors.PeerGone, match="shutting down"):
        await collect(client.stream(server.address, "ns.c.echo", b"1", request_id="late"))
    release.set()
    assert await collect(it) == [b"b"]
    await asyncio.wait_for(stopping, 5)


async def test_stop_grace_over_cancels_and_client_sees_peer_gone(server, client) -> None:
    gate = Gate()
    server.register("ns.c.gate", gate)
    it = client.stream(server.address, "ns.c.gate", b"", request_id="r")
    assert await anext(it) == b"hello"
    await server.stop(grace_s=0.05)
    await asyncio.wait_for(gate.cancelled.wait(), 5)
    with pytest.raises(errors.PeerGone):
        await anext(it)


async def test_try_send_only_within_credit_and_while_the_stream_is_open(server) -> None:
    """`StreamContext.try_send` (an engine's step sending past its handler): in order with
    the handler's own items, refused without credit, after a cancel and after END."""
    held: list[StreamContext] = []
    proceed = asyncio.Event()
    answers: list[bool] = []

    async def pushed(payload: bytes, ctx: StreamContext) -> AsyncIterator[bytes]:
        held.append(ctx)
        yield b"0"
        answers.extend(ctx.try_send(b"%d" % i) for i in (1, 2, 3))  # window 4: 3 left
        answers.append(ctx.try_send(b"4"))  # no credit left
        await proceed.wait()
        yield b"4"  # the handler's own path waits for credit

    server.register("ns.c.pushed", pushed)
    small = TcpRequestClient(connect_timeout_s=2, stream_window=4)
    try:
        stream = small.stream(server.address, "ns.c.pushed", b"", request_id="p")
        got = [await anext(stream) for _ in range(4)]
        assert got == [b"0", b"1", b"2", b"3"] and answers == [True, True, True, False]
        proceed.set()
        assert await collect(stream) == [b"4"]
        assert not held[0].try_send(b"late")  # after END: refused, nothing sent

        proceed.clear()
        stream = small.stream(server.address, "ns.c.pushed", b"", request_id="c")
        assert await anext(stream) == b"0"
        await stream.aclose()
        await asyncio.wait_for(held[-1].cancelled.wait(), 5)
        assert not held[-1].try_send(b"x")  # cancelled: refused
    finally:
        await small.close()


async def test_next_ready_takes_what_arrived_without_waiting_and_returns_credit(server) -> None:
    """A reader that is behind takes buffered payloads with `next_ready` (no await); credit
    still flows back, so a stream many windows long completes; None when nothing waits."""
    small = TcpRequestClient(connect_timeout_s=2, stream_window=4)
    try:
        stream = small.stream(server.address, "ns.c.echo", b"40", request_id="n")
        assert stream.next_ready() is None  # not started
        got: list[bytes] = []
        num_ready = 0
        async with asyncio.timeout(10):  # credit not returned: the server stalls, this fails
            while len(got) < 40:
                ready = stream.next_ready()
                num_ready += ready is not None
                got.append(ready if ready is not None else await anext(stream))
        assert got == [b"%d" % i for i in range(40)]
        assert num_ready > 0  # the window lets several arrive while the reader is away
        assert await collect(stream) == []
        assert stream.next_ready() is None  # ended
    finally:
        await small.close()
