"""The frontend, assembled and served: runtime → model registry (routers, tokenizers) →
streamer → app → HTTP server.

`serve_frontend` runs inside an existing event loop with a given Runtime: the `tandem
frontend` process (`main.py`) and the all-in-one `tandem serve` call it.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.errors import ConfigError, StartupError
from tandem.frontend.adapters import LoraAdapters
from tandem.frontend.api.responses.store import ResponseStore
from tandem.frontend.app import FrontendApp
from tandem.frontend.batch.lane import BatchLane
from tandem.frontend.config import FrontendConfig
from tandem.frontend.disagg_wiring import disagg_streamer
from tandem.frontend.http.server import HttpServer
from tandem.frontend.migration import EngineStreamer
from tandem.frontend.models import ModelRegistry, freeze_long_lived
from tandem.frontend.observability.dashboard import Dashboard
from tandem.frontend.observability.health import HealthMonitor
from tandem.frontend.observability.metrics import FrontendMetrics
from tandem.frontend.observability.request_stats import (
    RequestStatsCollector,
    publish_request_stats,
)
from tandem.frontend.observability.worker_scrape import WorkerScraper
from tandem.frontend.ownership import Ownership
from tandem.frontend.pipeline import prompt_ids
from tandem.frontend.pipeline.streamer import Streamer
from tandem.frontend.rate_limit import RateLimiter, default_db_path
from tandem.frontend.tenancy import Tenancy
from tandem.multimodal.loader import ImageLoader
from tandem.multimodal.remote_provider import ENCODER_COMPONENT, ENCODER_ENDPOINT
from tandem.protocols.discovery import InstanceEvent
from tandem.runtime.discovery.etcd import EtcdDiscovery
from tandem.runtime.discovery.file import FileDiscovery
from tandem.runtime.instances import InstanceSet
from tandem.runtime.metrics import TallyCollector
from tandem.runtime.runtime import Runtime
from tandem.tokens import ascii_encoder

if TYPE_CHECKING:
    from tandem.disagg.pool import PrefillPool

logger = logging.getLogger(__name__)


async def serve_frontend(
    config: FrontendConfig,
    runtime: Runtime,
    *,
    ready: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
    bound: list[tuple[str, int]] | None = None,
) -> None:
    """Serve the OpenAI API until `stop` is set (or the task is cancelled).

    Sets `ready` once listening; appends the bound (host, port) to `bound` if given (port 0
    picks a free port). On exit closes connections, routers and the instance watch."""
    await asyncio.to_thread(prompt_ids.load_library)  # built before the first request
    await asyncio.to_thread(ascii_encoder.load_c_split)  # likewise: chat prompts' split
    frontend = _build(config, runtime)
    await frontend.start()
    stats_task = _publish_request_stats(config, runtime, frontend.collector)
    try:
        if config.http.reuse_port:  # a port shared with other frontends: join once able to serve
            await _wait_for_a_model(frontend.registry, stop)
        host, port = await _listen(frontend.server, config)
        freeze_long_lived()
        logger.info("frontend listening on http://%s:%d", host, port)
        if bound is not None:
            bound.append((host, port))
        if ready is not None:
            ready.set()
        await (stop or asyncio.Event()).wait()
    finally:
        if stats_task is not None:
            stats_task.cancel()
            await asyncio.gather(stats_task, return_exceptions=True)
        # drain: stop accepting, let in-flight responses finish within the grace period
        await frontend.close(
            config.http.drain_grace_s if stop is not None and stop.is_set() else 0.0
        )


@dataclass(slots=True, kw_only=True)
class _Frontend:
    """The frontend's parts that start and close: built by `_build`, in wiring order."""

    registry: ModelRegistry
    adapters: LoraAdapters
    collector: RequestStatsCollector
    aggregated: EngineStreamer
    pool: PrefillPool | None
    encoders: InstanceSet
    health: HealthMonitor
    app: FrontendApp
    server: HttpServer
    batch: BatchLane

    async def start(self) -> None:
        await self.registry.start()
        await self.adapters.start()
        if self.pool is not None:
            await self.pool.start()
        await self.encoders.start()
        await self.health.start()
        self.batch.start()

    async def close(self, drain_grace_s: float) -> None:
        await self.server.stop(drain_grace_s)
        await self.batch.close()  # its lines in flight stay pending: the next runner resumes
        await self.app.images.close()
        await self.health.close()
        await self.encoders.close()
        await self.adapters.close()
        await self.registry.close()
        await self.aggregated.close()
        if self.pool is not None:
            await self.pool.close()


def _count_rejected_records(metrics: FrontendMetrics, runtime: Runtime) -> None:
    """tandem_discovery_rejected_records_total: records ignored for not verifying with the
    cluster secret (forged, altered, another cluster's), where the backend signs them."""
    discovery = runtime.discovery
    if isinstance(discovery, EtcdDiscovery | FileDiscovery):
        help_ = "discovery records ignored: not signed with this cluster's secret (forged)"
        tally = TallyCollector(
            "tandem_discovery_rejected_records", help_, lambda: discovery.num_forged
        )
        metrics.registry.register(tally)


def _build(config: FrontendConfig, runtime: Runtime) -> _Frontend:
    """Registry → metrics → streamer (aggregated, or two legs with disaggregation) → health →
    app with its dashboard → HTTP server; nothing started yet."""
    workers = runtime.instance_set(config.worker_component, config.worker_endpoint)
    registry = ModelRegistry(
        config,
        workers,
        events=runtime.events,
        client=runtime.client,
        namespace=runtime.namespace,
        blobs=runtime.blobs,
    )
    adapters = LoraAdapters(config.lora, runtime.loras, registry, runtime.client)
    collector = RequestStatsCollector(config.worker_component)
    metrics = FrontendMetrics(interval=collector if config.request_stats_interval_s else None)
    _count_rejected_records(metrics, runtime)
    aggregated = EngineStreamer(
        runtime.client,
        runtime.endpoint_path(config.worker_component, config.worker_endpoint),
        migration_limit=config.migration_limit,
        on_migrate=lambda model: metrics.migrations.labels(model).inc(),
        stall=config.stall,
        on_routed=metrics.queue_wait,
    )
    streamer: Streamer = aggregated
    pool = prefill = None
    if config.disagg.enabled:  # decode on the worker pool, prefill on its own (DESIGN §4)
        prefill = runtime.instance_set(config.disagg.prefill_component, config.worker_endpoint)
        streamer, pool = disagg_streamer(config, runtime, aggregated, workers, prefill)
        metrics.watch_routers(pool.routers)
    encoders = runtime.instance_set(ENCODER_COMPONENT, ENCODER_ENDPOINT)  # E/PD readiness
    for pool_set in (workers, prefill):  # a departed prefill worker's connection goes too
        if pool_set is not None:
            pool_set.add_listener(lambda event: _on_worker_event(aggregated, event))
    health = _health_monitor(config, runtime, registry, workers, prefill, encoders, aggregated)
    app = FrontendApp(
        registry=registry,
        streamer=streamer,
        metrics=metrics,
        max_inflight_requests=config.max_inflight_requests,
        max_fanout=config.max_fanout,
        request_timeout_s=config.request_timeout_s,
        retry_after_s=config.retry_after_s,
        images=ImageLoader(config.images),
        health=health,
        api_keys=config.api_keys,
        admin_api_keys=config.admin_api_keys,
        workers=WorkerScraper(runtime.discovery, runtime.client, runtime.namespace),
        client=runtime.client,  # /v1/embeddings calls workers' `embed` endpoints
        **_tenancy(config),
        adapters=adapters,
    )
    owners = Ownership(
        has_api_keys=bool(config.api_keys or config.admin_api_keys), tenancy=app.tenancy
    )
    batch = _batch_lane(config, app, registry, metrics, owners)
    _add_dashboard(app, config, runtime, health, pool, batch)
    app.responses.store = ResponseStore(config.responses_store)
    app.responses.owners = owners
    app.responses.shared_port = config.http.reuse_port
    server = HttpServer(app, config=config.http)
    return _Frontend(
        registry=registry,
        adapters=adapters,
        collector=collector,
        aggregated=aggregated,
        pool=pool,
        encoders=encoders,
        health=health,
        app=app,
        server=server,
        batch=batch,
    )


def _batch_lane(
    config: FrontendConfig,
    app: FrontendApp,
    registry: ModelRegistry,
    metrics: FrontendMetrics,
    owners: Ownership,
) -> BatchLane:
    """/v1/files and /v1/batches, and the runner that sends batch lines through the app's
    own handlers (frontend/batch/)."""
    batch = BatchLane(
        config.batch, registry, owners, lambda path: app.handler_for("POST", path), app.tenancy
    )
    for (method, path), handler in batch.routes().items():
        app.add_route(method, path, handler)
    app.prefix_routes.append(batch.route)
    metrics.registry.register(batch)
    return batch


def _on_worker_event(streamer: EngineStreamer, event: InstanceEvent) -> None:
    """A worker that left discovery and stopped answering loses its streams and its pooled
    connection now (not after the stall timeout), so when it returns it is served afresh."""
    if event.kind == "removed":
        streamer.worker_removed(event.instance.instance_id, event.instance.address)


def _tenancy(config: FrontendConfig) -> dict[str, Any]:
    """The tenants file's tables and the host's shared limit buckets (issue 33), or nothing."""
    if config.tenants_file is None:
        return {}
    try:
        tenancy = Tenancy(config.tenants_file)
    except ConfigError as exc:
        raise StartupError(str(exc)) from exc
    db = tenancy.table.limits_db or default_db_path(config.tenants_file)
    return {"tenancy": tenancy, "limiter": RateLimiter(db)}


def _health_monitor(
    config: FrontendConfig,
    runtime: Runtime,
    registry: ModelRegistry,
    workers: InstanceSet,
    prefill: InstanceSet | None,
    encoders: InstanceSet,
    streamer: EngineStreamer,
) -> HealthMonitor:
    """/health and /live: instances of every pool, their load metrics on the event plane,
    whether the request plane reaches them and whether the stall watchdog excluded them."""
    watchdog = streamer.health
    components = [config.worker_component]
    if config.disagg.enabled:
        components.append(config.disagg.prefill_component)
    return HealthMonitor(
        registry=registry,
        workers=workers,
        prefill=prefill,
        encoders=encoders,
        events=runtime.events,
        subjects=[f"{runtime.namespace}.{component}.load_metrics" for component in components],
        stale_s=config.health_stale_s,
        namespace=runtime.namespace,
        client=runtime.client,
        excluded=watchdog.excluded if watchdog is not None else None,
    )


def _add_dashboard(
    app: FrontendApp,
    config: FrontendConfig,
    runtime: Runtime,
    health: HealthMonitor,
    pool: PrefillPool | None,
    batch: BatchLane,
) -> None:
    dashboard = Dashboard(
        registry=app.registry,
        num_inflight=lambda: app.admission.num_inflight,
        max_inflight=config.max_inflight_requests,
        health=health,
        prefill_pool=pool,
        discovery=runtime.discovery,
        namespace=runtime.namespace,
        batches=batch.summary,
        tenancy=app.tenancy,
    )
    app.add_route("GET", "/dashboard", dashboard.page)
    app.add_route("GET", "/dashboard/state", dashboard.state_endpoint)


def _publish_request_stats(
    config: FrontendConfig, runtime: Runtime, collector: RequestStatsCollector
) -> asyncio.Task[None] | None:
    """The planner's per-interval request stats on the event plane (None when off)."""
    if not config.request_stats_interval_s:
        return None
    return asyncio.create_task(
        publish_request_stats(
            collector, runtime.events, runtime.namespace, config.request_stats_interval_s
        ),
        name="frontend-request-stats",
    )


async def _listen(server: HttpServer, config: FrontendConfig) -> tuple[str, int]:
    try:
        return await server.start(config.host, config.port)
    except OSError as exc:
        where = f"http://{config.host}:{config.port}"
        raise StartupError(f"cannot listen on {where}: {exc.strerror or exc}") from exc


REUSE_PORT_WAIT_S = 600.0


async def _wait_for_a_model(registry: ModelRegistry, stop: asyncio.Event | None) -> None:
    """With SO_REUSEPORT the kernel hands this process connections as soon as it listens; a
    frontend that has not yet seen a model would answer them 404, so it listens only once one
    has been prepared (or `stop` is set, or REUSE_PORT_WAIT_S pass: then it listens anyway)."""
    waits = [asyncio.ensure_future(registry.any_prepared.wait())]
    if stop is not None:
        waits.append(asyncio.ensure_future(stop.wait()))
    done, pending = await asyncio.wait(
        waits, timeout=REUSE_PORT_WAIT_S, return_when=asyncio.FIRST_COMPLETED
    )
    for task in pending:
        task.cancel()
    if not done:
        logger.warning("no model ready after %.0f s; listening anyway", REUSE_PORT_WAIT_S)
