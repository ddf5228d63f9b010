"""The initiator side of a transfer: dial the owner, claim, move bytes, report done."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from typing import Protocol

import msgspec

from tandem.errors import TransferError
from tandem.runtime.tls import TlsFiles
from tandem.transfer import handshake
from tandem.transfer.base import TransferBackend
from tandem.transfer.config import TransferAgentConfig
from tandem.transfer.descriptor import OpRef, TransferOpMeta
from tandem.transfer.pool import ConnectionPool
from tandem.transfer.region import MemoryRegion
from tandem.transfer.wire import (
    Begin,
    BeginReply,
    Cancel,
    Done,
    Export,
    ExportReply,
    Frame,
    Query,
    Start,
    StatusReply,
    recv_frame,
    send_frame,
)

logger = logging.getLogger(__name__)


class Initiator(Protocol):
    """What a transfer needs of the agent that starts it (`TransferAgent`)."""

    agent_id: str
    host_id: str
    config: TransferAgentConfig
    pool: ConnectionPool  # its connections to peers, reused from one transfer to the next

    def ensure_cross_host_backends(self, peer: str) -> None:
        """Start the backends a peer on another host may need (idempotent, thread-safe)."""
        ...

    def why_not_shared(self, probe: str, digest: bytes) -> str | None:
        """None when the owner's shared-memory probe reads back here; else why not (cached
        per probe, `shm.ShmProofs`)."""
        ...

    def choose_backend(
        self, remote: TransferOpMeta, no_shared_memory: str | None
    ) -> TransferBackend:
        """The fastest enabled backend that can reach ``remote`` (shm only when
        ``no_shared_memory`` is None); TransferError if none."""
        ...


def run_transfer(
    agent: Initiator,
    direction: str,
    target: TransferOpMeta | OpRef,
    local: MemoryRegion,
    block_ids: list[int],
    timeout_s: float,
    annex: bytes = b"",
) -> tuple[str, int]:
    """Pull from / push to ``target``; return (backend name, bytes moved).

    Raises TransferError naming the op, the peer and the reason; never hangs past
    ``timeout_s`` waiting on the peer (a local memcpy is not interrupted).
    """
    deadline = time.monotonic() + timeout_s
    peer = f"{target.agent_id or '?'}@{target.address[0]}:{target.address[1]}"
    where = f"transfer op={target.op_id} peer={peer} ({direction})"
    try:
        with agent.pool.connection(_address(target), timeout_s) as conn:
            return _run(agent, conn.sock, conn.probe, direction, target, local, block_ids,
                        deadline, annex)  # fmt: skip
    except TransferError as exc:
        raise TransferError(f"{where}: {exc}") from exc
    except TimeoutError as exc:
        raise TransferError(f"{where}: timed out after {timeout_s:.3g}s") from exc
    except (OSError, msgspec.DecodeError) as exc:
        raise TransferError(f"{where}: peer unreachable or gone: {exc}") from exc


def _run(
    agent: Initiator,
    sock: socket.socket,
    probe: tuple[str, bytes],
    direction: str,
    target: TransferOpMeta | OpRef,
    local: MemoryRegion,
    block_ids: list[int],
    deadline: float,
    annex: bytes,
) -> tuple[str, int]:
    no_shared_memory = agent.why_not_shared(*probe)
    send_frame(sock, Begin(op_id=target.op_id, direction=direction, peer=agent.agent_id,
                           timeout_s=_remaining(deadline), host_id=agent.host_id,
                           shares_memory=no_shared_memory is None))  # fmt: skip
    reply = recv_frame(sock)
    if not isinstance(reply, BeginReply) or reply.meta is None:
        raise TransferError(getattr(reply, "error", "") or f"unexpected reply {reply!r}")
    meta = reply.meta
    if no_shared_memory is not None:
        agent.ensure_cross_host_backends(meta.agent_id)
    problem = incompatibility(meta, local, block_ids)
    try:
        if problem:
            raise TransferError(problem)
        backend = agent.choose_backend(meta, no_shared_memory)
        send_frame(sock, Start(backend=backend.name))
        sock.settimeout(_remaining(deadline))  # one-sided backends bound their wait by it
        move = backend.pull if direction == "pull" else backend.push
        num_bytes = move(sock, meta, local, block_ids)
    except (OSError, msgspec.DecodeError):
        raise  # the connection itself broke: nothing more to tell the owner
    except Exception as exc:  # a backend failed (NIXL raises its own types): tell the owner
        with contextlib.suppress(OSError, msgspec.DecodeError):
            send_frame(sock, Done(ok=False, reason=f"{type(exc).__name__}: {exc}"))
            recv_frame(sock)  # the owner has recorded the failure once it answers
        raise TransferError(f"{type(exc).__name__}: {exc}") from exc
    sock.settimeout(_remaining(deadline))
    send_frame(sock, Done(ok=True, num_bytes=num_bytes, annex=annex))
    status = recv_frame(sock)
    if not isinstance(status, StatusReply) or status.status != "complete":
        what = status.status if isinstance(status, StatusReply) else repr(status)
        reason = status.reason if isinstance(status, StatusReply) else ""
        raise TransferError(f"owner reports the op {what} during the transfer: {reason}")
    return backend.name, num_bytes


def incompatibility(meta: TransferOpMeta, local: MemoryRegion, block_ids: list[int]) -> str:
    """Why ``local`` blocks cannot receive/supply ``meta``'s blocks, or '' when they can."""
    mine, theirs = local.layout, meta.layout
    if len(block_ids) != len(meta.block_ids):
        return f"{len(block_ids)} local blocks for {len(meta.block_ids)} remote blocks"
    if (mine.block_bytes, mine.num_parts) != (theirs.block_bytes, theirs.num_parts):
        return (
            f"block layout differs: local {mine.num_parts}x{mine.block_bytes} bytes, "
            f"remote {theirs.num_parts}x{theirs.block_bytes} bytes"
        )
    if mine.dtype != theirs.dtype:  # same bytes, other elements (float16 / bfloat16 caches)
        return f"KV element type differs: local {mine.dtype}, remote {theirs.dtype}"
    if meta.layer_end > mine.num_layers:
        return (
            f"remote layers [{meta.layer_start}, {meta.layer_end}) exceed local {mine.num_layers}"
        )
    bad = [b for b in block_ids if not 0 <= b < mine.num_blocks]
    return f"local block_ids {bad[:8]} outside [0, {mine.num_blocks})" if bad else ""


def send_control(
    sender_id: str,
    cluster_secret: str | None,
    target: TransferOpMeta | OpRef,
    what: str,
    reason: str,
    timeout_s: float,
    tls: TlsFiles | None = None,
    pool: ConnectionPool | None = None,
) -> str:
    """Send Cancel or Query for ``target``; return the op's status as the owner reports it.
    ``sender_id`` names the sender in the owner's logs (an agent id, or "frontend"); ``tls``
    as the owner's agent has it; ``pool``: an agent's connections to reuse (else one is
    dialled for this frame)."""
    frame = (
        Cancel(op_id=target.op_id, peer=sender_id, reason=reason)
        if what == "cancel"
        else Query(op_id=target.op_id)
    )
    reply = _round_trip(target, frame, cluster_secret, timeout_s, tls, pool,
                        f"transfer op={target.op_id}", f"{what} failed: ")  # fmt: skip
    return reply.status if isinstance(reply, StatusReply) else "unknown"


def _round_trip(
    target: TransferOpMeta | OpRef,
    frame: Frame,
    cluster_secret: str | None,
    timeout_s: float,
    tls: TlsFiles | None,
    pool: ConnectionPool | None,
    what: str,
    failed: str,
) -> Frame:
    """One control frame to ``target``'s agent and its reply; TransferError naming ``what``
    and the peer when the owner is unreachable or answers garbage."""
    try:
        if pool is not None:
            with pool.connection(_address(target), timeout_s) as conn:
                send_frame(conn.sock, frame)
                return recv_frame(conn.sock)
        with _connect(target, timeout_s, tls) as sock:
            handshake.connect(sock, handshake.transfer_key(cluster_secret))
            send_frame(sock, frame)
            return recv_frame(sock)
    except (OSError, msgspec.DecodeError, TransferError) as exc:
        raise TransferError(
            f"{what} peer={target.agent_id or target.address}: {failed}{exc}"
        ) from exc


def send_export(
    sender_id: str,
    cluster_secret: str | None,
    target: OpRef,
    block_hashes: list[int],
    ttl_s: float,
    timeout_s: float,
    tls: TlsFiles | None = None,
    pool: ConnectionPool | None = None,
) -> int:
    """Ask ``target``'s agent to open readable op ``target.op_id`` over the longest prefix of
    ``block_hashes`` it caches; returns how many blocks it covers (0: none, no op). Raises
    TransferError when the owner is unreachable, refuses, or has no exporter."""
    frame = Export(op_id=target.op_id, peer=sender_id, block_hashes=block_hashes, ttl_s=ttl_s)
    reply = _round_trip(target, frame, cluster_secret, timeout_s, tls, pool,
                        f"export op={target.op_id}", "")  # fmt: skip
    if not isinstance(reply, ExportReply):
        raise TransferError(f"export op={target.op_id}: owner answered {type(reply).__name__}")
    if reply.error:
        raise TransferError(f"export op={target.op_id} refused by {target.agent_id}: "
                            f"{reply.error}")  # fmt: skip
    return reply.num_blocks


def cancel_soon(
    target: TransferOpMeta | OpRef,
    reason: str,
    *,
    sender_id: str,
    cluster_secret: str | None,
    timeout_s: float = 1.0,
    tls: TlsFiles | None = None,
    pool: ConnectionPool | None = None,
) -> None:
    """Ask ``target``'s owner to cancel it (release its pins now) without waiting: the
    Cancel runs on the running loop's default executor. Best effort: a failure is logged
    at DEBUG and the op's TTL is the backstop. Call from a running event loop."""

    def cancel() -> None:
        try:
            send_control(sender_id, cluster_secret, target, "cancel", reason, timeout_s, tls,
                         pool)  # fmt: skip
        except TransferError:
            logger.debug("cancel of op=%s failed", target.op_id, exc_info=True)

    asyncio.get_running_loop().run_in_executor(None, cancel)


def _connect(
    target: TransferOpMeta | OpRef, timeout_s: float, tls: TlsFiles | None
) -> socket.socket:
    """A connection to ``target``'s agent, over TLS when ``tls`` is given (the agent's
    certificate checked against the CA and the address dialled)."""
    host, port = target.address[0], target.address[1]
    sock = socket.create_connection((host, port), timeout=timeout_s)
    if tls is None:
        return sock
    try:
        return tls.client_context().wrap_socket(sock, server_hostname=host)
    except BaseException:
        sock.close()
        raise


def _address(target: TransferOpMeta | OpRef) -> tuple[str, int]:
    return str(target.address[0]), int(target.address[1])


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left
