"""NATS event bus (core NATS via nats-py) against a running `nats-server`.

With a cluster secret every payload is encrypted and tagged (`envelope.py`, version 2) and
each subscription drops what does not verify: the NATS server may run without auth, so anyone
who can reach it could otherwise read prompts from KV events' token ids and publish KV events
and load metrics in a worker's name. NATS's own access control (`NatsAuth`: user/password,
token, a .creds file or an nkey seed; TLS with a CA and client certificate) decides who may
connect, publish and subscribe at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import ssl
from dataclasses import dataclass, field
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from tandem.runtime.events.envelope import EventOpener, EventSealer
from tandem.runtime.events.subject import validate_pattern, validate_subject
from tandem.runtime.events.subscription import BufferedSubscription
from tandem.runtime.task import cancel_and_wait

logger = logging.getLogger(__name__)
FIRST_CONNECT_TRIES = 3  # connect timeouts the first connect may take before it fails


class NatsConnectError(ConnectionError):
    """The NATS server cannot be reached or refused this client (credentials, TLS)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class NatsAuth:
    """How this client proves itself to nats-server: at most one of user/password, token,
    a credentials file (.creds) or an nkey seed file; TLS (tls:// URLs) with the CA that
    signed the server's certificate and, where the server verifies clients, a certificate."""

    user: str | None = None
    password: str | None = field(default=None, repr=False)
    token: str | None = field(default=None, repr=False)
    creds_file: str | None = None
    nkey_seed_file: str | None = None
    ca_file: str | None = None
    cert_file: str | None = None
    key_file: str | None = None

    def connect_options(self) -> dict[str, Any]:
        """nats.connect keyword arguments for these credentials."""
        options: dict[str, Any] = {}
        if self.user is not None:
            options.update(user=self.user, password=self.password)
        if self.token is not None:
            options["token"] = self.token
        if self.creds_file is not None:
            options["user_credentials"] = self.creds_file
        if self.nkey_seed_file is not None:
            options["nkeys_seed"] = self.nkey_seed_file
        if self.ca_file is not None or self.cert_file is not None:
            ctx = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file is not None:
                ctx.load_cert_chain(self.cert_file, self.key_file)
            options["tls"] = ctx
        return options

    def describe(self) -> str:
        given = [name for name in ("user", "token", "creds_file", "nkey_seed_file", "ca_file",
                                   "cert_file") if getattr(self, name) is not None]  # fmt: skip
        return (
            "with " + ", ".join(f"--nats-{n.replace('_', '-')}" for n in given)
            if given
            else ("without credentials or TLS options")
        )


class NatsEventBus:
    """Implements `EventBus`. Connects lazily on first use (`connect_timeout_s`) and
    reconnects on its own; subjects and wildcards are NATS's own."""

    error: str | None = None  # the client reconnects on its own: nothing to report

    def __init__(
        self,
        url: str,
        *,
        buffer_size: int = 10_000,
        connect_timeout_s: float = 5.0,
        secret: str | None = None,
        auth: NatsAuth | None = None,
    ) -> None:
        self.url, self._buffer_size, self._timeout = url, buffer_size, connect_timeout_s
        self._secret, self._auth = secret, auth or NatsAuth()
        self._sealer = EventSealer(secret, encrypt=True) if secret else None
        self.num_rejected = 0
        self._nc: Client | None = None
        self._subs: dict[BufferedSubscription, Any] = {}

    async def _client(self) -> Client:
        if self._nc is None:
            self._nc = await self._connect()
        return self._nc

    async def _connect(self) -> Client:
        """A connected client; raises NatsConnectError naming the URL, the options used and
        the server's reason at once when the server refuses this client (authorization, TLS),
        else after `FIRST_CONNECT_TRIES` connect timeouts (nats-py would retry forever)."""
        errors: list[Exception] = []
        refused = asyncio.Event()

        async def on_error(exc: Exception) -> None:
            if len(errors) < 4:  # the first reasons are what the error reports
                errors.append(exc)
            if _is_refusal(exc):
                refused.set()
            await _log_error(exc)

        nc = Client()
        connect = asyncio.create_task(
            nc.connect(
                self.url,
                connect_timeout=max(1, math.ceil(self._timeout)),
                max_reconnect_attempts=-1,
                name="tandem",
                error_cb=on_error,
                **self._auth.connect_options(),
            )
        )
        refusal = asyncio.create_task(refused.wait())
        await asyncio.wait(
            [connect, refusal],
            timeout=self._timeout * FIRST_CONNECT_TRIES,
            return_when=asyncio.FIRST_COMPLETED,
        )
        refusal.cancel()
        if connect.done() and connect.exception() is None:
            return nc
        await cancel_and_wait([connect])
        with contextlib.suppress(Exception):
            await nc.close()
        reasons = "; ".join(dict.fromkeys(repr(e) for e in errors)) or "timed out"
        raise NatsConnectError(
            f"cannot connect to NATS at {self.url} {self._auth.describe()}: {reasons}"
        )

    async def publish(self, subject: str, payload: bytes) -> None:
        validate_subject(subject)
        if self._sealer is not None:
            payload = self._sealer.seal(subject, payload)
        await (await self._client()).publish(subject, payload)

    async def subscribe(self, subject: str) -> BufferedSubscription:
        validate_pattern(subject)
        sub = BufferedSubscription(subject, self._buffer_size, on_close=self._unsubscribe)
        # one per subscription: NATS hands every subscription its own copy of a message
        opener = EventOpener(self._secret) if self._secret else None

        async def deliver(msg: Msg) -> None:
            payload: bytes | None = msg.data
            if opener is not None:
                before = opener.num_rejected
                payload = opener.open(msg.subject, msg.data)
                self.num_rejected += opener.num_rejected - before
            if payload is not None:
                sub.push(msg.subject, payload)

        nc = await self._client()
        self._subs[sub] = await nc.subscribe(subject, cb=deliver)
        # on return the server knows the interest: later publishes reach this subscription
        await nc.flush(timeout=max(1, round(self._timeout)))
        return sub

    async def _unsubscribe(self, sub: BufferedSubscription) -> None:
        nsub = self._subs.pop(sub, None)
        if nsub is not None and self._nc is not None and not self._nc.is_closed:
            await nsub.unsubscribe()

    async def close(self) -> None:
        for sub in list(self._subs):
            await sub.close()
        if self._nc is not None:
            await self._nc.close()
            self._nc = None


def _is_refusal(exc: Exception) -> bool:
    """The server refused this client (credentials, certificates): retrying cannot help."""
    return isinstance(exc, ssl.SSLError | nats.errors.AuthorizationError) or (
        "authorization" in str(exc).lower()
    )


async def _log_error(exc: Exception) -> None:
    logger.warning("nats: %r", exc)
