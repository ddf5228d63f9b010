"""`ReplicaSync`: routers of several frontends share their active-request bookkeeping (add,
prefill done, free) on `{ns}.router.sync`, so they do not all pick the same idle worker.

A router that starts (or restarts) says `hello`; every peer answers by announcing its own active
requests again, so the newcomer's view of the in-flight load catches up instead of starting
empty. The KV view needs no sync: each router follows the workers' KV events and asks a worker
it meets for its whole block set."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Literal

import msgspec

from tandem.router.active_sequences import ActiveSequences
from tandem.router.source import EventSource
from tandem.runtime.task import cancel_and_wait

logger = logging.getLogger(__name__)

MAX_PENDING = 10_000


class SyncMsg(msgspec.Struct, kw_only=True, omit_defaults=True):
    version: int = 1
    router_id: str
    kind: Literal["add", "prefilled", "free", "hello"]
    request_id: str
    worker_id: str = ""
    block_hashes: list[int] = msgspec.field(default_factory=list)
    num_prefill_tokens: int = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SyncMsg)


class Outbox:
    """What a router tells its peers, sent in order by one task: a bounded queue whose oldest
    message is dropped when full (peers recover what they miss by TTL). One event loop."""

    def __init__(self, events: EventSource, subject: str, max_pending: int) -> None:
        self._events, self._subject = events, subject
        self._pending: asyncio.Queue[bytes] = asyncio.Queue(max_pending)

    def put(self, payload: bytes) -> None:
        if self._pending.full():
            self._pending.get_nowait()
        self._pending.put_nowait(payload)

    async def send_forever(self, what: str) -> None:
        while True:
            payload = await self._pending.get()
            try:
                await self._events.publish(self._subject, payload)
            except Exception:
                logger.warning("%s publish failed", what, exc_info=True)


class ReplicaSync:
    """Publishes this router's changes (bounded queue, oldest dropped) and applies the
    others' to `active` under ids `router_id/request_id`. One event loop."""

    def __init__(
        self,
        active: ActiveSequences,
        events: EventSource,
        subject: str,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        self.router_id = uuid.uuid4().hex[:12]
        self._active = active
        self._events = events
        self._subject = subject
        self._on_change = on_change
        self._outbox = Outbox(events, subject, MAX_PENDING)
        self._tasks: list[asyncio.Task[None]] = []
        self.num_applied = 0

    async def start(self) -> None:
        sub = await self._events.subscribe(self._subject)
        self._tasks.append(asyncio.create_task(self._receive(sub), name="router-sync-in"))
        out = self._outbox.send_forever("router sync")
        self._tasks.append(asyncio.create_task(out, name="router-sync-out"))
        self.publish("hello", "")

    def publish(self, msg_kind: str, request_id: str, **fields: object) -> None:
        msg = SyncMsg(router_id=self.router_id, kind=msg_kind, request_id=request_id, **fields)  # type: ignore[arg-type]
        self._outbox.put(_encoder.encode(msg))  # peers sweep what they miss by TTL

    async def _receive(self, sub: object) -> None:
        try:
            async for _subject, payload in sub:  # type: ignore[attr-defined]
                try:
                    self.apply(_decoder.decode(payload))
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    logger.warning("dropping malformed router sync message: %s", exc)
        finally:
            await sub.close()  # type: ignore[attr-defined]

    def apply(self, msg: SyncMsg) -> None:
        if msg.router_id == self.router_id:
            return
        rid = f"{msg.router_id}/{msg.request_id}"
        if msg.kind == "hello":
            self._announce_own()
            return
        if msg.kind == "add":
            self._active.add(rid, msg.worker_id, msg.block_hashes, msg.num_prefill_tokens)
        elif msg.kind == "prefilled":
            self._active.mark_prefilled(rid)
        else:
            self._active.free(rid)
        self.num_applied += 1
        if self._on_change is not None:
            self._on_change()

    def _announce_own(self) -> None:
        """Publish this router's own active requests (peers' entries carry a `router/` prefix)
        for a replica that just joined."""
        for rid, worker_id, hashes, num_prefill, is_prefilled in self._active.snapshot():
            if "/" in rid:
                continue
            self.publish("add", rid, worker_id=worker_id, block_hashes=list(hashes),
                         num_prefill_tokens=num_prefill)  # fmt: skip
            if is_prefilled:
                self.publish("prefilled", rid)

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks.clear()
