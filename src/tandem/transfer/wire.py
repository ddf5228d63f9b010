"""Control frames between agents: 4-byte big-endian length + msgpack (version 2).

Every connection opens with a handshake (`handshake.py`): the owner sends ``Hello`` (a
nonce), the initiator answers ``Auth`` (its nonce and, with a cluster secret, an HMAC proof),
the owner answers ``AuthReply`` (its own proof, or why it refuses). Then a transfer is
``Begin`` → ... as follows.

A transfer is one TCP connection to the owner's agent: ``Begin`` claims the op and
gets its metadata back; ``Start`` names the backend the initiator chose; the bytes
move (over this socket for the tcp backend, by memcpy/RDMA otherwise); ``Done``
reports the outcome and the ``StatusReply`` says whether the owner accepted it (an op
cancelled meanwhile answers ``cancelled``). ``Export`` → ``ExportReply`` asks the owner to
open a readable op over the blocks it caches of some block hashes (a peer KV fetch).
"""

from __future__ import annotations

import socket
import struct

import msgspec

from tandem.transfer.descriptor import TransferOpMeta

_LEN = struct.Struct(">I")
MAX_FRAME_BYTES = 1 << 20
HANDSHAKE_MAX_FRAME_BYTES = 1024  # nothing larger is read from an unauthenticated peer
PROTOCOL_VERSION = 2


class Hello(msgspec.Struct, tag="hello", kw_only=True):
    version: int
    nonce: bytes
    auth_required: bool


class Auth(msgspec.Struct, tag="auth", kw_only=True):
    version: int
    nonce: bytes
    proof: bytes = b""


class AuthReply(msgspec.Struct, tag="auth_reply", kw_only=True):
    proof: bytes = b""
    error: str = ""
    # the owner's shared-memory probe (`shm.ShmProbe`): a /dev/shm segment name and the
    # SHA-256 of the random token in it; an initiator that reads the token back shares /dev/shm
    shm_probe: str = ""
    shm_digest: bytes = b""


class Begin(msgspec.Struct, tag="begin", kw_only=True):
    op_id: str
    direction: str  # "pull" (peer reads a readable op) or "push" (peer writes a writable op)
    peer: str  # the initiating agent's id, for errors and logs
    timeout_s: float  # bounds the wait for the op to be created and the whole transfer
    host_id: str = ""  # the initiator's host, for logs
    # the initiator read the owner's shm probe back; without that proof the owner starts its
    # lazy (cross-host) backends
    shares_memory: bool = False


class BeginReply(msgspec.Struct, tag="begin_reply", kw_only=True):
    meta: TransferOpMeta | None = None
    error: str = ""


class Start(msgspec.Struct, tag="start", kw_only=True):
    backend: str  # chosen by the initiator from the metadata in BeginReply


class Done(msgspec.Struct, tag="done", kw_only=True):
    ok: bool
    num_bytes: int = 0
    reason: str = ""
    annex: bytes = b""  # opaque, handed to the owner with a completed push (TransferOp.annex)


class Cancel(msgspec.Struct, tag="cancel", kw_only=True):
    op_id: str
    peer: str
    reason: str = ""


class Query(msgspec.Struct, tag="query", kw_only=True):
    op_id: str


class StatusReply(msgspec.Struct, tag="status", kw_only=True):
    status: str
    reason: str = ""


class Export(msgspec.Struct, tag="export", kw_only=True):
    """Ask the owner to open readable op ``op_id`` over the longest prefix of the chained
    ``block_hashes`` it still caches (a peer KV fetch); the initiator then pulls it."""

    op_id: str
    peer: str
    block_hashes: list[int]
    ttl_s: float


class ExportReply(msgspec.Struct, tag="export_reply", kw_only=True):
    num_blocks: int = 0  # blocks the op covers (0: none held, no op opened)
    error: str = ""


Frame = (
    Begin | BeginReply | Start | Done | Cancel | Query | StatusReply | Export | ExportReply
    | Hello | Auth | AuthReply
)  # fmt: skip
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


def send_frame(sock: socket.socket, frame: Frame) -> None:
    body = _encoder.encode(frame)
    sock.sendall(_LEN.pack(len(body)) + body)


def recv_frame(sock: socket.socket, max_bytes: int = MAX_FRAME_BYTES) -> Frame:
    """Read one frame; raises ConnectionError when the peer closed the socket or announces a
    frame over `max_bytes` (checked before its body is read)."""
    (length,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    if length > max_bytes:
        raise ConnectionError(f"control frame of {length} bytes exceeds {max_bytes}")
    frame: Frame = _decoder.decode(recv_exact(sock, length))
    return frame


def recv_exact(sock: socket.socket, num_bytes: int) -> bytes:
    buf = bytearray(num_bytes)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"peer closed the connection after {got}/{len(view)} bytes")
        got += n
