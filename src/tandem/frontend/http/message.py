"""HTTP/1.1 messages of the frontend's server: the parsed request, the response writer, and
the whole-response helpers (a Date header on every response, error bodies in OpenAI's shape).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Protocol


class Connection(Protocol):
    """What a response writes to (the server's HttpProtocol)."""

    @property
    def is_draining(self) -> bool: ...

    def write(self, data: bytes) -> None: ...

    @property
    def write_blocked(self) -> bool:
        """True while `drain` would wait (the transport's buffer is full)."""
        ...

    async def drain(self) -> None: ...

    def flush(self) -> None:
        """Send what is written so far now, not with the rest of this loop iteration."""
        ...


REASONS = {
    200: b"OK",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Payload Too Large",
    429: b"Too Many Requests",
    431: b"Request Header Fields Too Large",
    499: b"Client Closed Request",
    500: b"Internal Server Error",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}
_date_cache: tuple[int, bytes] = (0, b"")


def date_header() -> bytes:
    """`date: <IMF-fixdate>\\r\\n`, formatted once per second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, b"date: %s\r\n" % formatdate(now, usegmt=True).encode())
    return _date_cache[1]


def error_response(status: int, message: bytes, extra: bytes = b"") -> bytes:
    """A whole `connection: close` response with an OpenAI error body."""
    body = b'{"error":{"message":"%s","type":"invalid_request_error","param":null,"code":null}}'
    body %= message.replace(b"\\", b"/").replace(b'"', b"'")
    return b"HTTP/1.1 %d %s\r\n%scontent-type: application/json\r\n%sconnection: close\r\n" % (
        status,
        REASONS.get(status, b"Error"),
        date_header(),
        extra,
    ) + b"content-length: %d\r\n\r\n%s" % (len(body), body)


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
    `end_stream()`. Writes raise ClientDisconnected once the client has gone. A response to
    HEAD writes the head only (with the Content-Length the body would have had)."""

    __slots__ = (
        "_chunked",
        "_conn",
        "_head_only",
        "_keep_alive",
        "extra_headers",
        "finished",
        "is_event_stream",
        "is_http_11",
        "started",
    )

    def __init__(
        self, conn: Connection, keep_alive: bool, http_11: bool, *, head_only: bool = False
    ) -> None:
        self._conn = conn
        self._keep_alive = keep_alive
        self._chunked = http_11
        self._head_only = head_only
        self.is_http_11 = http_11
        self.is_event_stream = False
        self.started = False
        self.finished = False
        # sent with whatever head this response writes (e.g. the echoed X-Request-ID)
        self.extra_headers: list[tuple[str, str]] = []

    def _head(self, status: int, content_type: bytes, headers: list[tuple[str, str]]) -> bytes:
        reason = REASONS.get(status, b"Unknown")
        parts = [b"HTTP/1.1 %d %s\r\n%scontent-type: %s\r\n"]
        parts[0] %= (status, reason, date_header(), content_type)
        parts.extend(f"{k}: {v}\r\n".encode("latin-1") for k, v in headers)
        parts.extend(f"{k}: {v}\r\n".encode("latin-1") for k, v in self.extra_headers)
        if self._conn.is_draining:
            self._keep_alive = False
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
        payload = b"" if self._head_only else body
        self._conn.write(b"%scontent-length: %d\r\n\r\n%s" % (head, len(body), payload))
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
        self.is_event_stream = self._chunked and content_type == b"text/event-stream"
        if not self._chunked:  # HTTP/1.0: stream raw bytes and close at the end
            self._keep_alive = False
        head = self._head(status, content_type, [("cache-control", "no-cache"), *(headers or [])])
        te = b"transfer-encoding: chunked\r\n\r\n" if self._chunked else b"\r\n"
        self._conn.write(head + te)

    async def write(self, data: bytes) -> None:
        if not data or self._head_only:
            return
        if self._chunked:
            data = b"%x\r\n%s\r\n" % (len(data), data)
        conn = self._conn
        conn.write(data)  # raises ClientDisconnected once the client has gone
        if conn.write_blocked:
            await conn.drain()

    def flush(self) -> None:
        """Send what is written so far now (a stream's first token: the client's TTFT), not
        after every other callback of this loop iteration."""
        self._conn.flush()

    async def end_stream(self) -> None:
        self.finished = True
        if self._chunked and not self._head_only:
            self._conn.write(b"0\r\n\r\n")
        await self._conn.drain()

    @property
    def keep_alive(self) -> bool:
        return self._keep_alive
