"""The owner side: one listening socket per agent, one thread per transfer connection.

Serves ``Begin`` (claim an op, possibly waiting a bounded time for it to be created),
then ``Start`` + bytes + ``Done``; also ``Cancel``, ``Query`` and ``Export``; one exchange
after another on a connection until the initiator closes it (it pools them,
`pool.ConnectionPool`) or it idles `pool.SERVER_IDLE_S`. Whatever breaks the
connection before ``Done`` marks the op errored, so the owner's waiter wakes at once.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import ssl
import threading
from typing import Protocol

from tandem.errors import TransferError
from tandem.transfer import handshake
from tandem.transfer.base import TransferBackend
from tandem.transfer.client import Initiator
from tandem.transfer.descriptor import OpKind, OpStatus, TransferOpMeta
from tandem.transfer.operation import TransferOp
from tandem.transfer.pool import SERVER_IDLE_S
from tandem.transfer.region import MemoryRegion
from tandem.transfer.wire import (
    Begin,
    BeginReply,
    Cancel,
    Done,
    Export,
    ExportReply,
    Query,
    Start,
    StatusReply,
    recv_frame,
    send_frame,
)

logger = logging.getLogger(__name__)
_GRACE_S = 1.0  # the owner waits this much longer than the initiator before giving up
MAX_CONNECTIONS = 256  # concurrent transfers served; more are refused, never queued


class OpOwner(Initiator, Protocol):
    """What the server needs of the agent whose ops it serves (`TransferAgent`, which also
    initiates transfers). Every method is called from the connection threads, concurrently."""

    shm_probe: tuple[str, bytes]  # (segment, token digest) peers read back; ("", b""): none

    def find_op(self, op_id: str) -> TransferOp | None: ...

    def wait_for_op(self, op_id: str, timeout_s: float) -> TransferOp | None:
        """The op with ``op_id``, waiting up to ``timeout_s`` for it to be created."""
        ...

    def cancel(self, op_id: str, reason: str = ...) -> TransferOp | None: ...

    def current_meta(self, op: TransferOp) -> TransferOpMeta:
        """``op``'s metadata with the backends and handles as they are now."""
        ...

    def backend(self, name: str) -> TransferBackend:
        """The enabled backend ``name``; TransferError when it is not enabled."""
        ...

    def region(self, name: str) -> MemoryRegion:
        """The registered region ``name``; TransferError when there is none."""
        ...

    def finish_served(self, op: TransferOp, done: Done, moved: int) -> None:
        """Record the end of a transfer served into / out of ``op``."""
        ...

    def serve_export(self, export: Export) -> ExportReply:
        """Open the readable op a peer's KV fetch asks for, through the agent's exporter."""
        ...


class ControlServer:
    """Accepts peer connections for ``agent`` until `close`."""

    def __init__(self, agent: OpOwner, host: str, port: int) -> None:
        self._agent = agent
        self._key = handshake.transfer_key(agent.config.cluster_secret)
        tls = agent.config.tls
        self._ssl = tls.server_context() if tls is not None else None
        self._sock = socket.create_server((host, port))
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(
            target=self._accept_loop, name=f"transfer-accept-{agent.agent_id}", daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        self._thread.join(timeout=2.0)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                refuse = len(self._conns) >= MAX_CONNECTIONS
                if not refuse:
                    self._conns.add(conn)
            if refuse:
                logger.warning("transfer agent=%s: %d connections open, refusing one",
                               self._agent.agent_id, MAX_CONNECTIONS)  # fmt: skip
                conn.close()
                continue
            peer = f"{addr[0]}:{addr[1]}"
            threading.Thread(target=self._serve, args=(conn, peer), daemon=True).start()

    def _serve(self, raw: socket.socket, peer: str) -> None:
        conn = raw
        try:
            raw.settimeout(self._agent.config.io_timeout_s)
            if self._ssl is not None:
                conn = self._wrap(raw, peer)
            if not handshake.accept(conn, self._key, peer, self._agent.shm_probe):
                return
            while not self._closed:  # the initiator reuses the connection (transfer/pool.py)
                conn.settimeout(SERVER_IDLE_S)
                try:
                    frame = recv_frame(conn)
                except (TimeoutError, ConnectionError):
                    return  # idle too long, or the initiator closed it between exchanges
                conn.settimeout(self._agent.config.io_timeout_s)
                self._serve_frame(conn, frame)
        except ssl.SSLError as exc:
            logger.warning("refusing transfer connection from %s: TLS failed: %s", peer, exc)
        except (OSError, ValueError, TransferError) as exc:  # the peer died or the op ended
            logger.debug("transfer control connection ended: %s", exc)
        except Exception:
            logger.exception("transfer control connection failed")
        finally:
            with self._lock:
                self._conns.discard(raw)
                self._conns.discard(conn)
            conn.close()
            raw.close()

    def _serve_frame(self, conn: socket.socket, frame: object) -> None:
        if isinstance(frame, Begin):
            self._serve_transfer(conn, frame)
        elif isinstance(frame, Cancel):
            op = self._agent.cancel(frame.op_id, f"cancelled by peer {frame.peer}: {frame.reason}")
            send_frame(conn, _status(op))
        elif isinstance(frame, Query):
            send_frame(conn, _status(self._agent.find_op(frame.op_id)))
        elif isinstance(frame, Export):
            send_frame(conn, self._agent.serve_export(frame))
        else:
            raise ConnectionError(f"unexpected frame {type(frame).__name__}")

    def _wrap(self, raw: socket.socket, peer: str) -> socket.socket:
        """The TLS connection over ``raw`` (handshake within the io timeout); it replaces
        ``raw`` among the connections `close` shuts down."""
        assert self._ssl is not None
        conn = self._ssl.wrap_socket(raw, server_side=True)
        with self._lock:
            self._conns.discard(raw)
            self._conns.add(conn)
        return conn

    def _serve_transfer(self, conn: socket.socket, begin: Begin) -> None:
        # answer before the initiator's own timeout so it learns why
        wait_s = max(0.0, begin.timeout_s - min(0.25, begin.timeout_s / 4))
        op = self._agent.wait_for_op(begin.op_id, wait_s)
        error = _claim(op, begin)
        if error:
            send_frame(conn, BeginReply(error=error))
            return
        assert op is not None
        try:
            if not begin.shares_memory:  # another host or container (or no shm there)
                self._agent.ensure_cross_host_backends(begin.peer)
            send_frame(conn, BeginReply(meta=self._agent.current_meta(op)))
            conn.settimeout(begin.timeout_s + _GRACE_S)
            done, moved = self._move(conn, op)
        except Exception as exc:
            op.finish(OpStatus.ERRORED, f"peer {begin.peer} failed mid-transfer: {exc}")
            raise
        self._agent.finish_served(op, done, moved)
        send_frame(conn, _status(op))

    def _move(self, conn: socket.socket, op: TransferOp) -> tuple[Done, int]:
        """``Start`` → bytes (if the backend needs us) → ``Done``; or an early ``Done``."""
        start = recv_frame(conn)
        if isinstance(start, Done):  # the initiator gave up before moving anything
            return start, 0
        if not isinstance(start, Start):
            raise ConnectionError(f"expected Start, got {type(start).__name__}")
        backend = self._agent.backend(start.backend)
        moved = backend.serve(conn, op, self._agent.region(op.meta.region))
        done = recv_frame(conn)
        if not isinstance(done, Done):
            raise ConnectionError(f"expected Done, got {type(done).__name__}")
        return done, moved


def _claim(op: TransferOp | None, begin: Begin) -> str:
    if op is None:
        return f"no op {begin.op_id} appeared within {begin.timeout_s:.3g}s on this agent"
    wanted = OpKind.READABLE if begin.direction == "pull" else OpKind.WRITABLE
    if op.meta.kind is not wanted:
        return f"op {begin.op_id} is {op.meta.kind.value}; a {begin.direction} needs {wanted.value}"
    return op.claim(begin.peer) or ""


def _status(op: TransferOp | None) -> StatusReply:
    if op is None:
        return StatusReply(status="unknown", reason="no such op")
    return StatusReply(status=op.status.value, reason=op.reason)
