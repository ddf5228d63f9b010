"""`RequestQueue`: the router's queue of requests waiting for a worker that is not busy
(issue 33), in the order they get one:

1. priority class: a lower `PreprocessedRequest.priority` first (vLLM's convention);
2. within a class, the tenant with the lowest virtual token counter (VTC, "Fairness in Serving
   Large Language Models", OSDI '24): each dispatched request adds its weighted tokens
   (prompt tokens × `PROMPT_TOKEN_WEIGHT` + expected output tokens × `OUTPUT_TOKEN_WEIGHT`)
   divided by its tenant's weight to its tenant's counter, and is settled when it finishes:
   the expected output is replaced by the tokens it generated (`settle`), so a request that
   stops early is not over-charged nor one that runs long under-charged. Backlogged tenants
   are served in proportion to their weights, counted in tokens. Work-conserving: a tenant
   alone in the queue is served whatever its counter. A tenant that starts waiting while
   others are backlogged in its class is lifted to the lowest counter among them: idle time
   earns no burst of credit;
3. within a tenant, the earliest deadline first (`deadline_s`; none = last), then arrival.

Each (class, tenant) keeps its waiters sorted by (deadline, arrival), so a push or a removal
costs a bisection and a dispatch pass picks the next tenant among the tenants waiting, not
among the waiters: the queue's cost grows with its tenants, not its depth.

Synchronous and deterministic (no I/O, no clock); the router calls it from one event loop."""

from __future__ import annotations

import bisect
import itertools
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any

from tandem.protocols.engine import PreprocessedRequest
from tandem.protocols.tenancy import DEFAULT_TENANT

PROMPT_TOKEN_WEIGHT = 1.0
OUTPUT_TOKEN_WEIGHT = 2.0  # the VTC paper's w_q = 2 w_p: a decode token costs more of a step
# what a request counts for output before it ran: its max_tokens, at most this (a client that
# leaves max_tokens at the context's remainder must not be charged its whole context)
MAX_EXPECTED_OUTPUT_TOKENS = 512
_ORDER = attrgetter("order")  # bisect's key over a tenant's sorted waiters


@dataclass(eq=False, slots=True)
class Waiter:
    """One queued request. `exclude`: workers it must not go to (a failed attempt's)."""

    request: PreprocessedRequest
    exclude: frozenset[str]
    seq: int
    enqueued_s: float
    done: Any = None  # the router's future: set_result(decision) or set_exception
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tenant(self) -> str:
        return self.request.tenant or DEFAULT_TENANT

    @property
    def order(self) -> tuple[float, int]:
        """Its place among its tenant's waiters of its class: deadline (none = last), arrival."""
        deadline = self.request.deadline_s
        return (math.inf if deadline is None else deadline, self.seq)


def expected_output(request: PreprocessedRequest) -> int:
    """The output tokens a request counts for before it ran."""
    return min(request.stop.max_tokens, MAX_EXPECTED_OUTPUT_TOKENS)


def request_cost(request: PreprocessedRequest) -> float:
    """The weighted tokens `request` counts against its tenant's share (before its weight)."""
    output = expected_output(request)
    return request.num_prompt_tokens * PROMPT_TOKEN_WEIGHT + output * OUTPUT_TOKEN_WEIGHT


class RequestQueue:
    """Waiting requests ordered by class, tenant share and deadline; not thread-safe."""

    def __init__(self) -> None:
        self._seq = itertools.count()
        self._len = 0
        # (class, tenant) -> its waiters sorted by `Waiter.order`; no empty lists
        self._keys: dict[tuple[int, str], list[Waiter]] = {}
        self.counters: dict[str, float] = defaultdict(float)  # tenant -> virtual tokens
        self.served_tokens: dict[str, float] = defaultdict(float)  # tenant -> weighted tokens
        # request id -> (tenant, weight, expected output charged): dispatched, not yet settled
        self._charged: dict[str, tuple[str, float, int]] = {}

    def __len__(self) -> int:
        return self._len

    def push(self, request: PreprocessedRequest, exclude: frozenset[str], now_s: float) -> Waiter:
        """Queue `request`, lifting its tenant's counter if it was not backlogged."""
        waiter = Waiter(request, exclude, next(self._seq), now_s)
        tenant, klass = waiter.tenant, request.priority
        backlogged = {t for c, t in self._keys if c == klass}  # O(tenants), not O(waiters)
        if tenant not in backlogged and backlogged:
            floor = min(self.counters[t] for t in backlogged)
            self.counters[tenant] = max(self.counters[tenant], floor)
        bisect.insort(self._keys.setdefault((klass, tenant), []), waiter, key=_ORDER)
        self._len += 1
        return waiter

    def remove(self, waiter: Waiter) -> None:
        """Drop `waiter` (dispatched, timed out or cancelled); idempotent."""
        key = (waiter.request.priority, waiter.tenant)
        waiters = self._keys.get(key)
        if waiters is None:
            return
        i = bisect.bisect_left(waiters, waiter.order, key=_ORDER)
        if i == len(waiters) or waiters[i] is not waiter:
            return
        del waiters[i]
        self._len -= 1
        if not waiters:
            del self._keys[key]

    def key(self, waiter: Waiter) -> tuple[int, float, float, int]:
        return (waiter.request.priority, self.counters[waiter.tenant], *waiter.order)

    def num_waiting(self, priority: int, tenant: str) -> int:
        """Waiters of that class and tenant."""
        return len(self._keys.get((priority, tenant), ()))

    @property
    def num_keys(self) -> int:
        """Distinct (class, tenant) pairs waiting."""
        return len(self._keys)

    def offers(self, blocked: set[tuple[int, str]]) -> Iterator[Waiter]:
        """One dispatch pass: the waiters in the order they are offered a worker. Classes in
        turn; within one, the tenant with the lowest counter next, re-read before every
        offer (a dispatch charges its tenant: VTC picks again), its waiters by deadline
        then arrival. The caller may remove the waiter it was offered and add (class,
        tenant) keys to `blocked` while iterating: a blocked key offers no more."""
        for klass in sorted({c for c, _ in self._keys}):
            cursors = {t: 0 for c, t in self._keys if c == klass}  # next unoffered waiter
            while True:
                best: tuple[tuple[int, float, float, int], str, Waiter] | None = None
                for tenant, i in cursors.items():
                    waiters = self._keys.get((klass, tenant))
                    if waiters is None or i >= len(waiters) or (klass, tenant) in blocked:
                        continue
                    waiter = waiters[i]
                    rank = self.key(waiter)
                    if best is None or rank < best[0]:
                        best = (rank, tenant, waiter)
                if best is None:
                    break
                _, tenant, waiter = best
                yield waiter
                waiters = self._keys.get((klass, tenant), [])
                i = cursors[tenant]
                if i < len(waiters) and waiters[i] is waiter:  # still queued: move past it
                    cursors[tenant] = i + 1

    def ordered(self) -> list[Waiter]:
        """The waiters in the order a pass offers them when nothing is dispatched."""
        return list(self.offers(set()))

    def outranks_all(self, request: PreprocessedRequest) -> bool:
        """Whether a new `request` would be first: then it may take a free worker at once;
        otherwise it queues behind the waiters that come before it."""
        if not self._keys:
            return True
        head = min(self.key(waiters[0]) for waiters in self._keys.values())
        deadline = request.deadline_s
        own = (
            request.priority,
            self.counters[request.tenant or DEFAULT_TENANT],
            math.inf if deadline is None else deadline,
        )
        return own < head[:3]  # a tie goes to the one already waiting

    def charge(self, request: PreprocessedRequest) -> None:
        """Count a dispatched `request` against its tenant's share, its output as expected
        (`request_cost`) until `settle` knows it."""
        tenant = request.tenant or DEFAULT_TENANT
        weight = max(request.tenant_weight, 1e-6)
        cost = request_cost(request)
        self.counters[tenant] += cost / weight
        self.served_tokens[tenant] += cost
        self._charged[request.request_id] = (tenant, weight, expected_output(request))

    def settle(self, request_id: str, output_tokens: int | None) -> None:
        """`request_id` finished (or failed, or was re-routed) after generating
        `output_tokens` on its worker: its expected output is replaced by them. None (not
        known) keeps the charge as it was. Idempotent; an unknown id is ignored."""
        charged = self._charged.pop(request_id, None)
        if charged is None or output_tokens is None:
            return
        tenant, weight, expected = charged
        delta = (max(output_tokens, 0) - expected) * OUTPUT_TOKEN_WEIGHT
        self.counters[tenant] = max(self.counters[tenant] + delta / weight, 0.0)
        self.served_tokens[tenant] = max(self.served_tokens[tenant] + delta, 0.0)

    def depth(self) -> dict[tuple[int, str], int]:
        """Waiting requests per (priority class, tenant)."""
        return {key: len(waiters) for key, waiters in self._keys.items()}
