"""What the routers need from the runtime, as narrow protocols (so tests can pass fakes).

`tandem.runtime.instances.InstanceSet` satisfies `InstanceSource`; any `EventBus` satisfies
`EventSource`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tandem.protocols.discovery import Instance, InstanceEvent, ModelCard
from tandem.runtime.base import Subscription

InstanceListener = Callable[[InstanceEvent], None]


class InstanceSource(Protocol):
    @property
    def instances(self) -> dict[str, Instance]:
        """The live instances by instance_id."""
        ...

    def add_listener(self, callback: InstanceListener) -> None:
        """Call `callback` synchronously with every later change."""
        ...

    async def start(self) -> None:
        """Begin following the instances (idempotent)."""
        ...

    async def close(self) -> None:
        """Stop following the instances."""
        ...


class EventSource(Protocol):
    async def publish(self, subject: str, payload: bytes) -> None: ...

    async def subscribe(self, subject: str) -> Subscription: ...


class StaticInstanceSet:
    """In-memory `InstanceSource`: instances added and removed by hand (tests, fixed fleets)
    or fed discovery events through `apply` (one model's view of a wider `InstanceSet`).
    Listeners receive `InstanceEvent`s synchronously. One event loop; not thread-safe."""

    def __init__(self, instances: list[Instance] | None = None) -> None:
        self.instances: dict[str, Instance] = {i.instance_id: i for i in instances or []}
        self._listeners: list[InstanceListener] = []

    def add_listener(self, callback: InstanceListener) -> None:
        self._listeners.append(callback)

    async def start(self) -> None:
        """Nothing to follow: changes come by hand or through `apply`."""

    async def close(self) -> None:
        """Nothing to stop."""

    def add(self, instance: Instance) -> None:
        self.apply(InstanceEvent(kind="added", instance=instance))

    def remove(self, instance_id: str) -> None:
        instance = self.instances.get(instance_id)
        if instance is not None:
            self.apply(InstanceEvent(kind="removed", instance=instance))

    def apply(self, event: InstanceEvent) -> None:
        """Add or remove `event.instance` and pass `event` to the listeners; a removal of an
        unknown instance is ignored (no listener call)."""
        if event.kind == "added":
            self.instances[event.instance.instance_id] = event.instance
        elif self.instances.pop(event.instance.instance_id, None) is None:
            return
        for callback in list(self._listeners):
            callback(event)


class InstancesByModel:
    """Splits a live instance set (e.g. every `ns.backend.generate`) into one
    `StaticInstanceSet` per served model name, so each model gets its own router.
    `on_new_model(card, view)` runs once per model name, on its first added instance, before
    that instance is applied to `view`. One event loop; not thread-safe."""

    def __init__(
        self, source: InstanceSource, on_new_model: Callable[[ModelCard, StaticInstanceSet], None]
    ) -> None:
        self.source = source
        self.views: dict[str, StaticInstanceSet] = {}
        self._on_new_model = on_new_model

    async def start(self) -> None:
        """Take the instances already known, then follow changes (starts `source`)."""
        self.source.add_listener(self._on_event)
        for inst in list(self.source.instances.values()):
            self._on_event(InstanceEvent(kind="added", instance=inst))
        await self.source.start()

    def _on_event(self, event: InstanceEvent) -> None:
        card = event.instance.model
        if card is None:
            return
        view = self.views.get(card.name)
        if view is None:
            if event.kind != "added":
                return
            view = self.views[card.name] = StaticInstanceSet()
            self._on_new_model(card, view)
        view.apply(event)
