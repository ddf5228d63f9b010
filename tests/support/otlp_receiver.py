"""An in-process OTLP/HTTP trace receiver: `POST /v1/traces` with an
`ExportTraceServiceRequest` protobuf (gzip or not), decoded with opentelemetry-proto; the
spans are kept as `ReceivedSpan`s for the test to inspect."""

from __future__ import annotations

import contextlib
import gzip
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    start_ns: int
    end_ns: int
    kind: int
    attributes: dict[str, Any] = field(default_factory=dict)
    status_code: int = 0


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


@dataclass
class OtlpReceiver:
    url: str = ""
    spans: list[ReceivedSpan] = field(default_factory=list)
    num_exports: int = 0

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        if request.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        export = ExportTraceServiceRequest()
        export.ParseFromString(body)
        self.num_exports += 1
        for rs in export.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            kind=s.kind,
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            status_code=s.status.code,
                        )
                    )
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(),
            content_type="application/x-protobuf",
        )


@contextlib.asynccontextmanager
async def otlp_receiver() -> AsyncIterator[OtlpReceiver]:
    receiver = OtlpReceiver()
    app = web.Application(client_max_size=64 << 20)
    app.router.add_post("/v1/traces", receiver.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    receiver.url = f"http://127.0.0.1:{port}"
    try:
        yield receiver
    finally:
        await runner.cleanup()
