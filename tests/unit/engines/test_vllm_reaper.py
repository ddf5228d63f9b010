"""The reaper: a worker SIGKILLed leaves no child behind; a worker that says "done" keeps
its (already shut down) children's fate to itself."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.timeout(60)

HOST = """
import subprocess, sys, time
from tandem.engines.vllm.reaper import Reaper
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         start_new_session=True)
reaper = Reaper()  # returns once it has seen the child
print(child.pid, flush=True)
if sys.argv[1] == "clean":
    reaper.done()
    print("done", flush=True)
time.sleep(120)
"""


def _host(mode: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOST, mode], stdout=subprocess.PIPE, text=True, env=os.environ
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_children_die_with_a_sigkilled_worker():
    host, child = _host("kill")
    os.kill(host.pid, signal.SIGKILL)
    host.wait(10)
    assert _wait_gone(child, 10), "the worker's child outlived it"


def test_a_clean_shutdown_releases_the_reaper():
    host, child = _host("clean")
    try:
        assert host.stdout is not None and host.stdout.readline().strip() == "done"
        reapers = [p for p in psutil.Process(host.pid).children() if p.pid != child]
        assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in reapers)
    finally:
        host.kill()
        host.wait(10)
        os.kill(child, signal.SIGKILL)
