"""`tandem worker --engine mocker` as a real process on file discovery: ready line, serves,
SIGTERM unregisters then drains the in-flight request, exit 0."""

from __future__ import annotations

import asyncio
import os
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandem.protocols.engine import PreprocessedRequest, StopConditions, decode_output, encode
from tandem.runtime.discovery.file import FileDiscovery
from tandem.runtime.tcp import TcpRequestClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]
REPO = Path(__file__).resolve().parents[2]


def _spawn_worker(discovery_dir: Path, *flags: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start the worker; return it with its 'worker ready' log line."""
    cmd = [sys.executable, "-m", "tandem.cli.main", "worker", "--namespace", "e2e"]
    cmd += ["--discovery", "file", "--discovery-dir", str(discovery_dir), *flags]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert proc.stdout is not None
    fd = proc.stdout.fileno()  # raw reads: a buffered readline could hide lines from select
    deadline, seen = time.monotonic() + 30, b""
    while time.monotonic() < deadline and proc.poll() is None:
        if select.select([fd], [], [], 0.1)[0]:
            seen += os.read(fd, 65536)
            for line in seen.splitlines(keepends=True):
                if b"worker ready" in line and line.endswith(b"\n"):
                    return proc, line.decode()
    proc.kill()
    proc.wait(10)
    raise AssertionError(f"worker did not become ready:\n{seen.decode()}")


def _request(rid: str, max_tokens: int) -> bytes:
    return encode(
        PreprocessedRequest(
            request_id=rid,
            model="smollm2",
            token_ids=list(range(100)),
            stop=StopConditions(max_tokens=max_tokens),
        )
    )


async def test_worker_process_serves_and_drains_on_sigterm(tmp_path: Path) -> None:
    # speedup 20: ~0.3 ms per decode step, so the long request is still running at SIGTERM
    proc, ready = _spawn_worker(tmp_path, "--speedup-ratio", "20", "--drain-grace-s", "20")
    disc = FileDiscovery(str(tmp_path), poll_interval_s=0.05)
    client = TcpRequestClient()
    try:
        match = re.search(r"instance_id=(\w+) address=(\S+)", ready)
        assert match is not None, ready
        [inst] = await disc.list_instances("e2e.backend.generate")
        assert (inst.instance_id, inst.address) == match.groups()
        assert inst.model is not None and inst.model.tokenizer is not None
        assert inst.model.tokenizer.startswith("gguf:")  # the frontend can tokenize

        outs = [
            decode_output(p)
            async for p in client.stream(
                inst.address, inst.path, _request("quick", 3), request_id="quick"
            )
        ]
        assert sum(len(o.token_ids) for o in outs) == 3

        events = disc.watch("e2e.backend.generate")
        assert (await asyncio.wait_for(anext(events), 5)).kind == "added"
        stream = client.stream(inst.address, inst.path, _request("long", 2000), request_id="long")
        first = decode_output(await anext(stream))
        os.kill(proc.pid, signal.SIGTERM)
        assert (await asyncio.wait_for(anext(events), 5)).kind == "removed"
        rest = [decode_output(p) async for p in stream]
        assert len(first.token_ids) + sum(len(o.token_ids) for o in rest) == 2000
        assert rest[-1].finish_reason == "length"
        assert await asyncio.to_thread(proc.wait, 20) == 0
        await events.aclose()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        await client.close()
        await disc.close()
