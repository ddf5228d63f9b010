"""A frontend host with no model files (issue 30 item 3): the worker on host3 serves SmolLM2
from its local GGUF; the frontend on host1 runs where that file does not exist (an empty tmpfs
over the model package's directory, in the frontend's own mount namespace) and gets the
tokenizer and chat template from the worker's registration. /health says 200 and a chat
request is answered, its text decoded by that tokenizer."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from tests.support.netns import HostProcess
from tests.support.netns_tandem import FRONTEND_PORT, Hosts, start_worker, stop_all, wait_log
from tests.support.smollm2 import smollm2_gguf
from tests.support.tandem_procs import MODEL, get_json, http_request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def test_frontend_host_without_model_files_serves(hosts: Hosts) -> None:
    h = hosts.hosts
    runtime = hosts.runtime("nofiles")
    model_dir = smollm2_gguf().parent
    procs: list[HostProcess] = []
    try:
        worker, worker_id = start_worker(h[3], "nf-worker", runtime, "--speedup-ratio", "0")
        procs.append(worker)
        hide = f'mount -t tmpfs none {model_dir} && exec "$@"'
        front = h[1].spawn(
            "nf-front",
            ["unshare", "-m", "--propagation", "private", "sh", "-c", hide, "sh",
             sys.executable, "-m", "tandem.cli", "frontend", "--host", h[1].ip,
             "--port", str(FRONTEND_PORT), *runtime],
        )  # fmt: skip
        procs.append(front)
        wait_log(front, r"frontend listening on")
        base = f"http://{h[1].ip}:{FRONTEND_PORT}"
        # the frontend process sees no model file (its root as /proc shows it); the worker does
        assert not Path(f"/proc/{front.pid}/root{smollm2_gguf()}").exists()
        assert Path(f"/proc/{worker.pid}/root{smollm2_gguf()}").exists()
        status, body = _wait_health(base, worker_id)
        assert status == 200, body
        chat = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": 5}  # fmt: skip
        status, _, raw = http_request(f"{base}/v1/chat/completions", chat, timeout_s=30)
        assert status == 200, raw
        out = json.loads(raw)
        assert out["usage"]["completion_tokens"] == 5 and out["choices"][0]["message"]["content"]
        wait_log(front, r"tokenizer from the workers' registration \(etcd at ")
    finally:
        logs = stop_all(*procs)
    assert "Traceback" not in logs, logs[-5000:]


def _wait_health(base: str, worker_id: str, timeout_s: float = 15.0) -> tuple[int, dict]:
    deadline = time.monotonic() + timeout_s
    status, body = 0, {}
    while time.monotonic() < deadline:
        status, body = get_json(f"{base}/health")
        if status == 200 and worker_id in body.get("instances", {}).get(MODEL, []):
            break
        time.sleep(0.1)
    return status, body
