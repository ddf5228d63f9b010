"""The trace of one disaggregated request, collected by an in-process OTLP receiver from
`tandem serve --engine mocker --prefill-workers 1 --decode-workers 1 --otlp-endpoint URL`
(three processes): one trace id across the frontend and both workers, the client's
`traceparent` as the root's parent, each worker's span a child of the frontend's root (the
request plane carried the context), and the lifecycle spans in order: preprocess → route →
prefill worker (prefill) → first token → decode worker (kv_transfer → decode)."""

from __future__ import annotations

import asyncio
import json
import secrets
from pathlib import Path

import pytest
from tests.support.otlp_receiver import ReceivedSpan, otlp_receiver
from tests.support.services import free_port
from tests.support.tandem_procs import MODEL, http_request, start_tandem

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

PROMPT = " ".join(f"word{i}" for i in range(150))
SERVER = 2  # SpanKind.SPAN_KIND_SERVER in OTLP


def _one(spans: list[ReceivedSpan], name: str, **attrs: object) -> ReceivedSpan:
    found = [
        s
        for s in spans
        if s.name == name and all(s.attributes.get(k) == v for k, v in attrs.items())
    ]
    assert len(found) == 1, (name, attrs, [(s.service, s.name, s.attributes) for s in spans])
    return found[0]


async def test_one_disaggregated_request_is_one_trace(tmp_path: Path) -> None:
    async with otlp_receiver() as receiver:
        port = free_port()
        args = ["serve", "--engine", "mocker", "--prefill-workers", "1", "--decode-workers", "1"]
        args += ["--port", str(port), "--run-dir", str(tmp_path / "run")]
        args += ["--otlp-endpoint", receiver.url, "--speedup-ratio", "20"]
        serve = start_tandem("serve", args, tmp_path)
        try:
            await asyncio.to_thread(serve.wait_log, r"tandem serve ready", 60.0)
            trace_id, client_span = secrets.token_hex(16), secrets.token_hex(8)
            status, _, body = await asyncio.to_thread(
                http_request,
                f"http://127.0.0.1:{port}/v1/completions",
                {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "ignore_eos": True},
                30.0,
                {"traceparent": f"00-{trace_id}-{client_span}-01"},
            )
            assert status == 200, body
            request_id = json.loads(body)["id"]

            def mine() -> list[ReceivedSpan]:
                return [s for s in receiver.spans if s.trace_id == trace_id]

            async with asyncio.timeout(30):  # each process exports every 0.5 s
                while not {"decode", "kv_transfer", "first_token"} <= {s.name for s in mine()}:  # noqa: ASYNC110 - other processes export
                    await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # let any straggling export land before checking counts
        finally:
            await asyncio.to_thread(serve.stop)

    spans = mine()
    assert all(s.trace_id == trace_id for s in spans)
    root = _one(spans, "POST /v1/completions")
    assert root.service == "tandem-frontend" and root.kind == SERVER
    assert root.parent_span_id == client_span  # the client's traceparent was honoured
    assert root.attributes["request_id"] == request_id
    preprocess = _one(spans, "preprocess")
    first_token = _one(spans, "first_token")
    route_prefill = _one(spans, "route", pool="prefill")
    routes_decode = [s for s in spans if s.name == "route" and s.attributes["pool"] == "backend"]
    assert routes_decode
    for span in (preprocess, first_token, route_prefill, *routes_decode):
        assert span.service == "tandem-frontend" and span.parent_span_id == root.span_id

    worker_roots = [s for s in spans if s.name == "worker.generate"]
    assert {s.service for s in worker_roots} == {"tandem-worker"}
    prefill_root = _one(worker_roots, "worker.generate", role="prefill")
    decode_root = _one(worker_roots, "worker.generate", role="decode")
    for span in (prefill_root, decode_root):  # carried over the request plane
        assert span.parent_span_id == root.span_id and span.kind == SERVER
        assert span.attributes["request_id"] == request_id
    assert route_prefill.attributes["worker_id"] == prefill_root.attributes["worker_id"]
    prefill = _one(spans, "prefill")
    assert prefill.parent_span_id == prefill_root.span_id
    kv_transfer = _one(spans, "kv_transfer")
    decode = _one(spans, "decode")
    assert kv_transfer.parent_span_id == decode_root.span_id
    assert kv_transfer.attributes["mode"] == "pull" and kv_transfer.status_code != 2
    assert decode.parent_span_id == decode_root.span_id

    # in order: preprocess, route, prefill worker, first token, decode worker
    assert root.start_ns <= preprocess.start_ns <= preprocess.end_ns <= route_prefill.start_ns
    assert route_prefill.end_ns <= prefill_root.start_ns <= prefill.start_ns
    assert prefill.end_ns <= prefill_root.end_ns <= first_token.end_ns
    assert first_token.start_ns == root.start_ns  # first_token: its length is the TTFT
    assert prefill_root.end_ns <= decode_root.start_ns <= kv_transfer.start_ns
    assert kv_transfer.end_ns <= decode.start_ns <= decode.end_ns <= decode_root.end_ns
    assert decode_root.end_ns <= root.end_ns
