"""`tandem.runtime.tracing`: off costs nothing (no SDK import, no span objects); on, spans
nest as documented and the current span's `traceparent` rides the request plane's REQUEST
frame into the server's StreamContext (left out of the frame when tracing is off)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from tandem.runtime import tracing
from tandem.runtime.tcp import StreamContext, TcpRequestClient, TcpRequestServer
from tandem.runtime.tcp import frame as fr

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exp = InMemorySpanExporter()
    tracing.configure("http://unused", "test-service", exporter=exp)
    yield exp
    tracing.shutdown()


def finished(exp: InMemorySpanExporter) -> dict[str, Any]:
    tracing._provider.force_flush()
    return {s.name: s for s in exp.get_finished_spans()}


def test_off_imports_no_sdk_and_makes_no_spans() -> None:
    code = """
import sys
from tandem.runtime import tracing
import tandem.frontend.main, tandem.engines.worker, tandem.disagg.decode, tandem.router.kv_router
assert tracing.start("x") is None and tracing.current_traceparent() is None
with tracing.span("y") as s:
    assert s is None
assert tracing.span("a") is tracing.span("b")  # one shared no-op, nothing allocated
tracing.since_current("first_token")
loaded = [m for m in sys.modules if m.startswith("opentelemetry")]
assert not loaded, loaded
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_spans_nest_and_parents_come_from_traceparent(exporter: InMemorySpanExporter) -> None:
    incoming = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with tracing.span("root", parent=incoming, kind=tracing.SERVER, request_id="r1") as root:
        with tracing.span("child"):
            tracing.end(tracing.start("leaf"))
        tracing.since_current("first_token")
        sent = tracing.current_traceparent()
    spans = finished(exporter)
    assert spans["root"].context.trace_id == 0x0AF7651916CD43DD8448EB211C80319C
    assert spans["root"].parent.span_id == 0xB7AD6B7169203331
    assert spans["root"].attributes["request_id"] == "r1"
    assert spans["child"].parent.span_id == root.get_span_context().span_id
    assert spans["leaf"].parent.span_id == spans["child"].context.span_id
    assert spans["first_token"].start_time == spans["root"].start_time
    assert sent == f"00-{root.get_span_context().trace_id:032x}-" + (
        f"{root.get_span_context().span_id:016x}-01"
    )


def test_a_malformed_traceparent_starts_a_new_trace(exporter: InMemorySpanExporter) -> None:
    for bad in ("garbage", "00-" + "0" * 32 + "-b7ad6b7169203331-01"):
        with tracing.span("root", parent=bad):
            pass
        span = finished(exporter)["root"]
        assert span.parent is None and span.context.trace_id != 0
        exporter.clear()


def test_an_error_marks_the_span(exporter: InMemorySpanExporter) -> None:
    with pytest.raises(ValueError), tracing.span("boom"):
        raise ValueError("bad")
    assert not finished(exporter)["boom"].status.is_ok


@pytest.fixture
async def server() -> AsyncIterator[tuple[TcpRequestServer, list[StreamContext]]]:
    seen: list[StreamContext] = []

    async def handler(payload: bytes, ctx: Any) -> AsyncIterator[bytes]:
        seen.append(ctx)
        yield b"ok"

    srv = TcpRequestServer()
    srv.register("ns.c.e", handler)
    await srv.start()
    yield srv, seen
    await srv.stop(grace_s=0)


async def test_traceparent_rides_the_request_plane(server, exporter) -> None:  # type: ignore[no-untyped-def]
    srv, seen = server
    client = TcpRequestClient()
    try:
        with tracing.span("caller") as caller:
            stream = client.stream(srv.address, "ns.c.e", b"", request_id="r1")
        assert [x async for x in stream] == [b"ok"]  # sent after the span was left: captured
        ctx = caller.get_span_context()
        flags = int(ctx.trace_flags)
        assert seen[0].traceparent == f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{flags:02x}"
        assert [x async for x in client.stream(srv.address, "ns.c.e", b"", request_id="r2")]
        assert seen[1].traceparent is None  # no current span: nothing sent
    finally:
        await client.close()


async def test_without_tracing_the_frame_has_no_traceparent(server, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    srv, seen = server
    frames: list[Any] = []
    encode = fr.encode
    monkeypatch.setattr(fr, "encode", lambda f: frames.append(f) or encode(f))
    client = TcpRequestClient()
    try:
        assert [x async for x in client.stream(srv.address, "ns.c.e", b"", request_id="r1")]
    finally:
        await client.close()
    requests = [f for f in frames if f[0] == fr.REQUEST]
    assert len(requests) == 1 and requests[0][7] is None  # no trace context sent
    assert seen[0].traceparent is None
