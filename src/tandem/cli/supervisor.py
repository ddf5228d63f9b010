"""Worker child processes of `tandem serve`: start, wait until registered, watch, stop by PID.

Workers die with `tandem serve` (`tandem.cli.child`); a run directory that a killed stack left
behind anyway is removed by the next `tandem serve` (`remove_stale_run_dirs`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field

from tandem.runtime.config import RuntimeConfig
from tandem.runtime.process import pid_alive
from tandem.runtime.runtime import Runtime

logger = logging.getLogger(__name__)

RUN_DIR_PREFIX = "tandem-serve-"
OWNER_FILE = "serve.pid"


def make_run_dir() -> str:
    """A fresh private run directory (0700) holding the owner's pid in `serve.pid`."""
    run_dir = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)
    with open(os.path.join(run_dir, OWNER_FILE), "w") as f:
        f.write(str(os.getpid()))
    return run_dir


def remove_stale_run_dirs(parent: str | None = None) -> list[str]:
    """Remove this user's `tandem-serve-*` run directories (under `parent`, default the
    temporary directory) whose owner pid is dead; returns the removed paths. A directory with
    no readable owner file, or another user's, is left alone."""
    parent = parent or tempfile.gettempdir()
    removed: list[str] = []
    with contextlib.suppress(OSError):
        for entry in os.scandir(parent):
            if not entry.name.startswith(RUN_DIR_PREFIX) or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                    continue
                with open(os.path.join(entry.path, OWNER_FILE)) as f:
                    owner = int(f.read().strip())
            except (OSError, ValueError):
                continue
            if owner != os.getpid() and not pid_alive(owner):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    if removed:
        logger.info("removed %d stale run dir(s): %s", len(removed), ", ".join(removed))
    return removed


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerSpec:
    """One `tandem worker` process: its name in logs, its flags, and the component it registers.
    With `command` other than "worker" (a frontend replica) `argv` is the whole tandem command
    line, the runtime flags are not added and the process registers no instance."""

    name: str
    argv: list[str] = field(default_factory=list)
    component: str = "backend"
    endpoint: str = "generate"
    command: str = "worker"


class WorkerGroup:
    """Owns the worker processes of one stack. Not thread-safe; one event loop."""

    def __init__(
        self,
        runtime_config: RuntimeConfig,
        specs: list[WorkerSpec],
        *,
        run_dir: str | None = None,
    ) -> None:
        self.runtime_config = runtime_config
        self.specs = specs
        self.run_dir = run_dir  # removed by orphaned workers (tandem.cli.child)
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        # the children's lifeline: only this process holds the write end (not inheritable)
        self._life_read, self._life_write = os.pipe()

    def _command(self, spec: WorkerSpec) -> list[str]:
        rc = self.runtime_config
        # tandem.cli.child: the worker dies with this process, even when it is SIGKILLed
        guard = ["--parent-pid", str(os.getpid()), "--life-fd", str(self._life_read)]
        if self.run_dir is not None:
            guard += ["--run-dir", self.run_dir]
        if spec.command != "worker":
            return [sys.executable, "-m", "tandem.cli.child", *guard, "--", *spec.argv]
        return [
            sys.executable,
            "-m",
            "tandem.cli.child",
            *guard,
            "--",
            "worker",
            *spec.argv,
            "--component",
            spec.component,
            "--endpoint",
            spec.endpoint,
            "--namespace",
            rc.namespace,
            "--discovery",
            rc.discovery,
            "--discovery-dir",
            rc.resolved_discovery_dir,
            "--events",
            rc.events,
        ]

    async def start(self) -> None:
        for spec in self.specs:
            proc = await asyncio.create_subprocess_exec(
                *self._command(spec),
                env=dict(os.environ),
                start_new_session=True,
                pass_fds=(self._life_read,),
            )
            self.procs[spec.name] = proc
            logger.info("started %s pid=%d (%s)", spec.name, proc.pid, spec.component)

    def _exited(self) -> list[str]:
        return [name for name, p in self.procs.items() if p.returncode is not None]

    async def wait_ready(
        self, runtime: Runtime, timeout_s: float, stop: asyncio.Event
    ) -> str | None:
        """None once every spec's instance is registered, or when `stop` is set first; else
        the reason they are not: a worker exited first, or `timeout_s` passed."""
        wanted = Counter((s.component, s.endpoint) for s in self.specs if s.command == "worker")
        views = {key: runtime.instance_set(*key) for key in wanted}
        for view in views.values():
            await view.start()
        deadline = time.monotonic() + timeout_s
        try:
            while not stop.is_set():
                if all(len(views[k].instances) >= n for k, n in wanted.items()):
                    return None
                if dead := self._exited():
                    codes = ", ".join(f"{n} (exit code {self.procs[n].returncode})" for n in dead)
                    return (
                        f"worker(s) exited before they were ready: {codes}; see their error above"
                    )
                if time.monotonic() > deadline:
                    return f"workers not ready within --worker-ready-timeout-s {timeout_s:.0f}"
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 0.2)
            return None
        finally:
            for view in views.values():
                await view.close()

    async def watch(self, stop: asyncio.Event) -> None:
        """Until `stop`: log each worker that exits on its own (the rest keep serving)."""
        reported: set[str] = set()
        while not stop.is_set():
            for name in self._exited():
                if name not in reported:
                    reported.add(name)
                    logger.warning(
                        "worker %s exited with code %s", name, self.procs[name].returncode
                    )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)

    async def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every live worker (they drain), SIGKILL whatever is left after the grace."""
        with contextlib.suppress(OSError):  # one byte per child: "a normal stop, not orphaned"
            os.write(self._life_write, b"s" * max(len(self.procs), 1))
        live = [p for p in self.procs.values() if p.returncode is None]
        for proc in live:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(grace_s + 2.0):
                await asyncio.gather(*(p.wait() for p in live))
        except TimeoutError:
            for proc in live:
                if proc.returncode is None:
                    logger.warning("worker pid=%d did not stop; SIGKILL", proc.pid)
                    with contextlib.suppress(ProcessLookupError):
                        proc.kill()
            await asyncio.gather(*(p.wait() for p in live))
        for fd in (self._life_read, self._life_write):
            with contextlib.suppress(OSError):
                os.close(fd)
