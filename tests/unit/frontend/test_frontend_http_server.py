from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
from tests.support.eventually import eventually

from tandem.frontend.http.config import HttpConfig
from tandem.frontend.http.server import HttpRequest, HttpResponse, HttpServer

pytestmark = pytest.mark.timeout(10)

# every test runs on asyncio's loop and on uvloop (the frontend process's): see conftest.py


async def _serve(handler, **kw):
    server = HttpServer(handler, **kw)
    host, port = await server.start("127.0.0.1", 0)
    reader, writer = await asyncio.open_connection(host, port)
    return server, reader, writer


async def _echo(request: HttpRequest, response: HttpResponse) -> None:
    body = f"{request.method} {request.path} {request.query} ".encode() + request.body
    await response.send(200, body, content_type=b"text/plain")


async def _read_response(reader: asyncio.StreamReader) -> tuple[str, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode()
    status, *lines = head.strip().split("\r\n")
    headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines)}
    body = await reader.readexactly(int(headers["content-length"]))
    return status, headers, body


async def test_keep_alive_pipelining_and_chunked_request_body() -> None:
    server, reader, writer = await _serve(_echo)
    writer.write(
        b"POST /a?x=1 HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello"
        b"POST /b HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
        b"GET /c HTTP/1.1\r\nHost: h\r\n\r\n"
    )
    results = [await _read_response(reader) for _ in range(3)]
    assert [r[2] for r in results] == [b"POST /a x=1 hello", b"POST /b  abcde", b"GET /c  "]
    assert all(r[0] == "HTTP/1.1 200 OK" for r in results)
    writer.close()
    await server.stop()


async def test_body_over_limit_is_413_and_closes() -> None:
    server, reader, writer = await _serve(_echo, max_body_bytes=1024)
    writer.write(b"POST /x HTTP/1.1\r\nContent-Length: 5000\r\n\r\n")
    status, _headers, body = await _read_response(reader)
    assert status.startswith("HTTP/1.1 413")
    assert b"exceeds 1024 bytes" in body
    assert await reader.read() == b""  # connection closed
    await server.stop()


async def test_malformed_request_is_400() -> None:
    server, reader, writer = await _serve(_echo)
    writer.write(b"NOT A REQUEST\r\n\r\n")
    status, _, _ = await _read_response(reader)
    assert status.startswith("HTTP/1.1 400")
    await server.stop()


async def test_streamed_response_uses_chunked_encoding() -> None:
    async def sse(request: HttpRequest, response: HttpResponse) -> None:
        await response.start_stream()
        for i in range(3):
            await response.write(b"data: %d\n\n" % i)
        await response.end_stream()

    server, reader, writer = await _serve(sse)
    writer.write(b"GET /s HTTP/1.1\r\n\r\n")
    head = await reader.readuntil(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head and b"text/event-stream" in head
    body = await reader.readuntil(b"0\r\n\r\n")
    assert body == b"9\r\ndata: 0\n\n\r\n9\r\ndata: 1\n\n\r\n9\r\ndata: 2\n\n\r\n0\r\n\r\n"
    await server.stop()


async def test_client_disconnect_cancels_handler() -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def slow(request: HttpRequest, response: HttpResponse) -> None:
        await response.start_stream()
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    server, _reader, writer = await _serve(slow)
    writer.write(b"GET /s HTTP/1.1\r\n\r\n")
    await asyncio.wait_for(started.wait(), 5)
    writer.close()
    await asyncio.wait_for(cancelled.wait(), 5)
    await server.stop()


async def test_connection_close_header_is_honoured() -> None:
    server, reader, writer = await _serve(_echo)
    writer.write(b"GET /x HTTP/1.1\r\nConnection: close\r\n\r\n")
    _status, headers, _ = await _read_response(reader)
    assert headers.get("connection") == "close"
    assert await reader.read() == b""
    await server.stop()


async def test_writes_of_one_loop_iteration_leave_in_one_send() -> None:
    sends: list[bytes] = []

    async def sse(request: HttpRequest, response: HttpResponse) -> None:
        conn = next(iter(server.connections))
        transport = conn._transport
        assert transport is not None
        real_write = transport.write
        transport.write = lambda data: (sends.append(data), real_write(data))[1]  # type: ignore[method-assign]
        await response.start_stream()
        for i in range(3):  # no await suspends in between: one iteration
            await response.write(b"data: %d\n\n" % i)
        await response.end_stream()

    server, reader, writer = await _serve(sse)
    writer.write(b"GET /s HTTP/1.1\r\n\r\n")
    await reader.readuntil(b"0\r\n\r\n")
    assert len(sends) == 1 and sends[0].startswith(b"HTTP/1.1 200 OK")
    assert sends[0].endswith(b"9\r\ndata: 2\n\n\r\n0\r\n\r\n")
    writer.close()
    await server.stop()


# ------------------------------------------------------------------ limits and timeouts
def _limits(**kw: object) -> HttpConfig:
    return HttpConfig(**kw)  # type: ignore[arg-type]


async def _closed_within(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """Everything the server sends until it closes the connection."""
    return await asyncio.wait_for(reader.read(), timeout_s)


async def test_oversized_header_is_431_and_closes() -> None:
    server, reader, writer = await _serve(_echo, config=_limits(max_header_bytes=4096))
    writer.write(b"GET /x HTTP/1.1\r\nX-Big: " + b"a" * 300_000)  # never ends: still 431
    data = await _closed_within(reader, 5)
    assert data.startswith(b"HTTP/1.1 431 "), data[:80]
    assert b"exceed 4096 bytes" in data
    await server.stop()


async def test_too_many_header_fields_is_431() -> None:
    server, reader, writer = await _serve(_echo, config=_limits(max_header_count=10))
    fields = b"".join(b"X-%d: 1\r\n" % i for i in range(11))
    writer.write(b"GET /x HTTP/1.1\r\n" + fields + b"\r\n")
    data = await _closed_within(reader, 5)
    assert data.startswith(b"HTTP/1.1 431 ") and b"more than 10 header fields" in data
    await server.stop()


async def test_slowloris_connections_are_all_closed_by_the_header_timeout() -> None:
    server = HttpServer(_echo, config=_limits(header_timeout_s=0.3, idle_timeout_s=0.3))
    host, port = await server.start("127.0.0.1", 0)
    conns = [await asyncio.open_connection(host, port) for _ in range(100)]
    for _, writer in conns:
        writer.write(b"GET / HTTP/1.1\r\nX-a: ")  # a request head that never ends
    replies = await asyncio.gather(*(_closed_within(r, 5) for r, _ in conns))
    assert all(reply.startswith(b"HTTP/1.1 408 ") for reply in replies)
    await eventually(lambda: not server.connections)  # even peers that never close theirs
    await server.stop()


async def test_idle_keep_alive_connection_is_closed() -> None:
    server, reader, writer = await _serve(_echo, config=_limits(idle_timeout_s=0.2))
    writer.write(b"GET /x HTTP/1.1\r\n\r\n")
    await _read_response(reader)
    assert await _closed_within(reader, 5) == b""  # closed, no response for nothing asked
    await server.stop()


async def test_slow_body_is_408() -> None:
    server, reader, writer = await _serve(_echo, config=_limits(body_timeout_s=0.2))
    writer.write(b"POST /x HTTP/1.1\r\nContent-Length: 100\r\n\r\n0123456789")
    data = await _closed_within(reader, 5)
    assert data.startswith(b"HTTP/1.1 408 ") and b"request body not received" in data
    await server.stop()


async def test_connection_cap_refuses_excess_and_keeps_serving() -> None:
    server = HttpServer(_echo, config=_limits(max_connections=5))
    host, port = await server.start("127.0.0.1", 0)
    conns = [await asyncio.open_connection(host, port) for _ in range(5)]
    await eventually(lambda: len(server.connections) == 5)
    reader, writer = await asyncio.open_connection(host, port)
    data = await _closed_within(reader, 5)
    assert data.startswith(b"HTTP/1.1 503 ") and b"retry-after: 1" in data and b"date: " in data
    writer.close()
    r0, w0 = conns[0]  # an admitted connection is still served
    w0.write(b"GET /still HTTP/1.1\r\n\r\n")
    status, _, body = await _read_response(r0)
    assert status == "HTTP/1.1 200 OK" and body.startswith(b"GET /still")
    for _, w in conns:
        w.close()
    await eventually(lambda: not server.connections)
    reader, writer = await asyncio.open_connection(host, port)  # room again
    writer.write(b"GET /again HTTP/1.1\r\n\r\n")
    assert (await _read_response(reader))[0] == "HTTP/1.1 200 OK"
    await server.stop()


async def test_request_then_half_close_is_answered() -> None:
    async def slow(request: HttpRequest, response: HttpResponse) -> None:
        await asyncio.sleep(0.2)  # still answering when the client's EOF arrives
        await response.send(200, b"answer", content_type=b"text/plain")

    server = HttpServer(slow)
    host, port = await server.start("127.0.0.1", 0)
    sock = socket.create_connection((host, port))
    sock.sendall(b"GET /x HTTP/1.1\r\n\r\nGET /y HTTP/1.1\r\n\r\n")
    sock.shutdown(socket.SHUT_WR)
    data = await asyncio.to_thread(_recv_all, sock)
    assert data.count(b"HTTP/1.1 200 OK") == 2 and data.endswith(b"answer")
    await server.stop()


def _recv_all(sock: socket.socket) -> bytes:
    sock.settimeout(5)
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    sock.close()
    return b"".join(chunks)


async def _routes(request: HttpRequest, response: HttpResponse) -> None:
    """GET answers at once (a health check), POST after a moment (a worker's answer), /stream
    is an event stream."""
    if request.path == "/stream":
        await response.start_stream()
        for i in range(3):
            await asyncio.sleep(0.01)
            await response.write(b"data: %d\n\n" % i)
        await response.end_stream()
        return
    if request.method == "POST":
        await asyncio.sleep(0.05)
    await response.send(200, f"{request.method} {request.path} ".encode() + request.body)


def _parse_responses(data: bytes) -> list[tuple[bytes, bytes]]:
    """(status line, body) of each final response in `data`, in order (chunked bodies
    joined)."""
    out = []
    while data:
        head, sep, data = data.partition(b"\r\n\r\n")
        assert sep, f"truncated response head: {head!r}"
        status, *lines = head.split(b"\r\n")
        if status.split()[1].startswith(b"1"):
            continue  # interim (a probe of a half-closed client): no body
        headers = dict(line.lower().split(b": ", 1) for line in lines)
        if b"content-length" in headers:
            n = int(headers[b"content-length"])
            body, data = data[:n], data[n:]
        elif headers.get(b"transfer-encoding") == b"chunked":
            body = b""
            while True:
                size, _, data = data.partition(b"\r\n")
                chunk, data = data[: int(size, 16)], data[int(size, 16) + 2 :]
                if not chunk:
                    break
                body += chunk
        else:  # HTTP/1.0 stream: the rest
            body, data = data, b""
        out.append((status, body))
    return out


async def _half_closed_exchange(addr: tuple[str, int], sent: bytes) -> tuple[bytes, float]:
    """Send `sent`, shut down the write side, read until the server closes (bounded)."""
    sock = socket.create_connection(addr)
    sock.sendall(sent)
    sock.shutdown(socket.SHUT_WR)
    start = asyncio.get_running_loop().time()
    data = await asyncio.to_thread(_recv_all, sock)
    return data, asyncio.get_running_loop().time() - start


POST_A = b"POST /chat HTTP/1.1\r\nHost: h\r\nContent-Length: 5\r\n\r\nhello"


@pytest.mark.parametrize(
    ("sent", "expected"),
    [
        (b"GET /live HTTP/1.1\r\nHost: h\r\n\r\n", [(b"200", b"GET /live ")]),
        (POST_A, [(b"200", b"POST /chat hello")]),
        (b"GET /stream HTTP/1.1\r\n\r\n", [(b"200", b"data: 0\n\ndata: 1\n\ndata: 2\n\n")]),
        (
            b"GET /a HTTP/1.1\r\n\r\n" + POST_A + b"GET /health HTTP/1.1\r\n\r\n"
            b"POST /b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nhi\r\n0\r\n\r\n"
            b"GET /v1/models HTTP/1.1\r\n\r\n",
            [
                (b"200", b"GET /a "),
                (b"200", b"POST /chat hello"),
                (b"200", b"GET /health "),
                (b"200", b"POST /b hi"),
                (b"200", b"GET /v1/models "),
            ],
        ),
        (
            b"GET /a HTTP/1.1\r\n\r\nGET /health HTTP/1.1\r\n\r\nGET /v1/models HTTP/1.1\r\n\r\n",
            [(b"200", b"GET /a "), (b"200", b"GET /health "), (b"200", b"GET /v1/models ")],
        ),
        (b"GET /live HTTP/1.1\r\nConnection: close\r\n\r\n", [(b"200", b"GET /live ")]),
        (b"GET /live HTTP/1.0\r\n\r\n", [(b"200", b"GET /live ")]),
    ],
    ids=[
        "get",
        "post-body",
        "stream",
        "pipelined",
        "pipelined-gets",
        "connection-close",
        "http-1.0",
    ],
)
async def test_complete_requests_then_half_close_are_all_answered_in_order(
    sent: bytes, expected: list[tuple[bytes, bytes]]
) -> None:
    server = HttpServer(_routes)
    addr = await server.start("127.0.0.1", 0)
    data, _ = await _half_closed_exchange(addr, sent)  # _recv_all: closed within 5 s
    got = [(status.split()[1], body) for status, body in _parse_responses(data)]
    assert got == expected, data
    await eventually(lambda: not server.connections)
    await server.stop()


async def test_a_quick_answer_to_a_half_closed_client_has_no_interim_response() -> None:
    server = HttpServer(_routes)
    addr = await server.start("127.0.0.1", 0)
    data, _ = await _half_closed_exchange(addr, b"GET /live HTTP/1.1\r\n\r\n")
    assert data.startswith(b"HTTP/1.1 200 OK\r\n"), data  # not "100 Continue" first
    await server.stop()


@pytest.mark.parametrize(
    ("sent", "answered"),
    [
        (b"", []),
        (b"GET /live HTTP/1.1\r\nHost: h\r\n", [b"400"]),
        (b"POST /chat HTTP/1.1\r\nContent-Length: 50\r\n\r\nonly some", [b"400"]),
        (b"GET /a HTTP/1.1\r\n\r\n" + POST_A + b"GET /b HT", [b"200", b"200", b"400"]),
    ],
    ids=["nothing", "half-a-head", "half-a-body", "pipelined-then-half"],
)
async def test_incomplete_request_then_half_close_is_400_and_closed_at_once(
    sent: bytes, answered: list[bytes]
) -> None:
    server = HttpServer(_routes)
    addr = await server.start("127.0.0.1", 0)
    data, took_s = await _half_closed_exchange(addr, sent)
    responses = _parse_responses(data)
    assert [status.split()[1] for status, _ in responses] == answered, data
    if answered and answered[-1] == b"400":
        assert b"in the middle of a request" in responses[-1][1]
    assert took_s < 1.0  # closed when the answers are out, not after a timeout
    await eventually(lambda: not server.connections)
    await server.stop()


@pytest.mark.parametrize("line", [b"GET /live", b"GET /live HTTP/0.9"])
async def test_request_line_without_http_1_version_is_400_and_closes(line: bytes) -> None:
    server, reader, writer = await _serve(_echo)
    writer.write(line + b"\r\n\r\n")
    data = await _closed_within(reader, 5)
    assert data.startswith(b"HTTP/1.1 400 "), data
    assert b"needs HTTP/1.1 or HTTP/1.0" in data and b"connection: close" in data
    await server.stop()


async def test_pipelined_continue_and_error_wait_for_the_running_stream() -> None:
    release = asyncio.Event()

    async def handler(request: HttpRequest, response: HttpResponse) -> None:
        if request.path == "/stream":
            await response.start_stream()
            await response.write(b"data: 1\n\n")
            await release.wait()
            await response.write(b"data: 2\n\n")
            await response.end_stream()
        else:
            await _echo(request, response)

    for follow_up, expected in (
        (b"POST /next HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n",
         b"HTTP/1.1 100 Continue"),
        (b"POST /next HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n", b"HTTP/1.1 413 "),
        (b"BAD REQUEST\r\n\r\n", b"HTTP/1.1 400 "),
    ):  # fmt: skip
        release.clear()
        server, reader, writer = await _serve(handler, max_body_bytes=1024)
        writer.write(b"GET /stream HTTP/1.1\r\n\r\n" + follow_up)
        head = await reader.readuntil(b"data: 1\n\n\r\n")
        assert b"transfer-encoding: chunked" in head
        conn = next(iter(server.connections))  # the follow-up is parsed while the stream runs
        await eventually(lambda c=conn: c._phase == "body" or c._deferred_error is not None)
        release.set()
        rest = await reader.readuntil(b"0\r\n\r\n")
        assert rest == b"9\r\ndata: 2\n\n\r\n0\r\n\r\n"  # nothing landed inside the stream
        after = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert after.startswith(expected), after
        writer.close()
        await server.stop()


async def test_head_has_headers_only_and_every_response_has_a_date() -> None:
    server, reader, writer = await _serve(_echo)
    writer.write(b"HEAD /h HTTP/1.1\r\n\r\nGET /g HTTP/1.1\r\n\r\n")
    head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
    assert "content-length: 9\r\n" in head and "\r\ndate: " in head  # len("HEAD /h  ")
    status, headers, body = await _read_response(reader)  # no stray body before it
    assert status == "HTTP/1.1 200 OK" and body.startswith(b"GET /g")
    assert headers["date"].endswith(" GMT")
    await server.stop()


async def test_stop_drains_a_running_stream_and_refuses_new_connections() -> None:
    started, release = asyncio.Event(), asyncio.Event()

    async def sse(request: HttpRequest, response: HttpResponse) -> None:
        await response.start_stream()
        started.set()
        await release.wait()
        await response.write(b"data: done\n\n")
        await response.end_stream()

    server, reader, writer = await _serve(sse)
    host, port = next(iter(server.connections))._transport.get_extra_info("sockname")  # type: ignore[union-attr]
    writer.write(b"GET /s HTTP/1.1\r\n\r\n")
    await asyncio.wait_for(started.wait(), 5)
    stopping = asyncio.create_task(server.stop(grace_s=5))
    await eventually(lambda: server.is_draining)
    with pytest.raises(OSError):
        await asyncio.open_connection(host, port)
    release.set()
    data = await _closed_within(reader, 5)
    assert data.endswith(b"data: done\n\n\r\n0\r\n\r\n")  # whole, then closed
    await asyncio.wait_for(stopping, 5)


async def test_client_gone_before_the_response_starts_cancels_handler() -> None:
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def slow(request: HttpRequest, response: HttpResponse) -> None:
        started.set()  # e.g. waiting for the first token: nothing written yet
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    server, _reader, writer = await _serve(slow)
    writer.write(b"GET /s HTTP/1.1\r\n\r\n")
    await asyncio.wait_for(started.wait(), 5)
    writer.close()  # a full close looks like a half-close until a write meets the reset
    await asyncio.wait_for(cancelled.wait(), 2)
    await server.stop()


@pytest.mark.parametrize(
    "head",
    [
        b"POST /x HTTP/1.1\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"POST /x HTTP/1.1\r\nContent-Length: 4\r\nContent-Length: 40\r\n\r\n",
        b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked, identity\r\n\r\n",
        b"POST /x HTTP/1.1\r\nContent-Length: -4\r\n\r\n",
    ],
)
async def test_smuggling_attempts_are_400_and_close(head: bytes) -> None:
    server, reader, writer = await _serve(_echo)
    writer.write(head + b"0\r\n\r\nGET /smuggled HTTP/1.1\r\n\r\n")
    data = await _closed_within(reader, 5)
    assert data.startswith(b"HTTP/1.1 400 "), data[:120]
    assert b"smuggled" not in data  # the hidden request was never served
    await server.stop()


async def test_200_mb_chunked_body_is_413_without_reading_it_all() -> None:
    server, reader, writer = await _serve(_echo)  # default 8 MiB limit

    async def read_until_gone() -> bytes:  # reads while the client still sends
        data = b""
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                data += chunk
        return data

    received = asyncio.create_task(read_until_gone())
    writer.write(b"POST /x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
    chunk = b"%x\r\n%s\r\n" % (1 << 20, b"a" * (1 << 20))
    sent = 0
    with contextlib.suppress(ConnectionError):
        for _ in range(200):
            writer.write(chunk)
            await writer.drain()
            sent += 1
    data = await asyncio.wait_for(received, 5)
    assert data.startswith(b"HTTP/1.1 413 ") and b"exceeds 8388608 bytes" in data
    assert sent < 200  # cut off long before 200 MB
    await server.stop()
