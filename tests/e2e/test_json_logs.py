"""`--log-format json`: `tandem frontend` and a `tandem worker` (mocker, file discovery, ZMQ
events) write one JSON object per line, and every line logged for a request — in the frontend
and in the worker — carries that request's id."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tests.support.services import free_port
from tests.support.tandem_procs import (
    MODEL,
    http_request,
    start_tandem,
    start_worker,
    wait_healthy,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]
FLAGS = ["--log-format", "json", "--log-level", "DEBUG"]


def _lines(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        entry = json.loads(line)  # every line is one JSON object
        assert {"ts", "level", "logger", "message"} <= set(entry), line
        out.append(entry)
    return out


def test_request_scoped_lines_carry_the_request_id(tmp_path: Path) -> None:
    runtime = ["--discovery", "file", "--discovery-dir", str(tmp_path / "disc")]
    runtime += ["--events", "zmq"]
    port = free_port()
    frontend = start_tandem(
        "frontend", ["frontend", "--port", str(port), *runtime, *FLAGS], tmp_path
    )
    worker = None
    try:
        worker, _ = start_worker("worker", runtime, tmp_path, *FLAGS)
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, 30)
        ids = []
        for stream in (False, True):
            status, _, body = http_request(
                f"{base}/v1/chat/completions",
                {"model": MODEL, "max_tokens": 3, "stream": stream,
                 "messages": [{"role": "user", "content": "hello"}]},
                timeout_s=30,
            )  # fmt: skip
            assert status == 200, body
            first = body if not stream else body.split(b"\n")[0].removeprefix(b"data: ")
            ids.append(json.loads(first)["id"])
    finally:
        frontend.stop()
        if worker is not None:
            worker.stop()
    front_lines, worker_lines = _lines(frontend.log()), _lines(worker.log())
    assert any(e["message"].startswith("worker ready") for e in worker_lines)
    for request_id in ids:
        for lines in (front_lines, worker_lines):
            mentioning = [e for e in lines if request_id in e["message"]]
            assert mentioning, (request_id, lines[-5:])  # DEBUG logs each request
            assert all(e.get("request_id") == request_id for e in mentioning), mentioning
            scoped = [e for e in lines if e.get("request_id") == request_id]
            assert {e["logger"] for e in scoped} >= {e["logger"] for e in mentioning}
    # lifecycle lines are not request-scoped
    assert all("request_id" not in e for e in front_lines if "listening" in e["message"])
