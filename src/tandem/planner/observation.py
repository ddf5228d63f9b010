"""What the planner core sees of one pool at one tick: its workers and its traffic.

Built by `fleet.FleetTracker` from discovery and the event plane; plain values, so the core
(`planner.Planner`) stays synchronous and tests build them by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.protocols.scaling import RequestStats


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerView:
    """One registered (ready) worker as of its latest stats."""

    worker_id: str
    num_inflight: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_active_blocks: int = 0
    num_total_blocks: int = 0
    num_cached_blocks: int = 0
    block_size: int = 64
    max_num_batched_tokens: int = 8192
    prefill_tokens_per_step: float = 0.0  # mean over the recent steps
    prefill_tokens_per_s: float = 0.0  # prompt tokens computed per second, recently
    decode_kv_tokens: float = 0.0  # mean over the recent steps
    is_managed: bool = True  # the connector can drain it (else it is never a victim)


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolTraffic:
    """A pool's requests over the last interval, all frontends merged."""

    interval_s: float
    num_arrivals: int = 0
    num_finished: int = 0
    mean_isl: float = 0.0
    mean_osl: float = 0.0
    cached_fraction: float = 0.0  # share of prompt tokens served from the prefix cache
    mean_ttft_ms: float | None = None
    mean_itl_ms: float | None = None
    # per dispatch, the wait for the router's decision: > 0 when every worker was over a busy
    # threshold and requests queued in the router, a wait the workers' own queues do not show
    mean_queue_wait_ms: float | None = None

    @property
    def request_rate(self) -> float:
        return self.num_arrivals / self.interval_s if self.interval_s > 0 else 0.0

    @staticmethod
    def merge(rows: list[RequestStats], interval_s: float) -> PoolTraffic:
        arrivals = sum(r.num_arrivals for r in rows)
        finished = sum(r.num_finished for r in rows)
        sum_isl = sum(r.sum_isl for r in rows)
        num_ttft = sum(r.num_ttft for r in rows)
        num_itl = sum(r.num_itl for r in rows)
        num_dispatched = sum(r.num_dispatched for r in rows)
        return PoolTraffic(
            interval_s=interval_s,
            num_arrivals=arrivals,
            num_finished=finished,
            mean_isl=sum_isl / finished if finished else 0.0,
            mean_osl=sum(r.sum_osl for r in rows) / finished if finished else 0.0,
            cached_fraction=sum(r.sum_cached_tokens for r in rows) / sum_isl if sum_isl else 0.0,
            mean_ttft_ms=sum(r.sum_ttft_ms for r in rows) / num_ttft if num_ttft else None,
            mean_itl_ms=sum(r.sum_itl_ms for r in rows) / num_itl if num_itl else None,
            mean_queue_wait_ms=(
                sum(r.sum_queue_wait_ms for r in rows) / num_dispatched if num_dispatched else None
            ),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class PoolObservation:
    """`ready`: registered workers; `starting`/`draining`: ids reported in those states
    (by their stats or by the connector) and not registered."""

    component: str
    ready: list[WorkerView] = field(default_factory=list)
    starting: list[str] = field(default_factory=list)
    draining: list[str] = field(default_factory=list)
    traffic: PoolTraffic | None = None
