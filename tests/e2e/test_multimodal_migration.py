"""Migration of image requests (issue 15) in E/PD: `tandem serve --engine mocker --workers 2
--encode-workers 1 --migration-limit 3` (simulated encoder, no torch). A worker is SIGKILLed while
every image stream is mid-flight; every client still gets one unbroken stream with all its tokens:
the continuation carries the images again, so the surviving worker gets their embeddings from the
encode worker."""

from __future__ import annotations

import asyncio
import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from tests.support.images import data_url, synthetic_png
from tests.support.services import free_port
from tests.support.tandem_procs import MODEL, TandemProcess, http_request, start_tandem

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(150)]
NUM_STREAMS = 4
MAX_TOKENS = 600  # long enough that no stream ends before all have progressed on a loaded box
KILL_AFTER_TOKENS = 10


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[TandemProcess, str]]:
    port = free_port()
    args = ["serve", "--engine", "mocker", "--workers", "2", "--speedup-ratio", "1",
            "--encode-workers", "1", "--mm-num-tokens-per-image", "50", "--router", "kv",
            "--migration-limit", "3", "--port", str(port),
            "--run-dir", str(tmp_path / "run")]  # fmt: skip
    proc = start_tandem("serve", args, tmp_path)
    try:
        proc.wait_log(r"tandem serve ready", timeout_s=60)
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


async def _stream(client: openai.AsyncOpenAI, i: int, progressed: asyncio.Event) -> list[str]:
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(synthetic_png(seed=100 + i))}},
        {"type": "text", "text": f"story {i} about this picture"},
    ]
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": parts}],  # type: ignore[misc,list-item]
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    finishes: list[str] = []
    num_chunks = 0
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
        for choice in chunk.choices:
            num_chunks += bool(choice.delta.content)
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
        if num_chunks == KILL_AFTER_TOKENS:
            progressed.set()
    assert usage == MAX_TOKENS
    return finishes


async def test_killed_worker_mid_image_stream_migrates(served: tuple[TandemProcess, str]) -> None:
    proc, base = served
    workers = [int(p) for p in re.findall(r"started worker\d+ pid=(\d+)", proc.log())]
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
    progressed = [asyncio.Event() for _ in range(NUM_STREAMS)]
    tasks = [asyncio.create_task(_stream(client, i, progressed[i])) for i in range(NUM_STREAMS)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in progressed)), 30)
    os.kill(workers[0], signal.SIGKILL)
    finishes = await asyncio.wait_for(asyncio.gather(*tasks), 90)
    await client.close()
    assert finishes == [["length"]] * NUM_STREAMS
    _, _, metrics = http_request(f"{base}/metrics")
    migrated = re.search(rb'tandem_frontend_migrations_total\{model="smollm2"\} (\S+)', metrics)
    assert migrated is not None and float(migrated.group(1)) >= 1, metrics.decode()[-2000:]
