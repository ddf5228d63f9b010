"""NATS event bus (core NATS via nats-py) against a running `nats-server`.

With a cluster secret every payload is sealed (`envelope.py`) and each subscription drops
what does not verify: the NATS server may run without auth, so anyone who can reach it could
otherwise publish KV events and load metrics in a worker's name.
"""

from __future__ import annotations

import logging
from typing import Any

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg

from tandem.runtime.events.envelope import EventOpener, EventSealer
from tandem.runtime.events.subject import validate_pattern, validate_subject
from tandem.runtime.events.subscription import BufferedSubscription

logger = logging.getLogger(__name__)


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
    ) -> None:
        self.url, self._buffer_size, self._timeout = url, buffer_size, connect_timeout_s
        self._secret = secret
        self._sealer = EventSealer(secret) if secret else None
        self.num_rejected = 0
        self._nc: Client | None = None
        self._subs: dict[BufferedSubscription, Any] = {}

    async def _client(self) -> Client:
        if self._nc is None:
            self._nc = await nats.connect(
                self.url,
                connect_timeout=self._timeout,
                max_reconnect_attempts=-1,
                name="tandem",
                error_cb=_log_error,
            )
        return self._nc

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


async def _log_error(exc: Exception) -> None:
    logger.warning("nats: %r", exc)
