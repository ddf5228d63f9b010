"""The frontend's spans of a request that migrates: frontend + two fake workers in one process
(the first worker dies mid-stream). The continuation runs under a `migration` span (child of
the request's root) whose route and worker call are its children; each worker received the
traceparent of the span it works for."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from typing import Any

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tests.integration.test_frontend_openai import MODEL, FakeWorker, _start
from tests.support.eventually import eventually

from tandem.protocols.engine import decode_request
from tandem.runtime import tracing

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exp = InMemorySpanExporter()
    tracing.configure("http://unused", "tandem-frontend", exporter=exp)
    yield exp
    tracing.shutdown()


async def test_migration_span_parents_the_continuation(
    exporter: InMemorySpanExporter, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[str, str | None]] = []
    original = FakeWorker.handler

    async def handler(self: FakeWorker, payload: bytes, ctx: Any) -> AsyncIterator[bytes]:
        seen.append((decode_request(payload).request_id, ctx.traceparent))
        async for item in original(self, payload, ctx):
            yield item

    monkeypatch.setattr(FakeWorker, "handler", handler)
    async with AsyncExitStack() as stack:
        s = await _start(stack, 2, migration_limit=1, die_after=5, deaths={"left": 1})
        client = s.client()
        out = await client.completions.create(model=MODEL, prompt=[7] * 30, max_tokens=20)
        await client.close()
        assert out.usage is not None and out.usage.completion_tokens == 20
    tracing._provider.force_flush()
    spans = exporter.get_finished_spans()
    [root] = [x for x in spans if x.name == "POST /v1/completions"]
    [migration] = [x for x in spans if x.name == "migration"]
    routes = sorted((x for x in spans if x.name == "route"), key=lambda x: x.start_time)
    assert migration.parent.span_id == root.context.span_id
    assert migration.attributes["attempt"] == 1
    assert migration.attributes["num_tokens"] == 5
    assert len(routes) == 2
    assert routes[0].parent.span_id == root.context.span_id
    assert routes[1].parent.span_id == migration.context.span_id  # the re-route is its child
    assert migration.attributes["from_worker"] == routes[0].attributes["worker_id"]
    assert routes[1].attributes["worker_id"] != routes[0].attributes["worker_id"]
    assert migration.start_time >= routes[0].end_time and migration.end_time <= root.end_time

    def span_id(traceparent: str | None) -> int:
        assert traceparent is not None
        return int(traceparent.split("-")[2], 16)

    [(first_id, first_tp)] = [x for x in seen if not x[0].endswith("-m1")]
    [(_, moved_tp)] = [x for x in seen if x[0].endswith("-m1")]
    assert span_id(first_tp) == root.context.span_id
    assert span_id(moved_tp) == migration.context.span_id
    assert root.attributes["request_id"] == first_id == out.id


async def test_remote_router_and_workers_are_children_of_the_callers_span(
    exporter: InMemorySpanExporter,
) -> None:
    from tests.integration.test_router_service import cluster, req

    async with cluster(2) as c:
        router = await c.remote()
        await eventually(lambda: len(router.services.instances) == 1)
        with tracing.span("caller") as caller:
            outs = await c.generate(router, req("r1", list(range(12)), max_tokens=3))
        assert sum(len(o.token_ids) for o in outs) == 3
    tracing._provider.force_flush()
    spans = exporter.get_finished_spans()
    caller_id = caller.get_span_context().span_id
    [route] = [s for s in spans if s.name == "route"]  # in the router service, over TCP
    assert route.parent.span_id == caller_id
    assert route.context.trace_id == caller.get_span_context().trace_id
    [worker] = [s for s in spans if s.name == "worker.generate"]
    assert worker.parent.span_id == caller_id
    assert worker.attributes["worker_id"] == route.attributes["worker_id"]
    assert worker.attributes["role"] == "aggregated"
    prefill = next(s for s in spans if s.name == "prefill")
    decode = next(s for s in spans if s.name == "decode")
    assert prefill.parent.span_id == decode.parent.span_id == worker.context.span_id
    assert prefill.end_time <= decode.start_time
