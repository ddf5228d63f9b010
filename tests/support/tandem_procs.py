"""`tandem serve` / `tandem frontend` / `tandem worker` as real processes for e2e tests.

Output goes to a log file (a pipe nobody reads would fill up and stall the child). A process
is ready when its log prints its ready line (`wait_log`) or its HTTP `/health` lists enough
instances (`wait_instances`); both poll with a deadline. Processes are stopped by PID:
SIGTERM, then SIGKILL after a grace; the workers a `tandem serve` started are found by the PIDs
it logs and killed too if they outlive it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MODEL = "smollm2"
_POLL_S = 0.05


@dataclass
class TandemProcess:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    children: list[int] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")
        return ""

    def wait_log(self, pattern: str, timeout_s: float = 30.0) -> re.Match[str]:
        """The first match of `pattern` in the log; fails if the process exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while True:
            if (m := re.search(pattern, self.log())) is not None:
                return m
            if self.proc.poll() is not None or time.monotonic() > deadline:
                state = f"exited {self.proc.returncode}" if self.proc.poll() is not None else "up"
                raise AssertionError(
                    f"{self.name} ({state}) never logged /{pattern}/:\n{self.log()[-3000:]}"
                )
            time.sleep(_POLL_S)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self, grace_s: float = 15.0) -> int:
        """SIGTERM, wait up to `grace_s`, then SIGKILL; kill surviving logged children."""
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            self.signal(signal.SIGKILL)
            self.proc.wait(10)
        for pid in self.children + _logged_child_pids(self.log()):
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)
        return int(self.proc.returncode)


def _logged_child_pids(log: str) -> list[int]:
    return [int(p) for p in re.findall(r"started worker\d+ pid=(\d+)", log)]


def start_tandem(
    name: str,
    args: list[str],
    log_dir: Path,
    preexec_fn: Callable[[], None] | None = None,
    env: dict[str, str] | None = None,
) -> TandemProcess:
    """Run `python -m tandem.cli ARGS` from the repo root, output to `log_dir/name.log`
    (`preexec_fn` runs in the child before exec, e.g. to lower a resource limit; `env` adds
    variables to this process's environment)."""
    log_path = log_dir / f"{name}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tandem.cli", *args],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            preexec_fn=preexec_fn,
        )
    return TandemProcess(name=name, proc=proc, log_path=log_path)


def start_worker(
    name: str, runtime_flags: list[str], log_dir: Path, *flags: str
) -> tuple[TandemProcess, str]:
    """A `tandem worker --engine mocker` process; returns it once registered, with its id."""
    worker = start_tandem(name, ["worker", "--engine", "mocker", *flags, *runtime_flags], log_dir)
    try:
        m = worker.wait_log(r"worker ready: instance_id=(\w+)", timeout_s=30)
    except BaseException:
        worker.stop(grace_s=0)
        raise
    return worker, m.group(1)


def http_request(
    url: str,
    body: object = None,
    timeout_s: float = 5.0,
    headers: dict[str, str] | None = None,
    method: str | None = None,
) -> tuple[int, dict[str, str], bytes]:
    """(status, lower-cased headers, body) of a GET (or a POST of `body` as JSON); HTTP
    errors are returned, not raised."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url,
        data=data,
        headers={"content-type": "application/json", **(headers or {})},
        method=method,
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            headers = {k.lower(): v for k, v in resp.headers.items()}
            return resp.status, headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read()


def get_json(url: str, timeout_s: float = 5.0) -> tuple[int, dict]:
    """(status, JSON body) of a GET; HTTP errors are returned, not raised."""
    status, _, body = http_request(url, timeout_s=timeout_s)
    return status, json.loads(body or b"{}")


def instances(base_url: str, model: str = MODEL) -> set[str]:
    """The instance ids the frontend at `base_url` serves `model` with (from /health)."""
    with contextlib.suppress(OSError):
        _, body = get_json(f"{base_url}/health", timeout_s=2)
        return set(body.get("instances", {}).get(model, []))
    return set()


def wait_healthy(base_url: str, timeout_s: float = 30.0) -> dict:
    """Poll /health until it answers 200 (every model ready); return its body."""
    deadline = time.monotonic() + timeout_s
    body: dict = {}
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            status, body = get_json(f"{base_url}/health", timeout_s=2)
            if status == 200:
                return body
        time.sleep(_POLL_S)
    raise AssertionError(f"/health never answered 200 within {timeout_s}s; last {body}")


def wait_instances(
    base_url: str,
    check: object,
    *,
    timeout_s: float = 30.0,
    proc: TandemProcess | None = None,
) -> set[str]:
    """Poll /health until `check(instance_ids)` is true; return those ids."""
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    while time.monotonic() < deadline:
        seen = instances(base_url)
        if check(seen):  # type: ignore[operator]
            return seen
        if proc is not None and proc.proc.poll() is not None:
            raise AssertionError(f"{proc.name} exited:\n{proc.log()[-3000:]}")
        time.sleep(_POLL_S)
    raise AssertionError(f"instances never satisfied the check within {timeout_s}s; last {seen}")
