"""Progress watchdog for real: `tandem serve --migration-limit 3` with two mocker workers; one
worker is frozen with SIGSTOP (alive, registered, silent) while streams run on it and more
arrive. No request hangs for the 600 s deadline and none fails: stalled streams migrate, the
frozen worker gets no new requests, and after SIGCONT it answers a probe and is used again."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import time
from collections.abc import Iterator
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

from tandem.runtime.discovery.file import open_record

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]
MAX_TOKENS = 200  # ~6 ms per decode step at --speedup-ratio 1: ~1.2 s per stream
NUM_STREAMS = 8
STALL_S = 1.0
FIRST_TOKEN_S = 2.0


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[TandemProcess, str, Path]]:
    port = free_port()
    run_dir = tmp_path / "run"
    args = ["serve", "--engine", "mocker", "--workers", "2", "--speedup-ratio", "1"]
    args += ["--migration-limit", "3", "--port", str(port), "--run-dir", str(run_dir)]
    args += ["--stall-timeout-s", str(STALL_S), "--first-token-timeout-s", str(FIRST_TOKEN_S)]
    proc = start_tandem("serve", args, tmp_path)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_instances(base, lambda ids: len(ids) == 2, timeout_s=45, proc=proc)
        yield proc, base, run_dir
    finally:
        for record in (run_dir / "discovery").glob("*.json"):  # never leave a worker stopped
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(_record_pid(record), signal.SIGCONT)
        proc.stop()


def _record_pid(path: Path) -> int:
    """The pid in a file-discovery record (its seal is not checked here)."""
    return open_record(path.read_bytes(), None).pid


def _routed(base: str) -> dict[str, float]:
    _, _, text = http_request(f"{base}/metrics")
    rows = re.findall(rb'tandem_router_routed_requests_total\{worker_id="(\w+)"[^}]*\} (\S+)', text)
    return {w.decode(): float(n) for w, n in rows}


async def _stream(client: openai.AsyncOpenAI, i: int, progressed: asyncio.Event) -> float:
    """Stream one chat completion; returns how long it took. Fails unless it is complete."""
    started = time.monotonic()
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"tell story {i}"}],
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    finishes, chunks, usage = [], 0, None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            chunks += bool(choice.delta.content)
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
        if chunks >= 10:
            progressed.set()
    assert finishes == ["length"] and usage == MAX_TOKENS, (i, finishes, usage)
    return time.monotonic() - started


async def test_sigstop_worker_streams_migrate_and_worker_returns_after_sigcont(
    served: tuple[TandemProcess, str, Path],
) -> None:
    proc, base, run_dir = served
    ids = sorted(wait_instances(base, lambda ids: len(ids) == 2))
    frozen = ids[0]
    pid = _record_pid(run_dir / "discovery" / f"{frozen}.json")
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    progressed = [asyncio.Event() for _ in range(2 * NUM_STREAMS)]
    first = [asyncio.create_task(_stream(client, i, progressed[i])) for i in range(NUM_STREAMS)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in progressed[:NUM_STREAMS])), 20)
    assert _routed(base).get(frozen, 0) >= 1  # some streams are running on the worker

    os.kill(pid, signal.SIGSTOP)
    frozen_at = time.monotonic()
    second = [  # more arrive while it is frozen: some are routed there before it is noticed
        asyncio.create_task(_stream(client, i, progressed[i]))
        for i in range(NUM_STREAMS, 2 * NUM_STREAMS)
    ]
    durations = await asyncio.wait_for(asyncio.gather(*first, *second), 45)
    assert max(durations) < 15, durations  # the deadline is 600 s: nothing waited for it

    # noticed: while frozen it gets no new request (with file discovery its record also
    # expires 2 s after its heartbeats stopped; with etcd only when its lease runs out)
    before = _routed(base).get(frozen, 0)
    more = [asyncio.create_task(_stream(client, i, asyncio.Event())) for i in range(4)]
    await asyncio.wait_for(asyncio.gather(*more), 20)
    assert _routed(base).get(frozen, 0) == before
    assert time.monotonic() - frozen_at < 30

    os.kill(pid, signal.SIGCONT)
    await asyncio.to_thread(wait_instances, base, lambda ids: frozen in ids)
    deadline = time.monotonic() + 20
    while _routed(base).get(frozen, 0) == before:  # it answers a probe, then gets requests
        assert time.monotonic() < deadline, f"worker {frozen} never used again:\n{proc.log()}"
        await _stream(client, 0, asyncio.Event())
    await client.close()
    # back through a probe, or (its file record expired meanwhile) forgotten when it left
    # discovery without answering a PING and served afresh once it registered again
    log = proc.log()
    assert "is healthy again" in log or "left discovery and does not answer" in log
    _, _, metrics = http_request(f"{base}/metrics")
    assert b'status="error"' not in metrics
