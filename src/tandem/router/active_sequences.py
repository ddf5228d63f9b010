"""`ActiveSequences`: per worker, the blocks of requests in flight (deduplicated) and the
prompt tokens still to prefill. Fed by the router's own decisions (and replica sync)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Request:
    worker_id: str
    block_hashes: tuple[int, ...]
    num_prefill_tokens: int
    started_s: float
    is_prefilled: bool = False


@dataclass(slots=True)
class _Worker:
    block_refs: dict[int, int] = field(default_factory=dict)
    num_prefill_tokens: int = 0
    num_requests: int = 0


class ActiveSequences:
    """Synchronous; one event loop. `add` on route, `mark_prefilled` on the first token,
    `free` on finish or cancel (idempotent). Entries older than `ttl_s` are dropped by
    `sweep` (a lost finish must not inflate a worker's load forever)."""

    def __init__(self, *, ttl_s: float, clock: Callable[[], float]) -> None:
        self._ttl_s = ttl_s
        self._clock = clock
        self._requests: dict[str, _Request] = {}
        self._workers: dict[str, _Worker] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(
        self,
        request_id: str,
        worker_id: str,
        block_hashes: Sequence[int],
        num_prefill_tokens: int,
    ) -> None:
        """Record a routed request; re-adding an id first frees the old entry."""
        self.free(request_id)
        req = _Request(worker_id, tuple(block_hashes), num_prefill_tokens, self._clock())
        self._requests[request_id] = req
        worker = self._workers.setdefault(worker_id, _Worker())
        refs = worker.block_refs
        for h in req.block_hashes:
            refs[h] = refs.get(h, 0) + 1
        worker.num_prefill_tokens += num_prefill_tokens
        worker.num_requests += 1

    def snapshot(self) -> list[tuple[str, str, tuple[int, ...], int, bool]]:
        """(request_id, worker_id, block_hashes, num_prefill_tokens, is_prefilled) of every
        entry, for a replica that joins late."""
        return [
            (rid, r.worker_id, r.block_hashes, r.num_prefill_tokens, r.is_prefilled)
            for rid, r in self._requests.items()
        ]

    def mark_prefilled(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            self._settle_prefill(req)

    def _settle_prefill(self, req: _Request) -> None:
        if not req.is_prefilled:
            req.is_prefilled = True
            self._workers[req.worker_id].num_prefill_tokens -= req.num_prefill_tokens

    def free(self, request_id: str) -> str | None:
        """Forget the request; returns its worker id (None if unknown)."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return None
        self._settle_prefill(req)
        worker = self._workers[req.worker_id]
        worker.num_requests -= 1
        refs = worker.block_refs
        for h in req.block_hashes:
            n = refs[h] - 1
            if n:
                refs[h] = n
            else:
                del refs[h]
        if not worker.num_requests:
            del self._workers[req.worker_id]
        return req.worker_id

    def sweep(self) -> list[str]:
        """Drop entries older than the TTL; returns their request ids."""
        cutoff = self._clock() - self._ttl_s
        stale = [rid for rid, r in self._requests.items() if r.started_s < cutoff]
        for rid in stale:
            self.free(rid)
        if stale:
            logger.warning(
                "swept %d stale active requests (no finish within %ss)", len(stale), self._ttl_s
            )
        return stale

    def remove_worker(self, worker_id: str) -> None:
        for rid in [rid for rid, r in self._requests.items() if r.worker_id == worker_id]:
            self.free(rid)

    def worker_of(self, request_id: str) -> str | None:
        req = self._requests.get(request_id)
        return None if req is None else req.worker_id

    def num_active_blocks(self, worker_id: str) -> int:
        worker = self._workers.get(worker_id)
        return 0 if worker is None else len(worker.block_refs)

    def num_prefill_tokens(self, worker_id: str) -> int:
        worker = self._workers.get(worker_id)
        return 0 if worker is None else worker.num_prefill_tokens

    def num_new_blocks(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """How many of `block_hashes` are not already active on the worker."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return len(block_hashes)
        refs = worker.block_refs
        return sum(1 for h in block_hashes if h not in refs)

    def prefix_depth(self, worker_id: str, block_hashes: Sequence[int]) -> int:
        """How many leading `block_hashes` requests in flight on the worker hold: blocks it
        is computing now, cached there once their prefill reaches them (chained hashes, so a
        leading run is a shared prefix)."""
        worker = self._workers.get(worker_id)
        if worker is None:
            return 0
        refs = worker.block_refs
        depth = 0
        for h in block_hashes:
            if h not in refs:
                break
            depth += 1
        return depth

    def num_requests(self, worker_id: str) -> int:
        worker = self._workers.get(worker_id)
        return 0 if worker is None else worker.num_requests

    def check_integrity(self) -> None:
        expect: dict[str, _Worker] = {}
        for r in self._requests.values():
            w = expect.setdefault(r.worker_id, _Worker())
            for h in r.block_hashes:
                w.block_refs[h] = w.block_refs.get(h, 0) + 1
            w.num_prefill_tokens += 0 if r.is_prefilled else r.num_prefill_tokens
            w.num_requests += 1
        assert set(expect) == set(self._workers), "worker entries and requests disagree"
        for wid, w in self._workers.items():
            e = expect.get(wid, _Worker())
            assert w.block_refs == e.block_refs, f"block refs of {wid} drifted"
            assert w.num_prefill_tokens == e.num_prefill_tokens, f"prefill tokens of {wid} drifted"
            assert w.num_requests == e.num_requests, f"request count of {wid} drifted"
