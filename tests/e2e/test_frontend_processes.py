"""Several frontend processes over one set of workers (issue 13).

- `tandem serve --frontend-processes 2`: two processes listen on the one port (SO_REUSEPORT),
  each serves the model, and every request on fresh connections succeeds.
- Two `tandem frontend --router kv --router-replica-sync` processes on their own ports share the
  KV view: a prefix sent through one is a prefix-cache hit when the repeat comes through the other
  (both follow the workers' KV events), and a frontend that restarts catches up (it asks every
  worker for its whole block set) before it routes.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import psutil
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

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]

BLOCK = 64  # the mocker's default block size
PREFIX_LEN = 8 * BLOCK


def _complete(base: str, prompt: list[int]) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    status, _, raw = http_request(f"{base}/v1/completions", body, timeout_s=30)
    assert status == 200, raw
    return json.loads(raw)["usage"]


def _listeners(pid: int, port: int) -> list[int]:
    procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return [
        p.pid
        for p in procs
        for c in p.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]


def test_serve_with_two_frontend_processes_shares_one_port(tmp_path: Path) -> None:
    port = free_port()
    args = ["serve", "--engine", "mocker", "--workers", "2", "--router", "kv"]
    args += ["--port", str(port), "--run-dir", str(tmp_path / "run"), "--frontend-processes", "2"]
    proc = start_tandem("serve", [*args, "--speedup-ratio", "0"], tmp_path)
    try:
        proc.wait_log("tandem serve ready", timeout_s=60)
        base = f"http://127.0.0.1:{port}"
        wait_instances(base, lambda ids: len(ids) == 2, timeout_s=30, proc=proc)
        proc.wait_log(r"frontend1 pid=\d+", timeout_s=10)
        deadline = time.monotonic() + 30  # the replica listens once it has loaded the model
        while len(set(_listeners(proc.pid, port))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(set(_listeners(proc.pid, port))) == 2, proc.log()[-3000:]
        rng = random.Random(1)
        for _ in range(30):  # http_request opens a new connection each time
            usage = _complete(base, [rng.randrange(100, 40_000) for _ in range(200)])
            assert usage["prompt_tokens"] == 200
    finally:
        assert proc.stop() == 0, proc.log()[-3000:]


ADMIN = "sk-admin-test"


def _frontend(name: str, port: int, runtime: list[str], log_dir: Path) -> TandemProcess:
    args = ["frontend", "--port", str(port), "--router", "kv", "--router-replica-sync"]
    return start_tandem(name, [*args, "--admin-api-key", ADMIN, *runtime], log_dir)


def _hit_rate(base: str, prompt: list[int]) -> float:
    usage = _complete(base, prompt)
    return usage["prompt_tokens_details"]["cached_tokens"] / PREFIX_LEN


def test_frontends_share_the_kv_view_and_a_restarted_one_catches_up(tmp_path: Path) -> None:
    runtime = ["--discovery", "file", "--discovery-dir", str(tmp_path / "disc")]
    runtime += ["--events", "zmq"]
    port_a, port_b = free_port(), free_port()
    a_url, b_url = f"http://127.0.0.1:{port_a}", f"http://127.0.0.1:{port_b}"
    procs: list[TandemProcess] = []
    rng = random.Random(5)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, 40_000) for _ in range(n)]

    try:
        for i in range(2):
            worker, _ = start_worker(f"w{i}", runtime, tmp_path, "--speedup-ratio", "0")
            procs.append(worker)
        procs.append(_frontend("a", port_a, runtime, tmp_path))
        procs.append(b := _frontend("b", port_b, runtime, tmp_path))
        for url, proc in ((a_url, procs[2]), (b_url, b)):
            wait_instances(url, lambda ids: len(ids) == 2, timeout_s=45, proc=proc)

        # a prefix through A, its repeat through B: B routes it to the worker that holds it
        prefixes = [tokens(PREFIX_LEN) for _ in range(4)]
        for prefix in prefixes:
            assert _hit_rate(a_url, prefix + tokens(16)) == 0.0
        for prefix in prefixes:
            _wait_known(b_url, prefix)
            assert _hit_rate(b_url, prefix + tokens(16)) == 1.0

        # B restarts; meanwhile A caches new prefixes; the new B learns them from the workers
        b.stop()
        later = [tokens(PREFIX_LEN) for _ in range(4)]
        for prefix in later:
            assert _hit_rate(a_url, prefix + tokens(16)) == 0.0
        procs.append(b2 := _frontend("b2", port_b, runtime, tmp_path))
        wait_instances(b_url, lambda ids: len(ids) == 2, timeout_s=45, proc=b2)
        for prefix in later:
            _wait_known(b_url, prefix)
            assert _hit_rate(b_url, prefix + tokens(16)) == 1.0
    finally:
        for proc in reversed(procs):
            proc.stop(grace_s=5)


def _wait_known(base: str, prefix: list[int]) -> None:
    """Until the router at `base` knows some worker holds all of `prefix` (KV events travel over
    ZMQ and a new router's block-set request takes a moment). `/v1/route/explain` routes and
    caches nothing, so waiting on it cannot make the later request hit by itself."""
    body = {"model": MODEL, "prompt": prefix, "max_tokens": 2}
    headers = {"authorization": f"Bearer {ADMIN}"}
    deadline = time.monotonic() + 15
    best = 0
    while time.monotonic() < deadline:
        status, _, raw = http_request(f"{base}/v1/route/explain", body, headers=headers)
        assert status == 200, raw
        best = max(c["overlap_blocks"] for c in json.loads(raw)["candidates"])
        if best >= PREFIX_LEN // BLOCK:
            return
        time.sleep(0.05)
    raise AssertionError(f"router at {base} never learned the prefix (overlap {best} blocks)")
