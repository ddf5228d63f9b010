"""Workers die with `tandem serve` whatever kills it: SIGKILL of serve (no chance to stop its
children) leaves no process of the stack and no run directory behind within 5 s."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from tests.support.services import free_port
from tests.support.tandem_procs import start_tandem, wait_instances

from tandem.cli.supervisor import OWNER_FILE, RUN_DIR_PREFIX, remove_stale_run_dirs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


def _alive(pid: int) -> bool:
    """Running and not a zombie (a reaped or zombie child no longer serves anything)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def _wait_gone(pids: list[int], run_dir: Path, timeout_s: float) -> tuple[list[int], bool]:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if _alive(p)]
        if (not alive and not run_dir.exists()) or time.monotonic() > deadline:
            return alive, run_dir.exists()
        time.sleep(0.05)


# workers started by the supervisor log "started worker0 pid=N"; by the embedded planner's
# local connector "started worker <instance id> pid=N"
STARTED = re.compile(r"started worker ?\w+ pid=(\d+)")


@pytest.mark.parametrize("planner", [[], ["--planner"]], ids=["supervisor", "planner"])
def test_sigkill_of_serve_leaves_no_worker_and_no_run_dir(tmp_path: Path, planner) -> None:
    port = free_port()
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    os.environ["TMPDIR"] = str(tmp)  # the default run dir lands here (inherited by serve)
    try:
        proc = start_tandem(
            "serve",
            ["serve", "--engine", "mocker", "--workers", "2", "--port", str(port), *planner],
            tmp_path,
        )
    finally:
        del os.environ["TMPDIR"]
    try:
        wait_instances(f"http://127.0.0.1:{port}", lambda ids: len(ids) == 2, proc=proc)
        log = proc.log()
        worker_pids = [int(p) for p in STARTED.findall(log)]
        m = re.search(r"run directory (\S+)", log)
        assert len(worker_pids) == 2 and m is not None, log[-2000:]
        run_dir = Path(m.group(1))
        assert run_dir.parent == tmp and run_dir.is_dir()

        proc.signal(signal.SIGKILL)
        proc.proc.wait(5)
        alive, dir_left = _wait_gone(worker_pids, run_dir, timeout_s=5.0)
        assert alive == [], f"workers {alive} outlived SIGKILL of tandem serve"
        assert not dir_left, f"run dir {run_dir} left behind: {list(run_dir.rglob('*'))}"
    finally:
        proc.stop(grace_s=0)


def test_next_serve_removes_a_stale_run_dir_whose_owner_is_dead(tmp_path: Path) -> None:
    dead = tmp_path / f"{RUN_DIR_PREFIX}dead"
    (dead / "discovery").mkdir(parents=True)
    exited = subprocess.Popen(["true"])  # a pid that is certainly dead once reaped
    exited.wait(5)
    (dead / OWNER_FILE).write_text(str(exited.pid))
    live = tmp_path / f"{RUN_DIR_PREFIX}live"
    live.mkdir()
    (live / OWNER_FILE).write_text(str(os.getppid()))
    foreign = tmp_path / "tandem-serve-no-owner-file"
    foreign.mkdir()

    assert remove_stale_run_dirs(str(tmp_path)) == [str(dead)]
    assert not dead.exists() and live.exists() and foreign.exists()
