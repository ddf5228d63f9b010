"""Session affinity (issue 33): a conversation's requests (same `PreprocessedRequest.session_id`)
go to the worker that served its last turn, so an agent's turns reuse their KV, for
`RouterConfig.session_ttl_s` after the last one. A bound worker that is busy (the KV router's
thresholds) or carries `session_slack` more requests in flight than the least loaded candidate
is passed over: the request is routed as any other and the binding moves (a rebind).

`SessionTable` is the synchronous core (bounded: the least recently used binding goes first);
`SessionSync` shares bindings between router replicas on `{ns}.router.sessions` (event plane:
memory in one process, ZMQ or NATS across frontends), so a session's next turn finds its
worker whichever frontend it reaches."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable

import msgspec

from tandem.router.source import EventSource
from tandem.router.sync import Outbox
from tandem.runtime.base import Subscription

logger = logging.getLogger(__name__)

MAX_SESSIONS = 100_000
MAX_PENDING = 1024


class SessionMsg(msgspec.Struct, kw_only=True):
    """One binding, as replicas share it. `expires_s`: wall clock (time.time())."""

    version: int = 1
    router_id: str
    session_id: str
    worker_id: str
    expires_s: float


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SessionMsg)


class SessionTable:
    """session id -> (worker id, expiry). Not thread-safe; one event loop."""

    def __init__(self, *, ttl_s: float, max_sessions: int = MAX_SESSIONS) -> None:
        self.ttl_s = ttl_s
        self.max_sessions = max_sessions
        self._bound: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self.num_rebinds = 0
        self.num_hits = 0

    def __len__(self) -> int:
        return len(self._bound)

    def get(self, session_id: str, now_s: float) -> str | None:
        """The bound worker, or None (never bound, or expired: then forgotten)."""
        entry = self._bound.get(session_id)
        if entry is None:
            return None
        if entry[1] <= now_s:
            del self._bound[session_id]
            return None
        return entry[0]

    def bind(self, session_id: str, worker_id: str, now_s: float) -> bool:
        """Bind (or refresh) `session_id` to `worker_id` until now + ttl; True when it moved
        from another live worker (a rebind)."""
        previous = self.get(session_id, now_s)
        moved = previous is not None and previous != worker_id
        if moved:
            self.num_rebinds += 1
        self.apply(session_id, worker_id, now_s + self.ttl_s)
        return moved

    def apply(self, session_id: str, worker_id: str, expires_s: float) -> None:
        """Set a binding (a replica's); evicts the least recently used past the cap."""
        self._bound[session_id] = (worker_id, expires_s)
        self._bound.move_to_end(session_id)
        while len(self._bound) > self.max_sessions:
            self._bound.popitem(last=False)

    def forget_worker(self, worker_id: str) -> None:
        """Drop the bindings to a worker that left."""
        for sid in [s for s, (w, _) in self._bound.items() if w == worker_id]:
            del self._bound[sid]


class SessionSync:
    """Publishes this router's bindings and applies the other replicas'. One event loop."""

    def __init__(
        self,
        table: SessionTable,
        events: EventSource,
        subject: str,
        *,
        router_clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`router_clock`: the time base of `table`'s expiries (the router's clock); the
        wire carries wall-clock expiries."""
        self.router_id = uuid.uuid4().hex[:12]
        self._table, self._events, self._subject = table, events, subject
        self._router_clock = router_clock
        self._outbox = Outbox(events, subject, MAX_PENDING)
        self._tasks: list[asyncio.Task[None]] = []
        self.num_applied = 0

    async def start(self) -> None:
        sub = await self._events.subscribe(self._subject)
        self._tasks.append(asyncio.create_task(self._receive(sub), name="router-sessions-in"))
        out = self._outbox.send_forever("router session")
        self._tasks.append(asyncio.create_task(out, name="router-sessions-out"))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()

    def publish(self, session_id: str, worker_id: str) -> None:
        msg = SessionMsg(
            router_id=self.router_id,
            session_id=session_id,
            worker_id=worker_id,
            expires_s=time.time() + self._table.ttl_s,
        )
        self._outbox.put(_encoder.encode(msg))  # a lost binding costs one turn's cache, no more

    async def _receive(self, sub: Subscription) -> None:
        try:
            async for _subject, payload in sub:
                try:
                    msg = _decoder.decode(payload)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    logger.warning("dropping malformed router session message: %s", exc)
                    continue
                if msg.router_id != self.router_id:
                    remaining = msg.expires_s - time.time()
                    expires = self._router_clock() + remaining
                    self._table.apply(msg.session_id, msg.worker_id, expires)
                    self.num_applied += 1
        finally:
            await sub.close()
