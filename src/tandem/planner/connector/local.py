"""`LocalConnector`: `tandem worker` processes on this host, as `tandem serve` starts them.

Each pool has its worker flags (engine and its options); the connector adds the runtime
flags of the planner's runtime (namespace, discovery, event plane) and `--instance-id`, so
it knows the id before the worker registers. Draining is SIGTERM: the worker unregisters,
finishes its in-flight requests within `--drain-grace-s`, then exits. A process is reaped
when it exits; `close` drains the rest and SIGKILLs whatever outlives the grace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys

from tandem.engines.worker import new_instance_id
from tandem.planner.connector.base import ConnectorError
from tandem.runtime.config import RuntimeConfig

logger = logging.getLogger(__name__)


def secret_env(rc: RuntimeConfig) -> dict[str, str]:
    """The cluster secret, and etcd's and NATS's passwords and token, for a worker's
    environment (never its argv, which `ps` shows), unless this process's environment already
    names them (the worker inherits that)."""
    env: dict[str, str] = {}
    if rc.cluster_secret is not None and not any(
        os.environ.get(v) for v in ("TANDEM_CLUSTER_SECRET", "TANDEM_CLUSTER_SECRET_FILE")
    ):
        env["TANDEM_CLUSTER_SECRET"] = rc.cluster_secret
    for name in ("etcd_password", "nats_password", "nats_token"):
        value, var = getattr(rc, name), f"TANDEM_{name.upper()}"
        if value is not None and not os.environ.get(var):
            env[var] = value
    return env


# etcd's, NATS's and the request plane's own auth and TLS options a worker gets as flags
_SERVICE_FLAGS = (
    *("etcd_user", "etcd_ca_file", "etcd_cert_file", "etcd_key_file"),
    *("nats_user", "nats_creds_file", "nats_nkey_seed_file", "nats_ca_file", "nats_cert_file"),
    *("nats_key_file", "tls_cert_file", "tls_key_file", "tls_ca_file"),
)


def runtime_flags(rc: RuntimeConfig) -> list[str]:
    flags = ["--namespace", rc.namespace, "--discovery", rc.discovery, "--events", rc.events]
    if rc.discovery == "file":
        flags += ["--discovery-dir", rc.resolved_discovery_dir]
    if rc.discovery == "etcd":
        flags += ["--etcd-url", rc.etcd_url]
    if rc.events == "nats":
        flags += ["--nats-url", rc.nats_url]
    for name in _SERVICE_FLAGS:
        if getattr(rc, name) is not None:
            flags += ["--" + name.replace("_", "-"), getattr(rc, name)]
    if rc.tls_require_client_cert:
        flags.append("--tls-require-client-cert")
    return flags


class LocalConnector:
    def __init__(
        self,
        runtime_config: RuntimeConfig,
        worker_argv: dict[str, list[str]],
        *,
        drain_grace_s: float = 60.0,
        log_dir: str | None = None,
        guard_run_dir: str | None = None,
    ) -> None:
        """`guard_run_dir` (`tandem serve --planner`): workers die with this process whatever
        kills it (`tandem.cli.child`), and an orphaned one removes that run directory."""
        if runtime_config.discovery == "memory" or runtime_config.events == "memory":
            raise ValueError(
                "the local connector's workers are other processes: use file or etcd "
                "discovery and a zmq or nats event plane, not memory"
            )
        self.runtime_config = runtime_config
        self.worker_argv = worker_argv  # component -> engine/worker flags
        self.drain_grace_s = drain_grace_s
        self.log_dir = log_dir
        self.guard_run_dir = guard_run_dir
        # the children's lifeline (tandem.cli.child): only this process holds the write end
        self._lifeline = os.pipe() if guard_run_dir is not None else None
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self._reapers: set[asyncio.Task[None]] = set()

    def command(self, component: str, worker_id: str) -> list[str]:
        if component not in self.worker_argv:
            raise ConnectorError(f"no worker flags for pool '{component}'")
        guard: list[str] = []
        if self._lifeline is not None:
            guard = ["-m", "tandem.cli.child", "--parent-pid", str(os.getpid()),
                     "--life-fd", str(self._lifeline[0]), "--run-dir", str(self.guard_run_dir),
                     "--"]  # fmt: skip
        return [
            sys.executable, *(guard or ["-m", "tandem.cli"]), "worker",
            *self.worker_argv[component],
            "--component", component,
            "--instance-id", worker_id,
            "--drain-grace-s", str(self.drain_grace_s),
            *runtime_flags(self.runtime_config),
        ]  # fmt: skip

    async def add_worker(self, component: str) -> str:
        worker_id = new_instance_id()
        out: int | None = None
        if self.log_dir is not None:
            os.makedirs(self.log_dir, exist_ok=True)
            out = os.open(os.path.join(self.log_dir, f"worker-{worker_id}.log"),
                          os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)  # fmt: skip
        try:
            proc = await asyncio.create_subprocess_exec(
                *self.command(component, worker_id),
                stdout=out,
                stderr=out,
                env={**os.environ, **secret_env(self.runtime_config)},
                start_new_session=True,
                pass_fds=(self._lifeline[0],) if self._lifeline is not None else (),
            )
        except OSError as exc:
            raise ConnectorError(f"could not start a worker for '{component}': {exc}") from exc
        finally:
            if out is not None:
                os.close(out)
        self.procs[worker_id] = proc
        reaper = asyncio.create_task(self._reap(worker_id, proc), name=f"reap-{worker_id}")
        self._reapers.add(reaper)
        reaper.add_done_callback(self._reapers.discard)
        logger.info("started worker %s pid=%d (%s)", worker_id, proc.pid, component)
        return worker_id

    async def _reap(self, worker_id: str, proc: asyncio.subprocess.Process) -> None:
        code = await proc.wait()
        self.procs.pop(worker_id, None)
        logger.info("worker %s pid=%d exited with %s", worker_id, proc.pid, code)

    def _signal(self, worker_id: str, sig: int) -> None:
        proc = self.procs.get(worker_id)
        if proc is not None and proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)

    async def drain_worker(self, component: str, worker_id: str) -> None:
        self._signal(worker_id, signal.SIGTERM)

    async def kill_worker(self, component: str, worker_id: str) -> None:
        self._signal(worker_id, signal.SIGKILL)

    def manages(self, worker_id: str) -> bool:
        return worker_id in self.procs

    async def close(self) -> None:
        live = list(self.procs.items())
        if self._lifeline is not None:  # one byte per child: "a normal stop, not orphaned"
            with contextlib.suppress(OSError):
                os.write(self._lifeline[1], b"s" * max(len(live), 1))
        for wid, _ in live:
            self._signal(wid, signal.SIGTERM)
        try:
            async with asyncio.timeout(self.drain_grace_s + 5.0):
                await asyncio.gather(*(p.wait() for _, p in live))
        except TimeoutError:
            for wid, _ in live:
                self._signal(wid, signal.SIGKILL)
            await asyncio.gather(*(p.wait() for _, p in live))
        await asyncio.gather(*self._reapers, return_exceptions=True)
        if self._lifeline is not None:
            for fd in self._lifeline:
                with contextlib.suppress(OSError):
                    os.close(fd)
            self._lifeline = None
