"""Per-interval request statistics for the planner (DESIGN.md §11), published on the event plane.

`RequestStatsCollector` is fed by the frontend's metrics (arrivals, queue wait before dispatch,
TTFT, ITL, ISL/OSL, cached tokens, outcomes) and cut into one `RequestStats` per model per
interval; `publish_request_stats` sends them on `{namespace}.frontend.request_stats` every
`interval_s`.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable

from tandem.protocols import scaling
from tandem.runtime.base import EventBus

logger = logging.getLogger(__name__)


class RequestStatsCollector:
    """Not thread-safe; one event loop. `take` starts a new interval."""

    def __init__(self, pool: str, *, clock: Callable[[], float] = time.time) -> None:
        self.pool = pool
        self.frontend_id = uuid.uuid4().hex[:12]
        self._clock = clock
        self._start_s = clock()
        self._by_model: dict[str, scaling.RequestStats] = {}
        self.epoch = 0  # +1 at every `take`: a row held since an older epoch is published

    def row(self, model: str) -> scaling.RequestStats:
        """`model`'s row of the current interval, to update in place until `epoch` moves
        (the hot path: a stream's inter-token latencies, `frontend.metrics.TokenTimer`)."""
        return self._row(model)

    def _row(self, model: str) -> scaling.RequestStats:
        row = self._by_model.get(model)
        if row is None:
            row = self._by_model[model] = scaling.RequestStats(
                frontend_id=self.frontend_id,
                model=model,
                pool=self.pool,
                start_s=self._start_s,
                end_s=self._start_s,
            )
        return row

    def arrived(self, model: str) -> None:
        self._row(model).num_arrivals += 1

    def ttft(self, model: str, seconds: float) -> None:
        row = self._row(model)
        row.num_ttft += 1
        row.sum_ttft_ms += seconds * 1000.0
        row.max_ttft_ms = max(row.max_ttft_ms, seconds * 1000.0)

    def itl(self, model: str, seconds: float) -> None:
        row = self._row(model)
        row.num_itl += 1
        row.sum_itl_ms += seconds * 1000.0

    def queue_wait(self, model: str, seconds: float) -> None:
        row = self._row(model)
        row.num_dispatched += 1
        row.sum_queue_wait_ms += seconds * 1000.0
        row.max_queue_wait_ms = max(row.max_queue_wait_ms, seconds * 1000.0)

    def finished(self, model: str, *, isl: float, osl: float) -> None:
        row = self._row(model)
        row.num_finished += 1
        row.sum_isl += isl
        row.sum_osl += osl

    def cached(self, model: str, num_tokens: float) -> None:
        self._row(model).sum_cached_tokens += num_tokens

    def failed(self, model: str) -> None:
        self._row(model).num_failed += 1

    def take(self) -> list[scaling.RequestStats]:
        """The interval's rows (models without traffic omitted) and a fresh interval."""
        now = self._clock()
        rows = list(self._by_model.values())
        for row in rows:
            row.end_s = now
        self._by_model.clear()
        self._start_s = now
        self.epoch += 1
        return rows


async def publish_request_stats(
    collector: RequestStatsCollector, events: EventBus, namespace: str, interval_s: float
) -> None:
    """Until cancelled: every `interval_s`, publish the interval's rows (none when idle)."""
    subject = scaling.request_stats_subject(namespace)
    while True:
        await asyncio.sleep(interval_s)
        for row in collector.take():
            try:
                await events.publish(subject, scaling.encode(row))
            except Exception:
                logger.warning("request stats publish on %s failed", subject, exc_info=True)
