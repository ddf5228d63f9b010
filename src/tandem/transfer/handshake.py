"""Mutual authentication of a transfer-agent connection with the cluster secret.

The owner (server) sends a nonce; the initiator proves it holds the secret by an HMAC over
both nonces, and the owner proves it back, so neither side moves KV blocks for, or to, a peer
outside the cluster. Without a secret on either side the handshake still runs (versioning)
but proves nothing, as before; a secret on one side only is refused with a clear reason.
The owner's reply also names its shared-memory probe (`shm.ShmProbe`), so the initiator can
find out whether the two share /dev/shm by reading it back (`shm.ShmProofs`).
"""

from __future__ import annotations

import hmac
import logging
import socket

from tandem.errors import TransferError
from tandem.runtime.secret import client_proof, key_for, new_nonce, server_proof
from tandem.transfer.wire import (
    HANDSHAKE_MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Auth,
    AuthReply,
    Hello,
    recv_frame,
    send_frame,
)

logger = logging.getLogger(__name__)
PURPOSE = f"transfer-agent/v{PROTOCOL_VERSION}"


def transfer_key(secret: str | None) -> bytes | None:
    return key_for(secret, PURPOSE) if secret else None


def accept(
    conn: socket.socket, key: bytes | None, peer: str, probe: tuple[str, bytes] = ("", b"")
) -> bool:
    """Owner side: True when the peer may go on; False after refusing it (told why, logged).
    `probe` (segment name, token digest) goes to an authenticated peer only."""
    nonce = new_nonce()
    send_frame(conn, Hello(version=PROTOCOL_VERSION, nonce=nonce, auth_required=key is not None))
    auth = recv_frame(conn, HANDSHAKE_MAX_FRAME_BYTES)
    error = ""
    if not isinstance(auth, Auth):
        error = f"expected Auth (transfer protocol v{PROTOCOL_VERSION}), got {type(auth).__name__}"
    elif auth.version != PROTOCOL_VERSION:
        error = f"peer speaks transfer protocol v{auth.version}, this agent v{PROTOCOL_VERSION}"
    elif key is not None and not hmac.compare_digest(
        auth.proof, client_proof(key, nonce, auth.nonce)
    ):
        error = "authentication failed: the peer has no or the wrong cluster secret"
    if error:
        logger.warning("transfer agent refused a connection from %s: %s", peer, error)
        send_frame(conn, AuthReply(error=error))
        return False
    assert isinstance(auth, Auth)
    proof = server_proof(key, nonce, auth.nonce) if key else b""
    send_frame(conn, AuthReply(proof=proof, shm_probe=probe[0], shm_digest=probe[1]))
    return True


def connect(sock: socket.socket, key: bytes | None) -> tuple[str, bytes]:
    """Initiator side; raises TransferError when either side cannot prove the secret. Returns
    the owner's shared-memory probe (segment name, token digest; empty when it has none)."""
    hello = recv_frame(sock, HANDSHAKE_MAX_FRAME_BYTES)
    if not isinstance(hello, Hello) or hello.version != PROTOCOL_VERSION:
        raise TransferError(
            f"peer does not speak transfer protocol v{PROTOCOL_VERSION}: {type(hello).__name__}"
        )
    if key is not None and not hello.auth_required:
        raise TransferError(
            "peer agent does not authenticate (it has no cluster secret) but this one has"
        )
    nonce = new_nonce()
    proof = client_proof(key, hello.nonce, nonce) if key else b""
    send_frame(sock, Auth(version=PROTOCOL_VERSION, nonce=nonce, proof=proof))
    reply = recv_frame(sock, HANDSHAKE_MAX_FRAME_BYTES)
    if not isinstance(reply, AuthReply):
        raise TransferError(f"unexpected handshake reply {type(reply).__name__}")
    if reply.error:
        raise TransferError(f"peer refused the connection: {reply.error}")
    if key is not None and not hmac.compare_digest(
        reply.proof, server_proof(key, hello.nonce, nonce)
    ):
        raise TransferError("peer agent failed to prove it holds the cluster secret")
    return reply.shm_probe, reply.shm_digest
