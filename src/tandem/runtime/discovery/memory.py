"""In-process discovery: one object shared by every component of a process (or a test)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tandem.protocols.discovery import Instance, InstanceEvent


class MemoryDiscovery:
    """A dict of instances plus watcher queues. Records live until `unregister`/`close`
    (there is no process to die). Watch queues are unbounded on purpose: they carry one
    event per instance change, bounded by the number of instances."""

    def __init__(self) -> None:
        self._instances: dict[str, Instance] = {}
        self._watchers: list[tuple[str, asyncio.Queue[InstanceEvent | None]]] = []
        self._owned: set[str] = set()

    async def register(self, instance: Instance) -> None:
        if instance.instance_id in self._instances:
            raise ValueError(f"instance_id {instance.instance_id!r} is already registered")
        self._instances[instance.instance_id] = instance
        self._owned.add(instance.instance_id)
        self._notify(InstanceEvent(kind="added", instance=instance))

    async def unregister(self, instance_id: str) -> None:
        self._owned.discard(instance_id)
        instance = self._instances.pop(instance_id, None)
        if instance is not None:
            self._notify(InstanceEvent(kind="removed", instance=instance))

    async def list_instances(self, prefix: str = "") -> list[Instance]:
        return [i for i in self._instances.values() if i.path.startswith(prefix)]

    def _notify(self, event: InstanceEvent) -> None:
        for prefix, queue in self._watchers:
            if event.instance.path.startswith(prefix):
                queue.put_nowait(event)

    async def watch(self, prefix: str = "") -> AsyncIterator[InstanceEvent]:
        queue: asyncio.Queue[InstanceEvent | None] = asyncio.Queue()
        # snapshot and subscribe with no await between them: no change can slip through
        current = [i for i in self._instances.values() if i.path.startswith(prefix)]
        self._watchers.append((prefix, queue))
        try:
            for instance in current:
                yield InstanceEvent(kind="added", instance=instance)
            while (event := await queue.get()) is not None:
                yield event
        finally:
            self._watchers.remove((prefix, queue))

    async def close(self) -> None:
        for instance_id in list(self._owned):
            await self.unregister(instance_id)
        for _, queue in self._watchers:
            queue.put_nowait(None)
