"""InstanceSet keeps following discovery when a watch fails (it used to freeze for good)."""

from __future__ import annotations

import asyncio
import errno
from collections.abc import AsyncIterator

import pytest
from tests.support.eventually import eventually
from tests.support.instances import backend_instance

from tandem.protocols.discovery import Instance, InstanceEvent
from tandem.runtime.instances import InstanceSet

pytestmark = pytest.mark.timeout(10)


class FlakyDiscovery:
    """A watch that lists `live`, then fails with EMFILE while `failing` is set; later
    watches list `live` again and then follow `changes`."""

    def __init__(self, live: list[Instance]) -> None:
        self.live = {inst.instance_id: inst for inst in live}
        self.failing = asyncio.Event()
        self.num_watches = 0
        self.changes: asyncio.Queue[InstanceEvent] = asyncio.Queue()

    async def list_instances(self, prefix: str = "") -> list[Instance]:
        if self.failing.is_set():
            raise OSError(errno.EMFILE, "Too many open files")
        return list(self.live.values())

    async def watch(self, prefix: str = "") -> AsyncIterator[InstanceEvent]:
        self.num_watches += 1
        if self.failing.is_set():
            raise OSError(errno.EMFILE, "Too many open files")
        for inst in list(self.live.values()):
            yield InstanceEvent(kind="added", instance=inst)
        while True:
            get = asyncio.ensure_future(self.changes.get())
            fail = asyncio.ensure_future(self.failing.wait())
            done, pending = await asyncio.wait({get, fail}, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            if fail in done:
                raise OSError(errno.EMFILE, "Too many open files")
            yield get.result()


async def test_a_failed_watch_is_retried_and_reconciled() -> None:
    w0, w1, w2 = (backend_instance(i) for i in range(3))
    discovery = FlakyDiscovery([w0, w1])
    instances = InstanceSet(discovery, "tandem.backend.generate")  # type: ignore[arg-type]
    removed: list[str] = []
    instances.add_listener(
        lambda e: removed.append(e.instance.instance_id) if e.kind == "removed" else None
    )
    await instances.start()
    await instances.wait_for(2)
    assert instances.is_healthy

    discovery.failing.set()  # e.g. out of file descriptors
    await eventually(lambda: not instances.is_healthy)
    assert "EMFILE" in (instances.error or "") or "Too many open files" in (instances.error or "")
    del discovery.live["w1"]  # changes while the watch is down are not lost
    discovery.live["w2"] = w2
    discovery.failing.clear()

    await eventually(lambda: set(instances.instances) == {"w0", "w2"})
    assert instances.is_healthy and removed == ["w1"]
    discovery.changes.put_nowait(InstanceEvent(kind="removed", instance=w0))
    await eventually(lambda: set(instances.instances) == {"w2"})  # follows again
    await instances.close()
