"""`KvEventFollower`: the async edge of KV event ingestion.

Reads `{ns}.{component}.kv_events` from the event plane, feeds an `EventApplier`, and on a
gap (or a worker never synced) asks that worker's `{ns}.{component}.kv_state` endpoint for a
replay (or its whole block set). Batches that arrive while a worker is being synced are
buffered (bounded) and applied afterwards, so nothing is lost in between."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

import msgspec

from tandem.protocols.kv_events import KvEventBatch, KvStateRequest, decode_batch, encode
from tandem.router.event_applier import EventApplier
from tandem.router.indexer import WorkerKey
from tandem.router.source import EventSource, InstanceSource
from tandem.runtime.base import RequestClient, Subscription

logger = logging.getLogger(__name__)

MAX_BUFFERED_BATCHES = 10_000
RETRY_INTERVAL_S = 1.0
# a worker's reported KV event id may run ahead of the batches in flight on the event plane;
# only a lag that outlives this is taken for a lost batch
BEHIND_GRACE_S = 0.5


class KvEventFollower:
    """Owns its tasks; `start` subscribes and syncs every known worker, `close` stops."""

    def __init__(
        self,
        applier: EventApplier,
        *,
        events: EventSource,
        client: RequestClient | None,
        instances: InstanceSource,
        subject_prefix: str,
        timeout_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.applier = applier
        self._events = events
        self._client = client
        self._instances = instances
        self._prefix = subject_prefix  # "{ns}.{component}"
        self._timeout_s = timeout_s
        self._clock = clock
        self._syncing: dict[str, list[KvEventBatch]] = {}
        self._last_try_s: dict[str, float] = {}
        self._behind_since_s: dict[WorkerKey, float] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._reader: asyncio.Task[None] | None = None
        self.synced = asyncio.Event()  # set whenever no sync is in flight

    async def start(self) -> None:
        sub = await self._events.subscribe(f"{self._prefix}.kv_events")
        self._reader = asyncio.create_task(self._read(sub), name="router-kv-events")
        for worker_id in sorted(self._instances.instances):
            self.request_sync(worker_id, None)
        if not self._syncing:
            self.synced.set()

    async def _read(self, sub: Subscription) -> None:
        try:
            async for _subject, payload in sub:
                try:
                    batch = decode_batch(payload)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    self.applier.metrics.events[("batch", "malformed")] += 1
                    logger.warning("dropping malformed KV event batch: %s", exc)
                    continue
                self.on_batch(batch)
        finally:
            await sub.close()

    def on_batch(self, batch: KvEventBatch) -> None:
        worker_id = batch.worker_id
        if worker_id not in self._instances.instances:
            self.applier.metrics.events[("batch", "unknown_worker")] += 1
            return
        buffered = self._syncing.get(worker_id)
        if buffered is not None:
            if len(buffered) < MAX_BUFFERED_BATCHES:
                buffered.append(batch)
            return
        status = self.applier.apply(batch)
        if status == "gap":
            last = self.applier.last_event_id.get(WorkerKey(worker_id, batch.dp_rank))
            self.request_sync(worker_id, last, first=batch)
        elif status == "unsynced":
            self.request_sync(worker_id, None, first=batch)

    def request_sync(
        self, worker_id: str, after_event_id: int | None, first: KvEventBatch | None = None
    ) -> None:
        """Ask the worker for events after `after_event_id` (None: its whole block set)."""
        if worker_id in self._syncing:
            return
        now = self._clock()
        if now - self._last_try_s.get(worker_id, -RETRY_INTERVAL_S) < RETRY_INTERVAL_S:
            return  # a failed sync retried at most once a second, on the next batch
        self._last_try_s[worker_id] = now
        self._syncing[worker_id] = [first] if first is not None else []
        self.synced.clear()
        task = asyncio.create_task(self._sync(worker_id, after_event_id), name="router-kv-sync")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def check_event_id(self, worker_id: str, dp_rank: int, event_id: int) -> None:
        """A worker reported (with its load metrics) that its last KV batch is `event_id`.

        A lost batch is found by the gap before the next one; a lost *last* batch has no next
        one, so the index would stay stale until the worker stores again. When the applied id
        stays behind the reported one for longer than BEHIND_GRACE_S, replay from it."""
        key = WorkerKey(worker_id, dp_rank)
        last = self.applier.last_event_id.get(key)
        if (
            worker_id in self._syncing
            or worker_id not in self.applier.synced
            or (last is not None and last >= event_id)
        ):
            self._behind_since_s.pop(key, None)
            return
        now = self._clock()
        since = self._behind_since_s.setdefault(key, now)
        if now - since >= BEHIND_GRACE_S:
            del self._behind_since_s[key]
            self.applier.metrics.events[("batch", "lost_tail")] += 1
            self.request_sync(worker_id, last)

    def forget_worker(self, worker_id: str) -> None:
        self._syncing.pop(worker_id, None)
        for key in [k for k in self._behind_since_s if k.worker_id == worker_id]:
            del self._behind_since_s[key]
        self._last_try_s.pop(worker_id, None)
        self.applier.forget_worker(worker_id)
        self._maybe_synced()

    async def _sync(self, worker_id: str, after_event_id: int | None) -> None:
        batches: list[KvEventBatch] | None = None
        try:
            batches = await asyncio.wait_for(
                self._fetch(worker_id, after_event_id), timeout=self._timeout_s
            )
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self.applier.metrics.events[("sync", "failed")] += 1
            logger.warning("KV state sync of worker_id=%s failed: %r", worker_id, exc)
        buffered = self._syncing.pop(worker_id, None)
        if buffered is None:  # the worker left meanwhile
            self._maybe_synced()
            return
        if batches is not None:
            self._apply_sync(worker_id, after_event_id, batches)
            self._last_try_s.pop(worker_id, None)
        else:
            self._accept_loss(worker_id, buffered)
        for batch in buffered:
            self.on_batch(batch)
        self._maybe_synced()

    def _accept_loss(self, worker_id: str, buffered: list[KvEventBatch]) -> None:
        """A worker that cannot be synced (no kv_state endpoint, timeout) still feeds the
        index: its next batches count from here, the missed ones stay missed."""
        self.applier.synced.add(worker_id)
        if buffered:
            first = buffered[0]
            key = WorkerKey(worker_id, first.dp_rank)
            self.applier.last_event_id[key] = first.event_id - 1

    def _apply_sync(
        self, worker_id: str, after_event_id: int | None, batches: list[KvEventBatch]
    ) -> None:
        if EventApplier.is_replay_of(batches, after_event_id):
            self.applier.apply_replay(batches)
        else:
            self.applier.apply_full_state(worker_id, batches)
        logger.debug("synced worker_id=%s: %d batches", worker_id, len(batches))

    async def _fetch(self, worker_id: str, after_event_id: int | None) -> list[KvEventBatch]:
        instance = self._instances.instances.get(worker_id)
        if self._client is None:
            raise LookupError("no request client to ask workers for their KV state")
        if instance is None:
            raise LookupError(f"worker_id={worker_id} is not a live instance")
        payload = encode(KvStateRequest(after_event_id=after_event_id))
        out: list[KvEventBatch] = []
        async for chunk in self._client.stream(
            instance.address,
            f"{self._prefix}.kv_state",
            payload,
            request_id=f"kv-state-{uuid.uuid4().hex[:12]}",
            deadline_s=time.time() + self._timeout_s,
        ):
            out.append(decode_batch(chunk))
        return out

    def _maybe_synced(self) -> None:
        if not self._syncing:
            self.synced.set()

    async def close(self) -> None:
        tasks = [t for t in (self._reader, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:
                logger.debug("KV follower task ended with an error", exc_info=True)
