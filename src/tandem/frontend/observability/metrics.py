"""Prometheus metrics of the frontend (`GET /metrics`), named after Dynamo's `dynamo_frontend_*`
so a Dynamo user's queries translate by prefix (docs/architecture.md, "Metrics").

Every HTTP API request is counted once in `tandem_frontend_requests_total` with its outcome
(`status`: success, error, cancelled) and HTTP `status_code`, including the ones rejected before
routing (bad JSON 400, auth 401/403, unknown model 404, admission 429/503): the app opens a
`RequestTally` per request (`open_tally`), the handlers label it (`count_as`) once the model is
known to be served (so there is no label per mistyped name), and the app counts it when the
request ends. Per-worker load and the routers' own metrics are read from the model registry at
scrape time (`RouterCollector`).
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any, Protocol

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from tandem.frontend.observability.request_stats import RequestStatsCollector
from tandem.protocols.discovery import ModelCard
from tandem.protocols.scaling import RequestStats
from tandem.router.base import Router
from tandem.router.metrics import router_families, worker_component
from tandem.runtime import tracing
from tandem.runtime.metrics import LoopHistogram, LoopMetric, render

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (1, 8, 32, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 131072)


@dataclass(slots=True)
class RequestTally:
    """One request's `requests_total` labels and outcome, learnt while it runs."""

    model: str = ""
    request_type: str = "unary"
    status: str = "success"
    status_code: int = 200


_tally: ContextVar[RequestTally] = ContextVar("tandem_frontend_tally")


def open_tally() -> tuple[RequestTally, Token[RequestTally]]:
    """A new tally for the running request; `close_tally(token)` when it ends."""
    tally = RequestTally()
    return tally, _tally.set(tally)


def close_tally(token: Token[RequestTally]) -> None:
    _tally.reset(token)


def count_as(model: str, *, stream: bool, failed: bool = False) -> None:
    """Label the running request's sample; `failed` for an error already written into a
    started stream. Nothing when no tally is open (a handler called on its own)."""
    tally = _tally.get(None)
    if tally is not None:
        tally.model, tally.request_type = model, "stream" if stream else "unary"
        if failed:
            tally.status = "error"


RouterSource = Callable[[], Iterable[tuple[str, Router]]]  # (model name, router) pairs


class RoutedModels(Protocol):
    """What the metrics read of the model registry at scrape time."""

    def worker_loads(self) -> dict[str, dict[str, dict[str, float]]]: ...

    def routers(self) -> Iterable[tuple[str, Router]]: ...

    def cards(self) -> Iterable[tuple[ModelCard, int]]: ...


class FrontendMetrics:
    """Every frontend metric, on its own registry; one instance per frontend, one event loop.
    `interval`, when given, also receives arrivals, TTFT, ITL, ISL/OSL and outcomes for the
    planner (tandem.frontend.observability.request_stats)."""

    def __init__(
        self, prefix: str = "tandem_frontend", interval: RequestStatsCollector | None = None
    ) -> None:
        self.interval = interval
        self.router_sources: list[RouterSource] = []
        self._collector: RouterCollector | None = None
        self.registry = CollectorRegistry(auto_describe=True)
        p, m = prefix, ("model",)
        # every one is updated per request on the event loop: lock-free loop metrics
        self.requests = LoopMetric(
            f"{p}_requests",
            "HTTP API requests by model, endpoint, request type (stream/unary), outcome "
            "(success/error/cancelled) and HTTP status code",
            ("model", "endpoint", "request_type", "status", "status_code"),
            counter=True,
        )
        self.inflight = LoopMetric(
            f"{p}_inflight_requests", "generate requests in flight", m, counter=False
        )
        self.queued = LoopMetric(
            f"{p}_queued_requests",
            "generate requests in flight that have not received their first token yet",
            m,
            counter=False,
        )
        self.ttft = LoopHistogram(
            f"{p}_time_to_first_token_seconds",
            "time from request arrival to the first token",
            m,
            LATENCY_BUCKETS,
        )
        self.itl = LoopHistogram(
            f"{p}_inter_token_latency_seconds",
            "time between two token chunks of one stream",
            m,
            LATENCY_BUCKETS,
        )
        self.duration = LoopHistogram(
            f"{p}_request_duration_seconds",
            "time from request arrival to its last byte",
            m,
            DURATION_BUCKETS,
        )
        self.input_len = LoopHistogram(
            f"{p}_input_sequence_tokens", "prompt tokens per request (ISL)", m, TOKEN_BUCKETS
        )
        self.output_len = LoopHistogram(
            f"{p}_output_sequence_tokens", "generated tokens per request (OSL)", m, TOKEN_BUCKETS
        )
        self.cached_len = LoopHistogram(
            f"{p}_cached_tokens",
            "prompt tokens per request served from a worker's prefix cache",
            m,
            TOKEN_BUCKETS,
        )
        self.input_tokens = LoopMetric(f"{p}_input_tokens", "prompt tokens", m, counter=True)
        self.output_tokens = LoopMetric(f"{p}_output_tokens", "generated tokens", m, counter=True)
        self.migrations = LoopMetric(
            f"{p}_migrations", "streams moved to another worker mid-request", m, counter=True
        )
        self.disconnects = LoopMetric(
            f"{p}_disconnected_clients",
            "requests the client gave up on before they finished (count since start)",
            m,
            counter=False,
        )
        for metric in list(vars(self).values()):  # each one above, in order
            if isinstance(metric, LoopMetric | LoopHistogram):
                self.registry.register(metric)
        self._by_model: dict[str, _ModelSeries] = {}
        # requests' children by label values (a few models × endpoints × outcomes × codes)
        self._requests_by_key: dict[tuple[str, str, str, str, int], Any] = {}

    def watch(self, models: RoutedModels) -> None:
        """Read per-worker load and router metrics of `models` at every scrape (once)."""
        if self._collector is None:
            self._collector = RouterCollector(models, self.router_sources)
            self.registry.register(self._collector)

    def watch_routers(self, source: RouterSource) -> None:
        """Also read these routers' metrics at every scrape (the prefill pool's)."""
        self.router_sources.append(source)

    # ------------------------------------------------------------------ recording
    def _of(self, model: str) -> _ModelSeries:
        """`model`'s series of the per-request metrics (`labels()` once per model: it takes a
        lock and builds a key each call, ~14 calls per request otherwise)."""
        series = self._by_model.get(model)
        if series is None:
            series = self._by_model[model] = _ModelSeries(self, model)
        return series

    def arrived(self, model: str) -> None:
        s = self._of(model)
        s.inflight.inc()
        s.queued.inc()
        if self.interval is not None:
            self.interval.arrived(model)

    def queue_wait(self, model: str, seconds: float) -> None:
        """One dispatch waited `seconds` for the router's decision (its queue included)."""
        if self.interval is not None:
            self.interval.queue_wait(model, seconds)

    def first_token(self, model: str, seconds: float) -> None:
        s = self._of(model)
        s.queued.dec()
        s.ttft.observe(seconds)
        if self.interval is not None:
            self.interval.ttft(model, seconds)

    def observe_itl(self, model: str, seconds: float) -> None:
        self.itl.observe(self.itl.child(model), seconds)
        if self.interval is not None:
            self.interval.itl(model, seconds)

    def left(self, model: str, seconds: float, *, had_first_token: bool, failed: bool) -> None:
        """A generate request that `arrived` is done (any outcome)."""
        s = self._of(model)
        s.inflight.dec()
        if not had_first_token:
            s.queued.dec()
        s.duration.observe(seconds)
        if failed and self.interval is not None:
            self.interval.failed(model)

    def finished(self, model: str, *, num_in: int, num_out: int, num_cached: int) -> None:
        s = self._of(model)
        s.input_len.observe(num_in)
        s.output_len.observe(num_out)
        s.cached_len.observe(num_cached)
        s.input_tokens.inc(num_in)
        s.output_tokens.inc(num_out)
        if self.interval is not None:
            self.interval.finished(model, isl=num_in, osl=num_out)
            self.interval.cached(model, num_cached)

    def counted(
        self, model: str, endpoint: str, request_type: str, status: str, status_code: int
    ) -> None:
        key = (model, endpoint, request_type, status, status_code)
        child = self._requests_by_key.get(key)
        if child is None:
            child = self._requests_by_key[key] = self.requests.labels(
                model, endpoint, request_type, status, str(status_code)
            )
        child.inc()

    def render(self) -> bytes:
        return render(self.registry)


class RouterCollector:
    """Per-worker load as each model's router sees it, and the routers' own metrics (those
    of the models and of `sources`, labelled by model and the component routed to)."""

    def __init__(self, models: RoutedModels, sources: list[RouterSource]) -> None:
        self._models, self._sources = models, sources

    def describe(self) -> Iterable[Metric]:
        return []  # read at scrape time; nothing to check at registration

    def collect(self) -> Iterable[Metric]:
        p = "tandem_frontend_worker"
        load = GaugeMetricFamily(
            f"{p}_load",
            "per-worker load as the router sees it, one series per `metric` (inflight, "
            "active_blocks, total_blocks, waiting, running, router_active_blocks, ...)",
            labels=("model", "worker_id", "metric"),
        )
        blocks = GaugeMetricFamily(
            f"{p}_active_decode_blocks",
            "KV blocks active on the worker as the router sees them (its own bookkeeping "
            "with the KV policy, else the worker's reported load)",
            labels=("model", "worker_id"),
        )
        tokens = GaugeMetricFamily(
            f"{p}_active_prefill_tokens",
            "prompt tokens routed to the worker and not yet prefilled (KV policy)",
            labels=("model", "worker_id"),
        )
        for model, loads in self._models.worker_loads().items():
            for worker_id, row in loads.items():
                for name, value in row.items():
                    load.add_metric((model, worker_id, name), value)
                active = row.get("router_active_blocks", row.get("active_blocks"))
                if active is not None:
                    blocks.add_metric((model, worker_id), active)
                tokens.add_metric((model, worker_id), row.get("router_prefill_tokens", 0.0))
        yield from (load, blocks, tokens)
        yield from model_families(self._models.cards())
        rows = [*self._models.routers(), *(r for source in self._sources for r in source())]
        yield from router_families(
            ({"model": model, "component": worker_component(router)}, router)
            for model, router in rows
        )


_CARD_GAUGES = (
    ("context_length", "context_length", "longest prompt + output of the model, in tokens"),
    ("kv_cache_block_size", "block_size", "tokens per KV block"),
    ("total_kv_blocks", "num_total_blocks", "KV blocks of one worker's device pool"),
    ("max_num_seqs", "max_num_seqs", "most sequences in one worker's batch"),
    ("max_num_batched_tokens", "max_num_batched_tokens", "most tokens in one engine step"),
)


def model_families(cards: Iterable[tuple[ModelCard, int]]) -> list[Metric]:
    """`tandem_frontend_model_*`: each served model's card (as Dynamo's `dynamo_frontend_model_*`)
    and its live workers."""
    rows = list(cards)
    out: list[Metric] = []
    for name, field, doc in _CARD_GAUGES:
        family = GaugeMetricFamily(
            f"tandem_frontend_model_{name}", f"{doc} (model card)", labels=("model",)
        )
        for card, _ in rows:
            family.add_metric((card.name,), getattr(card, field))
        out.append(family)
    workers = GaugeMetricFamily(
        "tandem_frontend_model_workers", "live workers serving the model", labels=("model",)
    )
    for card, num_workers in rows:
        workers.add_metric((card.name,), num_workers)
    out.append(workers)
    return out


class _ModelSeries:
    """One model's children of the per-request metrics (`labels(model)` of each, once)."""

    __slots__ = (
        "cached_len",
        "duration",
        "inflight",
        "input_len",
        "input_tokens",
        "output_len",
        "output_tokens",
        "queued",
        "ttft",
    )

    def __init__(self, m: FrontendMetrics, model: str) -> None:
        m.migrations.labels(model)  # rare events read 0 (not "no data") from the start
        m.disconnects.labels(model)
        self.inflight, self.queued = m.inflight.labels(model), m.queued.labels(model)
        self.ttft, self.duration = m.ttft.labels(model), m.duration.labels(model)
        self.input_len, self.output_len = m.input_len.labels(model), m.output_len.labels(model)
        self.cached_len = m.cached_len.labels(model)
        self.input_tokens = m.input_tokens.labels(model)
        self.output_tokens = m.output_tokens.labels(model)


class TokenTimer:
    """One request's TTFT (and its `first_token` span) on the first token chunk, ITL between
    the later ones. Per chunk it does what `FrontendMetrics.observe_itl` does, with no call
    but the bisect: the histogram series and the interval's row are looked up once (the row
    again only when the interval has moved on)."""

    __slots__ = (
        "_buckets",
        "_epoch",
        "_interval",
        "_itl_series",
        "_metrics",
        "_model",
        "_row",
        "last",
        "started",
    )

    def __init__(self, metrics: FrontendMetrics, model: str) -> None:
        self._metrics, self._model = metrics, model
        self.started = time.perf_counter()
        self.last = 0.0
        self._buckets = metrics.itl.buckets
        self._itl_series = metrics.itl.child(model)
        self._interval = metrics.interval
        self._row: RequestStats | None = None
        self._epoch = -1

    def token(self) -> None:
        self.tokens(1)

    def tokens(self, count: int) -> None:
        """`count` token chunks that reach the client in one write: the first's TTFT or ITL
        as measured, the others' ITL 0."""
        now = time.perf_counter()
        last, self.last = self.last, now
        series = self._itl_series  # LoopHistogram.observe, inline
        if count > 1:
            series[bisect_left(self._buckets, 0.0)] += count - 1
        if last == 0.0:
            self._metrics.first_token(self._model, now - self.started)
            if tracing.enabled:
                tracing.since_current("first_token")
            num_itl, seconds = count - 1, 0.0
        else:
            seconds = now - last
            series[bisect_left(self._buckets, seconds)] += 1
            series[-1] += seconds
            num_itl = count
        interval = self._interval
        if num_itl and interval is not None:  # RequestStatsCollector.itl, inline
            row = self._row
            if row is None or self._epoch != interval.epoch:
                row, self._epoch = interval.row(self._model), interval.epoch
                self._row = row
            row.num_itl += num_itl
            row.sum_itl_ms += seconds * 1000.0
