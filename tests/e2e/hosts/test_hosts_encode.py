"""An encode worker on its own host (E/PD across hosts): the simulated encoder on host4, a mocker
worker that takes images on host3 (remote encode only, no local fallback), the frontend on
host1. Image requests are answered; the embeddings were encoded on host4 and moved to host3
over the data plane (the hosts share no /dev/shm)."""

from __future__ import annotations

import json
import re

import pytest
from tests.support.images import data_url, synthetic_png
from tests.support.netns_tandem import (
    Hosts,
    start_frontend,
    start_worker,
    stop_all,
    wait_log,
    wait_served,
)
from tests.support.tandem_procs import MODEL, http_request

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

SYSTEM_PORT = 9090
NUM_IMAGES = 3


def counter(ip: str, name: str) -> float:
    _, _, body = http_request(f"http://{ip}:{SYSTEM_PORT}/metrics")
    found = re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", body.decode(), re.M)
    return sum(float(n) for n in found)


def test_encode_worker_on_its_own_host(hosts: Hosts) -> None:
    h = hosts.hosts
    runtime = hosts.runtime("encode")
    procs = []
    try:
        encoder = h[4].tandem(
            "enc-encoder", "worker", "--engine", "encoder", "--mm-encoder", "sim",
            "--lease-ttl-s", "1", *runtime,
        )  # fmt: skip
        procs.append(encoder)
        wait_log(encoder, r"worker ready: instance_id=")
        worker, worker_id = start_worker(
            h[3], "enc-worker", runtime, "--speedup-ratio", "0",
            "--mm-num-tokens-per-image", "50", "--mm-remote-encode", "--no-mm-local-fallback",
            "--system-port", str(SYSTEM_PORT), "--system-host", h[3].ip,
        )  # fmt: skip
        procs.append(worker)
        front, base = start_frontend(h[1], "enc-front", runtime)
        procs.append(front)
        wait_served(base, {worker_id}, front)

        for i in range(NUM_IMAGES):
            parts = [
                {"type": "image_url", "image_url": {"url": data_url(synthetic_png(seed=300 + i))}},
                {"type": "text", "text": f"what is in picture {i}?"},
            ]
            body = {"model": MODEL, "messages": [{"role": "user", "content": parts}],
                    "max_tokens": 4}  # fmt: skip
            status, _, raw = http_request(f"{base}/v1/chat/completions", body, timeout_s=60)
            assert status == 200, raw
            usage = json.loads(raw)["usage"]
            assert usage["completion_tokens"] == 4 and usage["prompt_tokens"] > 50
        assert counter(h[3].ip, "tandem_mm_remote_encoded_images_total") == NUM_IMAGES
        assert counter(h[3].ip, "tandem_mm_local_encoded_images_total") == 0
    finally:
        logs = stop_all(*procs)
    assert "Traceback" not in logs, logs[-5000:]
    assert "FALLBACK" not in logs and "cannot map /dev/shm" not in logs, logs[-5000:]
    # the embeddings crossed hosts over a network backend, never shm
    assert re.search(r"transfer agent=\S+ peer=\S+ backend=(tcp|nixl|mooncake) ", logs), logs[
        -3000:
    ]
