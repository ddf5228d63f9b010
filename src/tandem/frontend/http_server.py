"""A small HTTP/1.1 server on httptools + asyncio, built for streaming LLM responses.

Keep-alive and pipelining (requests answered in order), Content-Length and chunked request
bodies, a body size limit (413), `Expect: 100-continue`, write backpressure, and responses
either whole (Content-Length) or streamed with chunked transfer encoding (SSE).

Writes are coalesced: everything written to a connection in one event-loop iteration leaves
in one `send` (a stream's head, role chunk and first tokens; a burst of tokens that arrived
together; the last token, usage, `[DONE]` and the chunked terminator). Each send is a syscall
and a wake-up of the client, so this is most of the per-token cost. TCP_NODELAY is already set
by both asyncio and uvloop on every TCP transport.
When the client disconnects, the task running its request is cancelled, so cancellation flows
on to the worker. One `HttpProtocol` per connection; everything runs on one event loop.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import cast

import httptools

logger = logging.getLogger(__name__)

MAX_PIPELINED = 16
# buffered response bytes that are sent at once instead of at the end of the loop iteration,
# so a handler writing a large backlog still meets the kernel's backpressure
FLUSH_BYTES = 64 << 10
_REASONS = {
    200: b"OK",
    400: b"Bad Request",
    404: b"Not Found",
    405: b"Method Not Allowed",
    413: b"Payload Too Large",
    429: b"Too Many Requests",
    499: b"Client Closed Request",
    500: b"Internal Server Error",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}


@dataclass(slots=True)
class HttpRequest:
    method: str
    path: str
    query: str
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names
    body: bytes = b""
    keep_alive: bool = True
    http_11: bool = True


Handler = Callable[[HttpRequest, "HttpResponse"], Awaitable[None]]


class ClientDisconnected(ConnectionError):
    """Writing to a client that has gone."""


class HttpResponse:
    """Writes one response. Either `send()` once, or `start_stream()`, `write()`* and
    `end_stream()`. Writes raise ClientDisconnected once the client has gone."""

    __slots__ = ("_chunked", "_conn", "_keep_alive", "finished", "started")

    def __init__(self, conn: HttpProtocol, keep_alive: bool, http_11: bool) -> None:
        self._conn = conn
        self._keep_alive = keep_alive
        self._chunked = http_11
        self.started = False
        self.finished = False

    def _head(self, status: int, content_type: bytes, headers: list[tuple[str, str]]) -> bytes:
        reason = _REASONS.get(status, b"Unknown")
        parts = [b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\n" % (status, reason, content_type)]
        parts.extend(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers)
        if not self._keep_alive:
            parts.append(b"connection: close\r\n")
        return b"".join(parts)

    async def send(
        self,
        status: int,
        body: bytes,
        *,
        content_type: bytes = b"application/json",
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        assert not self.started, "response already started"
        self.started = self.finished = True
        head = self._head(status, content_type, headers or [])
        self._conn.write(b"%scontent-length: %d\r\n\r\n%s" % (head, len(body), body))
        await self._conn.drain()

    async def start_stream(
        self,
        status: int = 200,
        *,
        content_type: bytes = b"text/event-stream",
        headers: list[tuple[str, str]] | None = None,
    ) -> None:
        assert not self.started, "response already started"
        self.started = True
        if not self._chunked:  # HTTP/1.0: stream raw bytes and close at the end
            self._keep_alive = False
        head = self._head(status, content_type, [("cache-control", "no-cache"), *(headers or [])])
        te = b"transfer-encoding: chunked\r\n\r\n" if self._chunked else b"\r\n"
        self._conn.write(head + te)

    async def write(self, data: bytes) -> None:
        if not data:
            return
        if self._chunked:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        self._conn.write(data)
        await self._conn.drain()

    async def end_stream(self) -> None:
        self.finished = True
        if self._chunked:
            self._conn.write(b"0\r\n\r\n")
        await self._conn.drain()

    @property
    def keep_alive(self) -> bool:
        return self._keep_alive


class HttpProtocol(asyncio.Protocol):
    """One client connection: parses requests, runs `handler` for each, in order."""

    def __init__(self, handler: Handler, *, max_body_bytes: int, server: HttpServer) -> None:
        self._handler = handler
        self._max_body = max_body_bytes
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._body_size = 0
        self._pending: deque[HttpRequest] = deque()
        self._task: asyncio.Task[None] | None = None
        self._write_ready: asyncio.Future[None] | None = None
        self._closed = False
        self._reading_paused = False
        self._wbuf: list[bytes] = []
        self._wbuf_bytes = 0
        self._loop = asyncio.get_running_loop()

    # ---------------------------------------------------------------- transport callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; both have the methods used.
        # Both already set TCP_NODELAY (asking for the socket to set it again costs syscalls).
        self._transport = cast(asyncio.Transport, transport)
        self._server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, b"upgrade not supported")
        except httptools.HttpParserError as exc:
            self._reject(400, f"malformed HTTP request: {exc}".encode())

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._wbuf.clear()
        self._server.connections.discard(self)
        if self._task is not None and not self._task.done():
            self._task.cancel()  # client gone: cancel the request end to end
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_exception(ClientDisconnected("client disconnected"))

    def pause_writing(self) -> None:
        if self._write_ready is None or self._write_ready.done():
            self._write_ready = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_result(None)

    # ---------------------------------------------------------------- parser callbacks
    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._body_size = b"", {}, [], 0

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self._max_body:
            self._reject(413, f"request body exceeds {self._max_body} bytes".encode())
            return
        if self._headers.get("expect", "").lower() == "100-continue" and self._transport:
            self._flush()  # after what earlier pipelined responses left in the buffer
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_size += len(body)
        if self._body_size > self._max_body:
            self._reject(413, f"request body exceeds {self._max_body} bytes".encode())
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        if self._closed:
            return
        path, _, query = self._url.decode("latin-1").partition("?")
        request = HttpRequest(
            method=self._parser.get_method().decode(),
            path=path,
            query=query,
            headers=self._headers,
            body=b"".join(self._body),
            keep_alive=self._parser.should_keep_alive(),
            http_11=self._parser.get_http_version() == "1.1",
        )
        self._pending.append(request)
        if len(self._pending) >= MAX_PIPELINED and self._transport is not None:
            self._transport.pause_reading()
            self._reading_paused = True
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    # ---------------------------------------------------------------- request loop
    async def _run(self) -> None:
        try:
            while self._pending and not self._closed:
                request = self._pending.popleft()
                if self._reading_paused and self._transport is not None:
                    self._transport.resume_reading()
                    self._reading_paused = False
                response = HttpResponse(self, request.keep_alive, request.http_11)
                await self._serve_one(request, response)
                if not response.keep_alive or not request.keep_alive:
                    self.close()
                    return
        finally:
            self._task = None

    async def _serve_one(self, request: HttpRequest, response: HttpResponse) -> None:
        try:
            await self._handler(request, response)
        except (ClientDisconnected, asyncio.CancelledError):
            if not self._closed:
                raise
            return
        except Exception:
            logger.exception("unhandled error serving %s %s", request.method, request.path)
            if not response.started:
                await response.send(500, b'{"error":{"message":"internal error"}}')
            else:
                self.close()
                return
        if response.started and not response.finished:
            await response.end_stream()

    def write(self, data: bytes) -> None:
        """Queue `data`; it is sent with everything else written in this loop iteration
        (at once past FLUSH_BYTES). Raises ClientDisconnected once the client has gone."""
        if self._closed or self._transport is None:
            raise ClientDisconnected("client disconnected")
        wbuf = self._wbuf
        if not wbuf:
            self._loop.call_soon(self._flush)
        wbuf.append(data)
        self._wbuf_bytes += len(data)
        if self._wbuf_bytes >= FLUSH_BYTES:
            self._flush()

    def _flush(self) -> None:
        wbuf = self._wbuf
        if not wbuf:
            return
        data = wbuf[0] if len(wbuf) == 1 else b"".join(wbuf)
        wbuf.clear()
        self._wbuf_bytes = 0
        if not self._closed and self._transport is not None:
            self._transport.write(data)  # may call pause_writing: drain() then waits

    async def drain(self) -> None:
        if self._closed:
            raise ClientDisconnected("client disconnected")
        if self._write_ready is not None and not self._write_ready.done():
            await self._write_ready

    def _reject(self, status: int, message: bytes) -> None:
        if self._transport is not None and not self._closed:
            self._flush()
            body = b'{"error":{"message":"%s","type":"invalid_request_error"}}' % message.replace(
                b'"', b"'"
            )
            reason = _REASONS.get(status, b"Error")
            self._transport.write(
                b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (status, reason, len(body), body)
            )
        self.close()

    def close(self) -> None:
        """Send what is buffered, then close (the transport still sends its own buffer)."""
        if self._transport is not None and not self._closed:
            self._flush()
            self._closed = True
            self._transport.close()


class HttpServer:
    """Owns the listening socket and live connections."""

    def __init__(self, handler: Handler, *, max_body_bytes: int = 8 << 20) -> None:
        self._handler = handler
        self._max_body = max_body_bytes
        self.connections: set[HttpProtocol] = set()
        self._server: asyncio.Server | None = None

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on host:port (port 0 = any free port); returns the bound address."""
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: HttpProtocol(self._handler, max_body_bytes=self._max_body, server=self),
            host,
            port,
            reuse_address=True,
            backlog=1024,
        )
        bound = self._server.sockets[0].getsockname()
        return str(bound[0]), int(bound[1])

    async def stop(self) -> None:
        """Stop listening and close every connection (their requests are cancelled)."""
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
            self._server = None
