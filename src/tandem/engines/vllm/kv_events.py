"""vLLM's ZMQ KV events → tandem KV events, on the worker (DESIGN.md §5, §6).

vLLM's publisher, given a `tcp://127.0.0.1:P` endpoint, *connects*: the worker binds the SUB
socket and hands vLLM the endpoint. Each batch is translated with the worker's own table of
the blocks vLLM holds (engine hash → tandem hash, parent, tokens), so a chain's parent
resolves without the router, the worker can describe its whole block set (`snapshot`) to a
router that joins late, and events go out on tandem's event plane under the worker's identity
with the Worker's own event ids and replay buffer. A gap in vLLM's sequence numbers is filled
from vLLM's replay endpoint; what cannot be recovered is logged and counted.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import msgspec
import zmq
import zmq.asyncio

from tandem.protocols.engine_kv_events import (
    EngineBlockRemoved,
    EngineBlockStored,
    EngineEventBatch,
    decode_engine_batch,
    engine_hash_key,
)
from tandem.protocols.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEvent
from tandem.tokens.hashing import sequence_hashes

logger = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 2.0
MAX_FRAME_BYTES = 64 << 20


@dataclass(slots=True)
class _Block:
    tandem_hash: int
    parent_engine_hash: int | None
    token_ids: list[int]


class KvEventTranslator:
    """Holds the blocks vLLM reported stored and not yet removed. Not thread-safe; one loop.
    vLLM's KV cache is the worker's device tier, whatever medium name it reports."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.blocks: dict[int, _Block] = {}
        self.num_unknown_parents = 0

    def translate(self, batch: EngineEventBatch) -> list[KvEvent]:
        out: list[KvEvent] = []
        for ev in batch.events:
            if isinstance(ev, EngineBlockStored):
                out.extend(self._stored(ev))
            elif isinstance(ev, EngineBlockRemoved):
                hashes = []
                for h in ev.block_hashes:
                    block = self.blocks.pop(engine_hash_key(h), None)
                    if block is not None:
                        hashes.append(block.tandem_hash)
                if hashes:
                    out.append(BlockRemoved(block_hashes=hashes))
            else:
                self.blocks.clear()
                out.append(AllBlocksCleared())
        return out

    def _stored(self, ev: EngineBlockStored) -> list[KvEvent]:
        engine_hashes = [engine_hash_key(h) for h in ev.block_hashes]
        engine_parent = (
            None if ev.parent_block_hash is None else engine_hash_key(ev.parent_block_hash)
        )
        parent = None
        if engine_parent is not None:
            known = self.blocks.get(engine_parent)
            if known is None:  # evicted meanwhile: the chain cannot match a prompt from the root
                self.num_unknown_parents += 1
                return []
            parent = known.tandem_hash
        ours = sequence_hashes(
            ev.token_ids, ev.block_size, lora_name=ev.lora_name, parent_hash=parent
        )[: len(engine_hashes)]
        prev = engine_parent
        for i, (eh, th) in enumerate(zip(engine_hashes, ours, strict=False)):
            tokens = ev.token_ids[i * ev.block_size : (i + 1) * ev.block_size]
            self.blocks[eh] = _Block(th, prev, tokens)
            prev = eh
        return [
            BlockStored(
                block_hashes=ours,
                parent_hash=parent,
                token_ids=ev.token_ids[: len(ours) * ev.block_size],
                block_size=ev.block_size,
                lora_name=ev.lora_name,
                engine_block_hashes=engine_hashes[: len(ours)],
            )
        ]

    def snapshot(self) -> list[KvEvent]:
        """One BlockStored per held block, parents before children."""
        out: list[KvEvent] = []
        done: set[int] = set()
        for eh in self.blocks:
            chain = []
            cur: int | None = eh
            while cur is not None and cur not in done and cur in self.blocks:
                chain.append(cur)
                cur = self.blocks[cur].parent_engine_hash
            for h in reversed(chain):
                block = self.blocks[h]
                parent = self.blocks.get(block.parent_engine_hash or -1)
                out.append(
                    BlockStored(
                        block_hashes=[block.tandem_hash],
                        parent_hash=None if parent is None else parent.tandem_hash,
                        token_ids=block.token_ids,
                        block_size=self.block_size,
                        engine_block_hashes=[h],
                    )
                )
                done.add(h)
        return out


class VllmEventSubscriber:
    """Binds the SUB socket vLLM's publisher connects to, reads batches in order, fills gaps
    from vLLM's replay endpoint and hands translated events to `sink`. `start` then `close`."""

    def __init__(self, translator: KvEventTranslator, sink: object) -> None:
        self.translator = translator
        self._sink = sink  # callable(list[KvEvent]) on the event loop
        self._ctx = zmq.asyncio.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        port = self._sub.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay_endpoint: str | None = None
        self.last_seq = -1
        self.num_batches = 0
        self.num_lost = 0
        self._task: asyncio.Task[None] | None = None

    def start(self, replay_endpoint: str | None) -> None:
        self.replay_endpoint = replay_endpoint
        self._task = asyncio.create_task(self._read(), name="vllm-kv-events")

    async def _read(self) -> None:
        while True:
            frames = await self._sub.recv_multipart()
            if len(frames) != 3:
                logger.warning("dropping a vLLM KV event message of %d frames", len(frames))
                continue
            seq = int.from_bytes(frames[1], "big", signed=True)
            if self.last_seq >= 0 and seq > self.last_seq + 1:
                await self._replay(self.last_seq + 1, seq)
            if seq > self.last_seq:
                self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch = decode_engine_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("dropping malformed vLLM KV batch seq=%d: %s", seq, exc)
            return
        if self.last_seq >= 0 and seq != self.last_seq + 1:
            self.num_lost += seq - self.last_seq - 1
            logger.warning("vLLM KV events %d..%d lost", self.last_seq + 1, seq - 1)
        self.last_seq = seq
        self.num_batches += 1
        events = self.translator.translate(batch)
        if events:
            self._sink(events)  # type: ignore[operator]

    async def _replay(self, first: int, until: int) -> None:
        if self.replay_endpoint is None:
            return
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.replay_endpoint)
        try:
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                await sock.send_multipart([b"", first.to_bytes(8, "big")])
                while True:
                    frames = await sock.recv_multipart()
                    seq = int.from_bytes(frames[-2], "big", signed=True)
                    if not frames[-1] or seq < 0 or seq >= until:
                        return
                    if seq > self.last_seq:
                        self._apply(seq, frames[-1])
        except (TimeoutError, zmq.ZMQError) as exc:
            logger.warning("vLLM KV replay from %s failed: %r", self.replay_endpoint, exc)
        finally:
            sock.close(linger=0)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        self._sub.close(linger=0)
