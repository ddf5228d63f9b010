"""The container image that `make image` builds (deploy/image/build.sh), run with podman as
CI runs it (`make test-image`): its default command, `tandem serve`, answers a chat request
from outside the container on a published 127.0.0.1 port, as a non-root user; its HEALTHCHECK
is /health and passes; SIGTERM drains: a stream in flight when it arrives finishes, and the
container exits 0.

Where podman or the image is missing the tests skip, saying how to get them, except under
CI=true, where `make test-image` has built the image and their absence fails."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests.support.optional import in_ci
from tests.support.services import free_port
from tests.support.tandem_procs import MODEL, http_request

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "deploy" / "image" / "build.sh"

pytestmark = [pytest.mark.image, pytest.mark.e2e, pytest.mark.timeout(420)]


def _missing(reason: str) -> None:
    if in_ci():
        pytest.fail(f"CI=true: {reason}", pytrace=False)
    pytest.skip(reason)


def _build_sh(what: str) -> str:
    out = subprocess.run(["bash", str(BUILD), what], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@dataclass
class Container:
    name: str
    base_url: str
    podman: str

    def podman_out(self, *args: str, timeout_s: float = 60) -> str:
        done = subprocess.run(
            [self.podman, *args], capture_output=True, text=True, timeout=timeout_s
        )
        assert done.returncode == 0, f"podman {' '.join(args)}: {done.stderr}"
        return done.stdout.strip()

    def logs(self) -> str:
        done = subprocess.run(
            [self.podman, "logs", self.name], capture_output=True, text=True, timeout=30
        )
        return (done.stdout + done.stderr)[-6000:]

    def state(self) -> dict[str, object]:
        state: dict[str, object] = json.loads(
            self.podman_out("inspect", "--format", "{{json .State}}", self.name)
        )
        return state


def _wait_healthy(c: Container, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not c.state()["Running"]:
            pytest.fail(f"the container exited before /health was 200:\n{c.logs()}")
        try:
            if http_request(f"{c.base_url}/health", timeout_s=2)[0] == 200:
                return
        except OSError:
            pass  # not listening yet (the port is published before tandem binds it)
        time.sleep(0.5)
    pytest.fail(f"/health not 200 within {timeout_s:.0f} s:\n{c.logs()}")


@pytest.fixture(scope="module")
def container() -> Iterator[Container]:
    podman = shutil.which("podman")
    if podman is None:
        _missing("podman is not installed (`make image` installs it from Debian)")
    assert podman is not None
    image = _build_sh("name")
    if subprocess.run([podman, "image", "exists", image], timeout=30).returncode != 0:
        _missing(f"image {image} is not built (`make image`)")
    name = f"tandem-image-test-{os.getpid()}"
    subprocess.run([podman, "rm", "-f", "-t", "0", name], capture_output=True, timeout=60)
    port = free_port()
    # the image's own command (`tandem serve`), only the port published on loopback
    run = [podman, "run", "-d", "--name", name, *_build_sh("run-flags").split(),
           "-p", f"127.0.0.1:{port}:8000", image]  # fmt: skip
    started = subprocess.run(run, capture_output=True, text=True, timeout=120)
    c = Container(name, f"http://127.0.0.1:{port}", podman)
    try:
        assert started.returncode == 0, started.stderr
        _wait_healthy(c, timeout_s=240)
        yield c
    finally:
        subprocess.run([podman, "rm", "-f", "-t", "0", name], capture_output=True, timeout=60)


def test_serve_answers_a_chat_request_from_outside(container: Container) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    status, _, raw = http_request(f"{container.base_url}/v1/chat/completions", body, 60)
    assert status == 200, raw
    answer = json.loads(raw)
    assert "Paris" in answer["choices"][0]["message"]["content"], answer
    assert answer["usage"]["completion_tokens"] > 0


def test_runs_as_a_non_root_user(container: Container) -> None:
    assert container.podman_out("exec", container.name, "id", "-u") != "0"
    # every process of the stack (the serve process and its workers), not only exec's
    users = container.podman_out("top", container.name, "user").split()[1:]
    assert users and set(users) == {"tandem"}, users


def test_healthcheck_is_health_and_passes(container: Container) -> None:
    check = json.loads(
        container.podman_out("inspect", "--format", "{{json .Config.Healthcheck}}", container.name)
    )
    assert any("/health" in part for part in check["Test"]), check
    done = subprocess.run(
        [container.podman, "healthcheck", "run", container.name],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def test_sigterm_drains_a_stream_in_flight_and_exits_0(container: Container) -> None:
    """Last: it stops the container."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count from one to one hundred."}],
        "max_tokens": 160,
        "ignore_eos": True,
        "stream": True,
    }
    host, port = container.base_url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"content-type": "application/json"})  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()
    assert first.startswith(b"data: "), first
    # SIGTERM as `podman stop` sends it (then SIGKILL after -t seconds: well past the drain)
    signalled = time.monotonic()
    stop = subprocess.Popen([container.podman, "stop", "-t", "90", container.name],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        rest = resp.read().decode()
        done = time.monotonic()
        conn.close()
        events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", rest[-2000:]
        chunks = [json.loads(e) for e in events[:-1]]
        finish = [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]]
        assert finish[-1] == "length", rest[-2000:]  # all its tokens, not cut off
        # it was in flight: its tokens kept coming for a while after the signal
        assert done - signalled > 0.5, f"the stream had ended before SIGTERM: {done - signalled}"
        assert stop.wait(timeout=120) == 0, stop.stdout.read() if stop.stdout else ""
    finally:
        if stop.poll() is None:
            stop.kill()
            stop.wait()
    state = container.state()
    logs = container.logs()
    assert state["ExitCode"] == 0 and not state["OOMKilled"], f"{state}\n{logs}"
    assert "received SIGTERM" in logs, logs
    assert "Traceback" not in logs, logs
