"""`RouterMetrics`: a router's counters and routing-overhead histogram; `router_families` turns
the routers of every model into Prometheus families labelled with `model` (the frontend's
/metrics), `RouterMetrics.render` one router's alone (the router service, tests)."""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Protocol

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.metrics_core import Metric

from tandem.protocols.engine import PreprocessedRequest
from tandem.protocols.tenancy import DEFAULT_TENANT, class_name
from tandem.router.config import RouterConfig
from tandem.router.lora import LoraCounters, lora_families
from tandem.runtime.metrics import Families, render

OVERHEAD_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1)


class RouterMetrics:
    """Plain counters; the owner increments them. Not thread-safe."""

    def __init__(self) -> None:
        self.routed: Counter[str] = Counter()  # worker_id -> requests
        self.overlap_blocks = 0
        self.request_blocks = 0
        self.events: Counter[tuple[str, str]] = Counter()  # (type, status) -> count
        self._buckets = [0] * (len(OVERHEAD_BUCKETS_S) + 1)
        self.overhead_sum_s = 0.0
        self._overhead_count = 0
        self.lora = LoraCounters()  # per adapter, and residency per worker (router/lora.py)
        # issue 33, per (priority class name, tenant): time queued, deadline misses; the
        # queue's own depth and served tokens (`tenants`, set by the router that has a queue)
        self.queue_waits: Counter[tuple[str, str]] = Counter()
        self.queue_wait_sum_s: dict[tuple[str, str], float] = {}
        self.deadline_misses: Counter[tuple[str, str]] = Counter()
        self.tenants: TenantView | None = None
        self.sessions: SessionView | None = None  # router/session.py's table
        # peer KV fetch (router/fetch.py): hints sent, and the blocks and bytes they name
        self.kv_fetches = self.kv_fetch_blocks = self.kv_fetch_bytes = 0

    def observe_queue_wait(
        self, request: PreprocessedRequest, wait_s: float, *, missed: bool = False
    ) -> None:
        key = (class_name(request.priority), request.tenant or DEFAULT_TENANT)
        self.queue_waits[key] += 1
        self.queue_wait_sum_s[key] = self.queue_wait_sum_s.get(key, 0.0) + wait_s
        if missed:
            self.deadline_misses[key] += 1

    def observe_route(
        self, worker_id: str, overlap_blocks: int, request_blocks: int, overhead_s: float
    ) -> None:
        self.routed[worker_id] += 1
        self.overlap_blocks += overlap_blocks
        self.request_blocks += request_blocks
        self._buckets[bisect.bisect_left(OVERHEAD_BUCKETS_S, overhead_s)] += 1
        self.overhead_sum_s += overhead_s
        self._overhead_count += 1

    def observe_fetch(self, num_blocks: int, num_bytes: int) -> None:
        self.kv_fetches += 1
        self.kv_fetch_blocks += num_blocks
        self.kv_fetch_bytes += num_bytes

    @property
    def hit_rate(self) -> float:
        """Overlap blocks / request blocks over all routed requests (0 when none)."""
        return self.overlap_blocks / self.request_blocks if self.request_blocks else 0.0

    def overhead_buckets(self) -> list[tuple[str, int]]:
        """Cumulative (le, count) pairs, +Inf last."""
        out, acc = [], 0
        for bound, n in zip(OVERHEAD_BUCKETS_S, self._buckets, strict=False):
            acc += n
            out.append((repr(bound), acc))
        out.append(("+Inf", self._overhead_count))
        return out

    def render(self) -> str:
        rows: list[tuple[Mapping[str, str], RouterMetrics | None, int | None]] = [({}, self, None)]
        return render(Families(_families(rows) + _lora_families(rows))).decode()


class TenantView(Protocol):
    """What the families read of a router's queue (`router.queue.RequestQueue`)."""

    served_tokens: dict[str, float]

    def depth(self) -> dict[tuple[int, str], int]: ...


class SessionView(Protocol):
    """What the families read of a router's session table (`router.session.SessionTable`)."""

    num_rebinds: int
    num_hits: int

    def __len__(self) -> int: ...


class MeteredRouter(Protocol):
    """What the families read of a router (`tandem.router.base.Router` has it all)."""

    @property
    def config(self) -> RouterConfig: ...

    @property
    def metrics(self) -> RouterMetrics | None: ...

    @property
    def num_queued(self) -> int: ...


def router_families(
    rows: Iterable[tuple[Mapping[str, str], MeteredRouter | RouterMetrics]],
) -> list[Metric]:
    """Families over `(labels, router)` rows (every row with the same label names, e.g. model
    and component); a row's router contributes when it has its `RouterMetrics` here (a bare
    `RouterMetrics` is a router's counters without a queue)."""
    found = [_row(labels, router) for labels, router in rows]
    return _families(found) + _lora_families(found)


def _lora_families(
    found: list[tuple[Mapping[str, str], RouterMetrics | None, int | None]],
) -> list[Metric]:
    return lora_families("tandem_router", [(lb, m.lora) for lb, m, _ in found if m is not None])


def _row(
    labels: Mapping[str, str], router: MeteredRouter | RouterMetrics
) -> tuple[Mapping[str, str], RouterMetrics | None, int | None]:
    if isinstance(router, RouterMetrics):
        return labels, router, None
    return labels, router.metrics, router.num_queued


def _families(
    found: list[tuple[Mapping[str, str], RouterMetrics | None, int | None]],
) -> list[Metric]:
    """`found`: (labels, counters, queued requests) rows; a row without counters adds
    nothing, one without a queue no queued gauge."""
    p = "tandem_router"
    names = tuple(found[0][0]) if found else ()
    routed = CounterMetricFamily(
        f"{p}_routed_requests", "requests routed to each worker", labels=("worker_id", *names)
    )
    overlap = CounterMetricFamily(
        f"{p}_overlap_blocks", "prompt blocks already cached on the chosen worker", labels=names
    )
    blocks = CounterMetricFamily(f"{p}_request_blocks", "prompt blocks routed", labels=names)
    hit_rate = GaugeMetricFamily(
        f"{p}_kv_hit_rate", "overlap blocks / prompt blocks over all routed requests", labels=names
    )
    events = CounterMetricFamily(
        f"{p}_kv_events",
        "KV event batches by type (batch, full_state, replay, sync) and status (applied, "
        "stale, gap, malformed, unknown_worker, ...)",
        labels=("type", "status", *names),
    )
    queued = GaugeMetricFamily(
        f"{p}_queued_requests",
        "requests waiting for a worker below its busy threshold",
        labels=names,
    )
    overhead = HistogramMetricFamily(
        f"{p}_overhead_seconds", "time the router spent choosing a worker", labels=names
    )
    fetch_families = _fetch_families(p, names)
    tenant_families = _tenant_families(p, names)
    for labels, metrics, num_queued in found:
        if metrics is None:
            continue
        values = tuple(labels[n] for n in names)
        for worker_id, n in sorted(metrics.routed.items()):
            routed.add_metric((worker_id, *values), n)
        overlap.add_metric(values, metrics.overlap_blocks)
        blocks.add_metric(values, metrics.request_blocks)
        hit_rate.add_metric(values, metrics.hit_rate)
        for (kind, status), n in sorted(metrics.events.items()):
            events.add_metric((kind, status, *values), n)
        if num_queued is not None:
            queued.add_metric(values, num_queued)
        overhead.add_metric(values, metrics.overhead_buckets(), sum_value=metrics.overhead_sum_s)
        _add_tenant_rows(tenant_families, metrics, values)
        for family, n in zip(
            fetch_families,
            (metrics.kv_fetches, metrics.kv_fetch_blocks, metrics.kv_fetch_bytes),
            strict=True,
        ):
            family.add_metric(values, n)  # type: ignore[attr-defined]
    return [routed, overlap, blocks, hit_rate, events, queued, overhead, *fetch_families,
            *tenant_families]  # fmt: skip


def _fetch_families(p: str, names: tuple[str, ...]) -> list[Metric]:
    return [
        CounterMetricFamily(
            f"{p}_kv_fetches",
            "requests sent with a peer KV fetch hint (the worker pulls a cached prefix)",
            labels=names,
        ),
        CounterMetricFamily(
            f"{p}_kv_fetch_blocks", "KV blocks peer fetch hints ask to pull", labels=names
        ),
        CounterMetricFamily(
            f"{p}_kv_fetch_bytes", "KV bytes peer fetch hints ask to pull (estimated)", labels=names
        ),
    ]


def _tenant_families(p: str, names: tuple[str, ...]) -> list[Metric]:
    by = ("priority_class", "tenant", *names)
    return [
        GaugeMetricFamily(
            f"{p}_tenant_queued_requests",
            "requests waiting in the router queue, per priority class and tenant",
            labels=by,
        ),
        SummaryMetricFamily(
            f"{p}_tenant_queue_wait_seconds",
            "time requests waited in the router queue, per priority class and tenant",
            labels=by,
        ),
        CounterMetricFamily(
            f"{p}_tenant_deadline_misses",
            "requests answered 504 because their deadline passed while queued",
            labels=by,
        ),
        CounterMetricFamily(
            f"{p}_tenant_routed_tokens",
            "weighted tokens routed per tenant (prompt + 2 x expected output: the fair share's "
            "count)",
            labels=("tenant", *names),
        ),
        GaugeMetricFamily(f"{p}_sessions", "live session bindings (x-session-id)", labels=names),
        CounterMetricFamily(
            f"{p}_session_hits",
            "session requests sent back to their bound worker",
            labels=names,
        ),
        CounterMetricFamily(
            f"{p}_session_rebinds",
            "sessions moved off a busy or overloaded bound worker",
            labels=names,
        ),
    ]


def _add_tenant_rows(fams: list[Metric], metrics: RouterMetrics, values: tuple[str, ...]) -> None:
    queued, waits, misses, tokens, sessions, hits, rebinds = fams
    if metrics.sessions is not None:
        sessions.add_metric(values, len(metrics.sessions))  # type: ignore[attr-defined]
        hits.add_metric(values, metrics.sessions.num_hits)  # type: ignore[attr-defined]
        rebinds.add_metric(values, metrics.sessions.num_rebinds)  # type: ignore[attr-defined]
    if metrics.tenants is not None:
        for (klass, tenant), n in sorted(metrics.tenants.depth().items()):
            queued.add_metric((class_name(klass), tenant, *values), n)  # type: ignore[attr-defined]
        for tenant, num_tokens in sorted(metrics.tenants.served_tokens.items()):
            tokens.add_metric((tenant, *values), num_tokens)  # type: ignore[attr-defined]
    for key, n in sorted(metrics.queue_waits.items()):
        sum_s = metrics.queue_wait_sum_s[key]
        waits.add_metric((*key, *values), count_value=n, sum_value=sum_s)  # type: ignore[attr-defined]
    for key, n in sorted(metrics.deadline_misses.items()):
        misses.add_metric((*key, *values), n)  # type: ignore[attr-defined]


def worker_component(router: MeteredRouter | RouterMetrics) -> str:
    """The component of the workers `router` routes to (a bare `RouterMetrics`: backend,
    the default)."""
    if isinstance(router, RouterMetrics):
        return RouterConfig().worker_component
    return router.config.worker_component
