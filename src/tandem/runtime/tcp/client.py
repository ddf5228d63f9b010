"""TCP request-plane client: one pooled, multiplexed connection per server address.

`stream()` returns a `ResponseStream` (an async iterator). It connects lazily on the first
`__anext__`. Closing it early (`aclose`, `async with`, `break` once dropped, or cancelling the
consuming task) sends CANCEL so the server cancels the handler.

Liveness: every socket has TCP keepalive (transport.py), and a connection to a server that
answers PING (frame.py) and from which nothing arrived for `PING_INTERVAL_S` is pinged; one
silent for `dead_after_s` (default 10 s: a frozen or unreachable worker; a live one answers a
PING within milliseconds even when busy, unless its event loop is blocked that long) is
aborted, so its streams fail with PeerGone and the next request connects afresh.
`peer_silent_s` tells others (the frontend's /health, its instance-departure handling) how long
a connection has been silent, and `drop` closes one on their word (the worker stalled, or left
discovery), so a worker that returns is reached over a fresh connection, never the old one.

Flow control is per stream (frame.py): each stream buffers at most `stream_window` payloads;
consuming half a window returns that much credit to the server. The connection itself is
always read, so a stream nobody consumes never holds up another.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import ssl
import time
from collections import deque
from typing import Any

from tandem import errors
from tandem.runtime import tracing
from tandem.runtime.secret import client_proof, key_for, new_nonce, server_proof
from tandem.runtime.tcp import frame as fr
from tandem.runtime.tcp.server import AUTH_PURPOSE
from tandem.runtime.tcp.transport import FrameTransport

# what a plaintext client sees of a TLS server: silence, then the connection closed
_PLAINTEXT_HINT = " (is the server using TLS? then this process needs --tls-ca-file etc.)"
DEFAULT_STREAM_WINDOW = 256  # response payloads in flight per stream
PING_INTERVAL_S = 1.0  # a connection that heard nothing for this long is pinged
DEFAULT_DEAD_AFTER_S = 10.0  # ... and aborted once it heard nothing for this long
# (endpoint_path, request_id, deadline_s, payload, traceparent) of one request
RequestHead = tuple[str, str, float | None, bytes, str | None]


class TcpRequestClient:
    """Implements `RequestClient`. Safe for concurrent streams on one event loop.

    With a `secret` (the cluster secret) every connection authenticates both ways before a
    request is sent; without one the client connects only to servers that have none either."""

    def __init__(
        self,
        *,
        connect_timeout_s: float = 5.0,
        secret: str | None = None,
        max_frame_bytes: int = fr.DEFAULT_MAX_FRAME_BYTES,
        stream_window: int = DEFAULT_STREAM_WINDOW,
        dead_after_s: float = DEFAULT_DEAD_AFTER_S,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self._ssl = ssl_context  # TLS (`tandem.runtime.tls`); None = plaintext
        if not 2 <= stream_window <= fr.MAX_WINDOW:
            raise ValueError(f"stream_window={stream_window} outside [2, {fr.MAX_WINDOW}]")
        if not dead_after_s > 2 * PING_INTERVAL_S:
            raise ValueError(f"dead_after_s={dead_after_s} must exceed {2 * PING_INTERVAL_S}")
        self.dead_after_s = dead_after_s
        self.connect_timeout_s = connect_timeout_s
        self.key = key_for(secret, AUTH_PURPOSE) if secret else None
        self.max_frame_bytes = max_frame_bytes
        self.stream_window = stream_window
        self._conns: dict[str, _ClientConnection] = {}
        self._connecting: dict[str, asyncio.Task[_ClientConnection]] = {}
        self._closed = False
        self._pinger: asyncio.Task[None] | None = None

    def stream(
        self,
        address: str,
        endpoint_path: str,
        payload: bytes,
        *,
        request_id: str,
        deadline_s: float | None = None,
        connect_timeout_s: float | None = None,
    ) -> ResponseStream:
        timeout = self.connect_timeout_s if connect_timeout_s is None else connect_timeout_s
        traceparent = tracing.current_traceparent() if tracing.enabled else None
        head = (endpoint_path, request_id, deadline_s, payload, traceparent)
        return ResponseStream(self, address, head, timeout)

    async def connect(self, address: str, timeout_s: float | None = None) -> None:
        """Make sure a pooled connection to `address` is open and authenticated (connecting
        if needed); raises PeerGone saying why not."""
        await self.connection(address, self.connect_timeout_s if timeout_s is None else timeout_s)

    def peer_silent_s(self, address: str) -> float | None:
        """Seconds since anything arrived on the pooled connection to `address`: None without
        an open one; 0.0 when its server predates PING (then only TCP keepalive watches it)."""
        conn = self._conns.get(address)
        if conn is None or conn.closed:
            return None
        if not conn.answers_pings:
            return 0.0
        return max(conn.loop.time() - conn.last_rx, 0.0)

    async def answers(self, address: str, within_s: float) -> bool:
        """Whether the server at `address` answers, now, on its pooled connection: a PING
        whose answer (or any frame) arrives within `within_s`. False without an open
        connection; True, unasked, for a server that predates PING (it cannot be told)."""
        conn = self._conns.get(address)
        if conn is None or conn.closed:
            return False
        if not conn.answers_pings:
            return True
        heard = conn.loop.create_future()
        conn.rx_waiters.append(heard)
        conn.send((fr.PING, next(conn.pings)))
        try:
            async with asyncio.timeout(within_s):
                await heard
        except TimeoutError:
            return False
        finally:
            if heard in conn.rx_waiters:
                conn.rx_waiters.remove(heard)
        return not conn.closed

    def drop(self, address: str, reason: str) -> None:
        """Abort the pooled connection to `address` (its streams fail with PeerGone naming
        `reason`); the next request connects afresh."""
        conn = self._conns.pop(address, None)
        if conn is not None:
            conn.abort(reason)

    async def connection(self, address: str, timeout_s: float) -> _ClientConnection:
        """The pooled connection to `address`, connecting (once, shared) if needed."""
        conn = self._conns.get(address)
        if conn is not None and not conn.closed:
            return conn
        if self._closed:
            raise errors.PeerGone(f"request client is closed; cannot reach {address}")
        task = self._connecting.get(address)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._connect(address, timeout_s))
            self._connecting[address] = task
            task.add_done_callback(lambda _: self._connecting.pop(address, None))
        return await asyncio.shield(task)

    async def _connect(self, address: str, timeout_s: float) -> _ClientConnection:
        host, _, port = address.rpartition(":")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _ClientConnection(self, address),
                    host,
                    int(port),
                    ssl=self._ssl,
                    server_hostname=host.strip("[]") if self._ssl is not None else None,
                )
                try:
                    await conn.ready
                except BaseException:
                    if conn.transport is not None:
                        conn.transport.abort()
                    raise
        except errors.PeerGone as exc:
            if self._ssl is None and "handshake" in str(exc):
                raise errors.PeerGone(f"{exc}{_PLAINTEXT_HINT}") from exc
            raise
        except TimeoutError as exc:
            hint = "" if self._ssl else _PLAINTEXT_HINT
            raise errors.PeerGone(
                f"cannot connect to {address}: timed out after {timeout_s}s{hint}"
            ) from exc
        except ssl.SSLError as exc:
            raise errors.PeerGone(
                f"cannot connect to {address}: TLS failed ({exc}); is the server using TLS "
                "with a certificate for this address that --tls-ca-file signed?"
            ) from exc
        except (OSError, ValueError) as exc:
            raise errors.PeerGone(f"cannot connect to {address}: {exc}") from exc
        self._conns[address] = conn
        if self._pinger is None or self._pinger.done():
            self._pinger = loop.create_task(self._ping_loop(), name="request-plane-pings")
        return conn

    async def _ping_loop(self) -> None:
        """Every PING_INTERVAL_S: ping each connection that heard nothing for that long, abort
        those silent for `dead_after_s`. Ends when no connection is left."""
        while self._conns:
            await asyncio.sleep(PING_INTERVAL_S)
            for conn in list(self._conns.values()):
                conn.check_alive(self.dead_after_s)

    def _forget(self, conn: _ClientConnection) -> None:
        if self._conns.get(conn.address) is conn:
            del self._conns[conn.address]

    async def close(self) -> None:
        """Close every connection; open streams fail with PeerGone."""
        self._closed = True
        for task in list(self._connecting.values()):
            task.cancel()
        if self._pinger is not None:
            self._pinger.cancel()
        for conn in list(self._conns.values()):
            if conn.transport is not None:
                conn.transport.close()
        self._conns.clear()


class _ClientConnection(FrameTransport):
    def __init__(self, client: TcpRequestClient, address: str) -> None:
        super().__init__(client.max_frame_bytes)
        self.client, self.address = client, address
        self.streams: dict[int, _Sink] = {}
        self._sids = itertools.count(1)
        self.ready: asyncio.Future[None] = self.loop.create_future()  # handshake done
        self._nonce = new_nonce()
        self._server_nonce = b""
        self.answers_pings = False  # the server said so in WELCOME
        self.last_rx = self.loop.time()  # when a frame last arrived
        self.pings = itertools.count(1)
        self.rx_waiters: list[asyncio.Future[None]] = []  # resolved when anything arrives
        self._abort_reason: str | None = None

    def data_received(self, data: bytes) -> None:
        self.last_rx = self.loop.time()
        if self.rx_waiters:
            self._wake_rx_waiters()
        super().data_received(data)

    def _wake_rx_waiters(self) -> None:
        waiters, self.rx_waiters = self.rx_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    def check_alive(self, dead_after_s: float) -> None:
        """Ping when idle; abort when silent past `dead_after_s` (servers that answer PING)."""
        if not self.answers_pings or self.closed:
            return
        silent_s = self.loop.time() - self.last_rx
        if silent_s >= dead_after_s:
            self.abort(f"it answered nothing, not even a PING, for {silent_s:.1f}s")
        elif silent_s >= PING_INTERVAL_S:
            self.send((fr.PING, next(self.pings)))

    def abort(self, reason: str) -> None:
        """Close at once; streams fail with PeerGone naming `reason`."""
        if self.closed:
            return
        self._abort_reason = reason
        self.client._forget(self)
        if self.transport is not None:
            self.transport.abort()

    def open(self, stream: _Sink, request: RequestHead) -> int:
        sid = next(self._sids)
        self.streams[sid] = stream
        path, request_id, deadline_s, payload, traceparent = request
        window = self.client.stream_window
        # optional trailing fields, which servers that predate them ignore: the caller's
        # trace context, and that this client takes BATCH frames
        self.send(
            (fr.REQUEST, sid, path, request_id, deadline_s, window, payload, traceparent, True)
        )
        if len(payload) >= fr.FLUSH_NOW_BYTES:  # a long prompt: on its way at once (TTFT)
            self._flush()
        return sid

    def cancel(self, sid: int) -> None:
        if self.streams.pop(sid, None) is not None:
            self.send((fr.CANCEL, sid))

    def grant(self, sid: int, num_frames: int) -> None:
        if sid in self.streams:
            self.send((fr.CREDIT, sid, num_frames))

    def _fail_handshake(self, reason: str) -> None:
        if not self.ready.done():
            self.ready.set_exception(errors.PeerGone(f"request plane at {self.address}: {reason}"))
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def _handshake(self, f: list[Any]) -> None:
        kind, key = f[0], self.client.key
        if kind == fr.HELLO:
            _, version, self._server_nonce, auth_required = f
            if version != fr.PROTOCOL_VERSION:
                return self._fail_handshake(
                    f"server speaks request-plane protocol v{version}; this client speaks "
                    f"v{fr.PROTOCOL_VERSION}"
                )
            if key is not None and not auth_required:
                return self._fail_handshake(
                    "server does not authenticate (it has no cluster secret) but this process "
                    "has one; refusing to send requests to it"
                )
            proof = client_proof(key, self._server_nonce, self._nonce) if key else None
            self.send((fr.AUTH, fr.PROTOCOL_VERSION, self._nonce, proof))
        elif kind == fr.WELCOME:
            if key is not None and not (
                isinstance(f[1], bytes)
                and hmac.compare_digest(f[1], server_proof(key, self._server_nonce, self._nonce))
            ):
                return self._fail_handshake("server failed to prove it holds the cluster secret")
            self.max_frame_bytes = self.session_max_frame_bytes
            self.answers_pings = len(f) > 2 and f[2] is True
            self.ready.set_result(None)
        elif kind == fr.REFUSED:
            self._fail_handshake(f"refused the connection: {f[1]}")
        else:
            raise fr.FrameError(f"unexpected frame kind {kind} during the handshake")

    def on_frame(self, f: list[Any]) -> None:
        if not self.ready.done():
            return self._handshake(f)
        kind, sid = f[0], f[1]
        if kind == fr.PONG:  # its arrival was the point (last_rx)
            return
        if kind == fr.BATCH:
            if not len(f) & 1:
                raise fr.FrameError(f"a BATCH of {len(f)} fields from {self.address}")
            streams = self.streams
            pairs = iter(f)
            next(pairs)
            for sid, payload in zip(pairs, pairs, strict=True):
                if payload is not None:  # a DATA
                    st = streams.get(sid)
                    if st is not None:
                        st.push(payload)
                elif (st := streams.pop(sid, None)) is not None:  # an END
                    st.finish(None)
        elif kind == fr.DATA:
            st = self.streams.get(sid)
            if st is not None:
                st.push(f[2])
        elif kind == fr.END:
            st = self.streams.pop(sid, None)
            if st is not None:
                st.finish(None)
        elif kind == fr.ERROR:
            st = self.streams.pop(sid, None)
            if st is not None:
                st.finish(fr.error_from_frame(f[2], f[3], f[4]))
        else:
            raise fr.FrameError(f"unexpected frame kind {kind} from server {self.address}")

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self.client._forget(self)
        self._wake_rx_waiters()  # `answers` then sees it closed
        why = self._abort_reason or (f"{type(exc).__name__}: {exc}" if exc else "closed by peer")
        if not self.ready.done():
            self.ready.set_exception(
                errors.PeerGone(f"connection to {self.address} lost during the handshake ({why})")
            )
        streams, self.streams = self.streams, {}
        for st in streams.values():
            st.finish(
                errors.PeerGone(
                    f"connection to {self.address} lost ({why}) during request_id={st.request_id}"
                )
            )


class _Sink:
    """Receiving side of one stream, held by the connection. Kept apart from ResponseStream
    so that dropping an unfinished ResponseStream (e.g. `break`) lets `__del__` cancel it."""

    __slots__ = (
        "buf",
        "conn",
        "done",
        "error",
        "num_unacked",
        "request",
        "sid",
        "timer",
        "waiter",
        "window",
    )

    def __init__(self, conn: _ClientConnection, request: RequestHead):
        self.conn, self.request = conn, request
        self.buf: deque[bytes] = deque()
        self.waiter: asyncio.Future[None] | None = None
        self.done = False
        self.error: BaseException | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.num_unacked = 0  # consumed payloads not yet returned to the server as credit
        self.window = conn.client.stream_window
        self.sid = conn.open(self, request)
        deadline_s = request[2]
        if deadline_s is not None:
            self.timer = conn.loop.call_later(deadline_s - time.time(), self.expire)

    @property
    def request_id(self) -> str:
        return self.request[1]

    def push(self, payload: bytes) -> None:
        if len(self.buf) >= self.window:
            raise fr.FrameError(
                f"server sent request_id={self.request_id} more than its window of "
                f"{self.window} frames"
            )
        self.buf.append(payload)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def finish(self, error: BaseException | None) -> None:
        if self.done:
            return
        self.done, self.error = True, error
        if self.timer is not None:
            self.timer.cancel()
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def cancel(self, error: BaseException | None = None) -> None:
        if not self.done:
            self.conn.cancel(self.sid)
        self.buf.clear()
        self.finish(error)

    def expire(self) -> None:
        self.cancel(deadline_error(self.request, self.conn.address))

    def pop(self) -> bytes:
        """The oldest buffered payload (there is one); returns credit every half window."""
        self.num_unacked += 1
        if self.num_unacked * 2 >= self.window and not self.done:
            self.conn.grant(self.sid, self.num_unacked)
            self.num_unacked = 0
        return self.buf.popleft()


def deadline_error(request: RequestHead, address: str) -> Exception:
    return errors.DeadlineExceeded(
        f"request_id={request[1]} to {request[0]} at {address} passed its deadline"
    )


class ResponseStream:
    """Response payloads of one request. Buffered items are yielded before END or PeerGone."""

    __slots__ = ("_client", "_closed", "_request", "_sink", "_timeout_s", "address")

    def __init__(
        self,
        client: TcpRequestClient,
        address: str,
        request: RequestHead,
        timeout_s: float,
    ) -> None:
        self._client, self.address, self._request = client, address, request
        self._timeout_s = timeout_s
        self._sink: _Sink | None = None
        self._closed = False

    @property
    def request_id(self) -> str:
        return self._request[1]

    def __aiter__(self) -> ResponseStream:
        return self

    async def __anext__(self) -> bytes:
        sink = self._sink
        if sink is None:
            if self._closed:
                raise StopAsyncIteration
            deadline_s = self._request[2]
            if deadline_s is not None and deadline_s <= time.time():
                raise deadline_error(self._request, self.address)
            conn = await self._client.connection(self.address, self._timeout_s)
            if self._closed:  # closed while connecting
                raise StopAsyncIteration
            sink = self._sink = _Sink(conn, self._request)
        # the sink's next payload, waited for here (no coroutine of its own: once per token)
        buf = sink.buf
        while not buf:
            if sink.done:
                if sink.error is not None:
                    raise sink.error
                raise StopAsyncIteration
            sink.waiter = waiter = sink.conn.loop.create_future()
            try:
                await waiter
            except asyncio.CancelledError:
                sink.cancel()
                raise
            finally:
                sink.waiter = None
        return sink.pop()

    def next_ready(self) -> bytes | None:
        """The next payload if one has already arrived, without waiting (no coroutine: the
        per-token shortcut of a reader that is behind); None otherwise, `__anext__` then
        waits, ends or raises as usual."""
        sink = self._sink
        if sink is None or not sink.buf:
            return None
        return sink.pop()

    async def aclose(self) -> None:
        """Stop the stream; cancels the request on the server if it has not ended."""
        self._close()

    def _close(self) -> None:
        self._closed = True
        if self._sink is not None:
            self._sink.cancel()

    async def __aenter__(self) -> ResponseStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._close()

    def __del__(self) -> None:
        sink = self._sink
        if sink is not None and not sink.done:
            with contextlib.suppress(RuntimeError):  # event loop already closed
                sink.cancel()
