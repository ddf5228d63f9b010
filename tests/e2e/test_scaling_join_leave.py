"""Workers join and leave while requests flow (issue 2): `tandem serve --workers 2` serves a
steady stream of chat requests; a new `tandem worker` joins on the same file discovery dir and
starts taking requests; an original worker gets SIGTERM (unregister, then drain). No request
fails and every one gets all its tokens."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import openai
import pytest
from tests.support.services import free_port
from tests.support.tandem_procs import (
    MODEL,
    TandemProcess,
    http_request,
    start_tandem,
    wait_instances,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]
CONCURRENCY = 8
MAX_TOKENS = 24  # ~6 ms per decode step at --speedup-ratio 1: ~0.15 s per request
MAX_REQUESTS = 2000  # a bound on the load, whatever happens
SEEN_WITHIN_S = 2.0  # the frontend sees a join or a leave this fast (file discovery)


@dataclass
class Load:
    done: int = 0
    failures: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    progress: asyncio.Event = field(default_factory=asyncio.Event)

    async def until_done(self, target: int, timeout_s: float) -> None:
        """Wait until `target` requests have completed in total."""
        async with asyncio.timeout(timeout_s):
            while self.done < target:
                self.progress.clear()
                await self.progress.wait()


@dataclass
class Stack:
    serve: TandemProcess
    base_url: str
    run_dir: Path
    tmp_path: Path


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    port = free_port()
    run_dir = tmp_path / "run"
    args = ["serve", "--engine", "mocker", "--workers", "2", "--speedup-ratio", "1"]
    args += ["--port", str(port), "--run-dir", str(run_dir), "--drain-grace-s", "10"]
    proc = start_tandem("serve", args, tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_instances(base, lambda ids: len(ids) == 2, timeout_s=45, proc=proc)
        yield Stack(proc, base, run_dir, tmp_path)
    finally:
        proc.stop()


async def _client_loop(client: openai.AsyncOpenAI, n: int, load: Load) -> None:
    i = 0
    while not load.stop.is_set() and load.done + len(load.failures) < MAX_REQUESTS:
        i += 1
        try:
            stream = await client.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": f"client {n} request {i}"}],
                max_tokens=MAX_TOKENS,
                stream=True,
                stream_options={"include_usage": True},
            )
            usage, finish = None, None
            async for chunk in stream:
                usage = chunk.usage or usage
                finish = next((c.finish_reason for c in chunk.choices if c.finish_reason), finish)
            if usage is None or usage.completion_tokens != MAX_TOKENS or finish != "length":
                load.failures.append(f"client {n} #{i}: usage={usage} finish={finish}")
            else:
                load.done += 1
        except openai.APIError as exc:
            load.failures.append(f"client {n} #{i}: {type(exc).__name__}: {exc}")
        load.progress.set()


def _routed(base_url: str) -> dict[str, float]:
    _, _, body = http_request(f"{base_url}/metrics")
    found = re.findall(rb'tandem_router_routed_requests_total\{worker_id="(\w+)".*?\} (\S+)', body)
    return {wid.decode(): float(n) for wid, n in found}


async def test_join_and_leave_under_load(stack: Stack) -> None:
    worker_pids = [int(p) for p in re.findall(r"started worker\d+ pid=(\d+)", stack.serve.log())]
    client = openai.AsyncOpenAI(base_url=f"{stack.base_url}/v1", api_key="x", max_retries=0)
    load = Load()
    loops = [asyncio.create_task(_client_loop(client, n, load)) for n in range(CONCURRENCY)]
    joined: TandemProcess | None = None
    try:
        await load.until_done(2 * CONCURRENCY, 20)

        # join: a new worker process on the same discovery dir
        flags = ["--speedup-ratio", "1", "--namespace", "tandem", "--discovery", "file"]
        flags += ["--discovery-dir", str(stack.run_dir / "discovery"), "--events", "zmq"]
        flags += ["--cluster-secret-file", str(stack.run_dir / "cluster-secret")]  # the stack's
        joined = start_tandem("joined", ["worker", "--engine", "mocker", *flags], stack.tmp_path)
        log_match = await asyncio.to_thread(joined.wait_log, r"worker ready: instance_id=(\w+)")
        new_id = log_match.group(1)
        joined_at = time.monotonic()
        await asyncio.to_thread(
            wait_instances, stack.base_url, lambda ids: len(ids) == 3 and new_id in ids
        )
        assert time.monotonic() - joined_at < SEEN_WITHIN_S
        await load.until_done(load.done + 4 * CONCURRENCY, 20)
        assert (await asyncio.to_thread(_routed, stack.base_url)).get(new_id, 0) > 0

        # leave: SIGTERM an original worker mid-load; it unregisters, then drains
        before = await asyncio.to_thread(wait_instances, stack.base_url, lambda ids: True)
        os.kill(worker_pids[0], signal.SIGTERM)
        left_at = time.monotonic()
        after = await asyncio.to_thread(
            wait_instances, stack.base_url, lambda ids: len(ids) == 2 and new_id in ids
        )
        assert time.monotonic() - left_at < SEEN_WITHIN_S
        assert len(before - after) == 1
        await asyncio.to_thread(stack.serve.wait_log, r"worker worker0 exited with code 0")
        await load.until_done(load.done + 4 * CONCURRENCY, 20)
    finally:
        load.stop.set()
        await asyncio.wait_for(asyncio.gather(*loops), 20)
        await client.close()
        if joined is not None:
            assert joined.stop() == 0, joined.log()[-3000:]
    assert load.failures == []
    assert load.done >= 10 * CONCURRENCY
