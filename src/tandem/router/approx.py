"""`ApproxCache`: approximate mode (`--no-kv-events`). The router predicts each worker's cache
from its own decisions: a routed prompt's blocks count as cached there for `ttl_s` (refreshed
when routed again), and at most `max_blocks` per worker are kept (oldest pruned first)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from tandem.router.indexer import KvIndexer, WorkerKey


class ApproxCache:
    """Writes into `indexer` (which it then owns). Synchronous; injectable clock."""

    def __init__(
        self, indexer: KvIndexer, *, ttl_s: float, max_blocks: int, clock: Callable[[], float]
    ) -> None:
        self.indexer = indexer
        self._ttl_s = ttl_s
        self._max_blocks = max_blocks
        self._clock = clock
        self._expiry: dict[str, OrderedDict[int, float]] = {}  # oldest first
        self.num_pruned = 0
        self.num_expired = 0

    def record(self, worker_id: str, block_hashes: Sequence[int]) -> None:
        """The request's blocks are (about to be) cached on `worker_id`."""
        expires = self._clock() + self._ttl_s
        entries = self._expiry.setdefault(worker_id, OrderedDict())
        for h in block_hashes:
            entries[h] = expires
            entries.move_to_end(h)
        self.indexer.store(WorkerKey(worker_id), block_hashes)
        excess = len(entries) - self._max_blocks
        if excess > 0:
            victims = [entries.popitem(last=False)[0] for _ in range(excess)]
            self.indexer.remove(WorkerKey(worker_id), victims)
            self.num_pruned += excess

    def expire(self) -> int:
        """Drop blocks whose TTL passed; returns how many."""
        now = self._clock()
        dropped = 0
        for worker_id, entries in self._expiry.items():
            victims = []
            while entries:
                h, expires = next(iter(entries.items()))
                if expires > now:
                    break
                entries.popitem(last=False)
                victims.append(h)
            if victims:
                self.indexer.remove(WorkerKey(worker_id), victims)
                dropped += len(victims)
        self.num_expired += dropped
        return dropped

    def forget_worker(self, worker_id: str) -> None:
        self._expiry.pop(worker_id, None)
