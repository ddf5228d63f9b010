"""OpenTelemetry spans of the request lifecycle, exported by OTLP when configured.

Off unless `configure(endpoint, service_name)` ran (an entry point's `--otlp-endpoint`):
then every helper here returns at once — `start` returns None, `span` a shared no-op
context manager — and the OpenTelemetry SDK is never imported. Code that runs on every
request checks `tracing.enabled` first (one attribute read), so a process without an
endpoint does not call into this module for a request and allocates nothing.

The current span is this module's context variable (not OpenTelemetry's context, whose
attach/detach cannot cross an async generator's `yield`). Set it only around code without a
`yield` of an async generator in between (`span`, `use`): a request's coroutine or its own
task. Generators take their parent explicitly (`start(..., parent=...)`).

Across processes the W3C `traceparent` travels: an incoming HTTP `traceparent` header is the
frontend's root span's parent; the request plane (`tandem.runtime.tcp`) sends the current
span's `traceparent` with each request, and the worker's span is its child.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import logging
import re
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING, Any, TypeAlias, cast

if TYPE_CHECKING:  # the tracing extra; imported at run time only once configured
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import Span, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import SpanKind, Tracer

logger = logging.getLogger(__name__)

# a span's parent: a span of this process, or a remote caller's W3C `traceparent`
Parent: TypeAlias = "Span | str"

_tracer: Tracer | None = None  # set once configured; None = tracing off
enabled = False  # whether spans are made: `configure` ran and `shutdown` did not since
_provider: TracerProvider | None = None
_current: ContextVar[Parent | None] = ContextVar("tandem_span", default=None)
_NOOP = contextlib.nullcontext(None)
_TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")

SERVER, CLIENT, INTERNAL = "server", "client", "internal"
# what `configure` imports: the `tracing` extra (pyproject.toml), not a default dependency
INSTALL_HINT = "pip install 'tandem[tracing]'"
_EXTRA_MODULES = (
    "opentelemetry.sdk.trace",
    "opentelemetry.exporter.otlp.proto.http.trace_exporter",
)


def missing_extra() -> str | None:
    """Why `configure` cannot run in this environment (a module of the tracing extra does not
    import), or None when it can."""
    for name in _EXTRA_MODULES:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            return f"{exc.name or name} is not installed"
    return None


def configure(endpoint: str, service_name: str, *, exporter: SpanExporter | None = None) -> None:
    """Export spans of this process by OTLP http/protobuf to `endpoint` (a base URL;
    `/v1/traces` is appended unless given) under `service_name`. `exporter` replaces the
    OTLP exporter (tests). Idempotent per process: a second call replaces the first."""
    global _tracer, _provider, enabled
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    if exporter is None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        url = endpoint.rstrip("/")
        if not url.endswith("/v1/traces"):
            url += "/v1/traces"
        exporter = OTLPSpanExporter(endpoint=url, timeout=5)
    if _provider is not None:
        _provider.shutdown()
    _provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    _provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=500))
    _tracer = _provider.get_tracer("tandem")
    enabled = True
    atexit.register(shutdown)
    logger.info("tracing on: OTLP to %s as service %s", endpoint, service_name)


def shutdown() -> None:
    """Flush the spans not yet exported and turn tracing off (idempotent)."""
    global _tracer, _provider, enabled
    provider, _provider, _tracer, enabled = _provider, None, None, False
    if provider is not None:
        provider.shutdown()


def current() -> Parent | None:
    """The current span (None when tracing is off or outside a request)."""
    return _current.get() if _tracer is not None else None


def start(
    name: str,
    *,
    parent: Parent | None = None,
    kind: str = INTERNAL,
    start_time_ns: int | None = None,
    **attributes: Any,
) -> Span | None:
    """A started span (None when tracing is off), child of `parent` (a span or a traceparent
    string) or else of the current span; a root when neither. End it with `end`."""
    tracer = _tracer
    if tracer is None:
        return None
    from opentelemetry import trace
    from opentelemetry.context import Context

    if parent is None:
        parent = _current.get()
    if isinstance(parent, str):
        ctx = _context_from_traceparent(parent)
    elif parent is not None:
        ctx = trace.set_span_in_context(parent, Context())
    else:
        ctx = Context()
    span = tracer.start_span(
        name,
        context=ctx,
        kind=_kind(kind),
        attributes={k: v for k, v in attributes.items() if v is not None},
        start_time=start_time_ns,
    )
    return cast("Span", span)  # the SDK's TracerProvider (configure) makes SDK spans


def end(span: Span | None, error: BaseException | str | None = None, **attributes: Any) -> None:
    """Set `attributes`, mark an error, and end `span` (a no-op for None)."""
    if span is None:
        return
    for key, value in attributes.items():
        if value is not None:
            span.set_attribute(key, value)
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end()


def since_current(name: str, **attributes: Any) -> None:
    """A span from the current span's start until now, e.g. `first_token` under a request's
    root span: its length is the time to the first token."""
    if _tracer is None:
        return
    parent = _current.get()
    if parent is not None and not isinstance(parent, str):
        end(start(name, parent=parent, start_time_ns=parent.start_time, **attributes))


@contextlib.contextmanager
def _span(
    name: str, parent: Parent | None, kind: str, attributes: dict[str, Any]
) -> Iterator[Span | None]:
    span = start(name, parent=parent, kind=kind, **attributes)
    token = _current.set(span)
    error: BaseException | None = None
    try:
        yield span
    except BaseException as exc:
        error = exc
        raise
    finally:
        _current.reset(token)
        end(span, error)


def span(
    name: str, *, parent: Parent | None = None, kind: str = INTERNAL, **attributes: Any
) -> contextlib.AbstractContextManager[Span | None]:
    """A span around a block, current inside it (a shared no-op when tracing is off)."""
    if _tracer is None:
        return _NOOP
    return _span(name, parent, kind, attributes)


@contextlib.contextmanager
def _use(span: Parent) -> Iterator[Parent]:
    token = _current.set(span)
    try:
        yield span
    finally:
        _current.reset(token)


def use(span: Parent | None) -> contextlib.AbstractContextManager[Parent | None]:
    """`span` is the current span inside the block: a span, or a remote parent's
    `traceparent` string (a service handler's caller). No-op for None or tracing off."""
    if span is None or _tracer is None:
        return _NOOP
    return _use(span)


def current_traceparent() -> str | None:
    """W3C `traceparent` of the current span, to send with an outgoing request."""
    if _tracer is None:
        return None
    span = _current.get()
    if span is None or isinstance(span, str):
        return span
    ctx = span.get_span_context()
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def is_traceparent(value: object) -> bool:
    return isinstance(value, str) and _TRACEPARENT.match(value) is not None


def _context_from_traceparent(value: str) -> Context:
    """A context whose span is the remote parent `value` names; an empty one (a new root)
    when `value` is malformed (an untrusted header must not break the request)."""
    from opentelemetry import trace
    from opentelemetry.context import Context

    match = _TRACEPARENT.match(value.strip().lower())
    if match is None or set(match.group(1)) == {"0"} or set(match.group(2)) == {"0"}:
        return Context()
    parent = trace.SpanContext(
        trace_id=int(match.group(1), 16),
        span_id=int(match.group(2), 16),
        is_remote=True,
        trace_flags=trace.TraceFlags(int(match.group(3), 16)),
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(parent), Context())


def _kind(kind: str) -> SpanKind:
    from opentelemetry.trace import SpanKind

    return {SERVER: SpanKind.SERVER, CLIENT: SpanKind.CLIENT}.get(kind, SpanKind.INTERNAL)
