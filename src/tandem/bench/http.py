"""A lean HTTP/1.1 client connection for benchmarks: asyncio Protocol + httptools parser.

Why not aiohttp: at ~1000 streamed req/s on a shared 2-core box the client must stay far
cheaper than the server it measures. Here a response's SSE events are parsed synchronously in
`data_received` (no task switch, no await per chunk) and handed to a `StreamSink`.

Contract: one request in flight per `HttpConnection`; `request()` resolves when the whole
response has arrived (or the peer closed it). Not safe for concurrent use.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Protocol, cast

import httptools


class StreamSink(Protocol):
    def on_status(self, status: int) -> None: ...
    def on_body(self, data: bytes, now: float) -> None: ...


class HttpResponseError(ConnectionError):
    """The peer closed the connection before the response was complete."""


class HttpConnection(asyncio.Protocol):
    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._sink: StreamSink | None = None
        self._done: asyncio.Future[bool] | None = None
        self._headers_done = False
        self._reusable = False
        self.is_closed = False

    @classmethod
    async def open(cls, host: str, port: int, timeout_s: float = 10.0) -> HttpConnection:
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout_s):
            _, conn = await loop.create_connection(lambda: cls(host, port), host, port)
        return conn

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._finish(exc)

    def connection_lost(self, exc: Exception | None) -> None:
        self.is_closed = True
        if self._done is not None and not self._done.done():
            if self._headers_done and exc is None and not self._reusable:
                self._done.set_result(False)  # body delimited by connection close
            else:
                self._finish(HttpResponseError(f"connection lost mid-response: {exc!r}"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self._headers_done = True
        self._reusable = self._parser.should_keep_alive()
        if self._sink is not None:
            self._sink.on_status(self._parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self._sink is not None:
            self._sink.on_body(body, time.perf_counter())

    def on_message_complete(self) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(self._reusable)

    def _finish(self, exc: BaseException) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_exception(exc)
        self.close()

    async def request(self, head: bytes, body: bytes, sink: StreamSink, timeout_s: float) -> bool:
        """Send one request (`head` ends with the blank line); feed the response to `sink`.
        Returns whether the connection may be reused. Raises TimeoutError / ConnectionError."""
        if self.is_closed or self._transport is None:
            raise HttpResponseError("connection is closed")
        self._sink = sink
        self._headers_done = False
        self._done = asyncio.get_running_loop().create_future()
        self._parser = httptools.HttpResponseParser(self)
        self._transport.write(head + body)
        try:
            async with asyncio.timeout(timeout_s):
                return await self._done
        except BaseException:
            self.close()
            raise
        finally:
            self._sink = None

    def close(self) -> None:
        self.is_closed = True
        if self._transport is not None:
            self._transport.close()


def request_head(
    method: str, host: str, port: int, path: str, body_len: int, keep_alive: bool
) -> bytes:
    connection = "keep-alive" if keep_alive else "close"
    return (
        f"{method} {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\n"
        f"Content-Length: {body_len}\r\nConnection: {connection}\r\n\r\n"
    ).encode()
