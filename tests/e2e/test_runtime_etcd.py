"""EtcdDiscovery against a real etcd (started on free loopback ports, stopped by PID)."""

from __future__ import annotations

import asyncio
import time

import pytest
from tests.support.processes import kill, spawn_python_module
from tests.support.services import Service

from tandem.protocols.discovery import Instance
from tandem.runtime.discovery.etcd import EtcdDiscovery, prefix_end

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(40)]


def inst(iid: str, component: str = "backend") -> Instance:
    return Instance(
        instance_id=iid,
        namespace="t",
        component=component,
        endpoint="generate",
        address="127.0.0.1:1",
    )


def test_prefix_end() -> None:
    assert prefix_end(b"a/b") == b"a/c"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"") == b"\0"


async def test_register_list_watch_unregister(etcd_server: Service) -> None:
    a = EtcdDiscovery(etcd_server.url, ttl_s=1)
    b = EtcdDiscovery(etcd_server.url, ttl_s=1)
    try:
        await a.register(inst("a1"))
        events = b.watch("t.backend")
        ev = await asyncio.wait_for(anext(events), 5)
        assert (ev.kind, ev.instance.instance_id) == ("added", "a1")
        with pytest.raises(ValueError, match="already registered"):
            await b.register(inst("a1"))
        await a.register(inst("p1", "prefill"))  # other prefix: not seen by the watch
        await a.register(inst("a2"))
        ev = await asyncio.wait_for(anext(events), 5)
        assert (ev.kind, ev.instance.instance_id) == ("added", "a2")
        assert {i.instance_id for i in await b.list_instances("t.")} == {"a1", "a2", "p1"}
        await a.unregister("a1")
        ev = await asyncio.wait_for(anext(events), 5)
        assert (ev.kind, ev.instance.instance_id) == ("removed", "a1")
        t0 = time.monotonic()
        await a.close()  # clean exit: records go at once, not at lease expiry
        ev = await asyncio.wait_for(anext(events), 5)
        assert (ev.kind, ev.instance.instance_id) == ("removed", "a2")
        assert time.monotonic() - t0 < 0.5
        await events.aclose()
        assert await b.list_instances() == []
    finally:
        await a.close()
        await b.close()


async def test_keepalive_holds_records_past_ttl(etcd_server: Service) -> None:
    a, b = EtcdDiscovery(etcd_server.url, ttl_s=1), EtcdDiscovery(etcd_server.url)
    try:
        await a.register(inst("a1"))
        events = b.watch("t.backend")
        assert (await asyncio.wait_for(anext(events), 5)).kind == "added"
        with pytest.raises(TimeoutError):  # nothing is removed over 3 lease TTLs
            await asyncio.wait_for(anext(events), 3.0)
        await events.aclose()
        assert [i.instance_id for i in await b.list_instances()] == ["a1"]
    finally:
        await a.close()
        await b.close()


async def test_sigkilled_process_removed_within_2s(etcd_server: Service) -> None:
    watcher = EtcdDiscovery(etcd_server.url)
    events = watcher.watch("t.backend")
    proc = spawn_python_module(
        "tests.support.register_instance", "etcd", etcd_server.url, "w1", "1"
    )
    try:
        ev = await asyncio.wait_for(anext(events), 5)
        assert (ev.kind, ev.instance.instance_id) == ("added", "w1")
        kill(proc)
        t0 = time.monotonic()
        ev = await asyncio.wait_for(anext(events), 3)
        elapsed = time.monotonic() - t0
        assert (ev.kind, ev.instance.instance_id) == ("removed", "w1")
        assert elapsed <= 2.0, f"removed after {elapsed:.2f}s"
    finally:
        kill(proc)
        await events.aclose()
        await watcher.close()
