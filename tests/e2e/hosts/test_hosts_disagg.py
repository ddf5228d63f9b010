"""Disaggregated prefill/decode across hosts, both flows: the prefill worker on host2, the decode
worker on host3, a prefill-first frontend on host1 and a decode-first one on host4. KV bytes move
between the hosts' transfer agents over the network (the hosts share no /dev/shm), and every answer
equals the aggregated one (a plain worker and frontend in their own namespace on host4)."""

from __future__ import annotations

import json
import random
import re

import pytest
from tests.support.netns_tandem import Hosts, start_frontend, start_worker, stop_all, wait_served
from tests.support.tandem_procs import MODEL, http_request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SYSTEM_PORT = 9090
MOCKER = ["--speedup-ratio", "0", "--block-size", "16"]
BYTES = re.compile(r'tandem_transfer_bytes_total\{[^}]*direction="(\w+)"\} (\S+)')


def moved(ip: str) -> dict[str, float]:
    """A worker's transfer agent's bytes by direction (its /metrics on the system port)."""
    _, _, body = http_request(f"http://{ip}:{SYSTEM_PORT}/metrics")
    return {d: float(n) for d, n in BYTES.findall(body.decode())}


def answer(base: str, prompt: list[int]) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    status, _, raw = http_request(f"{base}/v1/completions", body, timeout_s=30)
    assert status == 200, raw
    out = json.loads(raw)
    assert out["usage"]["completion_tokens"] == 8
    return str(out["choices"][0]["text"])


def test_prefill_and_decode_on_different_hosts_both_flows(hosts: Hosts) -> None:
    h = hosts.hosts
    runtime, agg_runtime = hosts.runtime("disagg"), hosts.runtime("disagg-agg")
    system = ["--system-port", str(SYSTEM_PORT)]
    procs = []
    try:
        prefill, _ = start_worker(
            h[2], "pd-prefill", runtime, *MOCKER, "--disagg-mode", "prefill",
            *system, "--system-host", h[2].ip,
        )  # fmt: skip
        procs.append(prefill)
        decode, decode_id = start_worker(
            h[3], "pd-decode", runtime, *MOCKER, "--disagg-mode", "decode",
            *system, "--system-host", h[3].ip,
        )  # fmt: skip
        procs.append(decode)
        agg, agg_id = start_worker(h[4], "pd-agg", agg_runtime, *MOCKER)
        procs.append(agg)
        flows = {}
        for host, flow in ((h[1], "prefill-first"), (h[4], "decode-first")):
            front, base = start_frontend(host, f"pd-{flow}", runtime, "--disagg",
                                         "--disagg-flow", flow)  # fmt: skip
            procs.append(front)
            wait_served(base, {decode_id}, front)
            flows[flow] = base
        agg_front, agg_base = start_frontend(h[4], "pd-agg-front", agg_runtime, port=8001)
        procs.append(agg_front)
        wait_served(agg_base, {agg_id}, agg_front)

        rng = random.Random(31)
        for flow, base in flows.items():
            before_pull, before_push = moved(h[3].ip), moved(h[2].ip)
            for _ in range(3):
                prompt = [rng.randrange(100, 40_000) for _ in range(100)]
                assert answer(base, prompt) == answer(agg_base, prompt), flow
            after_pull, after_push = moved(h[3].ip), moved(h[2].ip)
            # prefill-first: decode (host3) pulls; decode-first: prefill (host2) pushes
            if flow == "prefill-first":
                assert after_pull["received"] > before_pull.get("received", 0), after_pull
                assert after_push["sent"] > before_push.get("sent", 0), after_push
            else:
                assert after_push["sent"] > before_push.get("sent", 0), after_push
                assert after_pull["received"] > before_pull.get("received", 0), after_pull
    finally:
        logs = stop_all(*procs)
    assert "Traceback" not in logs, logs[-5000:]
    # the agents chose a network backend between the hosts (same hostname, separate /dev/shm):
    # tcp, or nixl / mooncake where installed (started for a peer that shares no memory)
    assert re.search(r"transfer agent=\S+ peer=\S+ backend=(tcp|nixl|mooncake) ", logs), logs[
        -5000:
    ]
    assert "backend=shm" not in logs
    # ... on proof, not by a failed shm attempt (the hosts share hostname and boot id)
    assert "FALLBACK" not in logs and "cannot map /dev/shm" not in logs, logs[-5000:]
