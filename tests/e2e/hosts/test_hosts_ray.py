"""A Ray cluster across hosts: the head on host2 (no CPUs for actors), worker nodes on host3 and
host4 (two CPUs each), `tandem planner --connector ray --ray-address HEAD:6379` on the head's
host with a pool of two workers that reserve one CPU each, the frontend on host1. The planner's
worker actors land on both worker nodes (spread) and serve; their logs are on their nodes
(`--worker-log-dir`). host4's link goes down: Ray sees the node lost, the actor died, the
worker's lease expires, and the planner adds a worker on host3, which serves."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

import pytest
from tests.support.netns import BIN_DIR, Host, HostProcess
from tests.support.netns_tandem import Hosts, start_frontend, stop_all, wait_log
from tests.support.tandem_procs import MODEL, get_json, http_request

pytest.importorskip("ray")
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

RAY_PORT = 6379
# a lost node is declared dead after ~1.5 s of failed health checks (default: ~30 s)
# and the cluster's auth token (Ray >= 2.5x authenticates its nodes and drivers) given to
# every node and to the planner, as an operator would
RAY_ENV = {"RAY_health_check_period_ms": "500", "RAY_health_check_failure_threshold": "3",
           "RAY_health_check_initial_delay_ms": "0", "RAY_health_check_timeout_ms": "500",
           "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}  # fmt: skip
LOG_DIR = "/tmp/tandem-workers"  # on each node: its private /tmp


def ray_node(host: Host, head: str | None, num_cpus: int) -> HostProcess:
    """`ray start --block` on `host` (the head when `head` is None). The worker a node's
    actor starts needs no address: it advertises its node's address on the route to etcd."""
    where = (["--address", head] if head else
             ["--head", "--port", str(RAY_PORT), "--include-dashboard", "false"])  # fmt: skip
    argv = [str(BIN_DIR / "ray"), "start", *where, "--node-ip-address", host.ip,
            "--num-cpus", str(num_cpus), "--object-store-memory", str(80 << 20),
            "--disable-usage-stats", "--block"]  # fmt: skip
    env = dict(RAY_ENV)
    return host.spawn(f"ray-{host.name}", argv, env=env)


def test_planner_scales_ray_workers_onto_both_nodes_and_replaces_a_lost_one(hosts: Hosts) -> None:
    h = hosts.hosts
    runtime = hosts.runtime("rayhosts")
    procs: list[HostProcess] = []
    head = f"{h[2].ip}:{RAY_PORT}"
    try:
        procs.append(ray_node(h[2], None, 0))
        wait_log(procs[-1], r"Ray runtime started|ray start --address", timeout_s=90)
        for host in (h[3], h[4]):
            procs.append(ray_node(host, head, 2))
        for proc in procs[1:]:
            wait_log(proc, r"Ray runtime started", timeout_s=90)
        front, base = start_frontend(h[1], "ray-front", runtime)
        procs.append(front)
        planner = h[2].tandem(
            "ray-planner", "planner", "--connector", "ray", "--ray-address", head,
            "--ray-worker-cpus", "1", "--pool", "backend:aggregated:2:2",
            "--worker-args", "--engine mocker --speedup-ratio 0 --lease-ttl-s 1",
            "--worker-log-dir", LOG_DIR, "--interval-s", "0.5", "--ready-timeout-s", "90",
            "--cooldown-up-s", "0", *runtime, env=RAY_ENV,
        )  # fmt: skip
        procs.append(planner)
        ids = _wait_instances(base, 2, planner)
        on_node = _nodes(h, ids)
        assert sorted(on_node.values()) == [h[3].ip, h[4].ip], on_node  # spread over both
        _ask(base, 4)

        lost = next(i for i, ip in on_node.items() if ip == h[4].ip)
        h[4].link_down()
        wait_log(planner, rf"ray worker {lost}: its actor died", timeout_s=60)
        deadline = time.monotonic() + 90
        while True:
            ids = _wait_instances(base, 2, planner)
            if lost not in ids:
                break
            assert time.monotonic() < deadline, "the lost worker was never replaced"
            time.sleep(0.2)
        assert set(_nodes(h, ids).values()) == {h[3].ip}  # the replacement runs on host3
        _ask(base, 4)
    finally:
        h[4].link_up()
        logs = stop_all(*procs)
    assert "Traceback" not in logs.split("=== ray-")[0], logs[-5000:]


def _wait_instances(base: str, n: int, planner: HostProcess, timeout_s: float = 120) -> set[str]:
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = get_json(f"{base}/health")
        ids = set(body.get("instances", {}).get(MODEL, []))
        if status == 200 and len(ids) == n:
            return ids
        if planner.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(
                f"/health never listed {n} workers: {body}\n{planner.log()[-3000:]}"
            )
        time.sleep(0.1)


def _nodes(h: list[Host], ids: set[str]) -> dict[str, str]:
    """instance id → the IP of the node whose worker log directory holds its log."""
    found = {}
    for host in h:
        logs = host.workdir / "tmp" / Path(LOG_DIR).name
        for wid in ids:
            if (logs / f"worker-{wid}.log").exists():
                found[wid] = host.ip
    assert set(found) == ids, (found, ids)
    return found


def _ask(base: str, n: int) -> None:
    for i in range(n):
        body = {"model": MODEL, "prompt": f"ray {i}", "max_tokens": 3}
        status, _, raw = http_request(f"{base}/v1/completions", body, timeout_s=30)
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == 3
