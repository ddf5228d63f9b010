"""The router fed directly by a separate process publishing vLLM-format ZMQ KV events."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tandem.protocols.discovery import Instance
from tandem.protocols.engine import PreprocessedRequest, StopConditions
from tandem.router.config import RouterConfig
from tandem.router.indexer import WorkerKey
from tandem.router.kv_router import KvRouter
from tandem.router.source import StaticInstanceSet
from tandem.tokens.hashing import sequence_hashes

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(30)]

PUBLISHER = Path(__file__).with_name("vllm_format_publisher.py")
BS = 16
PROMPT = list(range(1000, 1000 + 8 * BS))
OTHER = list(range(5000, 5000 + 2 * BS))


def inst(wid: str, port: int) -> Instance:
    return Instance(
        instance_id=wid,
        namespace="tandem",
        component="backend",
        endpoint="generate",
        address=f"127.0.0.1:{port}",
    )


async def test_router_follows_vllm_zmq_events_with_replay() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(PUBLISHER),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    router = None
    try:
        endpoints = (await asyncio.wait_for(proc.stdout.readline(), 10)).decode().strip()
        cfg = RouterConfig(seed=0, block_size=BS, zmq_endpoints=(f"vllm0={endpoints}",))
        router = KvRouter(cfg, instances=StaticInstanceSet([inst("vllm0", 1), inst("other", 2)]))
        await router.start()
        source = router.engine_sources[0]
        async with asyncio.timeout(10):  # ZMQ slow joiner: warm up until a batch gets through
            while source.num_batches == 0:
                proc.stdin.write(b"warm\n")
                await proc.stdin.drain()
                await asyncio.sleep(0.02)
        proc.stdin.write(b"run\n")
        await proc.stdin.drain()
        last_seq = int((await asyncio.wait_for(proc.stdout.readline(), 10)).split()[1])
        key = WorkerKey("vllm0")
        async with asyncio.timeout(10):
            while router.applier.last_event_id.get(key) != last_seq:  # noqa: ASYNC110
                await asyncio.sleep(0.01)
        matches = router.indexer.find_matches(sequence_hashes(PROMPT, BS))
        assert matches == {key: 7}  # 8 stored (chained via engine parent), 1 removed in replay
        assert router.indexer.find_matches(sequence_hashes(OTHER, BS)) == {key: 2}
        assert router.metrics.events[("batch", "gap")] >= 1
        router.indexer.check_integrity()
        req = PreprocessedRequest(
            request_id="r", model="m", token_ids=[*PROMPT, 1, 2], stop=StopConditions(max_tokens=1)
        )
        decision = await router.route(req)
        assert (decision.instance_id, decision.overlap_blocks) == ("vllm0", 7)
    finally:
        if router is not None:
            await router.close()
        if proc.returncode is None:
            proc.stdin.write(b"quit\n")
            await proc.stdin.drain()
            try:
                await asyncio.wait_for(proc.wait(), 5)
            except TimeoutError:
                proc.kill()
                await proc.wait()
