"""`PlannerService`: the planner's async edge (DESIGN.md §11).

Follows each pool's instances in discovery, subscribes to every worker's `WorkerStats` and the
frontends' `RequestStats`, and every `interval_s` feeds a `FleetTracker` snapshot to the
`Planner` core, then carries out its actions through the connector: adds run concurrently
(the core is told each worker's id, or the failure); a remove drains the victim (the router
stops sending when it unregisters; its in-flight requests finish, or migrate when the grace
runs out); an abandon kills a worker that never became ready. Each tick is recorded in
`timeline` (for reports and plots).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from tandem.engines.profile import EngineProfile
from tandem.planner.config import PlannerConfig
from tandem.planner.connector.base import Connector
from tandem.planner.fleet import FleetTracker
from tandem.planner.planner import Planner, ScaleAction
from tandem.protocols import scaling
from tandem.runtime.base import Subscription
from tandem.runtime.instances import InstanceSet
from tandem.runtime.runtime import Runtime
from tandem.runtime.task import cancel_and_wait

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TickRecord:
    t_s: float  # since the service started
    ready: dict[str, int]
    starting: dict[str, int]
    draining: dict[str, int]
    request_rate: float
    actions: list[ScaleAction]
    queue_wait_ms: float | None = None  # the frontends' mean wait before dispatch


class PlannerService:
    def __init__(
        self,
        runtime: Runtime,
        connector: Connector,
        config: PlannerConfig,
        *,
        profile: EngineProfile | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.runtime = runtime
        self.connector = connector
        self.config = config
        self.planner = Planner(config, profile=profile, is_alive=connector.manages)
        components = [p.component for p in config.pools]
        self.tracker = FleetTracker(
            components,
            window_s=config.stats_window_s,
            interval_s=config.interval_s,
            is_managed=connector.manages,
        )
        self.timeline: list[TickRecord] = []
        self._clock = clock
        self._started_s = clock()
        self._views = {c: runtime.instance_set(c, "generate") for c in components}
        self._subs: list[Subscription] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._actions: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        ns = self.runtime.namespace
        for component, view in self._views.items():
            view.add_listener(functools.partial(self._on_instances, component, view))
            await view.start()
        workers = await self.runtime.events.subscribe(f"{ns}.*.worker_stats")
        requests = await self.runtime.events.subscribe(scaling.request_stats_subject(ns))
        self._subs = [workers, requests]
        self._tasks = [
            asyncio.create_task(self._read(workers, self._on_worker_stats), name="planner-ws"),
            asyncio.create_task(self._read(requests, self._on_request_stats), name="planner-rs"),
        ]

    def _on_instances(self, component: str, view: InstanceSet, _event: object) -> None:
        self.tracker.set_registered(component, view.instances)

    async def _read(self, sub: Subscription, handle: Callable[[bytes], None]) -> None:
        async for _subject, payload in sub:
            try:
                handle(payload)
            except msgspec.MsgspecError as exc:
                logger.warning("planner: dropping malformed stats: %s", exc)

    def _on_worker_stats(self, payload: bytes) -> None:
        msg = scaling.decode_worker_stats(payload)
        self.tracker.apply_worker_stats(msg, self._clock())
        self.planner.observe_steps(msg.component, msg.steps)

    def _on_request_stats(self, payload: bytes) -> None:
        self.tracker.apply_request_stats(scaling.decode_request_stats(payload), self._clock())

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every interval until `stop` is set."""
        while not stop.is_set():
            self.tick()
            try:
                async with asyncio.timeout(self.config.interval_s):
                    await stop.wait()
            except TimeoutError:
                pass

    def tick(self) -> list[ScaleAction]:
        now = self._clock()
        traffic = self.tracker.traffic(now)
        self.planner.observe_traffic(traffic)
        observations = self.tracker.observations(now)
        actions = self.planner.tick(now, observations)
        for action in actions:
            logger.info("planner: %s %s %s (%s)", action.kind, action.component,
                        action.worker_id or "", action.reason)  # fmt: skip
            task = asyncio.create_task(self._act(action, now), name=f"planner-{action.kind}")
            self._actions.add(task)
            task.add_done_callback(self._actions.discard)
        self.timeline.append(
            TickRecord(
                t_s=now - self._started_s,
                ready={c: len(o.ready) for c, o in observations.items()},
                starting={c: len(o.starting) for c, o in observations.items()},
                draining={c: len(o.draining) for c, o in observations.items()},
                request_rate=traffic.request_rate,
                actions=actions,
                queue_wait_ms=traffic.mean_queue_wait_ms,
            )
        )
        return actions

    async def _act(self, action: ScaleAction, now: float) -> None:
        c = action.component
        try:
            if action.kind == "add":
                worker_id: str | None = None
                try:
                    worker_id = await self.connector.add_worker(c)
                finally:
                    self.planner.on_added(c, worker_id, now)
            elif action.kind == "remove":
                assert action.worker_id is not None
                await self.connector.drain_worker(c, action.worker_id)
            else:
                assert action.worker_id is not None
                await self.connector.kill_worker(c, action.worker_id)
        except Exception:
            logger.exception("planner: %s on pool %s failed", action.kind, c)

    async def close(self) -> None:
        await cancel_and_wait([*self._tasks, *self._actions])
        for sub in self._subs:
            await sub.close()
        for view in self._views.values():
            await view.close()
