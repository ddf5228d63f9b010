"""Start and stop server stacks for benchmarks, by PID.

`ProcessStack` owns the processes it spawned: each runs in its own session (so a server's own
children go with it), logs to a file, and `stop()` sends SIGTERM to each group, waits, then
SIGKILLs what is left. Use it as a context manager so an error never leaves servers behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the OS may hand it out again later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tandem_argv(*args: str) -> list[str]:
    """Run the `tandem` CLI with this interpreter (works without the console script on PATH)."""
    return [sys.executable, "-m", "tandem.cli.main", *args]


@dataclass(slots=True)
class StartedProcess:
    name: str
    process: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.process.pid


class ProcessStack:
    """Processes started for one benchmark stage; stopped together, newest first."""

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.processes: list[StartedProcess] = []

    def spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
        log_path = self.log_dir / f"{name}.log"
        with open(log_path, "wb") as log:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        self.processes.append(StartedProcess(name, process, log_path))
        logger.info("started %s pid=%s: %s", name, process.pid, " ".join(argv))
        return process.pid

    def check_alive(self) -> None:
        """Raise naming the first process that exited, with the tail of its log."""
        for started in self.processes:
            if started.process.poll() is not None:
                tail = started.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(
                    f"{started.name} pid={started.pid} exited with {started.process.returncode}; "
                    f"log {started.log_path}:\n{tail}"
                )

    def stop(self, grace_s: float = 10.0) -> None:
        for started in reversed(self.processes):
            _signal_group(started.process, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for started in reversed(self.processes):
            try:
                started.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s pid=%s ignored SIGTERM; SIGKILL", started.name, started.pid)
                _signal_group(started.process, signal.SIGKILL)
                started.process.wait(timeout=5.0)
        self.processes.clear()

    def __enter__(self) -> ProcessStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    if process.poll() is not None:
        return
    # the group id is the pid of the process we started (start_new_session=True)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


async def wait_ready(
    url: str, *, timeout_s: float, stack: ProcessStack | None = None, probe: bool = True
) -> str:
    """Poll `GET {url}/v1/models` until it lists a model (and, with `probe`, a one-token
    completion succeeds, so workers are really reachable); returns the model id. Fails early
    when a process of `stack` dies."""
    deadline = time.monotonic() + timeout_s
    last_error = "no answer yet"
    timeout = aiohttp.ClientTimeout(total=5.0)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while time.monotonic() < deadline:
            if stack is not None:
                stack.check_alive()
            try:
                model = await _probe(session, url.rstrip("/"), probe)
                if model is not None:
                    return model
                last_error = "no model listed"
            except (aiohttp.ClientError, TimeoutError) as exc:
                last_error = repr(exc)
            await asyncio.sleep(0.25)
    raise TimeoutError(f"{url} not ready after {timeout_s} s: {last_error}")


async def _probe(session: aiohttp.ClientSession, url: str, probe: bool) -> str | None:
    async with session.get(url + "/v1/models") as resp:
        if resp.status != 200:
            return None
        models = (await resp.json()).get("data") or []
    if not models:
        return None
    model = str(models[0]["id"])
    if probe:
        body = {"model": model, "prompt": "hello", "max_tokens": 1}
        async with session.post(url + "/v1/completions", json=body) as resp:
            if resp.status != 200:
                return None
    return model
