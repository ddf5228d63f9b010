from __future__ import annotations

import asyncio

import pytest

from tandem.protocols.discovery import Instance
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.instances import InstanceSet

pytestmark = pytest.mark.timeout(10)


def inst(iid: str, component: str = "backend") -> Instance:
    return Instance(
        instance_id=iid,
        namespace="t",
        component=component,
        endpoint="generate",
        address="127.0.0.1:1",
    )


async def test_register_list_unregister() -> None:
    d = MemoryDiscovery()
    await d.register(inst("a"))
    await d.register(inst("b", "prefill"))
    assert [i.instance_id for i in await d.list_instances("t.backend")] == ["a"]
    with pytest.raises(ValueError, match="already registered"):
        await d.register(inst("a"))
    await d.unregister("a")
    await d.unregister("a")  # idempotent
    assert [i.instance_id for i in await d.list_instances()] == ["b"]


async def test_watch_sees_existing_then_changes() -> None:
    d = MemoryDiscovery()
    await d.register(inst("a"))
    events = d.watch("t.backend")
    first = await anext(events)
    assert (first.kind, first.instance.instance_id) == ("added", "a")
    await d.register(inst("x", "prefill"))  # other prefix: not seen
    await d.register(inst("b"))
    await d.unregister("a")
    got = [await asyncio.wait_for(anext(events), 2) for _ in range(2)]
    assert [(e.kind, e.instance.instance_id) for e in got] == [("added", "b"), ("removed", "a")]
    await events.aclose()


async def test_close_unregisters_own_records() -> None:
    shared = MemoryDiscovery()
    await shared.register(inst("a"))
    await shared.close()
    assert await shared.list_instances() == []


async def test_instance_set_follows_and_notifies() -> None:
    d = MemoryDiscovery()
    s = InstanceSet(d, "t.backend.generate")
    seen: list[tuple[str, str]] = []
    s.add_listener(lambda e: seen.append((e.kind, e.instance.instance_id)))
    await d.register(inst("a"))
    await s.start()
    await s.wait_for(1, timeout_s=2)
    await d.register(inst("b"))
    assert set(await s.wait_for(2, timeout_s=2)) == {"a", "b"}
    await d.unregister("a")
    assert set(await s.wait_for(1, timeout_s=2)) == {"b"}
    assert seen == [("added", "a"), ("added", "b"), ("removed", "a")]
    with pytest.raises(TimeoutError, match="expected 5 instances"):
        await s.wait_for(5, timeout_s=0.05)
    await s.close()
