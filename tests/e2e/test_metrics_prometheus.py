"""Metrics as an operator scrapes them (issue 12, "How it is shown"), on real processes:

- `tandem serve` (mocker, KV router, one prefill + one decode worker, a host KV tier, API key):
  `promtool check metrics` passes on the frontend's /metrics and /metrics/workers; errors are
  counted by status (401 without the key, 400 bad JSON, 404 unknown model); worker system ports
  stay off.
- a real Prometheus (Debian's) scrapes that stack with a generated config, and every PromQL
  query of the Grafana dashboard (deploy/grafana/tandem.json) returns data while requests flow,
  so the dashboard cannot drift from the metric names.
- a standalone `tandem worker --system-port` serves /metrics (promtool passes; HEAD too),
  /health and /live, and puts the port in its discovery record; so does `tandem router`.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tests.support.prometheus import (
    needs_prometheus,
    needs_promtool,
    promtool_check,
    query,
    start_prometheus,
    targets_up,
)
from tests.support.services import free_port
from tests.support.tandem_procs import (
    MODEL,
    REPO,
    TandemProcess,
    http_request,
    start_tandem,
    start_worker,
    wait_healthy,
)

from tandem.runtime.discovery.file import FileDiscovery
from tandem.runtime.metrics import parse

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
KEY = "metrics-e2e-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
DASHBOARD = REPO / "deploy" / "grafana" / "tandem.json"
# Grafana's variables as a query sees them with "All" selected
VARIABLES = {"$__rate_interval": "30s", "$model": ".*", "$worker": ".*"}


class Stack:
    def __init__(self, proc: TandemProcess, base: str, port: int) -> None:
        self.proc, self.base, self.port = proc, base, port

    def get(self, path: str, **kw: Any) -> tuple[int, dict[str, str], bytes]:
        return http_request(f"{self.base}{path}", headers=AUTH, **kw)

    def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> int:
        return http_request(f"{self.base}{path}", body, headers=headers or AUTH, timeout_s=30)[0]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("metrics")
    port = free_port()
    args = ["serve", "--engine", "mocker", "--router", "kv", "--speedup-ratio", "0"]
    args += ["--prefill-workers", "1", "--decode-workers", "1", "--block-size", "16"]
    args += ["--num-blocks", "64", "--kvbm-host-blocks", "256", "--api-key", KEY]
    args += ["--port", str(port), "--run-dir", str(tmp / "run"), "--log-level", "INFO"]
    proc = start_tandem("serve", args, tmp)
    try:
        base = f"http://127.0.0.1:{port}"
        proc.wait_log("tandem serve ready", timeout_s=60)
        _wait_healthy_with_key(base)
        yield Stack(proc, base, port)
    finally:
        code = proc.stop()
        log = proc.log()
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-5000:]
    assert "system server on" not in log  # worker system ports are off in `tandem serve`


def _wait_healthy_with_key(base: str) -> None:
    wait_healthy(base, timeout_s=60)  # /health is open (a probe)
    deadline = time.monotonic() + 30
    body = {"model": MODEL, "prompt": "warm up", "max_tokens": 2}
    while http_request(f"{base}/v1/completions", body, headers=AUTH)[0] != 200:
        assert time.monotonic() < deadline, "the stack never served a completion"
        time.sleep(0.1)


def _chat(i: int, **kw: Any) -> dict[str, Any]:
    prefix = "You are a terse assistant who answers in one line. " * 4
    messages = [{"role": "user", "content": f"{prefix} question {i}"}]
    return {"model": MODEL, "messages": messages, "max_tokens": 8, **kw}


@needs_promtool
def test_promtool_passes_on_the_live_frontend_and_workers(stack: Stack) -> None:
    for i in range(3):
        assert stack.post("/v1/chat/completions", _chat(i, stream=i % 2 == 0)) == 200
    for path in ("/metrics", "/metrics/workers"):
        status, headers, body = stack.get(path)
        assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
        promtool_check(body)
    m = parse(stack.get("/metrics/workers")[2].decode())
    components = {dict(k)["component"] for k in m["tandem_worker_up"]}
    assert components == {"prefill", "backend"}
    assert all(v == 1 for v in m["tandem_worker_up"].values())
    assert "tandem_kvbm_offload_blocks_total" in m and "tandem_transfer_bytes_total" in m
    status, headers, body = stack.get("/metrics", method="HEAD")
    assert status == 200 and body == b"" and int(headers["content-length"]) > 1000
    frontend = parse(stack.get("/metrics")[2].decode())
    routed = frontend["tandem_router_routed_requests_total"]
    by_component = {dict(k)["component"]: v for k, v in routed.items()}
    assert by_component["prefill"] >= 3 and by_component["backend"] >= 3  # both pools' routers
    moved: dict[tuple[str, str], float] = {}
    for k, v in m["tandem_transfer_bytes_total"].items():
        key = (dict(k)["component"], dict(k)["direction"])
        moved[key] = moved.get(key, 0) + v
    # what the prefill worker sent is what the decode worker pulled
    assert moved[("prefill", "sent")] == moved[("backend", "received")] > 0


def _requests(stack: Stack) -> dict[tuple[tuple[str, str], ...], float]:
    return parse(stack.get("/metrics")[2].decode()).get("tandem_frontend_requests_total", {})


def _count(rows: dict[tuple[tuple[str, str], ...], float], **labels: str) -> float:
    return sum(v for k, v in rows.items() if set(labels.items()) <= set(k))


def test_errors_are_counted_by_status(stack: Stack) -> None:
    before = _requests(stack)
    assert stack.post("/v1/chat/completions", _chat(0), headers={"x": "no key"}) == 401
    assert http_request(f"{stack.base}/metrics")[0] == 401  # /metrics is guarded too
    assert stack.post("/v1/chat/completions", {**_chat(0), "max_tokens": "many"}) == 400
    assert stack.post("/v1/chat/completions", {**_chat(0), "model": "no-such-model"}) == 404
    assert stack.post("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}) == 200
    after = _requests(stack)
    for labels in (
        {"endpoint": "chat_completions", "status": "error", "status_code": "401"},
        {"endpoint": "chat_completions", "status": "error", "status_code": "400"},
        {"endpoint": "chat_completions", "status": "error", "status_code": "404"},
        {"model": MODEL, "endpoint": "completions", "status": "success", "status_code": "200"},
    ):
        assert _count(after, **labels) == _count(before, **labels) + 1, labels


def _dashboard_queries() -> list[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for name, value in VARIABLES.items():
                expr = expr.replace(name, value)
            out.append((panel["title"], expr))
    assert len(out) >= 30
    return out


@needs_prometheus
def test_every_dashboard_query_returns_data(stack: Stack, tmp_path: Path) -> None:
    auth = {"authorization": {"type": "Bearer", "credentials": KEY}}
    target = {"targets": [f"127.0.0.1:{stack.port}"]}
    jobs = [
        {"job_name": "frontend", "metrics_path": "/metrics", "static_configs": [target], **auth},
        {"job_name": "workers", "metrics_path": "/metrics/workers", "static_configs": [target],
         **auth},
    ]  # fmt: skip
    prometheus = start_prometheus(tmp_path, jobs)
    stop = threading.Event()
    driver = threading.Thread(target=_drive, args=(stack, stop), daemon=True)
    driver.start()
    try:
        pending = dict.fromkeys(_dashboard_queries())
        deadline = time.monotonic() + 90
        while pending and time.monotonic() < deadline:
            for title, expr in list(pending):
                if query(prometheus, expr):
                    del pending[(title, expr)]
            time.sleep(0.5)
        assert not pending, (
            f"dashboard queries without data: {list(pending)}; targets {targets_up(prometheus)}"
        )
    finally:
        stop.set()
        driver.join(30)
        prometheus.stop()


def _drive(stack: Stack, stop: threading.Event) -> None:
    """Requests until `stop`: streamed and unary, repeated prefixes (cache hits), one error."""
    i = 0
    while not stop.is_set():
        stack.post("/v1/chat/completions", _chat(i % 5, stream=i % 2 == 0))
        if i % 10 == 0:
            stack.post("/v1/chat/completions", {**_chat(i), "model": "no-such-model"})
        i += 1
        stop.wait(0.05)


@needs_promtool
def test_worker_system_port_serves_metrics_health_live(tmp_path: Path) -> None:
    disc = tmp_path / "disc"
    runtime = ["--discovery", "file", "--discovery-dir", str(disc), "--events", "zmq"]
    port = free_port()
    flags = ["--speedup-ratio", "0", "--kvbm-host-blocks", "64", "--system-port", str(port)]
    worker, instance_id = start_worker("w0", runtime, tmp_path, *flags)
    try:
        base = f"http://127.0.0.1:{port}"
        assert http_request(f"{base}/live")[0] == 200
        status, _, body = http_request(f"{base}/health")
        assert status == 200 and json.loads(body)["instance_id"] == instance_id
        status, headers, body = http_request(f"{base}/metrics")
        assert status == 200 and headers["content-type"].startswith("text/plain; version=0.0.4")
        promtool_check(body)
        m = parse(body.decode())
        state = m["tandem_worker_state"]
        labels = {"worker_id": instance_id, "component": "backend", "model": MODEL}
        assert state[tuple(sorted({**labels, "state": "ready"}.items()))] == 1
        assert "tandem_kvbm_host_cache_hit_rate" in m and "tandem_component_inflight_requests" in m
        status, _, head = http_request(f"{base}/metrics", method="HEAD")
        assert status == 200 and head == b""
        records = asyncio.run(FileDiscovery(str(disc)).list_instances())
        mine = [r for r in records if r.instance_id == instance_id]
        assert mine and mine[0].metadata["system_port"] == port
        assert mine[0].metadata["metrics_endpoint"] == "metrics"
    finally:
        assert worker.stop() == 0, worker.log()[-3000:]


@needs_promtool
def test_router_service_system_port_serves_its_metrics(tmp_path: Path) -> None:
    runtime = ["--discovery", "file", "--discovery-dir", str(tmp_path / "disc")]
    port = free_port()
    router = start_tandem(
        "router", ["router", *runtime, "--events", "zmq", "--system-port", str(port)], tmp_path
    )
    try:
        router.wait_log("router ready", timeout_s=30)
        status, _, body = http_request(f"http://127.0.0.1:{port}/metrics")
        assert status == 200
        promtool_check(body)
        assert b"# TYPE tandem_router_overhead_seconds histogram" in body
        assert http_request(f"http://127.0.0.1:{port}/health")[0] == 200
    finally:
        assert router.stop() == 0, router.log()[-3000:]
