"""A small HTTP/1.1 server on httptools + asyncio, built for streaming LLM responses.

Keep-alive and pipelining (responses strictly in request order), Content-Length and chunked
request bodies, `Expect: 100-continue`, HEAD, write backpressure, and responses either whole
(Content-Length) or streamed with chunked transfer encoding (SSE).

The edge is where software gets hurt, so every connection has limits (`HttpConfig`): header
bytes and count (431), body size (413), a header timeout, a body timeout (408) and an idle
keep-alive timeout; the server has a connection cap below the process's file-descriptor limit
(past it: 503 + close) and its own accept loop, which sheds the newest connection and backs
off when accept runs out of descriptors (it never stops accepting for good). Nothing meant
for a later pipelined request (100 Continue, an error) is written while an earlier response
is still going: it waits its turn. A client that half-closes after its request still gets
the answer. `stop(grace_s)` drains: stop accepting, let running responses finish, close.

Writes are coalesced: everything written to a connection in one event-loop iteration leaves
in one `send` (a stream's head, role chunk and first tokens; a burst of tokens that arrived
together; the last token, usage, `[DONE]` and the chunked terminator). Each send is a syscall
and a wake-up of the client, so this is most of the per-token cost.
When the client disconnects, the task running its request is cancelled, so cancellation flows
on to the worker. One `HttpProtocol` per connection; everything runs on one event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import deque
from typing import Literal, cast

import httptools

from tandem.frontend.http.accept import Acceptor
from tandem.frontend.http.config import HttpConfig
from tandem.frontend.http.message import (
    ClientDisconnected,
    Handler,
    HttpRequest,
    HttpResponse,
    error_response,
)

logger = logging.getLogger(__name__)

MAX_PIPELINED = 16
# buffered response bytes that are sent at once instead of at the end of the loop iteration,
# so a handler writing a large backlog still meets the kernel's backpressure
FLUSH_BYTES = 64 << 10
LINGER_S = 1.0  # after an error response, how long the client's remaining bytes are dropped
LINGER_BYTES = 1 << 20  # and how many at most
# after a client's EOF, when to check that it is still reading: the first probe draws a reset
# from a peer that closed for good (a loopback round trip), the second write then fails
EOF_PROBE_DELAYS_S = (0.05, 0.5)
# the first probe waits this long, so a quick answer (a health check) needs none: a probe
# before the response is an interim 100 Continue, which a naive client may take for it
EOF_FIRST_PROBE_S = 0.1
Phase = Literal["idle", "head", "body"]


class HttpProtocol(asyncio.Protocol):
    """One client connection: parses requests, runs `handler` for each, in order.

    At most one timer runs: while a request is being answered none (the client waits for
    us); otherwise `idle` (no byte of a next request yet), `head` or `body`."""

    def __init__(self, handler: Handler, *, config: HttpConfig, server: HttpServer) -> None:
        self._handler = handler
        self._config = config
        self._server = server
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._headers: dict[str, str] = {}
        self._body: list[bytes] = []
        self._body_size = 0
        self._head_bytes = 0  # of the request head being parsed
        self._num_begun = 0  # messages begun, to tell which bytes of a read are head bytes
        self._phase: Phase = "idle"
        self._pending: deque[HttpRequest] = deque()
        self._task: asyncio.Task[None] | None = None
        self._write_ready: asyncio.Future[None] | None = None
        # the transport asked writers to wait (`drain` would block); read once per chunk
        self.write_blocked = False
        self._closed = False
        self._reading_paused = False
        self._eof = False  # the client half-closed: answer what it sent, then close
        self._deferred_error: tuple[int, bytes] | None = None  # sent after earlier responses
        self._continue_wanted = False  # 100 Continue owed once earlier responses are done
        self._response: HttpResponse | None = None  # being written
        self._probe_timer: asyncio.TimerHandle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_phase: Phase | None = None
        self._wbuf: list[bytes] = []
        self._wbuf_bytes = 0
        self._linger_bytes = LINGER_BYTES
        self._loop = asyncio.get_running_loop()

    @property
    def is_busy(self) -> bool:
        """A request is being answered or waits its turn."""
        return self._task is not None or bool(self._pending)

    @property
    def is_draining(self) -> bool:
        return self._server.is_draining

    # ---------------------------------------------------------------- transport callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses; both have the methods used.
        self._transport = cast(asyncio.Transport, transport)
        self._server.on_connection_made(self)
        self._arm_timer()

    def data_received(self, data: bytes) -> None:
        if self._closed or self._deferred_error is not None:
            self._linger_bytes -= len(data)  # dropped; a peer that keeps sending is cut off
            if self._linger_bytes < 0 and self._transport is not None:
                self._transport.close()
            return
        num_begun = self._num_begun
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, b"upgrade not supported")
        except httptools.HttpParserError as exc:
            if not self._closed and self._deferred_error is None:
                self._reject(400, f"malformed HTTP request: {exc}".encode())
        if self._phase == "head" and num_begun == self._num_begun and not self._stopped:
            # a header split over reads is buffered inside httptools: bound it here
            self._head_bytes += len(data)
            self._check_head_size()
        self._arm_timer()

    def eof_received(self) -> bool | None:
        """The client sent EOF: a half-close (shutdown(SHUT_WR)) still wants the answers to
        every request it sent, a full close looks the same until a write meets the peer's
        reset. So the write side stays open until every response owed is out (they may still
        sit in the write buffer, or not be written yet), then the connection closes. Half a
        request can never complete: after the earlier responses it is answered 400."""
        if self._closed:
            return None
        self._eof = True
        if self._phase != "idle":
            self._reject(400, b"connection closed by the client in the middle of a request")
        if self.is_busy:
            # probe, so that a client that closed for good has its request cancelled
            self._probe_timer = self._loop.call_later(EOF_FIRST_PROBE_S, self._probe, 0)
        elif not self._closed:
            self.close()  # sends what is buffered first
        return True  # keep the write side open until then (close() ends it)

    def _probe(self, num_done: int) -> None:
        """While answering a client that sent EOF: write something every client ignores
        (an interim 100 Continue before the response, an SSE comment inside an event
        stream). A client that closed for good answers with a reset, and the next write
        fails: connection_lost then cancels the request."""
        self._probe_timer = None
        if self._closed or not self.is_busy:
            return
        response = self._response
        with contextlib.suppress(ClientDisconnected):
            if response is None or not response.started:
                if response is None or response.is_http_11:
                    self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            elif response.is_event_stream and not response.finished:
                self.write(b"2\r\n:\n\r\n")
        if not self._closed:
            delay = EOF_PROBE_DELAYS_S[min(num_done, len(EOF_PROBE_DELAYS_S) - 1)]
            self._probe_timer = self._loop.call_later(delay, self._probe, num_done + 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._wbuf.clear()
        self._cancel_timers()
        self._server.connections.pop(self, None)
        self._server.on_connection_lost()
        if self._task is not None and not self._task.done():
            self._task.cancel()  # client gone: cancel the request end to end
        self.write_blocked = False
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_exception(ClientDisconnected("client disconnected"))

    def pause_writing(self) -> None:
        self.write_blocked = True
        if self._write_ready is None or self._write_ready.done():
            self._write_ready = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        self.write_blocked = False
        if self._write_ready is not None and not self._write_ready.done():
            self._write_ready.set_result(None)

    @property
    def _stopped(self) -> bool:
        return self._closed or self._deferred_error is not None

    # ---------------------------------------------------------------- parser callbacks
    def on_message_begin(self) -> None:
        self._url, self._headers, self._body, self._body_size = b"", {}, [], 0
        self._head_bytes = 0
        self._num_begun += 1
        self._phase = "head"

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._head_bytes += len(url)
        self._check_head_size()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._stopped:
            return
        self._head_bytes += len(name) + len(value) + 4
        if len(self._headers) >= self._config.max_header_count:
            self._reject(431, b"more than %d header fields" % self._config.max_header_count)
            return
        if self._check_head_size():
            self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def _check_head_size(self) -> bool:
        if self._head_bytes <= self._config.max_header_bytes or self._stopped:
            return not self._stopped
        self._reject(
            431, b"request line and headers exceed %d bytes" % self._config.max_header_bytes
        )
        return False

    def on_headers_complete(self) -> None:
        if self._stopped:
            return
        self._phase = "body"
        version = self._parser.get_http_version()
        if version not in ("1.1", "1.0"):
            # httptools reads a request line without a version as HTTP/0.9
            got = "none" if version == "0.9" else f"HTTP/{version}"
            message = f"request line needs HTTP/1.1 or HTTP/1.0 at its end (got {got})"
            self._reject(400, message.encode())
            return
        length = self._headers.get("content-length")
        limit = self._config.max_body_bytes
        if length is not None and length.isdigit() and int(length) > limit:
            self._reject(413, f"request body exceeds {limit} bytes".encode())
            return
        if self._headers.get("expect", "").lower() == "100-continue":
            self._continue_wanted = True
            self._send_continue()

    def on_body(self, body: bytes) -> None:
        if self._stopped:
            return
        self._body_size += len(body)
        if self._body_size > self._config.max_body_bytes:
            self._reject(413, f"request body exceeds {self._config.max_body_bytes} bytes".encode())
            return
        self._body.append(body)

    def on_message_complete(self) -> None:
        self._phase = "idle"
        self._continue_wanted = False
        if self._stopped:
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
            self._task = self._loop.create_task(self._run())

    # ---------------------------------------------------------------- request loop
    async def _run(self) -> None:
        try:
            while self._pending and not self._closed:
                request = self._pending.popleft()
                if self._reading_paused and self._transport is not None:
                    self._transport.resume_reading()
                    self._reading_paused = False
                head_only = request.method == "HEAD"
                response = HttpResponse(
                    self, request.keep_alive, request.http_11, head_only=head_only
                )
                await self._serve_one(request, response)
                if not response.keep_alive or not request.keep_alive:
                    self.close()
                    return
        finally:
            self._task = None
        self._on_idle()

    def _on_idle(self) -> None:
        """Every earlier response is out: now what waited its turn may go."""
        if self._closed:
            return
        if self._deferred_error is not None:
            status, message = self._deferred_error
            self._write_error_and_close(status, message)
        elif self._eof or self.is_draining:
            self.close()
        else:
            self._send_continue()
            self._arm_timer()

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

    def _send_continue(self) -> None:
        if self._continue_wanted and not self.is_busy and self._transport is not None:
            self._continue_wanted = False
            self.flush()
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    # ---------------------------------------------------------------- timers
    def _arm_timer(self) -> None:
        """Keep the one timer that fits the connection's state (a running one keeps its
        deadline: a slow peer cannot extend it by trickling bytes)."""
        if self._closed:
            return
        phase: Phase | None = None if self.is_busy else self._phase
        if phase == self._timer_phase:
            return
        self._cancel_timer()
        if phase is None:
            return
        cfg = self._config
        delay = {"idle": cfg.idle_timeout_s, "head": cfg.header_timeout_s}.get(
            phase, cfg.body_timeout_s
        )
        self._timer = self._loop.call_later(delay, self._on_timeout, phase)
        self._timer_phase = phase

    def _cancel_timers(self) -> None:
        if self._probe_timer is not None:
            self._probe_timer.cancel()
            self._probe_timer = None
        self._cancel_timer()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer, self._timer_phase = None, None

    def _on_timeout(self, phase: Phase) -> None:
        self._timer, self._timer_phase = None, None
        if phase == "idle":
            self.close()
        elif phase == "head":
            self._reject(
                408, b"request headers not received within %gs" % self._config.header_timeout_s
            )
        else:
            self._reject(408, b"request body not received within %gs" % self._config.body_timeout_s)

    # ---------------------------------------------------------------- writing
    def write(self, data: bytes) -> None:
        """Queue `data`; it is sent with everything else written in this loop iteration
        (at once past FLUSH_BYTES). Raises ClientDisconnected once the client has gone."""
        if self._closed or self._transport is None:
            raise ClientDisconnected("client disconnected")
        wbuf = self._wbuf
        if not wbuf:
            self._loop.call_soon(self.flush)
        wbuf.append(data)
        self._wbuf_bytes += len(data)
        if self._wbuf_bytes >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        """Send what is queued now (`write` leaves it to the end of the loop iteration)."""
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
        """Answer `status` and close; after the responses still owed to earlier requests."""
        if self._stopped:
            return
        self._deferred_error = (status, message)
        self._cancel_timer()
        if self._transport is not None and not self._reading_paused:
            self._transport.pause_reading()
            self._reading_paused = True
        if not self.is_busy:
            self._write_error_and_close(status, message)

    def _write_error_and_close(self, status: int, message: bytes) -> None:
        if self._transport is None or self._closed:
            return
        self.flush()
        self._transport.write(error_response(status, message))
        self._linger()

    def _linger(self) -> None:
        """Close after an error, politely: FIN our side, drop what the client still sends for
        up to LINGER_S and LINGER_BYTES, then close. Closing with its bytes unread would send
        a reset, which can destroy the error response before the client reads it."""
        transport = self._transport
        assert transport is not None
        self._closed = True  # data_received drops everything from now on
        self._cancel_timers()
        if self._eof or not transport.can_write_eof():
            transport.close()  # after the client's EOF: nothing to drop, no reset to avoid
            return
        transport.write_eof()
        if self._reading_paused:
            transport.resume_reading()
            self._reading_paused = False
        self._timer = self._loop.call_later(LINGER_S, transport.close)

    def close(self) -> None:
        """Send what is buffered, then close (the transport still sends its own buffer)."""
        self._cancel_timers()
        if self._transport is not None and not self._closed:
            self.flush()
            self._closed = True
            self._transport.close()


class HttpServer:
    """Owns the listening socket and live connections (in accept order)."""

    def __init__(
        self,
        handler: Handler,
        *,
        config: HttpConfig | None = None,
        max_body_bytes: int | None = None,
    ) -> None:
        self._handler = handler
        self.config = config or HttpConfig()
        if max_body_bytes is not None:
            self.config = dataclasses.replace(self.config, max_body_bytes=max_body_bytes)
        self.connections: dict[HttpProtocol, None] = {}
        self.is_draining = False
        self._idle = asyncio.Event()
        self._acceptor: Acceptor | None = None

    def _new_connection(self) -> HttpProtocol:
        return HttpProtocol(self._handler, config=self.config, server=self)

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on host:port (port 0 = any free port); returns the bound address."""
        self._acceptor = Acceptor(self._new_connection, self.connections, self.config)
        return await self._acceptor.start(host, port)

    @property
    def max_connections(self) -> int:
        return self._acceptor.max_connections if self._acceptor else self.config.max_connections

    def on_connection_made(self, conn: HttpProtocol) -> None:
        self.connections[conn] = None
        if self._acceptor is not None:
            self._acceptor.on_connection_made()

    def on_connection_lost(self) -> None:
        if not self.connections:
            self._idle.set()

    async def stop(self, grace_s: float = 0.0) -> None:
        """Stop listening (new connections are refused), close idle connections, let
        requests in flight finish within `grace_s`, then close every connection (what is
        still running is cancelled). Responses started while draining say
        `connection: close`."""
        self.is_draining = True
        if self._acceptor is not None:
            self._acceptor.close()
        busy = [conn for conn in self.connections if conn.is_busy]
        for conn in list(self.connections):
            if not conn.is_busy:
                conn.close()
        if busy and grace_s > 0:
            logger.info("draining %d HTTP connection(s) for up to %gs", len(busy), grace_s)
            self._idle.clear()
            try:
                async with asyncio.timeout(grace_s):
                    while self.connections:
                        await self._idle.wait()
                        self._idle.clear()
            except TimeoutError:
                logger.warning(
                    "%d HTTP connection(s) still busy after %gs; closing",
                    len(self.connections),
                    grace_s,
                )
        for conn in list(self.connections):
            conn.close()
        if self._acceptor is not None:
            await self._acceptor.wait_closed()
            self._acceptor = None


__all__ = [
    "ClientDisconnected",
    "Handler",
    "HttpProtocol",
    "HttpRequest",
    "HttpResponse",
    "HttpServer",
]
