"""tandem over mocker workers, started for a benchmark: split or all-in-one.

`tandem_mocker_stack` (and `dynamo_mocker_stack` for Dynamo's anchor) is a context manager
yielding a `RunningStack` (base URL, model, the frontend's PID) and stopping everything it
started on exit, errors included.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import shlex
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from tandem.bench.process_stack import ProcessStack, free_port, tandem_argv, wait_ready

LAYOUTS = ("auto", "serve", "split")


@dataclass(frozen=True, slots=True)
class RunningStack:
    url: str
    model: str
    frontend_pid: int
    # what the frontend pid's CPU includes: "frontend" or "frontend+engines" (all-in-one)
    cpu_scope: str
    # further frontend processes (`tandem serve --frontend-processes N`): their CPU counts too
    replica_pids: tuple[int, ...] = ()
    # the engine (mocker worker) processes, where they are processes of their own
    engine_pids: tuple[int, ...] = ()


def has_split_commands() -> bool:
    """Whether `tandem frontend` and `tandem worker` exist (their modules, without importing)."""
    return all(
        importlib.util.find_spec(module) is not None
        for module in ("tandem.frontend.main", "tandem.cli.worker")
    )


@contextlib.contextmanager
def tandem_mocker_stack(
    work_dir: Path,
    *,
    layout: str = "auto",
    num_workers: int = 1,
    router: str = "round_robin",
    speedup_ratio: float = 0.0,
    speedup_ratios: Sequence[float] | None = None,
    extra_args: str = "",
    engine_args: str = "",
    ready_timeout_s: float = 120.0,
) -> Iterator[RunningStack]:
    """tandem over mocker workers. `split`: `tandem frontend` + N `tandem worker` processes on
    file discovery (so the frontend PID is the frontend alone); `serve`: `tandem serve`.
    `engine_args` go to the mocker (workers, or serve), `extra_args` to the frontend / serve.
    `speedup_ratios`: one mocker speed per worker (heterogeneous workers; split layout only)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout '{layout}'; expected one of: {', '.join(LAYOUTS)}")
    if layout == "auto":
        layout = "split" if has_split_commands() else "serve"
    if speedup_ratios is not None and (layout != "split" or len(speedup_ratios) != num_workers):
        raise ValueError("speedup_ratios needs the split layout and one ratio per worker")
    port = free_port()
    mocker = ["--engine", "mocker", "--speedup-ratio", f"{speedup_ratio:g}"]
    mocker += shlex.split(engine_args)
    http = ["--host", "127.0.0.1", "--port", str(port)]
    extra = shlex.split(extra_args)
    with ProcessStack(work_dir / "logs") as stack:
        engines: list[int] = []
        if layout == "split":
            env = {  # processes of their own: file discovery, ZMQ events between them
                "TANDEM_DISCOVERY": "file",
                "TANDEM_DISCOVERY_DIR": str(work_dir / "discovery"),
                "TANDEM_EVENTS": "zmq",
            }
            for i in range(num_workers):
                argv = list(mocker)
                if speedup_ratios is not None:
                    argv[3] = f"{speedup_ratios[i]:g}"  # --speedup-ratio's value
                engines.append(stack.spawn(f"worker{i}", tandem_argv("worker", *argv), env=env))
            pid = stack.spawn(
                "frontend", tandem_argv("frontend", *http, "--router", router, *extra), env=env
            )
            scope = "frontend"
        else:
            argv = tandem_argv(
                "serve", *http, *mocker, "--workers", str(num_workers), "--router", router, *extra
            )
            pid = stack.spawn("serve", argv)
        url = f"http://127.0.0.1:{port}"
        model = asyncio.run(wait_ready(url, timeout_s=ready_timeout_s, stack=stack))
        replicas: tuple[int, ...] = ()
        if layout == "serve":  # engines in child processes leave the serve pid to the frontend
            scope = "frontend" if _has_children(pid) else "frontend+engines"
            replicas = _frontend_replicas(pid, port, expected=_frontend_processes(extra) - 1)
        yield RunningStack(
            url=url,
            model=model,
            frontend_pid=pid,
            cpu_scope=scope,
            replica_pids=replicas,
            engine_pids=tuple(engines),
        )


def _frontend_processes(argv: list[str]) -> int:
    if "--frontend-processes" in argv[:-1]:
        value = argv[argv.index("--frontend-processes") + 1]
        return int(value) if value.isdigit() else 1
    return 1


def _frontend_replicas(
    pid: int, port: int, expected: int, timeout_s: float = 60.0
) -> tuple[int, ...]:
    """PIDs of `tandem serve`'s frontend replicas, once `expected` of them are listening (a
    replica listens after it has loaded the model, a moment after serve reports ready)."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        found = []
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(pid).children(recursive=True):
                with contextlib.suppress(psutil.Error):
                    listening = any(
                        c.status == psutil.CONN_LISTEN and c.laddr.port == port
                        for c in child.net_connections("tcp")
                    )
                    if "--frontend-replica" in child.cmdline() and listening:
                        found.append(child.pid)
        if len(found) >= expected or time.monotonic() > deadline:
            return tuple(found)
        time.sleep(0.1)


def _has_children(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).children())
    except psutil.Error:
        return False
