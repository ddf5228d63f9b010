"""An attacker who can write to etcd but lacks the cluster secret, against a live frontend and
worker: fake workers (one a plain record, one a real record copied under another key, both
pointing at a listener that never answers), a fake model whose tokenizer is an attacker's file,
and a real worker's key deleted. The frontend ignores the fakes (it never dials them, no
request waits on them, /health and /v1/models unchanged, the attacker's file never read) and
the deleted worker is back within a keep-alive period. /metrics counts the fakes."""

from __future__ import annotations

import base64
import json
import re
import secrets
import socket
import time
import urllib.request
from pathlib import Path

import openai
import pytest
from tests.support.services import Service, free_port
from tests.support.tandem_procs import (
    MODEL,
    TandemProcess,
    get_json,
    http_request,
    start_tandem,
    wait_healthy,
    wait_instances,
)

from tandem.runtime.discovery.etcd import prefix_end

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]
ROOT = b"tandem/instances/"


def _gateway(url: str, path: str, body: dict) -> dict:
    req = urllib.request.Request(url + path, data=json.dumps(body).encode())
    with urllib.request.urlopen(req, timeout=5) as r:
        return dict(json.loads(r.read()))


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_frontend_ignores_forged_records_and_a_deleted_worker_returns(
    tmp_path: Path, etcd_server: Service
) -> None:
    secret_file = tmp_path / "secret"
    secret_file.write_text(secrets.token_hex(32))
    secret_file.chmod(0o600)
    flags = ["--namespace", "fx", "--discovery", "etcd", "--etcd-url", etcd_server.url,
             "--events", "zmq", "--cluster-secret-file", str(secret_file)]  # fmt: skip
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    silent.setblocking(False)
    silent_addr = f"127.0.0.1:{silent.getsockname()[1]}"
    evil_dir = tmp_path / "evil"
    evil_dir.mkdir()
    (evil_dir / "tokenizer.json").write_text("{ not a tokenizer")
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    procs: list[TandemProcess] = []
    try:
        procs.append(start_tandem("frontend", ["frontend", "--port", str(port), *flags], tmp_path))
        argv = ["worker", "--speedup-ratio", "0", "--lease-ttl-s", "1", *flags]
        procs.append(start_tandem("worker", argv, tmp_path))
        wid = procs[1].wait_log(r"worker ready: instance_id=(\w+)", timeout_s=40).group(1)
        wait_instances(base, lambda seen: seen == {wid}, timeout_s=30, proc=procs[0])
        wait_healthy(base)

        # what the attacker reads and writes: raw gateway requests, no secret
        kvs = _gateway(etcd_server.url, "/v3/kv/range",
                       {"key": _b64(ROOT), "range_end": _b64(prefix_end(ROOT))})["kvs"]  # fmt: skip
        (real,) = [kv for kv in kvs if base64.b64decode(kv["key"]).endswith(wid.encode())]
        real_key = base64.b64decode(real["key"]).decode()
        sealed = json.loads(base64.b64decode(real["value"]))
        prefix = real_key.rsplit("/", 1)[0]
        plain = {**sealed["record"], "instance_id": "fake1", "address": silent_addr}
        copied = {**sealed, "record": {**sealed["record"], "address": silent_addr}}
        model = {**sealed["record"], "instance_id": "evil1", "address": silent_addr}
        model["model"] = {**model["model"], "name": "evil", "tokenizer": f"hf:{evil_dir}"}
        for name, value in (("fake1", plain), ("fake2", copied), ("evil1", model)):
            key, data = f"{prefix}/{name}".encode(), json.dumps(value).encode()
            _gateway(etcd_server.url, "/v3/kv/put", {"key": _b64(key), "value": _b64(data)})
        for name in ("fake1", "fake2", "evil1"):
            procs[0].wait_log(rf"ignoring etcd discovery record '[^']*/{name}'", timeout_s=10)

        _, _, body = http_request(f"{base}/metrics")
        rejected = re.search(
            r"^tandem_discovery_rejected_records_total (\d+)$", body.decode(), re.M
        )
        assert rejected is not None and int(rejected.group(1)) == 3
        status, health = get_json(f"{base}/health")
        assert status == 200 and health["instances"] == {MODEL: [wid]}
        _, models = get_json(f"{base}/v1/models")
        assert [m["id"] for m in models["data"]] == [MODEL]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)
        started = time.monotonic()
        for i in range(6):  # round robin would offer a fake every other request
            out = client.completions.create(model=MODEL, prompt=f"hi {i}", max_tokens=3)
            assert out.usage.completion_tokens == 3
        assert time.monotonic() - started < 5.0  # no request waited on a silent fake
        with pytest.raises(BlockingIOError):
            silent.accept()  # nobody ever dialled the fakes' address
        assert str(evil_dir) not in procs[0].log()  # the attacker's tokenizer never loaded

        # the real worker's key deleted by the attacker: re-registered within TTL/3 (+ watch)
        _gateway(etcd_server.url, "/v3/kv/deleterange", {"key": _b64(real_key.encode())})
        deleted_at = time.monotonic()
        wait_instances(base, lambda seen: seen == {wid}, timeout_s=10, proc=procs[0])
        procs[1].wait_log(r"discovery record of instance_id=\w+ was deleted", timeout_s=5)
        assert time.monotonic() - deleted_at < 3.0
        out = client.completions.create(model=MODEL, prompt="back", max_tokens=3)
        assert out.usage.completion_tokens == 3
    finally:
        for proc in reversed(procs):
            proc.stop()
        silent.close()
    logs = "".join(p.log() for p in procs)
    assert "Traceback" not in logs, logs[-5000:]
