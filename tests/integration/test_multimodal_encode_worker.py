"""Encode workers (simulated encoder, no torch) on memory discovery + the real TCP request plane,
and the worker-side provider: remote encode + shm pull, embedding-cache hits that skip the
encoder, failover between encoders, 503 with none, and a mocker in E/PD taking image requests."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from dataclasses import dataclass

import numpy as np
import pytest
from tests.support.images import synthetic_png

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.errors import InvalidRequest, NoWorkersAvailable
from tandem.multimodal.embedding_cache import EmbeddingCache
from tandem.multimodal.embedding_transfer import EmbeddingReceiver
from tandem.multimodal.encode_engine import EncoderEngine, EncodeWorkerConfig
from tandem.multimodal.image import decode_image
from tandem.multimodal.remote_provider import CachingEmbeddingProvider, RemoteEncoderClient
from tandem.multimodal.sim_encoder import SimEncoderConfig, SimVisionEncoder
from tandem.protocols.engine import MmItem, PreprocessedRequest, StopConditions
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.runtime import Runtime, open_runtime

pytestmark = pytest.mark.timeout(30)
SIM = SimEncoderConfig(num_tokens_per_image=8, hidden_size=16, base_ms=0, ms_per_image=1)


@dataclass
class Stack:
    encoders: list[Worker]
    engines: list[EncoderEngine]
    provider: CachingEmbeddingProvider
    client: RemoteEncoderClient
    runtime: Runtime


async def _encoder(
    disc: MemoryDiscovery, bus: MemoryEventBus, exits: AsyncExitStack
) -> tuple[Worker, EncoderEngine]:
    rt = await exits.enter_async_context(
        open_runtime(RuntimeConfig(namespace="t"), discovery=disc, events=bus)
    )
    engine = EncoderEngine(
        EncodeWorkerConfig(encoder="sim", sim=SIM, transfer_backends=("shm", "tcp"))
    )
    worker = Worker(engine, rt, WorkerConfig(component="encoder", endpoint="encode"))
    await worker.start()
    return worker, engine


@pytest.fixture
async def stack() -> AsyncIterator[Stack]:
    from tandem.transfer import TransferAgent, TransferAgentConfig

    disc, bus = MemoryDiscovery(), MemoryEventBus()
    async with AsyncExitStack() as exits:
        pairs = [await _encoder(disc, bus, exits) for _ in range(2)]
        rt = await exits.enter_async_context(
            open_runtime(RuntimeConfig(namespace="t"), discovery=disc, events=bus)
        )
        agent = TransferAgent(TransferAgentConfig(backends=("shm", "tcp")))
        exits.callback(agent.close)
        client = RemoteEncoderClient(rt, EmbeddingReceiver(agent, num_slots=8), timeout_s=3)
        await client.start()
        await client.instances.wait_for(2)
        provider = CachingEmbeddingProvider(
            EmbeddingCache(1 << 20), remote=client, to_tensor=lambda a: a
        )
        yield Stack([w for w, _ in pairs], [e for _, e in pairs], provider, client, rt)
        await client.close()
        for worker, _ in pairs:
            await worker.stop(grace_s=0)


def _request(*seeds: int, rows: int = 8) -> PreprocessedRequest:
    items = []
    for k, seed in enumerate(seeds):
        data = synthetic_png(seed=seed)
        mm_hash = decode_image(data).mm_hash
        items.append(MmItem(mm_hash=mm_hash, offset=k * rows, num_tokens=rows, image_bytes=data))
    return PreprocessedRequest(request_id=f"r{seeds}", model="smollm2",
                               token_ids=[16] * rows * len(seeds) + [100, 101],
                               stop=StopConditions(max_tokens=2), mm_items=items)  # fmt: skip


def _num_images(stack: Stack) -> int:
    return sum(e.stats.num_images for e in stack.engines)


async def test_remote_embeddings_are_the_encoders_rows_and_cached(stack: Stack) -> None:
    request = _request(1, 2)
    rows = await stack.provider.embeddings(request)
    sim = SimVisionEncoder(SIM)
    for item, got in zip(request.mm_items, rows, strict=True):
        assert np.array_equal(got, sim.rows(item.mm_hash))
    assert _num_images(stack) == 2
    again = await stack.provider.embeddings(request)  # every image from the cache
    assert all(np.array_equal(a, b) for a, b in zip(rows, again, strict=True))
    assert _num_images(stack) == 2
    assert (stack.provider.cache.num_hits, stack.provider.cache.num_misses) == (2, 2)
    # a request with one known and one new image sends only the new one
    await stack.provider.embeddings(_request(2, 3))
    assert _num_images(stack) == 3
    assert all(e.sender is not None and e.sender.num_held == 0 for e in stack.engines)


async def test_a_stopped_encoder_fails_over_then_none_is_503(stack: Stack) -> None:
    await stack.encoders[0].stop(grace_s=0)
    await stack.provider.embeddings(_request(7))  # served by the other one
    assert stack.engines[1].stats.num_images == 1
    await stack.encoders[1].stop(grace_s=0)
    started = time.monotonic()
    with pytest.raises(NoWorkersAvailable, match="no encode worker"):
        await stack.provider.embeddings(_request(8))
    assert time.monotonic() - started < 3.5


async def test_undecodable_image_is_a_400_not_a_failover(stack: Stack) -> None:
    bad = _request(9)
    item = bad.mm_items[0]
    bad.mm_items[0] = MmItem(mm_hash=item.mm_hash, offset=0, num_tokens=8, image_bytes=b"nope")
    with pytest.raises(InvalidRequest, match="cannot decode"):
        await stack.provider.embeddings(bad)
    assert stack.client.num_failovers == 0


async def test_mocker_takes_images_through_the_provider(stack: Stack) -> None:
    engine = MockerEngine(MockerConfig(speedup_ratio=0, tokenizer=None, block_size=4,
                                       mm_num_tokens_per_image=8))  # fmt: skip
    engine.embedding_provider = stack.provider
    await engine.start()
    try:
        outs = [o async for o in engine.generate(_request(11))]
        assert outs[-1].finish_reason == "length"
        assert _num_images(stack) == 1
        text_only = MockerEngine(MockerConfig(speedup_ratio=0, tokenizer=None))
        await text_only.start()
        with pytest.raises(InvalidRequest, match="text only"):
            [o async for o in text_only.generate(_request(12))]
        await text_only.stop()
    finally:
        await engine.stop()
