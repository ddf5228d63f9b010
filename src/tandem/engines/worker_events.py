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


class KvEventPublisher:
    """Wraps each list of engine KV events in a `KvEventBatch` (event_id + 1 per batch,
    starting at 1), keeps the last `buffer_size` batches and publishes them on `subject`.
    A failed publish is logged; the batch stays replayable. One publishing task only."""

    def __init__(
        self,
        events: EventBus,
        subject: str,
        worker_id: str,
        *,
        buffer_size: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._bus = events
        self.subject = subject
        self.worker_id = worker_id
        self.event_id = 0  # id of the last batch published; 0 = none yet
        self._buffer: deque[KvEventBatch] = deque(maxlen=buffer_size)
        self._clock = clock

    async def publish(self, events: list[KvEvent]) -> KvEventBatch:
        self.event_id += 1
        batch = KvEventBatch(
            worker_id=self.worker_id,
            event_id=self.event_id,
            timestamp_s=self._clock(),
            events=events,
        )
        self._buffer.append(batch)
        try:
            await self._bus.publish(self.subject, encode(batch))
        except Exception:  # the event plane being down must not stop the worker
            logger.warning(
                "publishing kv event_id=%d on %s failed",
                batch.event_id,
                self.subject,
                exc_info=True,
            )
        return batch

    def can_replay_after(self, after_event_id: int) -> bool:
        """True when every batch after `after_event_id` is still buffered."""
        if after_event_id > self.event_id or after_event_id < 0:
            return False
        if after_event_id == self.event_id:
            return True
        return bool(self._buffer) and self._buffer[0].event_id <= after_event_id + 1

    def state_reply(
        self, after_event_id: int | None, snapshot: Callable[[], list[KvEvent]]
    ) -> list[KvEventBatch]:
        """Batches after `after_event_id` when buffered (possibly none); otherwise one batch
        holding the whole block set: AllBlocksCleared then BlockStored per cached chain,
        carrying the current event id (later batches continue from it)."""
        if after_event_id is not None and self.can_replay_after(after_event_id):
            skip = len(self._buffer) - (self.event_id - after_event_id)
            return list(self._buffer)[skip:]
        events: list[KvEvent] = [AllBlocksCleared(), *snapshot()]
        return [
            KvEventBatch(
                worker_id=self.worker_id,
                event_id=self.event_id,
                timestamp_s=self._clock(),
                events=events,
            )
        ]
