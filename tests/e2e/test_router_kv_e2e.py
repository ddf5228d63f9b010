"""`tandem serve --engine mocker --workers 4 --router kv` as a real process tree: requests that
share a long prefix land on the worker that holds it (KV hit rate from usage > 80 % after one
warm-up request per group), while unrelated requests still spread over all four workers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import re
import signal
import sys
from collections import Counter
from collections.abc import AsyncIterator

import aiohttp
import pytest
from tests.support.services import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(90)]

NUM_WORKERS = 4
BLOCK = 64  # the mocker's default block size
PREFIX_LEN = 16 * BLOCK
READY = "tandem serve ready"
ROUTED = re.compile(
    r'^tandem_router_routed_requests_total\{worker_id="([^"]+)"[^}]*\} (\d+)$', re.M
)
ACTIVE = re.compile(
    r"^tandem_frontend_worker_active_(?:decode_blocks|prefill_tokens)\{[^}]*\} (\S+)$", re.M
)
STORED = re.compile(
    r'^tandem_router_kv_events_total\{type="stored",status="applied"[^}]*\} (\d+)$', re.M
)


@contextlib.asynccontextmanager
async def serve_kv(tmp_path) -> AsyncIterator[str]:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        *[sys.executable, "-m", "tandem.cli.main", "serve", "--engine", "mocker"],
        *["--workers", str(NUM_WORKERS), "--router", "kv", "--host", "127.0.0.1"],
        *["--port", str(port), "--run-dir", str(tmp_path / "run")],
        *["--speedup-ratio", "20", "--tokenizer", "none"],  # unknown flags go to the workers
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stderr is not None
    log: list[str] = []
    ready = asyncio.Event()

    async def drain() -> None:  # also keeps the pipe from filling up
        async for raw in proc.stderr:  # type: ignore[union-attr]
            line = raw.decode(errors="replace")
            log.append(line)
            if READY in line:
                ready.set()

    reader = asyncio.create_task(drain())
    try:
        async with asyncio.timeout(60):
            await asyncio.wait(
                [asyncio.create_task(ready.wait()), reader], return_when=asyncio.FIRST_COMPLETED
            )
        assert ready.is_set(), "tandem serve exited early:\n" + "".join(log[-40:])
        yield f"http://127.0.0.1:{port}"
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 20)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int]) -> dict:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 4}
    async with session.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return (await resp.json())["usage"]


async def routed_per_worker(session: aiohttp.ClientSession, url: str) -> Counter[str]:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return Counter({w: int(n) for w, n in ROUTED.findall(text)})


async def wait_stored_events(session: aiohttp.ClientSession, url: str, count: int) -> None:
    """Until the router applied `count` BlockStored events (they travel over ZMQ, so they
    can trail the HTTP response a little)."""
    async with asyncio.timeout(10):
        while True:
            async with session.get(url + "/metrics") as resp:
                found = STORED.search(await resp.text())
            if found and int(found.group(1)) >= count:
                return
            await asyncio.sleep(0.02)


async def wait_idle(session: aiohttp.ClientSession, url: str) -> None:
    """Until the router sees no active blocks or unprefilled tokens on any worker (a finished
    request's bookkeeping can trail its HTTP response a little)."""
    async with asyncio.timeout(10):
        while True:
            async with session.get(url + "/metrics") as resp:
                loads = [float(v) for v in ACTIVE.findall(await resp.text())]
            if len(loads) >= 2 * NUM_WORKERS and not any(loads):
                return
            await asyncio.sleep(0.02)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100, 40_000) for _ in range(n)]


async def test_shared_prefixes_hit_their_worker_and_unrelated_requests_spread(tmp_path) -> None:
    rng = random.Random(7)
    prefixes = [random_tokens(rng, PREFIX_LEN) for _ in range(NUM_WORKERS)]
    async with serve_kv(tmp_path) as url, aiohttp.ClientSession() as session:
        for i, prefix in enumerate(prefixes):  # warm-up: one request per group
            await complete(session, url, prefix + random_tokens(rng, 40))
            await wait_stored_events(session, url, i + 1)

        async def group(prefix: list[int]) -> list[dict]:
            return [await complete(session, url, prefix + random_tokens(rng, 40)) for _ in range(4)]

        usages = [u for g in await asyncio.gather(*(group(p) for p in prefixes)) for u in g]
        cached = sum(u["prompt_tokens_details"]["cached_tokens"] for u in usages)
        prompt = sum(u["prompt_tokens"] for u in usages)
        assert cached / prompt > 0.8, f"KV hit rate {cached / prompt:.2f}"

        await wait_idle(session, url)  # the spread below is a claim about idle workers
        before = await routed_per_worker(session, url)
        await asyncio.gather(
            *(complete(session, url, random_tokens(rng, 6 * BLOCK)) for _ in range(12))
        )
        spread = await routed_per_worker(session, url) - before
        assert len(spread) == NUM_WORKERS, f"unrelated requests per worker: {dict(spread)}"
        assert sum(spread.values()) == 12
