"""A split deployment closed by `--cluster-secret-file`: etcd + nats-server + `tandem frontend`
+ `tandem worker` processes sharing one secret serve requests; a rogue worker that registers in
the same (unauthenticated) etcd with another secret is never listed (its record does not verify)
nor receives a prompt, and every request succeeds on the real worker."""

from __future__ import annotations

import secrets
from pathlib import Path

import openai
import pytest
from tests.support.services import Service, free_port
from tests.support.tandem_procs import MODEL, TandemProcess, start_tandem, wait_instances

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


def _secret_file(path: Path, value: str) -> str:
    path.write_text(value + "\n")
    path.chmod(0o600)
    return str(path)


def test_rogue_worker_with_another_secret_gets_no_prompt(
    tmp_path: Path, etcd_server: Service, nats_server: Service
) -> None:
    ours = _secret_file(tmp_path / "ours", secrets.token_hex(32))
    theirs = _secret_file(tmp_path / "theirs", secrets.token_hex(32))
    flags = ["--namespace", "sec", "--discovery", "etcd", "--etcd-url", etcd_server.url,
             "--events", "nats", "--nats-url", nats_server.url]  # fmt: skip
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    procs: list[TandemProcess] = []
    try:
        front = start_tandem(
            "frontend",
            ["frontend", "--port", str(port), "--cluster-secret-file", ours, *flags],
            tmp_path,
        )
        procs.append(front)
        for name, secret in (("worker", ours), ("rogue", theirs)):
            argv = ["worker", "--speedup-ratio", "0", "--cluster-secret-file", secret, *flags]
            procs.append(start_tandem(name, argv, tmp_path))
        ours_id, rogue_id = (
            p.wait_log(r"worker ready: instance_id=(\w+)", timeout_s=40).group(1) for p in procs[1:]
        )
        wait_instances(base, lambda seen: seen == {ours_id}, timeout_s=20, proc=front)
        front.wait_log(rf"ignoring etcd discovery record .*/{rogue_id}'?: no valid tag")

        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        for i in range(6):
            out = client.completions.create(model=MODEL, prompt=f"secret {i}", max_tokens=3)
            assert out.usage.completion_tokens == 3
        assert wait_instances(base, lambda seen: True) == {ours_id}
        rogue = procs[2]
        assert "secret 1" not in rogue.log()
        assert "refusing request-plane connection" not in rogue.log()  # never even dialled
    finally:
        for proc in reversed(procs):
            proc.stop()
    logs = "".join(p.log() for p in procs)
    assert "Traceback" not in logs, logs[-5000:]
