"""`InProcessConnector`: workers on the planner's own event loop, sharing its runtime's planes.

For tests and simulations: each worker is a `Worker` around an engine from `engine_factory`,
with its own request server, registered in the shared discovery. Draining is `Worker.stop`
(unregister, finish in-flight within the grace, stop the engine).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from contextlib import AsyncExitStack

from tandem.engines.base import Engine
from tandem.engines.worker import Worker, WorkerConfig, new_instance_id
from tandem.runtime.runtime import Runtime, open_runtime
from tandem.runtime.task import cancel_and_wait

logger = logging.getLogger(__name__)


class InProcessConnector:
    def __init__(
        self,
        runtime: Runtime,
        engine_factory: Callable[[str], Engine],
        *,
        drain_grace_s: float = 60.0,
    ) -> None:
        self.runtime = runtime
        self.engine_factory = engine_factory  # component -> a new engine
        self.drain_grace_s = drain_grace_s
        self.workers: dict[str, Worker] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stops: dict[str, asyncio.Event] = {}

    async def add_worker(self, component: str) -> str:
        worker_id = new_instance_id()
        stop = self._stops[worker_id] = asyncio.Event()
        self._tasks[worker_id] = asyncio.create_task(
            self._run(component, worker_id, stop), name=f"worker-{worker_id}"
        )
        return worker_id

    async def _run(self, component: str, worker_id: str, stop: asyncio.Event) -> None:
        rt = self.runtime
        try:
            async with AsyncExitStack() as stack:
                runtime = await stack.enter_async_context(
                    open_runtime(rt.config, discovery=rt.discovery, events=rt.events)
                )
                config = WorkerConfig(
                    component=component, instance_id=worker_id, drain_grace_s=self.drain_grace_s
                )
                worker = Worker(self.engine_factory(component), runtime, config)
                self.workers[worker_id] = worker
                await worker.start()
                await stop.wait()
                await worker.stop()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("in-process worker %s failed", worker_id)
        finally:
            self.workers.pop(worker_id, None)
            self._stops.pop(worker_id, None)

    async def drain_worker(self, component: str, worker_id: str) -> None:
        stop = self._stops.get(worker_id)
        if stop is not None:
            stop.set()

    async def kill_worker(self, component: str, worker_id: str) -> None:
        task = self._tasks.pop(worker_id, None)
        await cancel_and_wait([task])
        worker = self.workers.pop(worker_id, None)
        if worker is not None:
            with contextlib.suppress(Exception):
                await worker.engine.stop()

    def manages(self, worker_id: str) -> bool:
        return worker_id in self._stops

    async def close(self) -> None:
        for stop in self._stops.values():
            stop.set()
        tasks = list(self._tasks.values())
        if tasks:
            await asyncio.wait(tasks, timeout=self.drain_grace_s + 5.0)
        await cancel_and_wait(tasks)
