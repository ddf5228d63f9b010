"""Separate "hosts" on one machine for multi-host tests: network namespaces joined by a bridge.

Each `Host` is a network namespace with one veth leg on a bridge (a 10.x.y.0/24 subnet this
harness picks unused) and its own mount namespace, held open by a `sleep` process: a tmpfs on
/dev/shm (no shared memory with any other host) and a private /tmp (a bind mount of
`workdir/<host>/tmp`, so the test can read what the host wrote there). Everything a host runs is
started with `nsenter` into both namespaces and so shares that host's /dev/shm and /tmp, as
processes on one machine do; the venv and the repository stay visible (they are not under
/tmp). The test process itself stays in the root namespace and reaches the hosts through the
bridge's address.

`Cluster.close()` kills every process it started by PID, then the holders, then deletes the
namespaces and the bridge; it runs even when a test fails (use `cluster()` as a context manager).
`can_make_namespaces()` says why not where this machine cannot (not root, no CAP_NET_ADMIN).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.support.tandem_procs import TandemProcess

REPO = Path(__file__).resolve().parents[2]
BIN_DIR = Path(sys.executable).parent


def _ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    argv = ["ip", *(["-n", netns] if netns else []), *args]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


def can_make_namespaces() -> str | None:
    """None when this process can build hosts; else why not (for a skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    name = f"tprobe{secrets.token_hex(3)}"
    try:
        _ip("netns", "add", name)
    except (RuntimeError, OSError) as exc:
        return f"cannot create a network namespace: {exc}"
    _ip("netns", "del", name, check=False)
    return None


def _free_subnet() -> ipaddress.IPv4Network:
    """A 10.x.y.0/24 no interface of this machine is on."""
    used = [
        ipaddress.ip_interface(word).network
        for line in _ip("-o", "-4", "addr").splitlines()
        for word in line.split()[3:4]
    ]
    for _ in range(200):
        net = ipaddress.ip_network(
            f"10.{secrets.randbelow(200) + 40}.{secrets.randbelow(250)}.0/24"
        )
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.x.y.0/24 subnet for the test bridge")


def kept_under_tmp() -> list[str]:
    """The checkout and the interpreter's prefixes that lie under /tmp (outermost only):
    a host's private /tmp would otherwise hide them from everything it runs."""
    repo = Path(__file__).resolve().parents[2]
    paths = {p.resolve() for p in (repo, Path(sys.prefix), Path(sys.base_prefix))}
    under = sorted(p for p in paths if Path("/tmp") in p.parents)
    return [str(p) for p in under if not any(q in p.parents for q in under)]


class HostProcess(TandemProcess):
    """A process on a host; its output goes to `log_path` (written from the root namespace).
    Stopped by PID like any test process (`tandem_procs.TandemProcess`)."""


@dataclass
class Host:
    name: str
    netns: str
    ip: str
    veth: str  # the host's own leg (inside netns)
    workdir: Path  # this host's files; its /tmp is workdir/tmp
    holder: subprocess.Popen[bytes]
    procs: list[HostProcess] = field(default_factory=list)

    def spawn(
        self, name: str, argv: Sequence[str], env: dict[str, str] | None = None
    ) -> HostProcess:
        """Run `argv` on this host (its network and mount namespace), output to
        `workdir/<name>.log`. TMPDIR is the host's private /tmp."""
        log_path = self.workdir / f"{name}.log"
        full_env = {
            **os.environ,
            "PYTHONUNBUFFERED": "1",
            "TMPDIR": "/tmp",
            "HOSTNAME": self.name,
            **(env or {}),
        }
        enter = ["nsenter", "-t", str(self.holder.pid), "-m", "-n", f"--wd={REPO}", "--"]
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [*enter, *argv],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=full_env,
            )
        hp = HostProcess(name=name, proc=proc, log_path=log_path)
        self.procs.append(hp)
        return hp

    def tandem(self, name: str, *args: str, env: dict[str, str] | None = None) -> HostProcess:
        """`python -m tandem.cli ARGS` on this host."""
        return self.spawn(name, [sys.executable, "-m", "tandem.cli", *args], env)

    def run(self, *argv: str, timeout_s: float = 30.0) -> str:
        """Run a short command on this host and return its output (fails on a non-zero exit)."""
        enter = ["nsenter", "-t", str(self.holder.pid), "-m", "-n", f"--wd={REPO}", "--"]
        done = subprocess.run([*enter, *argv], capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"{argv} on {self.name} failed: {done.stdout}{done.stderr}")
        return done.stdout

    def link_down(self) -> None:
        """Cut this host off the network (its veth goes down, as a pulled cable)."""
        _ip("link", "set", self.veth, "down", netns=self.netns)

    def link_up(self) -> None:
        _ip("link", "set", self.veth, "up", netns=self.netns)

    def stop_all(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(grace_s=3.0)


class Cluster:
    """N hosts on one bridge; the test process reaches them at `host.ip` (the bridge has
    `gateway`). Build with `cluster(n, workdir)`."""

    def __init__(self, workdir: Path) -> None:
        tag = secrets.token_hex(3)
        self.tag = tag
        self.bridge = f"tbr{tag}"
        self.workdir = workdir
        self.hosts: list[Host] = []
        self._netns: list[str] = []
        self.subnet = _free_subnet()
        self.gateway = str(self.subnet[1])

    def _make_bridge(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")

    def add_host(self, index: int) -> Host:
        name = f"host{index}"
        netns = f"t{self.tag}h{index}"
        outer, inner = f"tv{self.tag}{index}", f"eth{index}"
        ip = str(self.subnet[10 + index])
        _ip("netns", "add", netns)
        self._netns.append(netns)
        _ip("link", "add", outer, "type", "veth", "peer", "name", inner, "netns", netns)
        _ip("link", "set", outer, "master", self.bridge)
        _ip("link", "set", outer, "up")
        _ip("addr", "add", f"{ip}/24", "dev", inner, netns=netns)
        _ip("link", "set", inner, "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)
        _ip("route", "add", "default", "via", self.gateway, netns=netns)
        workdir = self.workdir / name
        (workdir / "tmp").mkdir(parents=True, exist_ok=True)
        # one mount namespace per host, held open by this sleep: everything the host runs
        # enters it, so its processes share /dev/shm and /tmp and no other host's
        # the checkout and the venv stay visible where they are, also when they live under
        # /tmp (a CI clone): bound aside before /tmp is covered, moved back after
        keep = kept_under_tmp()
        aside = [f"mkdir -p /dev/shm/.keep{i} && mount --bind {k} /dev/shm/.keep{i} && "
                 for i, k in enumerate(keep)]  # fmt: skip
        back = [f"mkdir -p {k} && mount --move /dev/shm/.keep{i} {k} && rmdir /dev/shm/.keep{i} && "
                for i, k in enumerate(keep)]  # fmt: skip
        script = (
            "mount -t tmpfs -o size=256m none /dev/shm && "
            + "".join(aside)
            + f"mount --bind {workdir / 'tmp'} /tmp && "
            + "".join(back)
            + "echo up && exec sleep infinity"
        )
        holder = subprocess.Popen(
            ["ip", "netns", "exec", netns, "unshare", "-m", "--propagation", "private",
             "sh", "-c", script],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert holder.stdout is not None
        line = holder.stdout.readline()
        if line.strip() != b"up":
            holder.kill()
            holder.wait(5)
            raise RuntimeError(f"{name}: mount namespace not made: {line!r}")
        host = Host(name=name, netns=netns, ip=ip, veth=inner, workdir=workdir, holder=holder)
        self.hosts.append(host)
        return host

    def close(self) -> None:
        """Kill every process by PID, then the holders; delete namespaces and the bridge."""
        for host in reversed(self.hosts):
            host.stop_all()
        for host in self.hosts:
            if host.holder.poll() is None:
                os.kill(host.holder.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                host.holder.wait(5)
        for netns in self._netns:
            _ip("netns", "del", netns, check=False)
        _ip("link", "del", self.bridge, check=False)


@contextlib.contextmanager
def cluster(num_hosts: int, workdir: Path) -> Iterator[Cluster]:
    """`num_hosts` hosts on a fresh bridge, all torn down on exit (also on failure)."""
    c = Cluster(workdir)
    try:
        c._make_bridge()
        for i in range(num_hosts):
            c.add_host(i)
        yield c
    finally:
        c.close()


def wait_port(
    host: str, port: int, timeout_s: float = 20.0, proc: HostProcess | None = None
) -> None:
    """Until a TCP connect to host:port succeeds (from the root namespace)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.proc.poll() is not None:
            raise RuntimeError(f"{proc.name} exited {proc.proc.returncode}:\n{proc.log()[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=1):
            return
        time.sleep(0.05)
    tail = proc.log()[-3000:] if proc else ""
    raise RuntimeError(f"{host}:{port} not reachable within {timeout_s}s\n{tail}")


def start_etcd(host: Host, port: int = 2379) -> tuple[HostProcess, str]:
    """etcd on `host`'s address (fast election; lease TTLs down to 1 s)."""
    url = f"http://{host.ip}:{port}"
    peer = f"http://127.0.0.1:{port + 1}"
    proc = host.spawn(
        "etcd",
        [str(BIN_DIR / "etcd"), "--name", "t", "--data-dir", "/tmp/etcd-data",
         "--listen-client-urls", url, "--advertise-client-urls", url,
         "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
         "--initial-cluster", f"t={peer}", "--heartbeat-interval", "50",
         "--election-timeout", "500", "--log-level", "warn"],
    )  # fmt: skip
    wait_port(host.ip, port, proc=proc)
    return proc, url


def start_nats(host: Host, port: int = 4222) -> tuple[HostProcess, str]:
    """nats-server on `host`'s address."""
    proc = host.spawn("nats", [str(BIN_DIR / "nats-server"), "-a", host.ip, "-p", str(port)])
    wait_port(host.ip, port, proc=proc)
    return proc, f"nats://{host.ip}:{port}"
