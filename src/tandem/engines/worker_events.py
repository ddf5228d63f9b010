"""KV event publishing for a Worker: per-worker event ids, a bounded replay buffer, and the
replies of the `kv_state` endpoint (DESIGN.md §6)."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

from tandem.protocols.kv_events import AllBlocksCleared, KvEvent, KvEventBatch, encode
from tandem.runtime.base import EventBus

logger = logging.getLogger(__name__)


DEFAULT_BUFFER_BYTES = 1 << 20


class KvEventPublisher:
    """Wraps each list of engine KV events in a `KvEventBatch` (event_id + 1 per batch,
    starting at 1), keeps the last batches for replay and publishes them on `subject`.
    A failed publish is logged; the batch stays replayable. One publishing task only.

    The replay buffer holds at most `buffer_size` batches AND `buffer_bytes` bytes: batches
    are kept encoded (a BlockStored's token ids as msgpack, ~2 bytes per token instead of
    ~36 for a Python int), and a count bound alone let it grow to tens of MB when batches
    are large. A router that asks for more than is buffered gets the full state instead."""

    def __init__(
        self,
        events: EventBus,
        subject: str,
        worker_id: str,
        *,
        buffer_size: int,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._bus = events
        self.subject = subject
        self.worker_id = worker_id
        self.event_id = 0  # id of the last batch published; 0 = none yet
        self._max_batches, self._max_bytes = buffer_size, buffer_bytes
        self._buffer: deque[bytes] = deque()  # encoded batches, event ids consecutive
        self.num_buffered_bytes = 0
        self._clock = clock

    async def publish(self, events: list[KvEvent]) -> KvEventBatch:
        self.event_id += 1
        batch = KvEventBatch(
            worker_id=self.worker_id,
            event_id=self.event_id,
            timestamp_s=self._clock(),
            events=events,
        )
        payload = encode(batch)
        self._remember(payload)
        try:
            await self._bus.publish(self.subject, payload)
        except Exception:  # the event plane being down must not stop the worker
            logger.warning(
                "publishing kv event_id=%d on %s failed",
                batch.event_id,
                self.subject,
                exc_info=True,
            )
        return batch

    def _remember(self, payload: bytes) -> None:
        self._buffer.append(payload)
        self.num_buffered_bytes += len(payload)
        while len(self._buffer) > self._max_batches or (
            self.num_buffered_bytes > self._max_bytes and len(self._buffer) > 1
        ):
            self.num_buffered_bytes -= len(self._buffer.popleft())

    @property
    def num_buffered(self) -> int:
        return len(self._buffer)

    def can_replay_after(self, after_event_id: int) -> bool:
        """True when every batch after `after_event_id` is still buffered."""
        if after_event_id > self.event_id or after_event_id < 0:
            return False
        return self.event_id - after_event_id <= len(self._buffer)

    def state_reply(
        self, after_event_id: int | None, snapshot: Callable[[], list[KvEvent]]
    ) -> list[bytes]:
        """Encoded batches after `after_event_id` when buffered (possibly none); otherwise
        one batch holding the whole block set: AllBlocksCleared then BlockStored per cached
        chain, carrying the current event id (later batches continue from it)."""
        if after_event_id is not None and self.can_replay_after(after_event_id):
            skip = len(self._buffer) - (self.event_id - after_event_id)
            return list(self._buffer)[skip:]
        events: list[KvEvent] = [AllBlocksCleared(), *snapshot()]
        batch = KvEventBatch(
            worker_id=self.worker_id,
            event_id=self.event_id,
            timestamp_s=self._clock(),
            events=events,
        )
        return [encode(batch)]
