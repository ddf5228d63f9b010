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
WATCH_BACKOFF_MIN_S, WATCH_BACKOFF_MAX_S = 0.05, 2.0


class InstanceSet:
    """`instances` (instance_id -> Instance) follows discovery's watch of `prefix`.
    Listeners are called synchronously after each change has been applied. A failed watch is
    retried with back-off (`error` says why meanwhile). Not thread-safe."""

    def __init__(self, discovery: Discovery, prefix: str) -> None:
        self.discovery, self.prefix = discovery, prefix
        self.instances: dict[str, Instance] = {}
        self._listeners: list[Listener] = []
        self._changed: asyncio.Future[None] | None = None  # resolved on the next change
        self._task: asyncio.Task[None] | None = None
        self.error: str | None = None  # why the watch is failing now; None while it follows

    def add_listener(self, callback: Listener) -> None:
        self._listeners.append(callback)

    def remove_listener(self, callback: Listener) -> None:
        self._listeners.remove(callback)

    async def start(self) -> None:
        """Begin following discovery (returns at once; see `wait_for`)."""
        if self._task is None:
            self._task = asyncio.create_task(self._follow(), name=f"instance-set:{self.prefix}")

    @property
    def is_healthy(self) -> bool:
        """Following discovery now: started, and its watch neither failed nor stopped."""
        return self._task is not None and not self._task.done() and self.error is None

    async def _follow(self) -> None:
        """Follow the watch; when it fails (a backend error, out of file descriptors), retry
        with back-off and reconcile with a fresh listing, so the set is never frozen."""
        backoff_s = WATCH_BACKOFF_MIN_S
        failed = False
        while True:
            try:
                if failed:
                    self._reconcile(await self.discovery.list_instances(self.prefix))
                    logger.info("watch of %r recovered", self.prefix)
                    self.error, failed, backoff_s = None, False, WATCH_BACKOFF_MIN_S
                async for event in self.discovery.watch(self.prefix):
                    self._apply(event)
                raise RuntimeError("discovery watch ended")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if self.error is None:  # once per failure episode
                    logger.warning(
                        "watch of %r failed; retrying every <= %gs", self.prefix,
                        WATCH_BACKOFF_MAX_S, exc_info=True,
                    )  # fmt: skip
                self.error = f"{type(exc).__name__}: {exc}"
                failed = True
                await asyncio.sleep(backoff_s)
                backoff_s = min(WATCH_BACKOFF_MAX_S, backoff_s * 2)

    def _reconcile(self, listed: list[Instance]) -> None:
        """Apply the difference between `instances` and a fresh listing (after a failed watch;
        the new watch's initial 'added' events for known instances are then no-ops)."""
        current = {inst.instance_id: inst for inst in listed}
        for iid, inst in list(self.instances.items()):
            if iid not in current:
                self._apply(InstanceEvent(kind="removed", instance=inst))
        for inst in current.values():
            self._apply(InstanceEvent(kind="added", instance=inst))

    def _apply(self, event: InstanceEvent) -> None:
        inst = event.instance
        if event.kind == "added":
            if self.instances.get(inst.instance_id) == inst:
                return  # known already (a re-started watch lists every instance again)
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
