"""vLLM's per-step scheduler stats → the worker's `EngineLoad`, and vLLM's Prometheus
metrics served over HTTP by the worker (`--metrics-port`)."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from tandem.protocols.scaling import StepSample

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
        self.kv_capacity_tokens = 0  # num_gpu_blocks × block_size, set once the engine started
        # prompt tokens whose KV vLLM loaded from another engine (its NixlConnector: peer fetch)
        self.num_external_kv_tokens = 0
        self.steps: deque[StepSample] = deque(maxlen=4096)  # for the planner; oldest dropped
        self._last_ts: float | None = None  # previous record's IterationStats.iteration_timestamp
        self._last_idle = True

    def record_step(self, scheduler_stats: Any, iteration_stats: Any) -> None:
        """Append one `StepSample` for a vLLM iteration (one `record` call).

        Fields, from what vLLM 0.32 hands its stat loggers:
        - wall_ms: `scheduler_stats.iteration_details.elapsed_ms` when vLLM measured it in the
          engine core (only with the engine arg `enable_logging_iteration_details`); otherwise
          the gap between this and the previous record's `iteration_stats.iteration_timestamp`
          (the frontend's clock when it took the step's outputs; with a busy engine that gap
          is one step), capped by the smallest time-to-first-token of this iteration (a
          request prefilled here arrived before the step began), so a step after an idle
          spell does not count the idle time. A step after idle with no first token in it
          has no honest wall time and is not sampled, nor is a step with no outputs (vLLM
          builds no IterationStats for it), nor the step after one.
        - num_prefill_tokens: `iteration_details.num_ctx_tokens` when present, else
          `iteration_stats.prompt_token_stats.computed` (uncached prompt tokens). vLLM counts
          those when a request's prefill finishes, so a chunked prefill lands in its last step.
        - num_decode_kv_tokens: vLLM reports no per-request context lengths to stat loggers;
          approximated as `kv_cache_usage × num_gpu_blocks × block_size` (allocated KV, in
          whole blocks, including any request still prefilling).
        - num_running / num_waiting: `num_running_reqs`, `num_waiting_reqs +
          num_skipped_waiting_reqs`.
        """
        if scheduler_stats is None:
            return
        last_ts, last_idle = self._last_ts, self._last_idle
        running = int(scheduler_stats.num_running_reqs)
        waiting = int(scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs)
        # a record without outputs has no IterationStats, so no timestamp: the next gap is unknown
        ts = None if iteration_stats is None else float(iteration_stats.iteration_timestamp)
        self._last_ts, self._last_idle = ts, running == 0 and waiting == 0
        details = getattr(scheduler_stats, "iteration_details", None)
        wall_ms: float | None = None
        if details is not None and not details.is_dummy:
            wall_ms, prefill = float(details.elapsed_ms), int(details.num_ctx_tokens)
        elif iteration_stats is not None and ts is not None:
            prefill = int(iteration_stats.prompt_token_stats.computed)
            bounds = list(iteration_stats.time_to_first_tokens_iter)
            if last_ts is not None and not last_idle:
                bounds.append(ts - last_ts)
            wall_ms = min(bounds) * 1000.0 if bounds else None
        if wall_ms is None or wall_ms < 0:
            return
        self.steps.append(
            StepSample(
                wall_ms=wall_ms,
                num_prefill_tokens=prefill,
                num_decode_kv_tokens=round(
                    float(scheduler_stats.kv_cache_usage) * self.kv_capacity_tokens
                ),
                num_running=running,
                num_waiting=waiting,
            )
        )

    def take_steps(self) -> list[StepSample]:
        """The steps recorded since the last call (deque ops are atomic)."""
        out: list[StepSample] = []
        while self.steps:
            out.append(self.steps.popleft())
        return out


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
            if iteration_stats is not None:
                tokens = iteration_stats.prompt_token_stats.external_kv_transfer
                snapshot.num_external_kv_tokens += int(tokens)
            if scheduler_stats is None:
                return
            snapshot.num_running = scheduler_stats.num_running_reqs
            snapshot.num_waiting = (
                scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            )
            snapshot.kv_cache_usage = scheduler_stats.kv_cache_usage
            snapshot.record_step(scheduler_stats, iteration_stats)
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
