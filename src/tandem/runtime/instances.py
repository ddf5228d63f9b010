"""A live view of the instances under one discovery path prefix."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tandem.protocols.discovery import Instance, InstanceEvent
from tandem.runtime.base import Discovery
from tandem.runtime.task import cancel_and_wait

logger = logging.getLogger(__name__)

Listener = Callable[[InstanceEvent], None]


class InstanceSet:
    """`instances` (instance_id -> Instance) follows discovery's watch of `prefix`.
    Listeners are called synchronously after each change has been applied. Not thread-safe."""

    def __init__(self, discovery: Discovery, prefix: str) -> None:
        self.discovery, self.prefix = discovery, prefix
        self.instances: dict[str, Instance] = {}
        self._listeners: list[Listener] = []
        self._changed: asyncio.Future[None] | None = None  # resolved on the next change
        self._task: asyncio.Task[None] | None = None

    def add_listener(self, callback: Listener) -> None:
        self._listeners.append(callback)

    def remove_listener(self, callback: Listener) -> None:
        self._listeners.remove(callback)

    async def start(self) -> None:
        """Begin following discovery (returns at once; see `wait_for`)."""
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name=f"instance-set:{self.prefix}")

    async def _follow(self) -> None:
        try:
            async for event in self.discovery.watch(self.prefix):
                self._apply(event)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("watch of %r failed; instance set is frozen", self.prefix)

    def _apply(self, event: InstanceEvent) -> None:
        inst = event.instance
        if event.kind == "added":
            self.instances[inst.instance_id] = inst
        else:
            self.instances.pop(inst.instance_id, None)
        for cb in list(self._listeners):
            try:
                cb(event)
            except Exception:
                logger.exception("instance listener failed on %s", inst.instance_id)
        changed, self._changed = self._changed, None
        if changed is not None and not changed.done():
            changed.set_result(None)

    async def wait_for(self, count: int, timeout_s: float = 10.0) -> dict[str, Instance]:
        """Wait until exactly `count` instances are live; raises TimeoutError naming both."""
        try:
            async with asyncio.timeout(timeout_s):
                while len(self.instances) != count:
                    if self._changed is None:
                        self._changed = asyncio.get_running_loop().create_future()
                    await asyncio.shield(self._changed)
        except TimeoutError:
            raise TimeoutError(
                f"expected {count} instances under {self.prefix!r} within {timeout_s}s; "
                f"have {len(self.instances)}: {sorted(self.instances)}"
            ) from None
        return dict(self.instances)

    async def close(self) -> None:
        await cancel_and_wait([self._task])
        self._task = None
