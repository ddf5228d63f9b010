"""`LoadTracker`: the latest `LoadMetrics` each worker published, summed over its DP ranks."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from tandem.protocols.kv_events import LoadMetrics, decode_load

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerLoad:
    num_active_blocks: int = 0
    num_total_blocks: int = 0
    num_waiting: int = 0
    num_running: int = 0

    @property
    def active_fraction(self) -> float:
        return self.num_active_blocks / self.num_total_blocks if self.num_total_blocks else 0.0


class LoadTracker:
    """Keeps one `LoadMetrics` per (worker, dp_rank); not thread-safe, one event loop.

    `on_update` (if given) is called after every applied message, e.g. to wake queued requests.
    """

    def __init__(self, on_update: Callable[[], None] | None = None) -> None:
        self._by_rank: dict[tuple[str, int], LoadMetrics] = {}
        self._on_update = on_update

    def apply(self, metrics: LoadMetrics) -> None:
        self._by_rank[(metrics.worker_id, metrics.dp_rank)] = metrics
        if self._on_update is not None:
            self._on_update()

    def apply_payload(self, payload: bytes) -> LoadMetrics | None:
        """Decode and apply; returns the message, or None when it was malformed."""
        try:
            metrics = decode_load(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("dropping malformed load metrics: %s", exc)
            return None
        self.apply(metrics)
        return metrics

    def remove_worker(self, worker_id: str) -> None:
        for key in [k for k in self._by_rank if k[0] == worker_id]:
            del self._by_rank[key]

    def get(self, worker_id: str) -> WorkerLoad | None:
        """Sum over the worker's DP ranks; None when it never published."""
        out: WorkerLoad | None = None
        for (wid, _), m in self._by_rank.items():
            if wid != worker_id:
                continue
            out = out or WorkerLoad()
            out.num_active_blocks += m.num_active_blocks
            out.num_total_blocks += m.num_total_blocks
            out.num_waiting += m.num_waiting
            out.num_running += m.num_running
        return out
