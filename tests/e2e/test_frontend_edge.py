"""The HTTP edge with real processes: `tandem serve --api-key` (openai SDK: no key → 401,
right key → 200), SIGTERM drains (a stream in flight completes, new connections are
refused), and a frontend at a lowered RLIMIT_NOFILE that is flooded with connections keeps
following discovery and serves again once the flood is gone."""

from __future__ import annotations

import contextlib
import json
import resource
import signal
import socket
import threading
import time
from pathlib import Path

import openai
import pytest
from tests.support.services import free_port
from tests.support.tandem_procs import (
    MODEL,
    TandemProcess,
    http_request,
    start_tandem,
    start_worker,
    wait_instances,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
KEY = "sk-edge-test-key"


def _refused(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return False
    except OSError:
        return True


def test_serve_api_key_then_sigterm_drains_a_stream_in_flight(tmp_path: Path) -> None:
    port = free_port()
    args = ["serve", "--engine", "mocker", "--workers", "1", "--port", str(port)]
    args += ["--run-dir", str(tmp_path / "run"), "--api-key", KEY, "--http-drain-grace-s", "30"]
    proc = start_tandem("serve", args, tmp_path)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_instances(base, lambda ids: len(ids) == 1, timeout_s=45, proc=proc)
        anonymous = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            anonymous.models.list()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == [MODEL]

        chunks: list[str] = []
        finish: list[str | None] = []
        first = threading.Event()

        def consume() -> None:
            stream = client.completions.create(
                model=MODEL, prompt="Once upon a time", max_tokens=300, stream=True
            )
            for chunk in stream:
                chunks.append(chunk.choices[0].text)
                first.set()
                if chunk.choices[0].finish_reason is not None:
                    finish.append(chunk.choices[0].finish_reason)

        reader = threading.Thread(target=consume)
        reader.start()
        assert first.wait(30), proc.log()[-3000:]
        num_before = len(chunks)
        proc.signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while not _refused(port):  # the listener closes at once, the stream goes on
            assert time.monotonic() < deadline, "still accepting after SIGTERM"
            time.sleep(0.02)
        assert reader.is_alive(), "the stream ended before the listener closed"
        reader.join(60)
        assert not reader.is_alive()
        assert finish == ["length"] and len(chunks) > num_before, (len(chunks), finish)
        assert proc.proc.wait(30) == 0
        assert "draining 1 HTTP connection" in proc.log()
    finally:
        proc.stop()


def _frontend_at_fd_limit(name: str, args: list[str], log_dir: Path, nofile: int) -> TandemProcess:
    def lower_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

    return start_tandem(name, args, log_dir, preexec_fn=lower_limit)


def test_connection_flood_at_a_low_fd_limit_never_stops_discovery(tmp_path: Path) -> None:
    runtime = ["--discovery", "file", "--discovery-dir", str(tmp_path / "disc")]
    runtime += ["--events", "zmq"]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    workers: list[TandemProcess] = []
    frontend = _frontend_at_fd_limit(
        "frontend", ["frontend", "--port", str(port), *runtime], tmp_path, nofile=256
    )
    flood: list[socket.socket] = []
    try:
        w0, id0 = start_worker("w0", runtime, tmp_path, "--speedup-ratio", "0")
        workers.append(w0)
        wait_instances(base, lambda ids: ids == {id0}, timeout_s=45, proc=frontend)

        for _ in range(600):  # far past what 256 descriptors allow
            with contextlib.suppress(OSError):
                flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        refused = _read_refusals(flood)

        # while the flood holds every HTTP slot: a worker leaves, another joins
        w0.stop(grace_s=0)
        w1, id1 = start_worker("w1", runtime, tmp_path, "--speedup-ratio", "0")
        workers.append(w1)
        for sock in flood:
            sock.close()
        flood.clear()
        # the frontend followed both changes and serves again
        wait_instances(base, lambda ids: ids == {id1}, timeout_s=30, proc=frontend)
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
        status, _, raw = http_request(f"{base}/v1/completions", body, timeout_s=30)
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == 3
        assert "instance set is frozen" not in frontend.log()
        assert frontend.proc.poll() is None
        assert refused > 0, "no connection was refused: the cap did not apply"
        assert "connection cap" in frontend.log()
    finally:
        for sock in flood:
            sock.close()
        frontend.stop()
        for w in workers:
            w.stop(grace_s=0)


def _read_refusals(flood: list[socket.socket]) -> int:
    """How many of the connections the frontend answered 503 and closed."""
    refused = 0
    for sock in flood:
        sock.settimeout(0.05)
        try:
            data = sock.recv(4096)
        except OSError:
            continue
        if data.startswith(b"HTTP/1.1 503"):
            refused += 1
    return refused
