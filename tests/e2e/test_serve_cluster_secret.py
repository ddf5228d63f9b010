"""`tandem serve` closes its cluster: it generates a secret (0600 file in its run dir), its
worker refuses request-plane peers without it (`generate` and `kv_state` alike), and a forged
record written into its private discovery directory never becomes an instance."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.support.services import free_port
from tests.support.tandem_procs import (
    MODEL,
    TandemProcess,
    http_request,
    start_tandem,
    wait_healthy,
    wait_instances,
)

from tandem import errors
from tandem.protocols import kv_events as kv
from tandem.protocols.discovery import Instance
from tandem.runtime.discovery.file import FileRecord, open_record, seal_record
from tandem.runtime.tcp import TcpRequestClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TandemProcess, str, Path]]:
    tmp = tmp_path_factory.mktemp("serve-secret")
    port, run_dir = free_port(), tmp / "run"
    args = ["serve", "--engine", "mocker", "--workers", "1", "--speedup-ratio", "0"]
    args += ["--port", str(port), "--run-dir", str(run_dir)]
    env_secret = os.environ.pop("TANDEM_CLUSTER_SECRET", None)  # serve must make its own
    proc = start_tandem("serve", args, tmp)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_instances(base, lambda ids: len(ids) == 1, timeout_s=60, proc=proc)
        wait_healthy(base)  # /health is 200 once the model's tokenizer is loaded
        yield proc, base, run_dir
    finally:
        if env_secret is not None:
            os.environ["TANDEM_CLUSTER_SECRET"] = env_secret
        proc.stop()


def _worker(run_dir: Path) -> Instance:
    for path in (run_dir / "discovery").glob("*.json"):
        record = open_record(path.read_bytes(), None)  # read as an outsider would
        if record.instance.path == "tandem.backend.generate":
            return record.instance
    raise AssertionError("no worker record in the run directory")


async def _call(address: str, path: str, payload: bytes, secret: str | None) -> list[bytes]:
    client = TcpRequestClient(secret=secret)
    try:
        return [p async for p in client.stream(address, path, payload, request_id="probe")]
    finally:
        await client.close()


def test_secret_file_and_discovery_dir_are_private(served) -> None:
    _, _, run_dir = served
    assert stat.S_IMODE((run_dir / "cluster-secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((run_dir / "discovery").stat().st_mode) == 0o700


@pytest.mark.parametrize("endpoint", ["generate", "kv_state"])
def test_worker_refuses_a_peer_without_the_secret(served, endpoint) -> None:
    _, _, run_dir = served
    worker = _worker(run_dir)
    payload = kv.encode(kv.KvStateRequest(after_event_id=None))
    with pytest.raises(errors.PeerGone, match="authentication failed"):
        asyncio.run(_call(worker.address, f"tandem.backend.{endpoint}", payload, None))
    with pytest.raises(errors.PeerGone, match="authentication failed"):
        asyncio.run(_call(worker.address, f"tandem.backend.{endpoint}", payload, "x" * 32))


def test_worker_serves_a_peer_with_the_secret(served) -> None:
    _, _, run_dir = served
    secret = (run_dir / "cluster-secret").read_text().strip()
    payload = kv.encode(kv.KvStateRequest(after_event_id=None))
    out = asyncio.run(_call(_worker(run_dir).address, "tandem.backend.kv_state", payload, secret))
    assert [type(kv.decode_batch(p)).__name__ for p in out] == ["KvEventBatch"]


def test_forged_discovery_record_never_becomes_an_instance(served) -> None:
    proc, base, run_dir = served
    real = _worker(run_dir)
    evil = Instance(instance_id="evil", namespace="tandem", component="backend",
                    endpoint="generate", address="127.0.0.1:9", model=real.model)  # fmt: skip
    record = FileRecord(instance=evil, host=socket.gethostname(), pid=proc.proc.pid,
                        pid_start=_create_time(proc.proc.pid))  # fmt: skip
    (run_dir / "discovery" / "evil.json").write_bytes(seal_record(record, None))
    proc.wait_log(r"ignoring discovery record .*evil\.json", timeout_s=20)
    status, _, body = http_request(f"{base}/health")
    assert status == 200
    assert "evil" not in json.dumps(json.loads(body)["instances"])
    # logged once per process that reads the directory (frontend, worker), not once per poll
    assert proc.log().count("evil.json") <= 2


def _create_time(pid: int) -> float:
    import psutil

    return float(psutil.Process(pid).create_time())


def _serve_with(tmp: Path, *secret_args: str) -> tuple[TandemProcess, str, Path]:
    port, run_dir = free_port(), tmp / "run"
    args = ["serve", "--engine", "mocker", "--workers", "1", "--speedup-ratio", "0"]
    args += ["--port", str(port), "--run-dir", str(run_dir), *secret_args]
    return start_tandem("serve", args, tmp), f"http://127.0.0.1:{port}", run_dir


def test_serve_uses_the_given_secret_for_the_whole_stack(tmp_path: Path, monkeypatch) -> None:
    """`--cluster-secret S`: the frontend and the worker both hold S (before, every worker
    exited: it got the flag and serve's own secret file at once)."""
    for name in ("TANDEM_CLUSTER_SECRET", "TANDEM_CLUSTER_SECRET_FILE"):
        monkeypatch.delenv(name, raising=False)
    given = secrets.token_hex(32)
    proc, base, run_dir = _serve_with(tmp_path, "--cluster-secret", given)
    try:
        wait_instances(base, lambda ids: len(ids) == 1, timeout_s=60, proc=proc)
        wait_healthy(base)
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        status, _, reply = http_request(f"{base}/v1/completions", body)
        assert status == 200, reply
        assert (run_dir / "cluster-secret").read_text().strip() == given
        payload = kv.encode(kv.KvStateRequest(after_event_id=None))
        worker = _worker(run_dir)
        out = asyncio.run(_call(worker.address, "tandem.backend.kv_state", payload, given))
        assert [type(kv.decode_batch(p)).__name__ for p in out] == ["KvEventBatch"]
        assert "both --cluster-secret" not in proc.log() and given not in proc.log()
    finally:
        proc.stop()


def test_serve_refuses_a_placeholder_secret(tmp_path: Path) -> None:
    placeholder = "replace-me-with-the-output-of-openssl-rand-hex-32"
    proc, _, _ = _serve_with(tmp_path, f"--cluster-secret={placeholder}")
    try:
        assert proc.proc.wait(timeout=60) != 0
        assert "contains 'replace'" in proc.log() and "openssl rand -hex 32" in proc.log()
    finally:
        proc.stop()
