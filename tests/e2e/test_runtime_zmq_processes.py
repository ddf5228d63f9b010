"""ZmqEventBus across two processes on one host, peers found through file discovery."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from tests.support.processes import kill, spawn_python_module

from tandem.runtime.discovery.file import FileDiscovery
from tandem.runtime.events.zmq import ZmqEventBus

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(30)]


async def test_subscriber_receives_other_process_events_in_order(tmp_path: Path) -> None:
    proc = spawn_python_module("tests.support.zmq_publisher", str(tmp_path), "t.kv.w1")
    bus = ZmqEventBus(FileDiscovery(str(tmp_path), poll_interval_s=0.05), namespace="t")
    try:
        sub = await bus.subscribe("t.kv.>")
        got = [await asyncio.wait_for(anext(sub), 5) for _ in range(10)]
        assert all(subject == "t.kv.w1" for subject, _ in got)
        seqs = [int(payload) for _, payload in got]
        assert seqs == list(range(seqs[0], seqs[0] + 10))  # in publish order, none lost
        assert sub.num_dropped == 0
    finally:
        kill(proc)
        await bus.close()
