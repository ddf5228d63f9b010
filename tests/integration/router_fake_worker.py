"""A mocker-like KV event publisher for router tests: holds block chains, publishes every
change as a KvEventBatch, keeps a bounded replay buffer and serves `kv_state` per the
KvStateRequest contract (replay after an id, or the whole block set)."""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import AsyncIterator

import msgspec

from tandem.protocols.discovery import ModelCard
from tandem.protocols.kv_events import (
    BlockRemoved,
    BlockStored,
    KvEvent,
    KvEventBatch,
    KvStateRequest,
    LoadMetrics,
    encode,
)
from tandem.runtime.base import RequestContext
from tandem.tokens.hashing import sequence_hashes

BLOCK_SIZE = 4
_state_decoder = msgspec.msgpack.Decoder(KvStateRequest)


class FakeKvWorker:
    def __init__(self, runtime, worker_id: str, *, seed: int, buffer_size: int = 32) -> None:
        self.runtime = runtime
        self.worker_id = worker_id
        self.rng = random.Random(seed)
        self.event_id = 0
        self.blocks: dict[int, list[int]] = {}  # hash -> token ids of the chain up to it
        self.buffer: deque[KvEventBatch] = deque(maxlen=buffer_size)
        self.state_requests: list[int | None] = []

    async def start(self) -> None:
        card = ModelCard(
            name="m", context_length=4096, block_size=BLOCK_SIZE, num_total_blocks=1000
        )

        async def generate(payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
            yield b""

        await self.runtime.serve_endpoint(
            "backend", "kv_state", self.kv_state, instance_id=f"{self.worker_id}-kv"
        )
        await self.runtime.serve_endpoint(
            "backend", "generate", generate, model=card, instance_id=self.worker_id
        )

    async def kv_state(self, payload: bytes, ctx: RequestContext) -> AsyncIterator[bytes]:
        req = _state_decoder.decode(payload)
        self.state_requests.append(req.after_event_id)
        after = req.after_event_id
        if after is not None and (not self.buffer or self.buffer[0].event_id <= after + 1):
            for batch in list(self.buffer):
                if batch.event_id > after:
                    yield encode(batch)
            return
        hashes = list(self.blocks)
        yield encode(
            KvEventBatch(
                worker_id=self.worker_id,
                event_id=self.event_id,
                timestamp_s=time.time(),
                events=[BlockStored(block_hashes=hashes, block_size=BLOCK_SIZE)] if hashes else [],
            )
        )

    def _batch(self, events: list[KvEvent]) -> KvEventBatch:
        self.event_id += 1
        batch = KvEventBatch(
            worker_id=self.worker_id, event_id=self.event_id, timestamp_s=time.time(), events=events
        )
        self.buffer.append(batch)
        return batch

    def mutate(self) -> KvEventBatch:
        """Store a chain of shared-prefix blocks or evict some; returns the batch."""
        if self.blocks and self.rng.random() < 0.35:
            victims = self.rng.sample(list(self.blocks), k=min(3, len(self.blocks)))
            for h in victims:
                del self.blocks[h]
            return self._batch([BlockRemoved(block_hashes=victims)])
        group = self.rng.randrange(6)
        tokens = [group * 1000 + t for t in range(BLOCK_SIZE * self.rng.randint(1, 6))]
        hashes = sequence_hashes(tokens, BLOCK_SIZE)
        for h in hashes:
            self.blocks[h] = tokens
        return self._batch(
            [BlockStored(block_hashes=hashes, block_size=BLOCK_SIZE, token_ids=tokens)]
        )

    async def report_load(self) -> None:
        """Publish load metrics carrying the id of the last batch, as a Worker does."""
        msg = LoadMetrics(
            worker_id=self.worker_id,
            num_active_blocks=len(self.blocks),
            num_total_blocks=1000,
            num_waiting=0,
            num_running=0,
            kv_event_id=self.event_id,
        )
        await self.runtime.events.publish("tandem.backend.load_metrics", encode(msg))

    async def step(self, *, publish: bool = True) -> None:
        batch = self.mutate()
        if publish:
            await self.runtime.events.publish("tandem.backend.kv_events", encode(batch))
