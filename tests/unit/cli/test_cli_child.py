"""`tandem.cli.child`: a child whose parent is alive never removes the stack's run directory
when it exits on its own (e.g. a crashed worker), and a normal stop is told apart from an
orphaned one by the byte on the lifeline."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)


def _run_child(run_dir: Path, *, announce_stop: bool) -> int:
    read_fd, write_fd = os.pipe()
    try:
        if announce_stop:
            os.write(write_fd, b"s")
        child = subprocess.run(  # `tandem bench nosuch` exits at once with an error
            [
                sys.executable,
                "-m",
                "tandem.cli.child",
                "--parent-pid",
                str(os.getpid()),
                "--life-fd",
                str(read_fd),
                "--run-dir",
                str(run_dir),
                "--",
                "bench",
                "nosuch",
            ],
            pass_fds=(read_fd,),
            capture_output=True,
            timeout=30,
        )
    finally:
        os.close(read_fd)
        os.close(write_fd)
    return child.returncode


@pytest.mark.parametrize("announce_stop", [False, True])
def test_a_child_exiting_while_its_parent_lives_keeps_the_run_dir(
    tmp_path: Path, announce_stop: bool
) -> None:
    run_dir = tmp_path / "run"
    (run_dir / "discovery").mkdir(parents=True)
    assert _run_child(run_dir, announce_stop=announce_stop) != 0
    assert (run_dir / "discovery").is_dir()


def test_a_child_started_after_its_parent_died_exits_and_removes_the_run_dir(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    gone = subprocess.Popen(["true"])
    gone.wait(5)
    guard = ["--parent-pid", str(gone.pid), "--life-fd", "0", "--run-dir", str(run_dir)]
    child = subprocess.run(
        [sys.executable, "-m", "tandem.cli.child", *guard, "--", "worker", "--help"],
        capture_output=True,
        timeout=30,
    )
    assert child.returncode == 1 and b"usage" not in child.stdout  # never ran the worker
    assert not run_dir.exists()
