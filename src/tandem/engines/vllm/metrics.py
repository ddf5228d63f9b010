"""vLLM's per-step scheduler stats → the worker's `EngineLoad`, and vLLM's Prometheus
metrics served over HTTP by the worker (`--metrics-port`)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class SchedulerSnapshot:
    """The latest stats vLLM recorded. Written by vLLM's output handler (on the worker's event
    loop), read by `VllmEngine.load`; plain attribute swaps, no lock needed."""

    def __init__(self) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self.num_steps = 0
        self.on_change: Callable[[], None] | None = None


def stat_logger_factory(snapshot: SchedulerSnapshot) -> Any:
    """A vLLM `StatLoggerFactory` whose loggers write into `snapshot`."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class TandemLoadLogger(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is None:
                return
            snapshot.num_running = scheduler_stats.num_running_reqs
            snapshot.num_waiting = (
                scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            )
            snapshot.kv_cache_usage = scheduler_stats.kv_cache_usage
            snapshot.num_steps += 1
            if snapshot.on_change is not None:
                snapshot.on_change()

        def log_engine_initialized(self) -> None:
            pass

    return TandemLoadLogger


class PrometheusServer:
    """vLLM's metrics (prometheus_client's default registry, filled by vLLM's own
    PrometheusStatLogger) on http://host:port/metrics, from a daemon thread."""

    def __init__(self, host: str, port: int) -> None:
        from prometheus_client import start_http_server

        self._server, self._thread = start_http_server(port, addr=host)
        self.port = int(self._server.server_address[1])
        self.url = f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=2.0)


def start_metrics_server(host: str, port: int) -> PrometheusServer | None:
    try:
        return PrometheusServer(host, port)
    except OSError as exc:
        logger.warning("cannot serve vLLM metrics on %s:%d: %s", host, port, exc)
        return None
