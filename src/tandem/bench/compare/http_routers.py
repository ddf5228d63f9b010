"""SMG (`smg` 1.13.0) and the vLLM router (`vllm-router` 0.1.17) as routing baselines: each
fronts N one-worker `tandem serve --engine mocker` stacks, via the shared anchor scripts
(`anchors/smg/`, `anchors/vllm-router/`; see their READMEs).

The venvs are set up once by the anchors' `setup.sh` under /tmp/anchor-smg and
/tmp/anchor-vllm-router; a benchmark never installs them (minutes, and PyPI): `missing_setup`
says what to run instead. Each run gets a private `ANCHOR_DIR` (pid files, logs) and free ports.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from tandem.bench.compare.dynamo_anchor import _free_port_block
from tandem.bench.process_stack import free_port, tandem_argv
from tandem.bench.shared_dir import SHARED_DIR

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HttpRouterKind:
    name: str  # "smg" | "vllm-router"
    anchor_dir: str  # the scripts
    install_dir: str  # setup.sh's venv lives in install_dir/venv
    binary: str  # the router's console script in that venv


HTTP_ROUTERS = {
    "smg": HttpRouterKind(
        "smg", os.path.join(SHARED_DIR, "anchors", "smg"), "/tmp/anchor-smg", "smg"
    ),
    "vllm-router": HttpRouterKind(
        "vllm-router",
        os.path.join(SHARED_DIR, "anchors", "vllm-router"),
        "/tmp/anchor-vllm-router",
        "vllm-router",
    ),
}


def missing_setup(kind: HttpRouterKind) -> str | None:
    """None when the router's venv is there; else the command that sets it up."""
    if (Path(kind.install_dir) / "venv" / "bin" / kind.binary).exists():
        return None
    return f"bash {kind.anchor_dir}/setup.sh"


@dataclass(frozen=True, slots=True)
class RunningHttpRouter:
    url: str
    router_pid: int
    backend_pids: tuple[int, ...]  # the backends' `tandem serve` (frontend) processes


@contextlib.contextmanager
def http_router_stack(
    kind: HttpRouterKind,
    work_dir: Path,
    *,
    policy: str,
    num_workers: int,
    backend_args: str,
    router_args: str = "",
    worker_urls: Sequence[str] = (),
    ready_timeout_s: float = 240.0,
) -> Iterator[RunningHttpRouter]:
    """`anchor.sh start` with private dirs and ports; `anchor.sh stop` (then SIGKILL by PID of
    whatever is still ours) on exit, errors included. With `worker_urls` the router fronts
    those servers (started by the caller) and the anchor starts no backend."""
    run_dir = work_dir / kind.name
    run_dir.mkdir(parents=True, exist_ok=True)
    tandem = run_dir / "tandem"  # the anchor runs "$TANDEM serve ...": this interpreter's CLI
    tandem.write_text("#!/bin/sh\nexec " + " ".join(tandem_argv()) + ' "$@"\n')
    tandem.chmod(0o755)
    port = free_port()
    env = {
        **os.environ,
        "ANCHOR_DIR": str(run_dir),
        "VENV": str(Path(kind.install_dir) / "venv"),
        "HTTP_PORT": str(port),
        "PROM_PORT": str(free_port()),
        "POLICY": policy,
        "ROUTER_ARGS": router_args,
        "NUM_WORKERS": str(num_workers),
        "TANDEM": str(tandem),
        "BACKEND_PORT_BASE": str(_free_port_block(num_workers + 1)),
        "BACKEND_ARGS": backend_args,
        "WORKER_URLS": " ".join(worker_urls),
        "READY_S": str(int(ready_timeout_s)),
    }
    script = str(Path(kind.anchor_dir) / "anchor.sh")
    pids: list[int] = []
    try:
        proc = subprocess.run(
            ["bash", script, "start"],
            env=env,
            capture_output=True,
            text=True,
            timeout=ready_timeout_s * 2 + 30,
        )
        pids = _read_pids(run_dir / "run")
        if proc.returncode != 0:
            raise RuntimeError(f"{kind.name} anchor failed to start:\n{proc.stdout}\n{proc.stderr}")
        router_pid = int((run_dir / "run" / "router.pid").read_text())
        backends = tuple(int(p.read_text()) for p in sorted((run_dir / "run").glob("backend*.pid")))
        yield RunningHttpRouter(f"http://127.0.0.1:{port}", router_pid, backends)
    finally:
        pids = pids or _read_pids(run_dir / "run")
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            subprocess.run(["bash", script, "stop"], env=env, capture_output=True, timeout=60)
        for pid in pids:
            with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
                if psutil.Process(pid).is_running():
                    os.killpg(pid, signal.SIGKILL)  # setsid: each is its own group
                    logger.warning("killed leftover %s process pid=%s", kind.name, pid)


def _read_pids(run: Path) -> list[int]:
    if not run.exists():
        return []
    return [int(p.read_text()) for p in sorted(run.glob("*.pid")) if p.read_text().strip()]
