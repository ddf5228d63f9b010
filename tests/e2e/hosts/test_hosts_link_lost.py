"""A host lost mid-stream and brought back: the frontend on host1, a mocker worker on each of
host2 and host3 (real-time steps, so streams are still running when host3's link goes down).

- Lost: every stream completes, token-identical to an undisturbed run of the same prompts (the
  ones on host3 migrate to host2), and no request is lost.
- Back: once host3's link is up again its worker re-registers, and as soon as /health lists it
  requests reach it again.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from tests.support.netns_tandem import Hosts, start_frontend, start_worker, stop_all, wait_served
from tests.support.tandem_procs import MODEL, http_request, instances

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

NUM_STREAMS = 6
MAX_TOKENS = 60
ROUTED = re.compile(r'tandem_router_routed_requests_total\{worker_id="(\w+)"[^}]*\} (\S+)')
MIGRATED = re.compile(r'tandem_frontend_migrations_total\{model="smollm2"\} (\S+)')
# fast enough to keep the suite short, slow enough that streams outlive the cut
WORKER_FLAGS = ("--speedup-ratio", "0.5")
# the frontend's defaults (stall timeout 10 s): the streams migrate once the cut worker's
# lease (1 s) expires, not after the stall timeout
FRONTEND_FLAGS: tuple[str, ...] = ()


def metric(base: str, pattern: re.Pattern[str]) -> list[tuple[str, ...]]:
    _, _, body = http_request(f"{base}/metrics")
    return [m if isinstance(m, tuple) else (m,) for m in pattern.findall(body.decode())]


def stream(client: openai.OpenAI, prompt: str, started: threading.Event) -> str:
    text = []
    chunks = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, stream=True, temperature=0
    )
    for chunk in chunks:
        text.append(chunk.choices[0].text)
        if len(text) >= 3:
            started.set()
    return "".join(text)


def prompts() -> list[str]:
    return [f"host lost test prompt number {i}: tell me a long story" for i in range(NUM_STREAMS)]


@pytest.fixture(scope="module")
def stack(hosts: Hosts):  # type: ignore[no-untyped-def]
    h = hosts.hosts
    runtime = hosts.runtime("linklost")
    procs = []
    try:
        w2, id2 = start_worker(h[2], "ll-w2", runtime, *WORKER_FLAGS)
        procs.append(w2)
        w3, id3 = start_worker(h[3], "ll-w3", runtime, *WORKER_FLAGS)
        procs.append(w3)
        front, base = start_frontend(h[1], "ll-front", runtime, *FRONTEND_FLAGS)
        procs.append(front)
        wait_served(base, {id2, id3}, front)
        yield base, front, id2, id3
    finally:
        h[3].link_up()
        logs = stop_all(*procs)
    assert "Traceback" not in logs, logs[-5000:]


def test_streams_migrate_off_a_host_whose_link_goes_down(hosts: Hosts, stack) -> None:  # type: ignore[no-untyped-def]
    base, _, _, id3 = stack
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=60)
    undisturbed = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=MAX_TOKENS, temperature=0)
        .choices[0]
        .text
        for p in prompts()
    ]
    routed_before = dict(metric(base, ROUTED))
    events = [threading.Event() for _ in range(NUM_STREAMS)]
    with ThreadPoolExecutor(NUM_STREAMS) as pool:
        futures = [
            pool.submit(stream, client, p, e) for p, e in zip(prompts(), events, strict=True)
        ]
        for e in events:
            assert e.wait(30), "a stream never started"
        hosts.hosts[3].link_down()
        answers = [f.result(timeout=90) for f in futures]
    assert answers == undisturbed  # every stream complete, token for token
    routed_after = dict(metric(base, ROUTED))
    assert float(routed_after[id3]) > float(routed_before.get(id3, 0))  # host3 had streams
    assert float(metric(base, MIGRATED)[0][0]) >= 1


def test_a_host_brought_back_is_served_once_health_lists_it(hosts: Hosts, stack) -> None:  # type: ignore[no-untyped-def]
    base, front, id2, id3 = stack
    h3 = hosts.hosts[3]
    h3.link_down()  # (still down after the test above; idempotent)
    deadline = time.monotonic() + 30
    while id3 in instances(base):
        assert time.monotonic() < deadline, "host3's worker never left /health"
        time.sleep(0.05)
    h3.link_up()
    wait_served(base, {id2, id3}, front, timeout_s=30)
    before = dict(metric(base, ROUTED))
    for i in range(6):  # round robin: half of these are host3's
        body = {"model": MODEL, "prompt": f"back {i}", "max_tokens": 2}
        status, _, raw = http_request(f"{base}/v1/completions", body, timeout_s=30)
        assert status == 200, raw
        assert json.loads(raw)["usage"]["completion_tokens"] == 2
    after = dict(metric(base, ROUTED))
    assert float(after[id3]) > float(before.get(id3, 0)), (before, after)
