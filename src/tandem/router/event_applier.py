"""`EventApplier`: applies `KvEventBatch`es to a `KvIndexer` in event-id order.

Synchronous core of KV event ingestion. It tracks the last applied event id per
(worker, dp_rank) and classifies each batch: applied, duplicate (already seen), gap (ids
missing: the caller asks the worker to replay), or unsynced (a worker never synced: the
caller asks for its whole block set)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from tandem.protocols.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from tandem.router.indexer import KvIndexer, WorkerKey
from tandem.router.metrics import RouterMetrics

BatchStatus = Literal["applied", "duplicate", "gap", "unsynced"]


class EventApplier:
    """Not thread-safe. `synced` workers accept their next batch as a baseline even when
    no event id is known yet (a full sync that returned no blocks carries no id)."""

    def __init__(self, indexer: KvIndexer, metrics: RouterMetrics | None = None) -> None:
        self.indexer = indexer
        self.metrics = metrics or RouterMetrics()
        self.last_event_id: dict[WorkerKey, int] = {}
        self.synced: set[str] = set()

    def check(self, batch: KvEventBatch) -> BatchStatus | None:
        """The status `apply` would return without applying, or None if it would apply."""
        last = self.last_event_id.get(WorkerKey(batch.worker_id, batch.dp_rank))
        if last is None:
            return None if batch.worker_id in self.synced else "unsynced"
        if batch.event_id <= last:
            return "duplicate"
        if batch.event_id > last + 1:
            return "gap"
        return None

    def apply(self, batch: KvEventBatch) -> BatchStatus:
        status = self.check(batch)
        if status is not None:
            self.metrics.events[("batch", status)] += 1
            return status
        self._apply_events(batch)
        self.metrics.events[("batch", "applied")] += 1
        return "applied"

    def _apply_events(self, batch: KvEventBatch) -> None:
        key = WorkerKey(batch.worker_id, batch.dp_rank)
        counts = self.metrics.events
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self.indexer.store(key, ev.block_hashes, ev.medium, ev.engine_block_hashes)
                counts[("stored", "applied")] += 1
            elif isinstance(ev, BlockRemoved):
                self.indexer.remove(key, ev.block_hashes, ev.medium)
                counts[("removed", "applied")] += 1
            elif isinstance(ev, AllBlocksCleared):
                self.indexer.clear(key, ev.medium)
                counts[("cleared", "applied")] += 1
        self.last_event_id[key] = max(batch.event_id, self.last_event_id.get(key, -1))

    def apply_full_state(self, worker_id: str, batches: Sequence[KvEventBatch]) -> None:
        """Replace everything known about `worker_id` with `batches` (its whole block set);
        the highest event id per rank becomes the baseline."""
        self.forget_worker(worker_id)
        for batch in batches:
            if batch.worker_id == worker_id:
                self._apply_events(batch)
        self.synced.add(worker_id)
        self.metrics.events[("full_state", "applied")] += 1

    def apply_replay(self, batches: Sequence[KvEventBatch]) -> int:
        """Apply replayed batches in order (duplicates skipped); returns how many applied."""
        applied = 0
        for batch in batches:
            if self.check(batch) is None:
                self._apply_events(batch)
                applied += 1
        self.metrics.events[("replay", "applied")] += 1
        return applied

    def forget_worker(self, worker_id: str) -> None:
        self.indexer.remove_worker(worker_id)
        self.synced.discard(worker_id)
        for key in [k for k in self.last_event_id if k.worker_id == worker_id]:
            del self.last_event_id[key]

    @staticmethod
    def is_replay_of(batches: Sequence[KvEventBatch], after_event_id: int | None) -> bool:
        """A kv_state reply is a replay when it starts right after `after_event_id`;
        otherwise (None asked, or the worker's buffer no longer covered it) a full dump."""
        if after_event_id is None:
            return False
        return not batches or batches[0].event_id == after_event_id + 1
