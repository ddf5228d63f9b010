"""ZMQ CURVE for the event bus, with keys derived from the cluster secret.

Every publisher is a CURVE server with the same derived key pair, every subscriber a CURVE
client with another; a ZAP handler on each publisher admits only the derived client key. So a
process without the secret can neither read a publisher's events (KV events carry prompt
token ids) nor pose as a publisher (the subscriber checks the server key in the handshake).
The per-message tags of `envelope.py` stay on top: they are what NATS relies on, and they
catch a peer that holds the keys but replays old messages.
"""

from __future__ import annotations

import hmac
import logging
from typing import NamedTuple

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

from tandem.runtime.secret import key_for

logger = logging.getLogger(__name__)
ZAP_DOMAIN = "tandem-events"


class CurveKeys(NamedTuple):
    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes


def curve_keys(secret: str) -> CurveKeys:
    server_secret = z85.encode(key_for(secret, "event-plane/zmq-curve/server"))
    client_secret = z85.encode(key_for(secret, "event-plane/zmq-curve/client"))
    return CurveKeys(
        zmq.curve_public(server_secret), server_secret,
        zmq.curve_public(client_secret), client_secret,
    )  # fmt: skip


class _OnlyClientKey:
    """ZAP credentials provider: the derived client key, nothing else."""

    def __init__(self, client_public: bytes) -> None:
        self.client_public = client_public
        self.num_denied = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if hmac.compare_digest(key, self.client_public):
            return True
        self.num_denied += 1
        level = logging.WARNING if self.num_denied == 1 else logging.DEBUG
        logger.log(level, "refused an event-plane subscriber without the cluster secret "
                   "(%d refused so far)", self.num_denied)  # fmt: skip
        return False


def start_authenticator(ctx: zmq.asyncio.Context, keys: CurveKeys) -> AsyncioAuthenticator:
    auth = AsyncioAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback(ZAP_DOMAIN, _OnlyClientKey(keys.client_public))
    return auth


def make_server(sock: zmq.asyncio.Socket, keys: CurveKeys) -> None:
    """Before bind: this socket speaks CURVE as the server and asks ZAP about each client."""
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.server_secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_SERVER, 1)


def make_client(sock: zmq.asyncio.Socket, keys: CurveKeys) -> None:
    """Before connect: this socket only completes a handshake with a server holding the keys."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
