"""tandem processes on the hosts of tests/support/netns.py: the session's `Hosts` (etcd and
NATS on host0), a worker or frontend started on a host and waited for, and /health polled from
the root namespace. Every wait has a deadline."""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

from tests.support.netns import Cluster, Host, HostProcess
from tests.support.tandem_procs import get_json, instances

FRONTEND_PORT = 8000
_POLL_S = 0.05


@dataclass
class Hosts:
    """The session's hosts; `etcd_url`/`nats_url` on hosts[0]."""

    cluster: Cluster
    etcd_url: str
    nats_url: str

    @property
    def hosts(self) -> list[Host]:
        return self.cluster.hosts

    def runtime(self, namespace: str) -> list[str]:
        """The runtime flags every process of one test gives: etcd and NATS on host0, named
        by URL only (a URL chooses its backend; no address flag anywhere)."""
        return ["--namespace", namespace, "--etcd-url", self.etcd_url, "--nats-url", self.nats_url]


def wait_log(proc: HostProcess, pattern: str, timeout_s: float = 60.0) -> re.Match[str]:
    """The first match of `pattern` in the process's log; fails if it exits or time runs out."""
    return proc.wait_log(pattern, timeout_s)


def start_worker(host: Host, name: str, runtime: list[str], *flags: str) -> tuple[HostProcess, str]:
    """A `tandem worker` on `host` (mocker unless `flags` say otherwise), once registered. No
    address flag: it binds and advertises its host's address on the route to etcd/NATS."""
    args = ["worker", "--engine", "mocker", "--lease-ttl-s", "1"]
    proc = host.tandem(name, *args, *flags, *runtime)
    return proc, wait_log(proc, r"worker ready: instance_id=(\w+)").group(1)


def start_frontend(
    host: Host, name: str, runtime: list[str], *flags: str, port: int = FRONTEND_PORT
) -> tuple[HostProcess, str]:
    """A `tandem frontend` on `host`; returns it and its base URL once it listens."""
    args = ["frontend", "--host", host.ip, "--port", str(port)]
    proc = host.tandem(name, *args, *flags, *runtime)
    wait_log(proc, r"frontend listening on")
    return proc, f"http://{host.ip}:{port}"


def wait_served(base: str, ids: set[str], proc: HostProcess, timeout_s: float = 60.0) -> None:
    """Until the frontend's /health lists exactly `ids` and answers 200."""
    deadline = time.monotonic() + timeout_s
    seen: set[str] = set()
    while time.monotonic() < deadline:
        seen = instances(base)
        if seen == ids:
            status, _ = get_json(f"{base}/health")
            if status == 200:
                return
        if proc.proc.poll() is not None:
            raise AssertionError(f"{proc.name} exited:\n{proc.log()[-3000:]}")
        time.sleep(_POLL_S)
    raise AssertionError(f"/health never listed {ids} within {timeout_s}s (last {seen})")


def stop_all(*procs: HostProcess) -> str:
    """Stop `procs` (by PID, reverse order) and return their logs joined."""
    for proc in reversed(procs):
        proc.stop(grace_s=5)
    return "".join(f"\n=== {p.name}\n{p.log()}" for p in procs)
