"""A split stack with the request plane over mutual TLS: `tandem frontend` and `tandem worker`
given --tls-cert-file/--tls-key-file/--tls-ca-file and --tls-require-client-cert (a throw-away
CA) answer a chat; the worker's request plane says TLS, and a frontend without the TLS files
cannot reach the worker and says why. Disaggregated, over the same TLS files: the decode
worker pulls the prompt's KV from the prefill worker's transfer agent over TLS (tcp backend,
fallback off, so an answer means the KV moved)."""

from __future__ import annotations

import re
import secrets
from pathlib import Path

import openai
import pytest
from tests.support.certs import make_pki
from tests.support.services import free_port
from tests.support.tandem_procs import MODEL, TandemProcess, http_request, start_tandem

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


def test_chat_over_mutual_tls_and_a_plaintext_frontend_is_refused(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    secret_file = tmp_path / "secret"
    secret_file.write_text(secrets.token_hex(32))
    secret_file.chmod(0o600)
    flags = ["--namespace", "tls", "--discovery", "file", "--discovery-dir",
             str(tmp_path / "disc"), "--events", "zmq", "--cluster-secret-file",
             str(secret_file)]  # fmt: skip
    tls = ["--tls-cert-file", str(pki.server.cert), "--tls-key-file", str(pki.server.key),
           "--tls-ca-file", str(pki.ca), "--tls-require-client-cert"]  # fmt: skip
    port, plain_port = free_port(), free_port()
    procs: list[TandemProcess] = []
    try:
        worker = start_tandem("worker", ["worker", "--speedup-ratio", "0", *flags, *tls], tmp_path)
        procs.append(worker)
        worker.wait_log(r"request plane listening on \S+ \(TLS\)", timeout_s=40)
        worker.wait_log(r"worker ready: instance_id=", timeout_s=40)
        procs.append(start_tandem("front", ["frontend", "--port", str(port), *flags, *tls],
                                  tmp_path))  # fmt: skip
        procs[-1].wait_log(r"frontend listening on", timeout_s=40)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=3, timeout=30
        )
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "over TLS?"}], max_tokens=4
        )
        assert chat.usage.completion_tokens == 4

        plain = start_tandem("plain", ["frontend", "--port", str(plain_port), *flags], tmp_path)
        procs.append(plain)
        plain.wait_log(r"frontend listening on", timeout_s=40)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        status, _, _ = http_request(
            f"http://127.0.0.1:{plain_port}/v1/chat/completions", body, timeout_s=30
        )
        assert status >= 500
        plain.wait_log(r"is the server using TLS\? then this process needs --tls-ca-file", 20)
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_disaggregated_kv_pulled_over_tls(tmp_path: Path) -> None:
    pki = make_pki(tmp_path / "pki")
    secret_file = tmp_path / "secret"
    secret_file.write_text(secrets.token_hex(32))
    secret_file.chmod(0o600)
    flags = ["--namespace", "tlsd", "--discovery", "file", "--discovery-dir",
             str(tmp_path / "disc"), "--events", "zmq", "--cluster-secret-file",
             str(secret_file), "--tls-cert-file", str(pki.server.cert), "--tls-key-file",
             str(pki.server.key), "--tls-ca-file", str(pki.ca),
             "--tls-require-client-cert"]  # fmt: skip
    port = free_port()
    procs: list[TandemProcess] = []
    try:
        for mode in ("prefill", "decode"):
            argv = ["worker", "--speedup-ratio", "0", "--disagg-mode", mode,
                    "--disagg-transfer-backends", "tcp", "--disagg-on-transfer-failure", "fail",
                    *flags]  # fmt: skip
            procs.append(start_tandem(mode, argv, tmp_path))
        for proc in procs:
            proc.wait_log(r"worker ready: instance_id=", timeout_s=40)
        front = start_tandem("front", ["frontend", "--port", str(port), "--disagg", *flags],
                             tmp_path)  # fmt: skip
        procs.append(front)
        front.wait_log(r"frontend listening on", timeout_s=40)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=3, timeout=30
        )
        prompt = "a prompt long enough to fill several KV blocks " * 20
        out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        assert out.usage.completion_tokens == 4
        _, _, body = http_request(f"http://127.0.0.1:{port}/metrics/workers", timeout_s=10)
        received = re.findall(
            r'^tandem_transfer_bytes_total\{[^}]*direction="received"[^}]*\} (\S+)$',
            body.decode(),
            re.M,
        )
        assert received and sum(float(x) for x in received) > 0, body.decode()[-3000:]
    finally:
        for proc in reversed(procs):
            proc.stop()
    logs = "".join(p.log() for p in procs)
    assert "TLS failed" not in logs and "Traceback" not in logs, logs[-4000:]
