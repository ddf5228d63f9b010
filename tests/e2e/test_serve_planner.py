"""`tandem serve --planner`: the embedded planner's local connector starts the pool's floor of
workers, the stack serves, and SIGTERM drains every worker it started."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from tests.support.eventually import eventually
from tests.support.services import free_port
from tests.support.tandem_procs import MODEL, http_request, start_tandem, wait_instances

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_serve_with_planner_starts_the_floor_and_drains_on_exit(tmp_path: Path) -> None:
    port = free_port()
    args = ["serve", "--planner", "--engine", "mocker", "--pool", "backend:aggregated:2:3",
            "--interval-s", "0.5", "--speedup-ratio", "0", "--port", str(port),
            "--run-dir", str(tmp_path / "run"), "--log-level", "INFO"]  # fmt: skip
    proc = start_tandem("serve", args, tmp_path)
    pids: list[int] = []
    try:
        base = f"http://127.0.0.1:{port}"
        wait_instances(base, lambda ids: len(ids) == 2, timeout_s=60, proc=proc)
        body = {"model": MODEL, "prompt": "hello", "max_tokens": 5}
        status, _, reply = http_request(f"{base}/v1/completions", body)
        assert status == 200, reply
        assert json.loads(reply)["usage"]["completion_tokens"] == 5
        pids = [int(p) for p in re.findall(r"started worker [0-9a-f]+ pid=(\d+)", proc.log())]
        assert len(pids) == 2
    finally:
        code = proc.stop()
        log = proc.log()
        for pid in pids:
            if _alive(pid):  # never leave a worker behind, even when the test fails
                os.kill(pid, 9)
    assert code == 0, log[-3000:]
    assert "Traceback" not in log, log[-5000:]
    await eventually(lambda: not any(_alive(p) for p in pids), timeout_s=5)
    assert len(re.findall(r"worker [0-9a-f]+ pid=\d+ exited with 0", log)) == 2
