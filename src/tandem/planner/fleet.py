"""`FleetTracker`: what the planner knows of each pool, from discovery and the event plane.

Discovery says which workers are registered (ready); `WorkerStats` say which are starting or
draining and carry their recent steps; `RequestStats` rows from frontends say what traffic
arrived. `observations(now)` turns it into the core's `PoolObservation`s. Synchronous; the
service feeds it. Times are the service's monotonic clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.planner.observation import PoolObservation, PoolTraffic, WorkerView
from tandem.protocols.discovery import Instance
from tandem.protocols.scaling import RequestStats, StepSample, WorkerStats


@dataclass(slots=True)
class _Worker:
    latest: WorkerStats
    seen_s: float
    steps: deque[tuple[float, StepSample]] = field(default_factory=lambda: deque(maxlen=4096))


class FleetTracker:
    def __init__(
        self,
        components: list[str],
        *,
        window_s: float,
        interval_s: float,
        is_managed: Callable[[str], bool] = lambda _: True,
    ) -> None:
        self.components = components
        self.window_s = window_s
        self.interval_s = interval_s
        # "recent": long enough to hold a few WorkerStats/RequestStats periods at any tick rate
        self.recent_s = max(interval_s, 1.0)
        self.is_managed = is_managed
        self.registered: dict[str, dict[str, Instance]] = {c: {} for c in components}
        self._workers: dict[str, _Worker] = {}
        self._rows: deque[tuple[float, RequestStats]] = deque(maxlen=100_000)

    def apply_worker_stats(self, msg: WorkerStats, now: float) -> None:
        if msg.component not in self.registered:
            return
        w = self._workers.get(msg.worker_id)
        if w is None:
            w = self._workers[msg.worker_id] = _Worker(msg, now)
        w.latest, w.seen_s = msg, now
        w.steps.extend((now, s) for s in msg.steps)
        if msg.state == "stopped":
            del self._workers[msg.worker_id]

    def apply_request_stats(self, row: RequestStats, now: float) -> None:
        self._rows.append((now, row))

    def set_registered(self, component: str, instances: dict[str, Instance]) -> None:
        self.registered[component] = dict(instances)

    def traffic(self, now: float) -> PoolTraffic:
        """All frontends' rows received in the last `recent_s` (every pool serves the same
        requests: a disaggregated request passes the prefill and the decode pool)."""
        while self._rows and now - self._rows[0][0] > self.window_s:
            self._rows.popleft()
        recent = [r for t, r in self._rows if now - t <= self.recent_s]
        return PoolTraffic.merge(recent, self.recent_s)

    def observations(self, now: float) -> dict[str, PoolObservation]:
        traffic = self.traffic(now)
        for wid in [wid for wid, w in self._workers.items() if now - w.seen_s > self.window_s]:
            del self._workers[wid]  # silent for a whole window: gone
        out: dict[str, PoolObservation] = {}
        for component in self.components:
            registered = self.registered[component]
            ready = [self._view(wid, inst, now) for wid, inst in sorted(registered.items())]
            mine = [
                (wid, w)
                for wid, w in self._workers.items()
                if w.latest.component == component and wid not in registered
            ]
            out[component] = PoolObservation(
                component=component,
                ready=ready,
                starting=[wid for wid, w in mine if w.latest.state == "starting"],
                draining=[wid for wid, w in mine if w.latest.state == "draining"],
                traffic=traffic,
            )
        return out

    def _view(self, worker_id: str, instance: Instance, now: float) -> WorkerView:
        card = instance.model
        w = self._workers.get(worker_id)
        base = {
            "worker_id": worker_id,
            "is_managed": self.is_managed(worker_id),
            "block_size": card.block_size if card else 64,
            "max_num_batched_tokens": card.max_num_batched_tokens if card else 8192,
            "num_total_blocks": card.num_total_blocks if card else 0,
        }
        if w is None:
            return WorkerView(**base)  # type: ignore[arg-type]
        while w.steps and now - w.steps[0][0] > self.window_s:
            w.steps.popleft()
        recent = [s for t, s in w.steps if now - t <= self.recent_s]
        last = recent[-1] if recent else None
        n = len(recent)
        m = w.latest
        return WorkerView(
            **base,  # type: ignore[arg-type]
            num_inflight=m.num_inflight,
            num_running=last.num_running if last else 0,
            num_waiting=last.num_waiting if last else 0,
            num_active_blocks=m.num_active_blocks,
            num_cached_blocks=m.num_cached_blocks,
            prefill_tokens_per_step=sum(s.num_prefill_tokens for s in recent) / n if n else 0.0,
            prefill_tokens_per_s=sum(s.num_prefill_tokens for s in recent) / self.recent_s,
            decode_kv_tokens=sum(s.num_decode_kv_tokens for s in recent) / n if n else 0.0,
        )
