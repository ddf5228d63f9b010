"""Recovery and truth (issue 30 item 4), with real processes on loopback: a frontend, mocker
workers, file discovery and ZMQ events. SIGSTOP stands for a host whose link is down (the
worker keeps its socket and says nothing), SIGCONT for the link coming back.

- While a worker is frozen, /health answers 503 and names it as not reached (request plane
  silent, or excluded by the stall watchdog), even with load-metric staleness set far out;
  after SIGCONT the first chat sent as soon as /health lists it again succeeds (before: /health
  said 200 while chats got 503 "1 live, 1 excluded").
- A worker whose discovery record expires while it is frozen loses its streams at once: they
  migrate and complete within a bound far below the stall timeout (60 s here).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import signal
import threading
import time
from pathlib import Path

import openai
import pytest
from tests.support.services import free_port
from tests.support.tandem_procs import (
    MODEL,
    TandemProcess,
    get_json,
    http_request,
    start_tandem,
    start_worker,
    wait_healthy,
    wait_instances,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]


def _runtime(tmp_path: Path) -> list[str]:
    return ["--discovery", "file", "--discovery-dir", str(tmp_path / "disc"), "--events", "zmq"]


def _chat(base: str, max_tokens: int, timeout_s: float = 30.0) -> tuple[int, bytes]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    status, _, raw = http_request(
        f"{base}/v1/chat/completions", {**body, "max_tokens": max_tokens}, timeout_s=timeout_s
    )
    return status, raw


def _stop_all(procs: list[TandemProcess]) -> None:
    for p in procs:
        p.signal(signal.SIGCONT)  # never leave a process stopped
    for p in procs:
        p.stop(grace_s=2)


def test_a_frozen_worker_is_not_counted_and_is_served_once_health_lists_it(
    tmp_path: Path,
) -> None:
    runtime = _runtime(tmp_path)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["frontend", "--port", str(port), "--migration-limit", "1", *runtime]
    args += ["--stall-timeout-s", "1", "--first-token-timeout-s", "2", "--health-stale-s", "60"]
    args += ["--lease-ttl-s", "60"]  # file discovery: the reader judges a record's age
    frontend = start_tandem("frontend", args, tmp_path)
    procs = [frontend]
    try:
        # its record outlives the freeze: the worker never leaves discovery here
        worker, wid = start_worker("w0", runtime, tmp_path, "--speedup-ratio", "1")
        procs.append(worker)
        wait_instances(base, lambda ids: ids == {wid}, timeout_s=45, proc=frontend)
        wait_healthy(base, timeout_s=30)

        # a long request runs on it when it freezes: the watchdog finds it stalled
        lost = threading.Thread(target=_chat, args=(base, 3000, 60), daemon=True)
        lost.start()
        time.sleep(1.0)
        worker.signal(signal.SIGSTOP)
        deadline = time.monotonic() + 20
        while True:  # load metrics are fresh for 60 s: only the request plane can tell
            status, body = get_json(f"{base}/health", timeout_s=5)
            why = body.get("models", {}).get(MODEL, {}).get("not_counted", {}).get(wid, "")
            if status == 503 and re.search("request plane|stall watchdog", why):
                break
            assert time.monotonic() < deadline, f"/health never named {wid}: {status} {body}"
            time.sleep(0.1)
        assert any(wid in m for m in body["missing"]), body

        worker.signal(signal.SIGCONT)
        deadline = time.monotonic() + 30
        while True:  # the first chat as soon as /health lists it (and says 200) succeeds
            status, body = get_json(f"{base}/health", timeout_s=5)
            if status == 200 and wid in body["instances"].get(MODEL, []):
                break
            assert time.monotonic() < deadline, f"/health never recovered: {body}"
            time.sleep(0.02)
        for _ in range(3):
            status, raw = _chat(base, 4)
            assert status == 200, raw
            assert json.loads(raw)["usage"]["completion_tokens"] == 4
        lost.join(timeout=60)
    finally:
        _stop_all(procs)


def _routed(base: str) -> dict[str, float]:
    _, _, text = http_request(f"{base}/metrics")
    rows = re.findall(rb'tandem_router_routed_requests_total\{worker_id="(\w+)"[^}]*\} (\S+)', text)
    return {w.decode(): float(n) for w, n in rows}


MAX_TOKENS = 1500  # ~6 ms a decode step at --speedup-ratio 1: ~9 s a stream, longer loaded


async def _stream(client: openai.AsyncOpenAI, i: int, progressed: asyncio.Event) -> float:
    """Stream one chat completion to its end; returns its longest wait between chunks."""
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"story {i}"}],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    finishes, usage = [], None
    longest_gap_s, last = 0.0, time.monotonic()
    async for chunk in stream:
        now = time.monotonic()
        longest_gap_s, last = max(longest_gap_s, now - last), now
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                progressed.set()
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    assert finishes == ["length"] and usage == MAX_TOKENS, (i, finishes, usage)
    return longest_gap_s


async def test_streams_on_a_worker_whose_lease_expired_migrate_at_once(tmp_path: Path) -> None:
    runtime = _runtime(tmp_path)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = ["frontend", "--port", str(port), "--migration-limit", "3", *runtime]
    args += ["--stall-timeout-s", "60", "--first-token-timeout-s", "60"]
    frontend = start_tandem("frontend", args, tmp_path)
    procs = [frontend]
    try:
        workers: dict[str, TandemProcess] = {}
        for i in range(2):  # records expire 2 s after their last heartbeat (the default)
            worker, wid = start_worker(f"w{i}", runtime, tmp_path, "--speedup-ratio", "1")
            procs.append(worker)
            workers[wid] = worker
        wait_instances(base, lambda ids: ids == set(workers), timeout_s=45, proc=frontend)
        wait_healthy(base, timeout_s=30)

        client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        progressed = [asyncio.Event() for _ in range(4)]
        streams = [asyncio.create_task(_stream(client, i, progressed[i])) for i in range(4)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in progressed)), 30)
        routed = _routed(base)
        frozen = max(workers, key=lambda w: routed.get(w, 0))
        assert routed.get(frozen, 0) >= 1, routed
        workers[frozen].signal(signal.SIGSTOP)
        # its record expires (~2 s) and it does not answer a PING: its streams move now, not
        # after the 60 s stall timeout
        gaps = await asyncio.wait_for(asyncio.gather(*streams), 45)
        assert max(gaps) < 15, gaps
        assert "left discovery and does not answer" in frontend.log()
        await client.close()

        workers[frozen].signal(signal.SIGCONT)  # it registers again and is served
        await asyncio.to_thread(
            wait_instances, base, lambda ids: frozen in ids, timeout_s=30, proc=frontend
        )
        status, raw = await asyncio.to_thread(_chat, base, 4)
        assert status == 200, raw
    finally:
        with contextlib.suppress(Exception):
            _stop_all(procs)
