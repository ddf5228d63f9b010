"""LoRA adapters across processes (issue 32): an adapter loaded through one `tandem frontend`
process is kept in etcd (a real etcd, no lease), so after that frontend is killed a new
frontend process lists it and serves `model=<adapter>` on the `tandem worker` that holds it."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from tests.support.services import Service, free_port
from tests.support.tandem_procs import (
    MODEL,
    TandemProcess,
    get_json,
    http_request,
    start_tandem,
    start_worker,
    wait_instances,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


def _frontend(name: str, port: int, flags: list[str], tmp_path: Path) -> TandemProcess:
    argv = ["frontend", "--port", str(port), "--lora-dir", str(tmp_path / "adapters"), *flags]
    return start_tandem(name, argv, tmp_path)


def test_adapter_outlives_a_killed_frontend(tmp_path: Path, etcd_server: Service) -> None:
    adapter = tmp_path / "adapters" / "sql"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16}))
    flags = ["--namespace", "lora", "--discovery", "etcd", "--etcd-url", etcd_server.url]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    procs: list[TandemProcess] = []
    try:
        worker, worker_id = start_worker("worker", flags, tmp_path, "--speedup-ratio", "0",
                                         "--max-loras", "2")  # fmt: skip
        procs.append(worker)
        first = _frontend("frontend1", port, flags, tmp_path)
        procs.append(first)
        wait_instances(base, lambda seen: seen == {worker_id}, timeout_s=30, proc=first)
        body = {"lora_name": "sql-lora", "lora_path": "sql"}
        status, _, text = http_request(f"{base}/v1/load_lora_adapter", body, timeout_s=30)
        assert status == 200, text
        first.signal(signal.SIGKILL)  # no goodbye: only what etcd holds survives
        first.proc.wait(10)

        again = _frontend("frontend2", port, flags, tmp_path)
        procs.append(again)
        wait_instances(base, lambda seen: seen == {worker_id}, timeout_s=30, proc=again)
        _, models = get_json(f"{base}/v1/models")
        assert {m["id"]: m.get("parent") for m in models["data"]} == {
            MODEL: None,
            "sql-lora": MODEL,
        }
        chat = {"model": "sql-lora", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3}  # fmt: skip
        status, _, text = http_request(f"{base}/v1/chat/completions", chat, timeout_s=30)
        assert status == 200 and json.loads(text)["model"] == "sql-lora", text
        assert "LoRA adapter sql-lora loaded" in worker.log()
    finally:
        for proc in reversed(procs):
            proc.stop()
    logs = "".join(p.log() for p in procs)
    assert "Traceback" not in logs, logs[-5000:]
