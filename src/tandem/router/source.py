"""What the routers need from the runtime, as narrow protocols (so tests can pass fakes).

`tandem.runtime.instances.InstanceSet` satisfies `InstanceSource`; any `EventBus` satisfies
`EventSource`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from tandem.protocols.discovery import Instance, InstanceEvent
from tandem.runtime.base import Subscription


class InstanceSource(Protocol):
    @property
    def instances(self) -> dict[str, Instance]: ...

    def add_listener(self, callback: Callable[[Any], Any]) -> Any: ...


class EventSource(Protocol):
    async def publish(self, subject: str, payload: bytes) -> None: ...

    async def subscribe(self, subject: str) -> Subscription: ...


class StaticInstanceSet:
    """In-memory `InstanceSource`: instances added and removed by hand (tests, fixed fleets).
    Listeners receive `InstanceEvent`s synchronously."""

    def __init__(self, instances: list[Instance] | None = None) -> None:
        self.instances: dict[str, Instance] = {i.instance_id: i for i in instances or []}
        self._listeners: list[Callable[[Any], Any]] = []

    def add_listener(self, callback: Callable[[Any], Any]) -> None:
        self._listeners.append(callback)

    def add(self, instance: Instance) -> None:
        self.instances[instance.instance_id] = instance
        self._notify("added", instance)

    def remove(self, instance_id: str) -> None:
        instance = self.instances.pop(instance_id, None)
        if instance is not None:
            self._notify("removed", instance)

    def _notify(self, kind: str, instance: Instance) -> None:
        event = InstanceEvent(kind=kind, instance=instance)  # type: ignore[arg-type]
        for callback in list(self._listeners):
            callback(event)
