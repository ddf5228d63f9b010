"""Wiring of the frontend: runtime → model registry (routers, tokenizers) → app → HTTP server.

`serve_frontend` runs inside an existing event loop with a given Runtime (the all-in-one
`tandem serve` calls it); `run(config, runtime_config)` is the `tandem frontend` process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from tandem.frontend.app import FrontendApp
from tandem.frontend.config import FrontendConfig
from tandem.frontend.http_server import HttpServer
from tandem.frontend.metrics import FrontendMetrics
from tandem.frontend.migration import EngineStreamer
from tandem.frontend.models import ModelRegistry
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.runtime import Runtime, open_runtime

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
    registry = ModelRegistry(
        config,
        runtime.instance_set(config.worker_component, config.worker_endpoint),
        events=runtime.events,
        client=runtime.client,
        namespace=runtime.namespace,
    )
    metrics = FrontendMetrics()
    streamer = EngineStreamer(
        runtime.client,
        runtime.endpoint_path(config.worker_component, config.worker_endpoint),
        migration_limit=config.migration_limit,
        on_migrate=lambda model: metrics.migrations.inc((model,)),
    )
    app = FrontendApp(
        registry=registry,
        streamer=streamer,
        metrics=metrics,
        max_inflight_requests=config.max_inflight_requests,
        request_timeout_s=config.request_timeout_s,
        retry_after_s=config.retry_after_s,
    )
    server = HttpServer(app, max_body_bytes=config.max_body_bytes)
    await registry.start()
    try:
        host, port = await server.start(config.host, config.port)
        logger.info("frontend listening on http://%s:%d", host, port)
        if bound is not None:
            bound.append((host, port))
        if ready is not None:
            ready.set()
        await (stop or asyncio.Event()).wait()
    finally:
        await server.stop()
        await registry.close()


async def run_frontend(config: FrontendConfig, runtime_config: RuntimeConfig) -> None:
    """The `tandem frontend` process: open the runtime, serve until SIGTERM/SIGINT."""
    from tandem.runtime.lifecycle import install_signal_handlers

    stop = asyncio.Event()
    async with open_runtime(runtime_config) as runtime:
        install_signal_handlers(stop)
        await serve_frontend(config, runtime, stop=stop)


def run(config: FrontendConfig, runtime_config: RuntimeConfig) -> int:
    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(run_frontend(config, runtime_config))
    return 0
