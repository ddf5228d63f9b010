"""A process registered in file discovery disappears within 2 s of being SIGKILLed."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from tests.support.processes import kill, spawn_python_module

from tandem.runtime.discovery.file import FileDiscovery

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(30)]


async def test_killed_process_is_removed_within_2s(tmp_path: Path) -> None:
    watcher = FileDiscovery(str(tmp_path), ttl_s=60.0)  # long TTL: the pid check must do it
    events = watcher.watch("t.backend")
    proc = spawn_python_module("tests.support.register_instance", "file", str(tmp_path), "w1", "60")
    try:
        ev = await asyncio.wait_for(anext(events), 5)
        assert (ev.kind, ev.instance.instance_id) == ("added", "w1")
        kill(proc)
        t0 = time.monotonic()
        ev = await asyncio.wait_for(anext(events), 2)
        assert (ev.kind, ev.instance.instance_id) == ("removed", "w1")
        assert time.monotonic() - t0 < 2.0
    finally:
        kill(proc)
        await events.aclose()
