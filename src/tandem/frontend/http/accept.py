"""The HTTP server's accept loop: a connection cap below the fd limit, and shedding when
accept runs out of file descriptors.

asyncio's and uvloop's servers accept for us, but uvloop closes its listening socket for good
on an accept error, and neither caps connections. Running out of descriptors must cost HTTP
connections, never discovery or the event bus (they need descriptors to poll and reconnect):
so the cap is lowered to what RLIMIT_NOFILE leaves after a reserve, a connection past the cap
gets a 503 and is closed at once, and an accept that fails with EMFILE/ENFILE closes the
newest connection, logs once and retries after a back-off.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import resource
import select
import socket
from collections.abc import Callable
from typing import Any, Protocol

from tandem.frontend.http.config import HttpConfig
from tandem.frontend.http.message import date_header

logger = logging.getLogger(__name__)

ACCEPT_BATCH = 64  # connections accepted per readiness callback
BACKLOG = 1024
FD_RESERVE_MAX = 256  # descriptors kept for everything but HTTP connections (a quarter below that)
BACKOFF_MIN_S, BACKOFF_MAX_S = 0.01, 1.0
_FD_ERRNOS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)
_REFUSAL_BODY = (
    b'{"error":{"message":"too many connections; retry later","type":"overloaded_error",'
    b'"param":null,"code":null}}'
)


def refusal() -> bytes:
    """The whole 503 sent to a connection past the cap."""
    return (
        b"HTTP/1.1 503 Service Unavailable\r\n%scontent-type: application/json\r\n"
        b"retry-after: 1\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
        % (date_header(), len(_REFUSAL_BODY), _REFUSAL_BODY)
    )


class Connection(Protocol):
    @property
    def is_busy(self) -> bool: ...

    def close(self) -> None: ...


def connection_budget(max_connections: int) -> int:
    """`max_connections`, lowered to RLIMIT_NOFILE minus the descriptors open now minus a
    reserve (a quarter of the limit, at most FD_RESERVE_MAX)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return max_connections
    try:
        num_open = len(os.listdir("/proc/self/fd"))
    except OSError:
        num_open = 0
    reserve = min(FD_RESERVE_MAX, soft // 4)
    return max(1, min(max_connections, soft - num_open - reserve))


class Acceptor:
    """Accepts on one listening socket; `connections` (owned by the server, in accept order)
    is read to apply the cap and to pick the connection to shed. One event loop."""

    def __init__(
        self,
        factory: Callable[[], asyncio.Protocol],
        connections: dict[Any, None],
        config: HttpConfig,
    ) -> None:
        self._factory, self._connections, self._config = factory, connections, config
        self.max_connections = config.max_connections
        self._loop = asyncio.get_running_loop()
        self._sock: socket.socket | None = None
        self._connecting: set[asyncio.Task[None]] = set()
        self._num_pending = 0  # accepted, not yet in `connections`
        self._shed: Connection | None = None  # the connection closed last to free a descriptor
        self._resume: asyncio.TimerHandle | None = None
        self._backoff_s = BACKOFF_MIN_S
        self._exhausted = False  # in an fd-exhaustion episode (logged once)
        self._capped = False  # in a connection-cap episode (logged once)

    async def start(self, host: str, port: int) -> tuple[str, int]:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if self._config.reuse_port:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind(addr)
            sock.listen(BACKLOG)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._sock = sock
        self.max_connections = connection_budget(self._config.max_connections)
        if self.max_connections < self._config.max_connections:
            logger.info(
                "HTTP connection cap lowered to %d (RLIMIT_NOFILE %d)",
                self.max_connections,
                resource.getrlimit(resource.RLIMIT_NOFILE)[0],
            )
        self._loop.add_reader(sock.fileno(), self._on_acceptable)
        bound = sock.getsockname()
        return str(bound[0]), int(bound[1])

    def _on_acceptable(self) -> None:
        sock = self._sock
        for _ in range(ACCEPT_BATCH):
            if sock is None:
                return
            try:
                conn, _addr = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in _FD_ERRNOS:
                    # Linux takes a descriptor before looking at the queue: EMFILE with
                    # nobody waiting is no reason to shed anyone
                    if self._has_pending(sock):
                        self._on_exhausted(exc)
                    return
                if exc.errno == errno.ECONNABORTED:
                    continue
                logger.warning("HTTP accept failed: %s", exc)
                return
            self._on_accepted(conn)

    @staticmethod
    def _has_pending(sock: socket.socket) -> bool:
        """A connection waits in the backlog (poll needs no descriptor of its own)."""
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))

    def _on_accepted(self, conn: socket.socket) -> None:
        if self._exhausted:
            logger.info("HTTP accept recovered (%d connections)", len(self._connections))
            self._exhausted, self._backoff_s = False, BACKOFF_MIN_S
        if len(self._connections) + self._num_pending >= self.max_connections:
            if not self._capped:
                logger.warning(
                    "HTTP connection cap %d reached; refusing new connections with 503",
                    self.max_connections,
                )
                self._capped = True
            refuse(conn)
            return
        self._capped = False
        conn.setblocking(False)
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._num_pending += 1  # until connection_made (`on_connection_made`)
        task = self._loop.create_task(self._connect(conn))
        self._connecting.add(task)
        task.add_done_callback(self._connecting.discard)

    async def _connect(self, conn: socket.socket) -> None:
        try:
            await self._loop.connect_accepted_socket(self._factory, conn)
        except OSError as exc:
            logger.debug("HTTP connection setup failed: %s", exc)
            self._num_pending = max(0, self._num_pending - 1)
            conn.close()

    def on_connection_made(self) -> None:
        """The protocol of an accepted connection is in `connections` now."""
        self._num_pending = max(0, self._num_pending - 1)

    def _on_exhausted(self, exc: OSError) -> None:
        if not self._exhausted:
            self._exhausted = True
            logger.warning(
                "HTTP accept: %s with %d connections open; shedding the newest and backing off",
                os.strerror(exc.errno or 0),
                len(self._connections),
            )
        self._shed_newest()
        assert self._sock is not None
        self._loop.remove_reader(self._sock.fileno())
        self._resume = self._loop.call_later(self._backoff_s, self._resume_accepting)
        self._backoff_s = min(BACKOFF_MAX_S, self._backoff_s * 2)

    def _shed_newest(self) -> None:
        """Close the newest idle connection (the newest of all when none is idle), unless
        the one shed last is still closing (its descriptor is freed when it has closed)."""
        if self._shed is not None and self._shed in self._connections:
            return
        newest: Connection | None = None
        for conn in reversed(self._connections):
            if newest is None:
                newest = conn
            if not conn.is_busy:
                newest = conn
                break
        if newest is not None:
            self._shed = newest
            newest.close()

    def _resume_accepting(self) -> None:
        self._resume = None
        if self._sock is not None:
            self._loop.add_reader(self._sock.fileno(), self._on_acceptable)

    def close(self) -> None:
        """Stop accepting: from now on connecting clients are refused by the kernel."""
        if self._resume is not None:
            self._resume.cancel()
            self._resume = None
        if self._sock is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None

    async def wait_closed(self) -> None:
        if self._connecting:
            await asyncio.gather(*self._connecting, return_exceptions=True)


def refuse(conn: socket.socket) -> None:
    """503 and close, without blocking; reads what the client already sent so the close is a
    FIN (a close with unread data is a reset, which can destroy the 503 on the way)."""
    try:
        conn.setblocking(False)
        conn.send(refusal())
        with contextlib.suppress(BlockingIOError):
            conn.recv(1 << 16)
    except OSError:
        pass
    finally:
        conn.close()
