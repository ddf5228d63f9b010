"""Dynamo 1.6.1 as a baseline: its Rust frontend over its mocker, via the shared anchor scripts.

The scripts (`setup.sh`, `anchor.sh`, `zmq_broker.py`; see their README) live in
`anchor_dir`. The venv and tokenizer folder are set up once under `install_dir` (default
/tmp/anchor); each benchmark run gets a private `run_dir` (pid files, logs, discovery) and free
ports, so runs never collide. `stop()` uses `anchor.sh stop` and then kills, by the recorded
PIDs, anything still alive.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil

from tandem.bench.process_stack import free_port, wait_ready
from tandem.bench.shared_dir import DYNAMO_ANCHOR_DIR
from tandem.bench.tandem_stack import RunningStack
from tandem.config_check import check_range

logger = logging.getLogger(__name__)

DEFAULT_ANCHOR_DIR = DYNAMO_ANCHOR_DIR
DEFAULT_INSTALL_DIR = "/tmp/anchor"


@dataclass(frozen=True, slots=True, kw_only=True)
class AnchorConfig:
    anchor_dir: str = DEFAULT_ANCHOR_DIR
    install_dir: str = DEFAULT_INSTALL_DIR
    num_workers: int = 1
    speedup: float = 10000.0
    router_mode: str = "round-robin"
    # "SmolLM2-135M-Instruct" (8192-token context) or "smol-long" (same tokenizer, 131072)
    model_name: str = "SmolLM2-135M-Instruct"
    mocker_args: str = ""  # extra `dynamo.mocker` flags (e.g. --block-size 64)
    setup_timeout_s: float = 900.0
    start_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        check_range("num_workers", self.num_workers, low=1)
        check_range(
            "speedup", self.speedup, low=0, low_open=True, note="(0 is not infinite in 1.6.1)"
        )


class DynamoAnchor:
    """One Dynamo stack. `start()` returns the base URL; `frontend_pid` is then known."""

    def __init__(self, config: AnchorConfig, run_dir: str | Path) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.port = free_port()
        self.frontend_pid: int | None = None
        self.mocker_pids: tuple[int, ...] = ()
        self._pids: list[int] = []

    def _env(self) -> dict[str, str]:
        install = Path(self.config.install_dir)
        return {
            **os.environ,
            "ANCHOR": str(self.run_dir),
            "VENV": str(install / "venv"),
            "MODEL_DIR": str(install / "model" / self.config.model_name),
            "HTTP_PORT": str(self.port),
            "NUM_WORKERS": str(self.config.num_workers),
            "SPEEDUP": f"{self.config.speedup:g}",
            "ROUTER_MODE": self.config.router_mode,
            "MOCKER_ARGS": self.config.mocker_args,
            "SYS_PORT_BASE": str(_free_port_block(self.config.num_workers + 1)),
            "BROKER_XSUB": str(free_port()),
            "BROKER_XPUB": str(free_port()),
        }

    def ensure_installed(self) -> None:
        """Run `setup.sh` (minutes; needs PyPI) unless the venv is already there."""
        install = Path(self.config.install_dir)
        if (install / "venv" / "bin" / "python").exists() and (install / "model").exists():
            return
        logger.info("setting up the Dynamo anchor under %s (takes minutes)", install)
        subprocess.run(
            ["bash", str(Path(self.config.anchor_dir) / "setup.sh")],
            env={**os.environ, "ANCHOR": str(install)},
            check=True,
            timeout=self.config.setup_timeout_s,
        )

    def start(self) -> str:
        self.ensure_installed()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy(Path(self.config.anchor_dir) / "zmq_broker.py", self.run_dir)
        proc = subprocess.run(
            ["bash", str(Path(self.config.anchor_dir) / "anchor.sh"), "start"],
            env=self._env(),
            capture_output=True,
            text=True,
            timeout=self.config.start_timeout_s,
        )
        self._pids = self._read_pids()
        if proc.returncode != 0:
            self.stop()
            raise RuntimeError(f"Dynamo anchor failed to start:\n{proc.stdout}\n{proc.stderr}")
        self.frontend_pid = int((self.run_dir / "run" / "frontend.pid").read_text())
        mockers = sorted((self.run_dir / "run").glob("mocker*.pid"))
        self.mocker_pids = tuple(int(p.read_text()) for p in mockers if p.read_text().strip())
        logger.info("Dynamo anchor up on port %s, frontend pid=%s", self.port, self.frontend_pid)
        return f"http://127.0.0.1:{self.port}"

    def _read_pids(self) -> list[int]:
        run = self.run_dir / "run"
        return [int(p.read_text()) for p in sorted(run.glob("*.pid")) if p.read_text().strip()]

    def stop(self) -> None:
        pids = self._pids or self._read_pids()
        with contextlib.suppress(subprocess.TimeoutExpired, OSError):
            subprocess.run(
                ["bash", str(Path(self.config.anchor_dir) / "anchor.sh"), "stop"],
                env=self._env(),
                capture_output=True,
                timeout=30,
            )
        for pid in pids:  # anything anchor.sh could not stop, if it is still ours
            with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
                cmdline = " ".join(psutil.Process(pid).cmdline())
                if "dynamo" in cmdline or "zmq_broker" in cmdline:
                    os.kill(pid, signal.SIGKILL)
                    logger.warning("killed leftover Dynamo process pid=%s", pid)
        self._pids = []


def _free_port_block(count: int) -> int:
    """A base port b with b+1..b+count free now (anchor.sh gives worker i port b+i). Dynamo
    reads DYN_SYSTEM_PORT as an i16, so the block lies below 32768, under the ephemeral range."""
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(20000, 32000 - count)
        if all(_is_free(base + i) for i in range(1, count + 1)):
            return base
    raise RuntimeError(f"no block of {count} free ports found below 32000")


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def dynamo_mocker_stack(
    work_dir: Path, config: AnchorConfig, *, ready_timeout_s: float = 120.0
) -> Iterator[RunningStack]:
    """Dynamo's Rust frontend over its mocker (separate processes: the PID is the frontend)."""
    anchor = DynamoAnchor(config, work_dir / "dynamo")
    try:
        url = anchor.start()
        model = asyncio.run(wait_ready(url, timeout_s=ready_timeout_s))
        assert anchor.frontend_pid is not None
        yield RunningStack(
            url=url,
            model=model,
            frontend_pid=anchor.frontend_pid,
            cpu_scope="frontend",
            engine_pids=anchor.mocker_pids,
        )
    finally:
        anchor.stop()
