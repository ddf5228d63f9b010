"""`tandem bench tracing`: what the request path's tracing and log-scope hooks cost per
request, with tracing off (the default) and on (spans built and handed to an in-memory
exporter, so no network is timed).

The timed function makes the calls one aggregated request makes in the frontend
(`frontend/pipeline/generate.py`, `router/policy_router.py`, `frontend/migration.py`, the
request-plane client) and in its worker (`engines/worker.py`): root + preprocess spans and
the log request scope (JSON logs only), the route span, the traceparent for the request
plane, first_token, the worker's span check. It reports µs per request against an empty
loop, and whether the OpenTelemetry SDK was imported while tracing was off (it must not be).
`tandem bench frontend` gives the end-to-end CPU per request of a whole frontend, where this
overhead is lost in the noise."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Callable

from tandem.frontend.http.message import HttpRequest
from tandem.frontend.pipeline.generate import request_context, step_span
from tandem.runtime import log_format, tracing
from tandem.runtime.log_format import request_scope

logger = logging.getLogger(__name__)
_HTTP = HttpRequest("POST", "/v1/completions", "")  # the request's, built before the hooks


def request_hooks() -> None:
    """The tracing/log calls of one request, frontend and worker, in order: each behind the
    check the request path makes (`tracing.enabled`, `log_format.request_ids_logged`)."""
    with request_context(_HTTP, "cmpl-bench", "m"):
        logger.debug("request_id=%s %s model=%s", "cmpl-bench", "/v1/completions", "m")
        with step_span("preprocess"):
            pass
        if tracing.enabled:
            route = tracing.start("route", policy="kv", pool="backend")
            tracing.end(route, worker_id="w0", overlap_blocks=0, request_blocks=4)
        traceparent = tracing.current_traceparent() if tracing.enabled else None
        if tracing.enabled:
            tracing.since_current("first_token")
    # the worker's side
    log_scope = request_scope("cmpl-bench") if log_format.request_ids_logged else None
    if log_scope is not None:
        log_scope.__enter__()
    if tracing.enabled:
        worker = tracing.start("worker.generate", parent=traceparent, kind=tracing.SERVER)
        tracing.end(tracing.start("prefill", parent=worker))
        tracing.end(tracing.start("decode", parent=worker))
        tracing.end(worker)
    if log_scope is not None:
        log_scope.__exit__(None, None, None)


def _empty() -> None:
    pass


def per_call_us(fn: Callable[[], None], iterations: int, repeats: int = 5) -> float:
    """Best of `repeats` runs (least disturbed by other processes), µs per call."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iterations):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / iterations * 1e6


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench tracing", description=__doc__)
    parser.add_argument("--iterations", type=int, default=100_000)
    args = parser.parse_args(argv)
    base = per_call_us(_empty, args.iterations)
    off = per_call_us(request_hooks, args.iterations)
    sdk_loaded_off = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    tracing.configure("http://unused", "bench", exporter=exporter)
    on = per_call_us(request_hooks, max(args.iterations // 10, 1), repeats=3)
    tracing.shutdown()
    print(f"empty loop:                   {base:8.3f} µs per call")
    print(f"tracing off (hooks of 1 req): {off - base:8.3f} µs per request")
    print(f"tracing on  (6 spans, memory):{on - base:8.3f} µs per request")
    print(f"OpenTelemetry modules imported while off: {len(sdk_loaded_off)}")
    return 0 if not sdk_loaded_off else 1
