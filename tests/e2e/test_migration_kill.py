"""Migration for real (DESIGN.md §3 step 7): `tandem serve` with its default flags (migration
on: `--migration-limit` 3) and two mocker workers at real-time speed; a worker is SIGKILLed
while every stream is mid-flight, and every client still gets one unbroken stream with the
full number of tokens. (`--migration-limit 3` given explicitly: test_migration_stall.py.)"""

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
    instances,
    start_tandem,
    wait_instances,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]
NUM_STREAMS = 6
MAX_TOKENS = 250  # ~6 ms per decode step at --speedup-ratio 1: each stream lasts ~1.5 s
KILL_AFTER_TOKENS = 10


@dataclass
class StreamLog:
    ids: set[str] = field(default_factory=set)
    num_content_chunks: int = 0
    finishes: list[str] = field(default_factory=list)
    completion_tokens: int | None = None
    num_usage_chunks: int = 0


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[TandemProcess, str]]:
    port = free_port()
    args = ["serve", "--engine", "mocker", "--workers", "2", "--speedup-ratio", "1"]
    args += ["--port", str(port), "--run-dir", str(tmp_path / "run")]  # default: migration on
    proc = start_tandem("serve", args, tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_instances(base, lambda ids: len(ids) == 2, timeout_s=45, proc=proc)
        yield proc, base
    finally:
        proc.stop()


async def _stream(
    client: openai.AsyncOpenAI, i: int, log: StreamLog, progressed: asyncio.Event
) -> None:
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"story number {i}, please"}],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        log.ids.add(chunk.id)
        if chunk.usage is not None:
            log.num_usage_chunks += 1
            log.completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.delta.content:
                log.num_content_chunks += 1
            if choice.finish_reason is not None:
                log.finishes.append(choice.finish_reason)
        if log.num_content_chunks == KILL_AFTER_TOKENS:
            progressed.set()


async def test_sigkill_worker_mid_stream_every_request_completes(
    served: tuple[TandemProcess, str],
) -> None:
    proc, base = served
    worker_pids = [int(p) for p in re.findall(r"started worker\d+ pid=(\d+)", proc.log())]
    assert len(worker_pids) == 2
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    logs = [StreamLog() for _ in range(NUM_STREAMS)]
    progressed = [asyncio.Event() for _ in range(NUM_STREAMS)]
    tasks = [
        asyncio.create_task(_stream(client, i, logs[i], progressed[i])) for i in range(NUM_STREAMS)
    ]
    waiting = asyncio.gather(*(e.wait() for e in progressed))
    await asyncio.wait_for(waiting, 20)
    assert not any(log.finishes for log in logs)  # every stream is mid-flight
    before = await asyncio.to_thread(instances, base)
    os.kill(worker_pids[0], signal.SIGKILL)
    killed_at = time.monotonic()

    def lost_after_s() -> float:
        wait_instances(base, lambda ids: len(ids) == 1 and ids < before)
        return time.monotonic() - killed_at

    lost = asyncio.create_task(asyncio.to_thread(lost_after_s))
    await asyncio.wait_for(asyncio.gather(*tasks), 30)
    assert await lost < 2.0  # file discovery drops the dead worker's record (dead pid)
    await client.close()

    for log in logs:
        assert len(log.ids) == 1  # one response id: the client saw one stream
        assert log.finishes == ["length"]
        assert log.num_usage_chunks == 1
        assert log.completion_tokens == MAX_TOKENS
        # the detokenizer may hold back a partial character, never more than a few tokens
        assert MAX_TOKENS - 5 <= log.num_content_chunks <= MAX_TOKENS
    _, _, metrics = http_request(f"{base}/metrics")
    migrated = re.search(rb'tandem_frontend_migrations_total\{model="smollm2"\} (\S+)', metrics)
    assert migrated is not None and float(migrated.group(1)) >= 1, metrics.decode()[-2000:]
    assert b'status="error"' not in metrics
