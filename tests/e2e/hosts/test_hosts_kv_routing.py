"""Aggregated KV routing across hosts: etcd and NATS on host0, the frontend on host1, a mocker
worker on each of host2 and host3. The workers' KV events cross hosts over NATS: a prompt's
repeat comes back with its prefix cached, from the worker that holds it."""

from __future__ import annotations

import json
import random
import re
import time

import pytest
from tests.support.netns_tandem import Hosts, start_frontend, start_worker, stop_all, wait_served
from tests.support.tandem_procs import MODEL, http_request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

BLOCK = 16
PREFIX_LEN = 8 * BLOCK
ROUTED = re.compile(r'tandem_router_routed_requests_total\{worker_id="(\w+)"[^}]*\} (\S+)')
STORED = re.compile(r'tandem_router_kv_events_total\{type="stored",status="applied"[^}]*\} (\S+)')


def routed(base: str) -> dict[str, float]:
    _, _, body = http_request(f"{base}/metrics")
    return {wid: float(n) for wid, n in ROUTED.findall(body.decode())}


def stored_events(base: str) -> float:
    _, _, body = http_request(f"{base}/metrics")
    return sum(float(n) for n in STORED.findall(body.decode()))


def complete(base: str, prompt: list[int]) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3}
    status, _, raw = http_request(f"{base}/v1/completions", body, timeout_s=30)
    assert status == 200, raw
    return json.loads(raw)


def wait_stored_above(base: str, count: float, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while stored_events(base) <= count:
        assert time.monotonic() < deadline, "no KV event crossed to the frontend's router"
        time.sleep(0.05)


def test_kv_events_cross_hosts_and_repeats_come_back_cached(hosts: Hosts) -> None:
    h = hosts.hosts
    runtime = hosts.runtime("kvroute")
    procs = []
    try:
        w2, id2 = start_worker(h[2], "kv-w2", runtime, "--block-size", str(BLOCK),
                               "--speedup-ratio", "0")  # fmt: skip
        procs.append(w2)
        w3, id3 = start_worker(h[3], "kv-w3", runtime, "--block-size", str(BLOCK),
                               "--speedup-ratio", "0")  # fmt: skip
        procs.append(w3)
        front, base = start_frontend(h[1], "kv-front", runtime, "--router", "kv")
        procs.append(front)
        wait_served(base, {id2, id3}, front)

        rng = random.Random(30)
        for _ in range(4):
            prefix = [rng.randrange(100, 40_000) for _ in range(PREFIX_LEN)]
            before, events = routed(base), stored_events(base)
            first = complete(base, prefix + [rng.randrange(100, 40_000) for _ in range(5)])
            assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            holder = _grown(before, routed(base))
            wait_stored_above(base, events)  # the holder's event reached host1

            before = routed(base)
            repeat = complete(base, prefix + [rng.randrange(100, 40_000) for _ in range(5)])
            assert repeat["usage"]["prompt_tokens_details"]["cached_tokens"] >= PREFIX_LEN
            assert _grown(before, routed(base)) == holder  # routed to the prefix's holder
        assert set(routed(base)) == {id2, id3}
    finally:
        logs = stop_all(*procs)
    assert "Traceback" not in logs, logs[-5000:]


def _grown(before: dict[str, float], after: dict[str, float]) -> str:
    grown = [wid for wid, n in after.items() if n > before.get(wid, 0.0)]
    assert len(grown) == 1, (before, after)
    return grown[0]
