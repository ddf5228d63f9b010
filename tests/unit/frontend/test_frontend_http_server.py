from __future__ import annotations

import asyncio

import pytest

from tandem.frontend.http_server import HttpRequest, HttpResponse, HttpServer

pytestmark = pytest.mark.timeout(10)


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
