"""`RayConnector`: workers as Ray actors on a Ray cluster.

Each worker is one actor (its own process on some node) running `tandem worker` with the
pool's flags, the runtime flags of the planner's runtime and `--instance-id`; the actor's
`run` returns when the worker has drained. Draining is the actor's `drain` (the worker
unregisters, finishes its in-flight requests within its grace, exits); `kill_worker` is
`ray.kill`. `address` None starts a local head bound to 127.0.0.1 (stopped on `close`);
otherwise it joins that cluster (e.g. "auto", "ray://host:10001").
Actors ask for `num_cpus` (default 0: a mocker fleet should not be capped by the CPU count).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from typing import Any

from tandem.engines.worker import new_instance_id
from tandem.planner.connector.base import ConnectorError
from tandem.planner.connector.local import runtime_flags, secret_env
from tandem.runtime.config import RuntimeConfig

logger = logging.getLogger(__name__)


class WorkerActor:
    """Runs inside the actor's process (its own asyncio loop: an async actor)."""

    def __init__(self, argv: list[str], log_level: str = "INFO") -> None:
        self.argv = argv
        self.stop: asyncio.Event | None = None
        logging.basicConfig(level=log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s %(message)s")  # fmt: skip

    async def run(self) -> str:
        from tandem.cli.worker import add_arguments, serve

        parser = argparse.ArgumentParser(prog="tandem worker (ray actor)")
        add_arguments(parser, self.argv)
        args = parser.parse_args(self.argv)
        self.stop = asyncio.Event()
        await serve(args, self.stop)
        return "drained"

    async def drain(self) -> None:
        if self.stop is not None:
            self.stop.set()


class RayConnector:
    def __init__(
        self,
        runtime_config: RuntimeConfig,
        worker_argv: dict[str, list[str]],
        *,
        drain_grace_s: float = 60.0,
        log_dir: str | None = None,
        address: str | None = None,
        num_cpus: float = 0.0,
        ray_init: dict[str, Any] | None = None,
    ) -> None:
        import ray

        if runtime_config.discovery == "memory" or runtime_config.events == "memory":
            raise ValueError("ray workers are other processes: use file/etcd discovery and "
                             "zmq/nats events, not memory")  # fmt: skip
        self.ray = ray
        self.runtime_config = runtime_config
        self.worker_argv = worker_argv
        self.drain_grace_s = drain_grace_s
        self.num_cpus = num_cpus
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
            if address is None:
                kwargs |= {"address": "local", "_node_ip_address": "127.0.0.1", "num_cpus": 2}
            else:
                kwargs["address"] = address
            ray.init(**(kwargs | (ray_init or {})))
        self._actor_cls = ray.remote(WorkerActor)
        self.actors: dict[str, Any] = {}
        self._runs: dict[str, asyncio.Task[None]] = {}

    async def add_worker(self, component: str) -> str:
        if component not in self.worker_argv:
            raise ConnectorError(f"no worker flags for pool '{component}'")
        worker_id = new_instance_id()
        argv = [*self.worker_argv[component], "--component", component,
                "--instance-id", worker_id, "--drain-grace-s", str(self.drain_grace_s),
                *runtime_flags(self.runtime_config)]  # fmt: skip
        try:
            env = secret_env(self.runtime_config)
            actor = self._actor_cls.options(
                name=f"tandem-worker-{worker_id}",
                num_cpus=self.num_cpus,
                runtime_env={"env_vars": env} if env else None,
            ).remote(argv)
        except Exception as exc:
            raise ConnectorError(f"could not create a ray actor for '{component}': {exc}") from exc
        self.actors[worker_id] = actor
        self._runs[worker_id] = asyncio.create_task(self._watch(worker_id, actor),
                                                    name=f"ray-{worker_id}")  # fmt: skip
        logger.info("started ray actor for worker %s (%s)", worker_id, component)
        return worker_id

    async def _watch(self, worker_id: str, actor: Any) -> None:
        try:
            result = await actor.run.remote()
            logger.info("ray worker %s: %s", worker_id, result)
        except Exception as exc:  # the actor died or was killed
            logger.info("ray worker %s ended: %s", worker_id, type(exc).__name__)
        finally:
            self.actors.pop(worker_id, None)
            with contextlib.suppress(Exception):
                self.ray.kill(actor)

    async def drain_worker(self, component: str, worker_id: str) -> None:
        actor = self.actors.get(worker_id)
        if actor is not None:
            await actor.drain.remote()

    async def kill_worker(self, component: str, worker_id: str) -> None:
        actor = self.actors.pop(worker_id, None)
        if actor is not None:
            with contextlib.suppress(Exception):
                self.ray.kill(actor)

    def manages(self, worker_id: str) -> bool:
        return worker_id in self.actors

    async def close(self) -> None:
        for actor in list(self.actors.values()):
            with contextlib.suppress(Exception):
                await actor.drain.remote()
        runs = list(self._runs.values())
        if runs:
            _, pending = await asyncio.wait(runs, timeout=self.drain_grace_s + 5.0)
            for wid in list(self.actors):
                await self.kill_worker("", wid)
            for task in pending:
                task.cancel()
            await asyncio.gather(*runs, return_exceptions=True)
        if self._owns_ray:
            self.ray.shutdown()
