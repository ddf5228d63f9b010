"""`ConnectionPool`: authenticated connections to peer agents, kept for the next transfer.

A peer KV fetch is two exchanges with the holder's agent (``Export``, then the pull's
``Begin`` … ``Done``); each used to dial a fresh TCP connection and run the secret
handshake (two round trips, two HMACs, a new thread on the owner). The owner's connection
thread now serves frames until the initiator closes or stays idle `SERVER_IDLE_S`; the
initiator keeps at most `MAX_IDLE_PER_PEER` idle connections per peer address and closes
one idle longer than `CLIENT_IDLE_S` (below the owner's, so the owner rarely closes first).
A connection is handed out only if nothing is readable on it (an idle connection the owner
closed reads EOF); one that errs mid-exchange is closed, never returned, and the caller's
error stands (a fetch then computes its prompt).
"""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from tandem.runtime.tls import TlsFiles
from tandem.transfer import handshake

SERVER_IDLE_S = 30.0  # the owner closes a connection with no frame for this long
CLIENT_IDLE_S = 10.0  # the initiator closes an idle pooled connection after this long
MAX_IDLE_PER_PEER = 4  # idle connections kept per peer address; more are closed


@dataclass(slots=True)
class PeerConnection:
    """One authenticated connection and what its handshake told (the owner's shm probe)."""

    sock: socket.socket
    probe: tuple[str, bytes]
    idle_since: float = 0.0


class ConnectionPool:
    """Per peer address, idle authenticated connections; thread-safe."""

    def __init__(self, cluster_secret: str | None, tls: TlsFiles | None) -> None:
        self._key = handshake.transfer_key(cluster_secret)
        self._tls = tls
        self._idle: dict[tuple[str, int], list[PeerConnection]] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.num_opened = 0  # connections dialled (handshake included)
        self.num_reused = 0  # exchanges that took an idle connection

    @contextlib.contextmanager
    def connection(self, address: tuple[str, int], timeout_s: float) -> Iterator[PeerConnection]:
        """An idle connection to ``address`` or a new one (dialled and authenticated within
        ``timeout_s``). It returns to the pool when the block ends normally, else closes."""
        conn = self._take(address)
        if conn is None:
            conn = self._open(address, timeout_s)
        conn.sock.settimeout(timeout_s)
        ok = False
        try:
            yield conn
            ok = True
        finally:
            if ok:
                self._give(address, conn)
            else:
                _close(conn.sock)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for conn in conns:
            _close(conn.sock)

    def _take(self, address: tuple[str, int]) -> PeerConnection | None:
        now = time.monotonic()
        stale: list[PeerConnection] = []
        found: PeerConnection | None = None
        with self._lock:
            idle = self._idle.get(address, [])
            while idle and found is None:
                conn = idle.pop()  # the most recently used
                if now - conn.idle_since < CLIENT_IDLE_S and _quiet(conn.sock):
                    found = conn
                else:
                    stale.append(conn)
            if found is not None:
                self.num_reused += 1
        for conn in stale:
            _close(conn.sock)
        return found

    def _give(self, address: tuple[str, int], conn: PeerConnection) -> None:
        conn.idle_since = time.monotonic()
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if not self._closed and len(idle) < MAX_IDLE_PER_PEER:
                idle.append(conn)
                return
        _close(conn.sock)

    def _open(self, address: tuple[str, int], timeout_s: float) -> PeerConnection:
        sock = socket.create_connection(address, timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                sock = self._tls.client_context().wrap_socket(sock, server_hostname=address[0])
            probe = handshake.connect(sock, self._key)
        except BaseException:
            _close(sock)
            raise
        with self._lock:
            self.num_opened += 1
        return PeerConnection(sock=sock, probe=probe)


def _quiet(sock: socket.socket) -> bool:
    """True when nothing is readable on an idle connection: the owner has not closed it
    (EOF) nor sent anything out of turn."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
    except (OSError, ValueError):
        return False
    return not readable


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()
