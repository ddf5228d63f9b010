"""A worker process on the TCP request plane: SIGTERM drains, SIGKILL is PeerGone."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from tests.support.processes import kill, spawn_python_module

from tandem import errors
from tandem.runtime.discovery.file import FileDiscovery
from tandem.runtime.tcp import TcpRequestClient

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(30)]


async def test_sigterm_unregisters_then_drains_inflight(tmp_path: Path) -> None:
    proc = spawn_python_module("tests.support.runtime_worker", str(tmp_path), "1.0")
    disc, client = FileDiscovery(str(tmp_path), poll_interval_s=0.05), TcpRequestClient()
    events = disc.watch("t.backend")
    try:
        worker = (await asyncio.wait_for(anext(events), 5)).instance
        it = client.stream(worker.address, worker.path, b"", request_id="r1")
        assert await anext(it) == b"start"
        os.kill(proc.pid, signal.SIGTERM)
        removed = await asyncio.wait_for(anext(events), 2)  # gone from discovery first...
        assert (removed.kind, removed.instance.instance_id) == ("removed", "w1")
        assert await asyncio.wait_for(anext(it), 5) == b"end"  # ...then the request finishes
        assert await anext(it, None) is None
        assert await asyncio.to_thread(proc.wait, 10) == 0
        assert proc.stdout is not None and b"EXITED" in proc.stdout.read()
    finally:
        kill(proc)
        await events.aclose()
        await client.close()


async def test_sigkill_mid_stream_is_peer_gone_naming_address(tmp_path: Path) -> None:
    proc = spawn_python_module("tests.support.runtime_worker", str(tmp_path), "30")
    disc, client = FileDiscovery(str(tmp_path)), TcpRequestClient()
    try:
        (worker,) = await disc.list_instances("t.backend")
        it = client.stream(worker.address, worker.path, b"", request_id="r1")
        assert await anext(it) == b"start"
        kill(proc)
        with pytest.raises(errors.PeerGone, match=worker.address):
            await asyncio.wait_for(anext(it), 5)
        assert await disc.list_instances() == []  # dead pid: expired at once
    finally:
        kill(proc)
        await client.close()
