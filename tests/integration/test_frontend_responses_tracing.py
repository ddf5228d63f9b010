"""`/v1/responses` and `/v1/embeddings` open the same root span as chat (a child of the
client's traceparent, with the request id), and a response's route span is its child."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AsyncExitStack

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from tests.support.frontend_stack import FrontendStack

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.runtime import tracing

pytestmark = pytest.mark.timeout(30)
MODEL = "smollm2"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    exp = InMemorySpanExporter()
    tracing.configure("http://unused", "tandem-frontend", exporter=exp)
    yield exp
    tracing.shutdown()


async def test_root_spans_of_responses_and_embeddings(exporter: InMemorySpanExporter) -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        await s.add_worker(MockerEngine(MockerConfig(speedup_ratio=0)))
        await s.start_frontend({"model": MODEL, "input": "x"}, ready_path="/v1/embeddings")
        assert s.http is not None
        headers = {"traceparent": PARENT}
        body = {"model": MODEL, "input": "hi", "max_output_tokens": 2}
        async with s.http.post(f"{s.base}/v1/responses", json=body, headers=headers) as r:
            response_id = (await r.json())["id"]
        async with s.http.post(
            f"{s.base}/v1/embeddings", json={"model": MODEL, "input": "hi"}, headers=headers
        ) as r:
            assert r.status == 200
    assert tracing._provider is not None
    tracing._provider.force_flush()
    spans = exporter.get_finished_spans()
    [responses] = [x for x in spans if x.name == "POST /v1/responses"]
    assert responses.attributes["request_id"] == response_id
    assert f"{responses.context.trace_id:032x}" == TRACE_ID
    route = [x for x in spans if x.name == "route" and x.parent is not None
             and x.parent.span_id == responses.context.span_id]  # fmt: skip
    assert len(route) == 1
    embeds = [x for x in spans if x.name == "POST /v1/embeddings"]
    assert any(f"{x.context.trace_id:032x}" == TRACE_ID for x in embeds)
    assert all(str(x.attributes["request_id"]).startswith("embd-") for x in embeds)
