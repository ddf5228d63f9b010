"""`WorkerMetrics`: the Prometheus metrics of one worker (its `/metrics` on `--system-port` and
its `metrics` request-plane endpoint, which the frontend proxies at `/metrics/workers`).

Every series carries `worker_id`, `component` and `model`, so the expositions of many workers
merge without clashes. What the worker counts itself (requests, prompt and cached tokens, engine
steps) lives in prometheus_client objects; the rest is read at scrape time: the engine's load,
the engine's own families (`Engine.metric_families`: the KV block manager's tiers, a transfer
agent's counters), the sources added (the multimodal embedding cache) and the request-plane
server's counters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tandem.protocols.scaling import StepSample
from tandem.runtime.metrics import Labelled, render

if TYPE_CHECKING:  # types only: an engine imports this module for text_families
    from tandem.engines.base import Engine, EngineInfo
    from tandem.runtime.runtime import Runtime
    from tandem.runtime.tcp.server import TcpRequestServer

STEP_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
STATES = ("starting", "ready", "draining", "stopped")


class _ComponentConfig(Protocol):
    @property
    def component(self) -> str: ...


class ScrapedWorker(Protocol):
    """What the metrics read of their Worker (tandem.engines.worker) at scrape time."""

    @property
    def engine(self) -> Engine: ...

    @property
    def info(self) -> EngineInfo | None: ...

    @property
    def state(self) -> str: ...

    @property
    def num_inflight(self) -> int: ...

    @property
    def instance_id(self) -> str: ...

    @property
    def config(self) -> _ComponentConfig: ...

    @property
    def runtime(self) -> Runtime: ...

    @property
    def metrics(self) -> WorkerMetrics: ...


class WorkerMetrics:
    """One per Worker; one event loop (scrapes and updates run on the worker's loop).
    `worker` is read at scrape time: engine, info, state, num_inflight, runtime.server."""

    def __init__(self, worker: ScrapedWorker) -> None:
        self._worker = worker
        self.num_prompt_tokens = self.num_cached_tokens = 0
        self.registry = CollectorRegistry(auto_describe=True)
        r, p = self.registry, "tandem_worker"
        self.requests = Counter(
            f"{p}_requests", "generate requests by outcome", ("status",), registry=r
        )
        self.prompt_tokens = Counter(f"{p}_prompt_tokens", "prompt tokens received", registry=r)
        self.cached_tokens = Counter(
            f"{p}_cached_prompt_tokens", "prompt tokens found in the prefix cache", registry=r
        )
        self.step_duration = Histogram(
            f"{p}_step_duration_seconds",
            "wall time of one engine step (forward pass and scheduling)",
            registry=r,
            buckets=STEP_BUCKETS_S,
        )
        self.step_batch = Histogram(
            f"{p}_step_batch_size",
            "sequences running in one engine step",
            registry=r,
            buckets=BATCH_BUCKETS,
        )
        self.step_prefill_tokens = Counter(
            f"{p}_step_prefill_tokens",
            "uncached prompt tokens computed by engine steps",
            registry=r,
        )
        self._sources: list[Callable[[], list[Metric]]] = []
        self.registry.register(_ScrapeTime(worker, self._sources))

    def add_source(self, families: Callable[[], list[Metric]]) -> None:
        """Read `families()` at each scrape too (e.g. the image embedding cache's)."""
        self._sources.append(families)

    def observe_steps(self, steps: Sequence[StepSample]) -> None:
        for step in steps:
            self.step_duration.observe(step.wall_ms / 1000.0)
            self.step_batch.observe(step.num_running)
            self.step_prefill_tokens.inc(step.num_prefill_tokens)

    def observe_prompt(self, num_tokens: int, num_cached: int) -> None:
        self.prompt_tokens.inc(num_tokens)
        self.cached_tokens.inc(num_cached)
        self.num_prompt_tokens += num_tokens
        self.num_cached_tokens += num_cached

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Cached / prompt tokens since start (0 before the first prompt)."""
        n = self.num_prompt_tokens
        return self.num_cached_tokens / n if n else 0.0

    def labels(self) -> dict[str, str]:
        w = self._worker
        model = w.info.model_name if w.info is not None else ""
        return {"worker_id": w.instance_id, "component": w.config.component, "model": model}

    def render(self) -> bytes:
        """Text exposition with every series labelled by worker_id, component and model."""
        return render(Labelled(self.registry, self.labels()))


class _ScrapeTime:
    """Families read from the worker, its engine, the sources added and its runtime when
    scraped."""

    def __init__(self, worker: ScrapedWorker, sources: list[Callable[[], list[Metric]]]) -> None:
        self._worker = worker
        self._sources = sources

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        w = self._worker
        yield from _worker_families(w)
        yield from w.engine.metric_families()  # KV tiers (tandem_kvbm_*), transfer agent
        for source in self._sources:
            yield from source()
        yield from request_plane_families(w.runtime.server)


def text_families(lines: list[str]) -> list[Metric]:
    """The families of Prometheus text lines (an engine's KV block manager tiers)."""
    return list(text_string_to_metric_families("\n".join(lines) + "\n")) if lines else []


def _worker_families(w: ScrapedWorker) -> Iterator[Metric]:
    p = "tandem_worker"
    yield GaugeMetricFamily(f"{p}_inflight_requests", "generate requests in flight", w.num_inflight)
    state = GaugeMetricFamily(
        f"{p}_state", "lifecycle state (1 for the current one)", labels=["state"]
    )
    for name in STATES:
        state.add_metric([name], 1 if w.state == name else 0)
    yield state
    if w.info is None:
        return
    load = w.engine.load()
    yield GaugeMetricFamily(f"{p}_running_sequences", "sequences scheduled", load.num_running)
    yield GaugeMetricFamily(f"{p}_waiting_sequences", "sequences queued", load.num_waiting)
    yield GaugeMetricFamily(
        f"{p}_kv_active_blocks", "KV blocks held by running sequences", load.num_active_blocks
    )
    yield GaugeMetricFamily(
        f"{p}_kv_total_blocks", "KV blocks in the device pool", load.num_total_blocks
    )
    yield GaugeMetricFamily(
        f"{p}_kv_cached_blocks", "KV blocks kept for prefix reuse", load.num_cached_blocks
    )
    total = load.num_total_blocks
    yield GaugeMetricFamily(
        f"{p}_kv_usage",
        "fraction of the device KV pool held by running sequences",
        load.num_active_blocks / total if total else 0.0,
    )
    yield GaugeMetricFamily(
        f"{p}_prefix_cache_hit_rate",
        "prompt tokens found in the prefix cache / prompt tokens, since start "
        "(rate() of the two counters gives it over a window)",
        w.metrics.prefix_cache_hit_rate,
    )


def request_plane_families(server: TcpRequestServer) -> list[Metric]:
    """The request-plane server's counters (tandem.runtime.tcp.server.RequestPlaneStats)."""
    p = "tandem_component"
    stats = server.stats
    requests = CounterMetricFamily(
        f"{p}_requests", "request-plane streams opened, by endpoint", labels=["endpoint"]
    )
    errors = CounterMetricFamily(
        f"{p}_errors", "request-plane streams that ended in an error", labels=["endpoint"]
    )
    for path, n in sorted(stats.requests.items()):
        requests.add_metric([path], n)
        errors.add_metric([path], stats.errors.get(path, 0))
    return [
        requests,
        errors,
        CounterMetricFamily(
            f"{p}_rejected_requests",
            "streams refused before a handler ran (unknown endpoint, draining, over the "
            "per-connection cap, past their deadline)",
            stats.num_rejected,
        ),
        CounterMetricFamily(f"{p}_request_bytes", "request payload bytes", stats.request_bytes),
        CounterMetricFamily(f"{p}_response_bytes", "response payload bytes", stats.response_bytes),
        GaugeMetricFamily(f"{p}_inflight_requests", "streams in flight", server.num_inflight),
        CounterMetricFamily(
            f"{p}_refused_connections",
            "connections refused (over the cap, failed or late handshake)",
            server.num_refused,
        ),
    ]
