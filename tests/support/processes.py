"""Start helper child processes for tests and stop them by PID."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def spawn_python_module(
    module: str, *args: str, ready_line: str = "READY", timeout_s: float = 15.0
) -> subprocess.Popen[bytes]:
    """Run `python -m module args...` from the repo root; return once it prints `ready_line`."""
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert proc.stdout is not None
    deadline, seen = time.monotonic() + timeout_s, b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline()
            seen += line
            if line.strip() == ready_line.encode():
                return proc
            if not line and proc.poll() is not None:
                break
    kill(proc)
    raise RuntimeError(f"{module} did not print {ready_line} within {timeout_s}s:\n{seen.decode()}")


def kill(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, sig)
    proc.wait(10)
