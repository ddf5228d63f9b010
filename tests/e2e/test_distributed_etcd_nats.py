"""The distributed stack for real: etcd + nats-server + `tandem frontend --discovery etcd
--events nats` + `tandem worker --engine mocker` processes. Requests flow to every worker; the
frontend sees a new worker, and loses a SIGKILLed one (lease expiry), within 2 s."""

from __future__ import annotations

import re
import signal
import time
from pathlib import Path

import openai
import pytest
from tests.support.services import Service, free_port
from tests.support.tandem_procs import (
    MODEL,
    TandemProcess,
    http_request,
    instances,
    start_tandem,
    wait_instances,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]
SEEN_WITHIN_S = 2.0


def _runtime_flags(etcd: Service, nats: Service) -> list[str]:
    return [
        "--namespace",
        "dist",
        "--discovery",
        "etcd",
        "--etcd-url",
        etcd.url,
        "--events",
        "nats",
        "--nats-url",
        nats.url,
    ]


def _routed(base_url: str) -> dict[str, float]:
    """Requests the frontend's router sent to each worker (from /metrics)."""
    _, _, body = http_request(f"{base_url}/metrics")
    found = re.findall(
        r'tandem_router_routed_requests_total\{worker_id="(\w+)"[^}]*\} (\S+)', body.decode()
    )
    return {wid: float(n) for wid, n in found}


def _ready_id(worker: TandemProcess) -> str:
    return worker.wait_log(r"worker ready: instance_id=(\w+)", timeout_s=30).group(1)


def test_frontend_follows_workers_over_etcd_and_nats(
    tmp_path: Path, etcd_server: Service, nats_server: Service
) -> None:
    flags = _runtime_flags(etcd_server, nats_server)
    # lease TTL 1 s: a SIGKILLed worker's records expire well inside the 2 s budget
    worker_flags = ["--speedup-ratio", "0", "--lease-ttl-s", "1", *flags]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    procs: list[TandemProcess] = []
    try:
        front = start_tandem("frontend", ["frontend", "--port", str(port), *flags], tmp_path)
        procs.append(front)
        for i in range(2):
            procs.append(start_tandem(f"worker{i}", ["worker", *worker_flags], tmp_path))
        ids = {_ready_id(w) for w in procs[1:]}
        assert wait_instances(base, lambda seen: seen == ids, proc=front) == ids

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        for i in range(4):
            out = client.completions.create(model=MODEL, prompt=f"hello {i}", max_tokens=5)
            assert out.usage.completion_tokens == 5
        assert _routed(base) == {wid: 2.0 for wid in ids}  # round robin reached both

        # a new worker joins: the frontend routes to it within 2 s of its registration
        procs.append(start_tandem("worker2", ["worker", *worker_flags], tmp_path))
        new_id = _ready_id(procs[-1])
        joined_at = time.monotonic()
        wait_instances(base, lambda seen: new_id in seen, timeout_s=10, proc=front)
        assert time.monotonic() - joined_at < SEEN_WITHIN_S

        # SIGKILL one: no unregister, only the lease expiry tells the frontend
        victim = procs[1]
        victim_id = _ready_id(victim)
        victim.signal(signal.SIGKILL)
        killed_at = time.monotonic()
        wait_instances(base, lambda seen: victim_id not in seen, timeout_s=10, proc=front)
        assert time.monotonic() - killed_at < SEEN_WITHIN_S
        assert instances(base) == (ids | {new_id}) - {victim_id}

        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "still there?"}], max_tokens=6
        )
        assert chat.usage.completion_tokens == 6
    finally:
        for proc in reversed(procs):
            proc.stop()
    logs = "".join(p.log() for p in procs)
    assert "Traceback" not in logs, logs[-5000:]
