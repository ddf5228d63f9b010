"""`RayConnector`: workers as Ray actors on a Ray cluster.

Each worker is one actor (its own process on some node) that starts `tandem worker` with the
pool's flags, the runtime flags of the planner's runtime and `--instance-id` as its child
process (`python -m tandem.cli.child`: the worker dies with the actor); the actor's `run`
returns when the worker has exited. Draining is the actor's `drain`, a SIGTERM (the worker
unregisters, finishes its in-flight requests within its grace, exits); `kill_worker` SIGKILLs
the worker and `ray.kill`s the actor. `address` None starts a local head bound to 127.0.0.1
(stopped on `close`); otherwise it joins that cluster (e.g. "10.0.0.5:6379" from a node of it,
"ray://host:10001" from outside). Actors ask for `num_cpus` and `num_gpus` (default 0 CPUs: a
mocker fleet should not be capped by the CPU count) and are spread across the nodes unless
`spread` is off. With `log_dir`, each worker's output goes to `log_dir/worker-<id>.log` on the
node that runs it. An actor that dies (its node lost, or killed) ends its worker's record here;
the worker's lease then expires and the planner, one worker short of its pool, adds another,
which Ray places on a node that is still up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any, cast

from tandem.engines.worker import new_instance_id
from tandem.planner.connector.base import ConnectorError
from tandem.planner.connector.local import runtime_flags, secret_env
from tandem.runtime.config import RuntimeConfig

if TYPE_CHECKING:
    from ray.actor import ActorHandle

logger = logging.getLogger(__name__)


class WorkerActor:
    """Runs inside the actor's process (its own asyncio loop: an async actor). The worker is
    this process's child under `tandem.cli.child` (the kernel's parent-death signal and a
    lifeline pipe stop it when the actor dies), so the planner never imports its entry point."""

    def __init__(self, argv: list[str], log_path: str | None = None) -> None:
        self.argv = argv
        self.log_path = log_path
        self.process: asyncio.subprocess.Process | None = None
        self._lifeline = os.pipe()  # only this process holds the write end
        self._draining = False

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tandem.cli.child", "--parent-pid", str(os.getpid()),
                "--life-fd", str(self._lifeline[0]), "--", "worker", *self.argv]  # fmt: skip

    def node(self) -> str:
        """Where this actor runs: hostname and the node's IP as Ray knows it."""
        import socket

        import ray

        ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        return f"{socket.gethostname()} {ip}"

    async def run(self) -> str:
        out: int | None = None
        if self.log_path is not None:
            os.makedirs(os.path.dirname(self.log_path), exist_ok=True)
            out = os.open(self.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            self.process = await asyncio.create_subprocess_exec(
                *self.command(), pass_fds=(self._lifeline[0],), stdout=out, stderr=out
            )
        finally:
            if out is not None:
                os.close(out)
        if self._draining:  # drained while it started
            self._signal(signal.SIGTERM)
        code = await self.process.wait()
        return "drained" if code == 0 else f"exited with code {code}"

    async def drain(self) -> None:
        if not self._draining:
            self._draining = True
            os.write(self._lifeline[1], b"s")  # a stop, not an orphaning (tandem.cli.child)
        self._signal(signal.SIGTERM)

    async def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)


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
        num_gpus: float = 0.0,
        spread: bool = True,
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
        self.num_gpus = num_gpus
        self.spread = spread
        self.log_dir = log_dir
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
            if address is None:
                kwargs |= {"address": "local", "_node_ip_address": "127.0.0.1", "num_cpus": 2}
            else:
                kwargs["address"] = address
            ray.init(**(kwargs | (ray_init or {})))
        self._actor_cls = ray.remote(WorkerActor)
        self.actors: dict[str, ActorHandle[WorkerActor]] = {}
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
            options: dict[str, Any] = {
                "name": f"tandem-worker-{worker_id}",
                "num_cpus": self.num_cpus,
                "num_gpus": self.num_gpus,
                "runtime_env": {"env_vars": env} if env else None,
            }
            if self.spread:
                options["scheduling_strategy"] = "SPREAD"
            log_path = None
            if self.log_dir is not None:
                log_path = os.path.join(self.log_dir, f"worker-{worker_id}.log")
            created = self._actor_cls.options(**options).remote(argv, log_path)
            # ray types remote() as `ActorHandle | type` (one signature for its decorator)
            actor = cast("ActorHandle[WorkerActor]", created)
        except Exception as exc:
            raise ConnectorError(f"could not create a ray actor for '{component}': {exc}") from exc
        self.actors[worker_id] = actor
        self._runs[worker_id] = asyncio.create_task(self._watch(worker_id, actor),
                                                    name=f"ray-{worker_id}")  # fmt: skip
        logger.info("started ray actor for worker %s (%s)", worker_id, component)
        return worker_id

    async def _watch(self, worker_id: str, actor: ActorHandle[WorkerActor]) -> None:
        try:
            with contextlib.suppress(Exception):  # where it runs, for the logs
                logger.info("ray worker %s runs on node %s", worker_id,
                            await asyncio.wait_for(actor.node.remote(), 60))  # fmt: skip
            result = await actor.run.remote()
            logger.info("ray worker %s: %s", worker_id, result)
        except Exception as exc:  # the actor died (its node lost) or was killed
            level = logging.WARNING if worker_id in self.actors else logging.INFO
            logger.log(level, "ray worker %s: its actor died (%s); the planner replaces the "
                       "worker once its lease expires", worker_id, type(exc).__name__)  # fmt: skip
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
                await actor.kill.remote()
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
