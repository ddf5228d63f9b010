"""`pid_alive`: a running process is alive, a reaped one is not, one of another user is."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.runtime.process import pid_alive

pytestmark = pytest.mark.timeout(10)


def test_this_process_is_alive() -> None:
    assert pid_alive(os.getpid())


def test_a_reaped_child_is_not_alive() -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert not pid_alive(child.pid)


def test_a_process_this_user_may_not_signal_is_alive(monkeypatch: pytest.MonkeyPatch) -> None:
    def kill(pid: int, sig: int) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "kill", kill)
    assert pid_alive(12345)
