"""TCP request-plane server: many endpoints, many connections, many streams per connection.

Hot path: one asyncio.Protocol per connection parses frames in `data_received` (no task per
frame); each request runs as one task; outgoing frames are batched into one
`transport.write` per event-loop iteration.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import ssl
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tandem import errors
from tandem.runtime.base import Handler
from tandem.runtime.secret import client_proof, key_for, new_nonce, server_proof
from tandem.runtime.tcp import frame as fr
from tandem.runtime.tcp.transport import FrameTransport

logger = logging.getLogger(__name__)
AUTH_PURPOSE = f"request-plane/v{fr.PROTOCOL_VERSION}"
_DATA_OVERHEAD_BYTES = 32  # msgpack array + kind + stream id + bin header around a payload


class StreamContext:
    """Server-side state of one request (implements `RequestContext`). `credit` is how many
    more DATA frames the client has room for (per-stream flow control)."""

    __slots__ = (
        "_cancelled",
        "conn",
        "credit",
        "credit_waiter",
        "deadline_s",
        "endpoint_path",
        "request_id",
        "sid",
        "task",
        "timer",
        "traceparent",
        "window",
    )

    def __init__(
        self,
        request_id: str,
        endpoint_path: str,
        deadline_s: float | None,
        window: int,
        traceparent: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.traceparent = traceparent  # W3C trace context of the caller's span
        self.endpoint_path = endpoint_path
        self.deadline_s = deadline_s
        self.window = self.credit = window
        self.credit_waiter: asyncio.Future[None] | None = None
        self._cancelled = asyncio.Event()
        self.task: asyncio.Task[None] | None = None
        self.timer: asyncio.TimerHandle | None = None
        # set while the stream is open on a connection (try_send's way out), else None
        self.conn: _ServerConnection | None = None
        self.sid = 0

    @property
    def cancelled(self) -> asyncio.Event:
        return self._cancelled

    def try_send(self, payload: bytes) -> bool:
        """Send one response payload of this stream now, from outside its handler (e.g. an
        engine's step loop), if that needs no wait: the stream is open, the client has credit
        for it and the connection's write buffer is not full. False (nothing sent) otherwise:
        the handler then yields it as usual, waiting where it must. Only while the handler
        has nothing of its own pending (so payloads stay in order)."""
        conn = self.conn
        if conn is None or self.credit <= 0 or conn.write_paused or conn.closed:
            return False
        if len(payload) > conn.max_payload_bytes:
            return False  # the handler's path raises the error that names it
        self.credit -= 1
        conn.server.stats.response_bytes += len(payload)
        conn.send_data(self.sid, payload)
        return True

    def grant(self, num_frames: int) -> None:
        self.credit = min(self.credit + num_frames, self.window)
        w = self.credit_waiter
        if w is not None and not w.done():
            w.set_result(None)


@dataclass(slots=True)
class RequestPlaneStats:
    """Counters of one request-plane server (monotonic; one event loop). `requests` and
    `errors` are keyed by endpoint path; rejected streams never reached a handler (unknown
    endpoint, shutting down, over the per-connection cap, past their deadline)."""

    requests: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    num_rejected: int = 0
    request_bytes: int = 0
    response_bytes: int = 0


class TcpRequestServer:
    """Serves registered endpoints on `host:port` (port 0 = any free port).

    A connection may carry at most `max_inflight_per_connection` concurrent streams; a
    request over that bound gets `Overloaded`. After `stop_accepting` (or during `stop`),
    new requests get `PeerGone` so clients migrate elsewhere.

    Edge limits: at most `max_connections` connections (more are closed at accept); a
    connection that has not authenticated within `handshake_timeout_s` is closed; with a
    `secret` (the cluster secret) a connection whose client cannot prove it holds the secret is
    refused before any request is read; frames over `max_frame_bytes` close the connection; a
    stream whose client grants no credit for `stream_stall_timeout_s` is cancelled."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        advertise_host: str = "",
        port: int = 0,
        max_inflight_per_connection: int = 1024,
        secret: str | None = None,
        max_frame_bytes: int = fr.DEFAULT_MAX_FRAME_BYTES,
        max_connections: int = 4096,
        handshake_timeout_s: float = 5.0,
        stream_stall_timeout_s: float = 60.0,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._host, self._port = host, port
        self._advertise_host = advertise_host or host  # what peers dial (never 0.0.0.0)
        self._ssl = ssl_context  # TLS (`tandem.runtime.tls`); None = plaintext
        self.max_inflight_per_connection = max_inflight_per_connection
        self.key = key_for(secret, AUTH_PURPOSE) if secret else None
        self.max_frame_bytes = max_frame_bytes
        self.max_connections = max_connections
        self.handshake_timeout_s = handshake_timeout_s
        self.stream_stall_timeout_s = stream_stall_timeout_s
        self.num_refused = 0  # connections refused: over the cap, failed or late handshake
        self.stats = RequestPlaneStats()
        self.handlers: dict[str, Handler] = {}
        self._server: asyncio.Server | None = None
        self._address = ""
        self._connections: set[_ServerConnection] = set()
        self._num_inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self.accepting = True

    @property
    def address(self) -> str:
        return self._address

    @property
    def num_inflight(self) -> int:
        return self._num_inflight

    def register(self, endpoint_path: str, handler: Handler) -> None:
        if endpoint_path in self.handlers:
            raise ValueError(f"endpoint {endpoint_path!r} is already registered")
        self.handlers[endpoint_path] = handler

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: _ServerConnection(self),
            self._host,
            self._port,
            reuse_address=True,
            ssl=self._ssl,
            ssl_handshake_timeout=self.handshake_timeout_s if self._ssl is not None else None,
        )
        port = self._server.sockets[0].getsockname()[1]
        self._address = f"{self._advertise_host}:{port}"
        logger.info("request plane listening on %s%s", self._address, " (TLS)" if self._ssl else "")

    def stop_accepting(self) -> None:
        """Close the listener and refuse new requests on open connections (idempotent)."""
        self.accepting = False
        if self._server is not None:
            self._server.close()

    async def stop(self, grace_s: float = 10.0) -> None:
        self.stop_accepting()
        if self._num_inflight:
            logger.info("draining %d in-flight requests (grace %.1fs)", self._num_inflight, grace_s)
            try:
                async with asyncio.timeout(grace_s):
                    await self._idle.wait()
            except TimeoutError:
                logger.warning("grace period over; cancelling %d requests", self._num_inflight)
        for conn in list(self._connections):
            conn.abort()
        if self._server is not None:
            await self._server.wait_closed()

    def _stream_started(self) -> None:
        self._num_inflight += 1
        self._idle.clear()

    def _stream_done(self) -> None:
        self._num_inflight -= 1
        if not self._num_inflight:
            self._idle.set()


class _ServerConnection(FrameTransport):
    def __init__(self, server: TcpRequestServer) -> None:
        super().__init__(server.max_frame_bytes)
        self._srv = self.server = server
        self.max_payload_bytes = server.max_frame_bytes - _DATA_OVERHEAD_BYTES
        self._streams: dict[int, StreamContext] = {}
        self._nonce = new_nonce()
        self._authed = False
        self._handshake_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        srv = self._srv
        if len(srv._connections) >= srv.max_connections:
            srv.num_refused += 1
            self.drop(f"{len(srv._connections)} connections open (limit {srv.max_connections})")
            return
        srv._connections.add(self)
        self.send((fr.HELLO, fr.PROTOCOL_VERSION, self._nonce, srv.key is not None))
        self._handshake_timer = self.loop.call_later(
            srv.handshake_timeout_s, self._handshake_expired
        )

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        self._srv._connections.discard(self)
        for sid in list(self._streams):
            self._cancel(sid)

    def abort(self) -> None:
        for sid in list(self._streams):
            self._cancel(sid)
        if self.transport is not None:
            self.transport.close()

    def _handshake_expired(self) -> None:
        if not self._authed:
            self._srv.num_refused += 1
            self.drop(f"no handshake within {self._srv.handshake_timeout_s}s")

    def _refuse(self, reason: str) -> None:
        """Tell the client why, then close; nothing it sent after is read."""
        self._srv.num_refused += 1
        logger.warning("refusing request-plane connection from %s: %s", self.peer, reason)
        if self.transport is not None:
            self.transport.write(fr.encode((fr.REFUSED, reason)))
            self.transport.close()
        self.closed = True

    def _authenticate(self, f: list[Any]) -> None:
        if f[0] != fr.AUTH:
            return self._refuse(
                f"expected an AUTH frame first (request-plane protocol v{fr.PROTOCOL_VERSION}); "
                f"got frame kind {f[0]}: is the client an older tandem?"
            )
        _, version, client_nonce, proof = f
        if version != fr.PROTOCOL_VERSION:
            return self._refuse(
                f"client speaks request-plane protocol v{version}; this server speaks "
                f"v{fr.PROTOCOL_VERSION}"
            )
        key = self._srv.key
        if key is not None and not (
            isinstance(client_nonce, bytes)
            and isinstance(proof, bytes)
            and hmac.compare_digest(proof, client_proof(key, self._nonce, client_nonce))
        ):
            return self._refuse(
                "authentication failed: the client has no or the wrong cluster secret "
                "(--cluster-secret / --cluster-secret-file / TANDEM_CLUSTER_SECRET)"
            )
        self._authed = True
        if self._handshake_timer is not None:
            self._handshake_timer.cancel()
        self.max_frame_bytes = self.session_max_frame_bytes
        mine = server_proof(key, self._nonce, client_nonce) if key is not None else None
        self.send((fr.WELCOME, mine, True))  # True: PINGs are answered

    def on_frame(self, f: list[Any]) -> None:
        if not self._authed:
            return self._authenticate(f)
        kind, sid = f[0], f[1]
        if kind == fr.CREDIT:
            ctx = self._streams.get(sid)
            if ctx is not None:
                ctx.grant(f[2])
        elif kind == fr.REQUEST:
            if len(f) > 8 and f[8] is True:  # the client takes BATCH frames
                self.takes_batches = True
            self._open(sid, f[2], f[3], f[4], f[5], f[6], f[7] if len(f) > 7 else None)
        elif kind == fr.CANCEL:
            self._cancel(sid)
        elif kind == fr.PING:
            self.send((fr.PONG, sid))
        else:
            raise fr.FrameError(f"unexpected frame kind {kind} from a client")

    def _open(
        self,
        sid: int,
        path: str,
        request_id: str,
        deadline_s: float | None,
        window: int,
        payload: bytes,
        traceparent: object = None,
    ) -> None:
        srv = self._srv
        handler = srv.handlers.get(path)
        if not isinstance(window, int) or not 1 <= window <= fr.MAX_WINDOW:
            raise fr.FrameError(f"stream window={window!r} outside [1, {fr.MAX_WINDOW}]")
        if not srv.accepting:
            return self._reject(sid, errors.PeerGone(f"server {srv.address} is shutting down"))
        if handler is None:
            known = ", ".join(sorted(srv.handlers)) or "none"
            return self._reject(
                sid,
                errors.NoWorkersAvailable(
                    f"no endpoint {path!r} at {srv.address}; serving: {known}"
                ),
            )
        if len(self._streams) >= srv.max_inflight_per_connection:
            return self._reject(
                sid,
                errors.Overloaded(
                    f"{len(self._streams)} streams in flight on this connection to {srv.address} "
                    f"(limit {srv.max_inflight_per_connection})"
                ),
            )
        if not isinstance(traceparent, str) or len(traceparent) > 55:
            traceparent = None  # a W3C traceparent is 55 characters; anything else is ignored
        ctx = StreamContext(request_id, path, deadline_s, window, traceparent)
        if deadline_s is not None:
            remaining = deadline_s - time.time()
            if remaining <= 0:
                return self._reject(sid, _deadline_error(ctx))
            ctx.timer = self.loop.call_later(remaining, self._expire, sid)
        self._streams[sid] = ctx
        ctx.conn, ctx.sid = self, sid
        srv.stats.requests[path] += 1
        srv.stats.request_bytes += len(payload)
        srv._stream_started()
        ctx.task = self.loop.create_task(self._serve(sid, handler, payload, ctx))

    def _fail(self, sid: int, exc: errors.ServingError) -> None:
        self.send(fr.error_frame(sid, exc))

    def _reject(self, sid: int, exc: errors.ServingError) -> None:
        self._srv.stats.num_rejected += 1
        self._fail(sid, exc)

    def _cancel(self, sid: int) -> None:
        ctx = self._streams.pop(sid, None)
        if ctx is None:
            return
        ctx.conn = None
        ctx.cancelled.set()
        if ctx.timer is not None:
            ctx.timer.cancel()
        if ctx.task is not None:
            ctx.task.cancel()

    def _expire(self, sid: int) -> None:
        ctx = self._streams.get(sid)
        if ctx is not None:
            self._cancel(sid)
            self._fail(sid, _deadline_error(ctx))

    async def _wait_credit(self, ctx: StreamContext) -> None:
        """Wait until the client has room for one more frame of this stream (never for the
        connection); a client that grants none for the stall timeout loses the stream."""
        timeout_s = self._srv.stream_stall_timeout_s
        while ctx.credit <= 0:
            ctx.credit_waiter = self.loop.create_future()
            try:
                async with asyncio.timeout(timeout_s):
                    await ctx.credit_waiter
            except TimeoutError:
                raise errors.DeadlineExceeded(
                    f"request_id={ctx.request_id} to {ctx.endpoint_path} stalled: its consumer "
                    f"read nothing for {timeout_s}s (stream_stall_timeout_s); cancelled"
                ) from None
            finally:
                ctx.credit_waiter = None

    async def _serve(self, sid: int, handler: Handler, payload: bytes, ctx: StreamContext) -> None:
        send_data, streams, stats = self.send_data, self._streams, self._srv.stats
        it = handler(payload, ctx)
        try:
            async for item in it:
                if len(item) > self.max_payload_bytes:
                    raise errors.ServingError(
                        f"a response item of {len(item)} bytes for request_id={ctx.request_id} "
                        f"exceeds max_frame_bytes={self._srv.max_frame_bytes} (--max-frame-bytes)"
                    )
                if ctx.credit <= 0:
                    await self._wait_credit(ctx)
                ctx.credit -= 1
                stats.response_bytes += len(item)
                send_data(sid, item)
                if self.write_paused:
                    await self.wait_writable()
            ctx.conn = None  # nothing may follow END
            if streams.pop(sid, None) is not None:
                self.send_end(sid)
        except errors.ServingError as exc:
            stats.errors[ctx.endpoint_path] += 1
            if streams.pop(sid, None) is not None:
                self._fail(sid, exc)
        except Exception as exc:
            stats.errors[ctx.endpoint_path] += 1
            logger.exception(
                "handler of %s failed request_id=%s", ctx.endpoint_path, ctx.request_id
            )
            if streams.pop(sid, None) is not None:
                self._fail(sid, errors.ServingError(f"{type(exc).__name__}: {exc}"))
        finally:
            ctx.conn = None
            await it.aclose()
            if ctx.timer is not None:
                ctx.timer.cancel()
            streams.pop(sid, None)
            self._srv._stream_done()


def _deadline_error(ctx: StreamContext) -> errors.DeadlineExceeded:
    return errors.DeadlineExceeded(
        f"request_id={ctx.request_id} to {ctx.endpoint_path} passed its deadline"
    )
