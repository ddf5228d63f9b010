"""`DecisionLog`: the last routing decisions of one router, and per-worker prefix-hit totals
(for `/dashboard`). Recording keeps references only (the KV router's per-candidate costs are
already built); `snapshot` formats them when someone looks."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any, NamedTuple

from tandem.protocols.engine import PreprocessedRequest
from tandem.router.base import RouteDecision
from tandem.router.cost import CandidateCost

DEFAULT_MAX_DECISIONS = 64


class Decision(NamedTuple):
    time_s: float
    request_id: str
    num_tokens: int
    decision: RouteDecision
    candidates: Sequence[CandidateCost] | None  # per candidate (KV router), else None


class WorkerTotals:
    __slots__ = ("num_overlap_blocks", "num_request_blocks", "num_routed")

    def __init__(self) -> None:
        self.num_routed = self.num_overlap_blocks = self.num_request_blocks = 0


class DecisionLog:
    """Bounded: the last `max_decisions` decisions; totals for workers seen (a worker's
    totals are dropped by `forget`). One event loop; not thread-safe."""

    def __init__(self, max_decisions: int = DEFAULT_MAX_DECISIONS) -> None:
        if max_decisions < 1:
            raise ValueError(f"max_decisions={max_decisions}; expected >= 1")
        self._recent: deque[Decision] = deque(maxlen=max_decisions)
        self.totals: dict[str, WorkerTotals] = {}
        self.num_decisions = 0

    def record(
        self,
        request: PreprocessedRequest,
        decision: RouteDecision,
        candidates: Sequence[CandidateCost] | None,
    ) -> None:
        self.num_decisions += 1
        self._recent.append(
            Decision(time.time(), request.request_id, len(request.token_ids), decision, candidates)
        )
        totals = self.totals.get(decision.instance_id)
        if totals is None:
            totals = self.totals[decision.instance_id] = WorkerTotals()
        totals.num_routed += 1
        totals.num_overlap_blocks += decision.overlap_blocks
        totals.num_request_blocks += decision.request_blocks

    def forget(self, worker_id: str) -> None:
        self.totals.pop(worker_id, None)

    def num_routed(self, worker_id: str) -> int:
        """Requests routed to `worker_id` (since it was last forgotten)."""
        totals = self.totals.get(worker_id)
        return totals.num_routed if totals is not None else 0

    def blocks(self) -> tuple[int, int]:
        """(prefix blocks found cached, prompt blocks) routed to every worker."""
        totals = self.totals.values()
        return sum(t.num_overlap_blocks for t in totals), sum(t.num_request_blocks for t in totals)

    def hit_rate(self, worker_id: str | None = None) -> float | None:
        """Prefix blocks the router found cached / prompt blocks routed (to `worker_id`, or
        to all); None before any block was routed."""
        rows = self.totals.values() if worker_id is None else [self.totals.get(worker_id)]
        overlap = sum(t.num_overlap_blocks for t in rows if t is not None)
        blocks = sum(t.num_request_blocks for t in rows if t is not None)
        return overlap / blocks if blocks else None

    def snapshot(self, limit: int = DEFAULT_MAX_DECISIONS) -> list[dict[str, Any]]:
        """The last `limit` decisions, newest first, as JSON-ready dicts."""
        out = []
        for d in list(self._recent)[-limit:][::-1]:
            row: dict[str, Any] = {
                "time_s": round(d.time_s, 3),
                "request_id": d.request_id,
                "num_tokens": d.num_tokens,
                "worker_id": d.decision.instance_id,
                "overlap_blocks": d.decision.overlap_blocks,
                "request_blocks": d.decision.request_blocks,
                "candidates": None,
                "kv_fetch": _fetch(d.decision),
            }
            if d.candidates is not None:
                row["candidates"] = [_candidate(c) for c in d.candidates]
            out.append(row)
        return out


def _fetch(decision: RouteDecision) -> dict[str, Any] | None:
    """The peer KV fetch the chosen worker was told to make, if any: its holder and the
    blocks to pull (the hint names the whole prefix; the worker keeps what it caches)."""
    hint = decision.kv_fetch
    if hint is None:
        return None
    planned = decision.details.get("kv_fetch")
    blocks = planned["blocks"] if isinstance(planned, dict) else len(hint.block_hashes)
    return {"source": hint.source_instance_id, "blocks": blocks}


def _candidate(cost: CandidateCost) -> dict[str, Any]:
    row = asdict(cost)
    for key in ("overlap_blocks", "prefill_blocks", "decode_blocks", "cost"):
        row[key] = round(float(row[key]), 3)
    return row
