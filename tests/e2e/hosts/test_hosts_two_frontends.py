"""Two frontends on two hosts sharing router state: `--router kv --router-replica-sync` on host1
and host4, mocker workers on host2 and host3. A prefix sent through one frontend is a prefix
cache hit when its repeat comes through the other (both routers follow the workers' KV events
across hosts), and a request in flight through one counts as load in the other's router (the
replica sync of active requests crosses hosts over NATS)."""

from __future__ import annotations

import json
import random
import re
import threading
import time

import pytest
from tests.support.netns_tandem import Hosts, start_frontend, start_worker, stop_all, wait_served
from tests.support.tandem_procs import MODEL, http_request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

BLOCK = 16
PREFIX_LEN = 8 * BLOCK
ADMIN = "sk-admin-hosts"
ROUTER_ACTIVE = re.compile(
    r'tandem_frontend_worker_load\{[^}]*metric="router_active_blocks"[^}]*\} (\S+)'
)
FRONTEND_FLAGS = ("--router", "kv", "--router-replica-sync", "--admin-api-key", ADMIN)


def complete(base: str, prompt: list[int], max_tokens: int = 2) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    status, _, raw = http_request(f"{base}/v1/completions", body, timeout_s=30)
    assert status == 200, raw
    return dict(json.loads(raw)["usage"])


def wait_known(base: str, prefix: list[int], timeout_s: float = 15.0) -> str:
    """Until the router at `base` knows a worker holding all of `prefix`; that worker's id.
    (`/v1/route/explain` routes and caches nothing, so waiting on it changes no outcome.)"""
    body = {"model": MODEL, "prompt": prefix, "max_tokens": 2}
    headers = {"authorization": f"Bearer {ADMIN}"}
    deadline = time.monotonic() + timeout_s
    best: dict = {}
    while time.monotonic() < deadline:
        status, _, raw = http_request(f"{base}/v1/route/explain", body, headers=headers)
        assert status == 200, raw
        best = max(json.loads(raw)["candidates"], key=lambda c: c["overlap_blocks"])
        if best["overlap_blocks"] >= PREFIX_LEN // BLOCK:
            return str(best["worker_id"])
        time.sleep(0.05)
    raise AssertionError(f"router at {base} never learned the prefix (best {best})")


def router_active_blocks(base: str, timeout_s: float = 15.0) -> float:
    """Until the router at `base` books active blocks on some worker (its own bookkeeping,
    replicas' included; not the workers' reported load); the most."""
    deadline = time.monotonic() + timeout_s
    most = 0.0
    while time.monotonic() < deadline and most == 0:
        _, _, raw = http_request(f"{base}/metrics")
        found = ROUTER_ACTIVE.findall(raw.decode())
        most = max((float(n) for n in found), default=0.0)
        time.sleep(0.02)
    return most


def test_two_frontends_on_two_hosts_share_the_kv_view(hosts: Hosts) -> None:
    h = hosts.hosts
    runtime = hosts.runtime("twofront")
    mocker = ("--block-size", str(BLOCK), "--speedup-ratio", "1")
    procs = []
    try:
        w2, id2 = start_worker(h[2], "tf-w2", runtime, *mocker)
        procs.append(w2)
        w3, id3 = start_worker(h[3], "tf-w3", runtime, *mocker)
        procs.append(w3)
        a, a_url = start_frontend(h[1], "tf-a", runtime, *FRONTEND_FLAGS)
        procs.append(a)
        b, b_url = start_frontend(h[4], "tf-b", runtime, *FRONTEND_FLAGS)
        procs.append(b)
        wait_served(a_url, {id2, id3}, a)
        wait_served(b_url, {id2, id3}, b)

        rng = random.Random(36)
        holders = set()
        for _ in range(4):
            prefix = [rng.randrange(100, 40_000) for _ in range(PREFIX_LEN)]
            assert (
                complete(a_url, [*prefix, 7, 8, 9])["prompt_tokens_details"]["cached_tokens"] == 0
            )
            holders.add(wait_known(b_url, prefix))  # host4's router learned it from host2/3
            repeat = complete(b_url, [*prefix, 10, 11, 12])
            assert repeat["prompt_tokens_details"]["cached_tokens"] >= PREFIX_LEN
        assert holders <= {id2, id3}

        # a long request through A: B's router counts its blocks on the worker A chose
        prompt = [rng.randrange(100, 40_000) for _ in range(4 * BLOCK)]
        long = threading.Thread(target=complete, args=(a_url, prompt, 400), daemon=True)
        long.start()
        assert router_active_blocks(b_url) > 0
        long.join(60)
    finally:
        logs = stop_all(*procs)
    assert "Traceback" not in logs, logs[-5000:]
