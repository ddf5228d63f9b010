"""Over a real request plane: the Worker hands the mocker the prompt as the wire's u32 buffer
(no list of ints) with the router's block hashes, an engine that does not opt in gets the list,
and both answer and publish the same KV blocks (hashes of the one definition)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.protocols.engine import (
    EngineOutput,
    PreprocessedRequest,
    StopConditions,
    decode_output,
    encode_request,
)
from tandem.protocols.kv_events import BlockStored, decode_batch
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.runtime import open_runtime
from tandem.tokens.hashing import sequence_hashes

pytestmark = pytest.mark.timeout(30)
PROMPT = list(range(100, 100 + 16 * 20 + 3))


class Recording(MockerEngine):
    def __init__(self, reads_buffer: bool) -> None:
        super().__init__(MockerConfig(tokenizer=None, block_size=16, speedup_ratio=0))
        self.capabilities = replace(self.capabilities, reads_token_bytes=reads_buffer)
        self.seen: list[PreprocessedRequest] = []

    async def generate(self, request: PreprocessedRequest, **kw) -> AsyncIterator[EngineOutput]:  # type: ignore[no-untyped-def, override]
        self.seen.append(request)
        async for out in super().generate(request, **kw):
            yield out


@pytest.mark.parametrize("reads_buffer", [True, False])
async def test_worker_gives_the_mocker_the_buffer_and_others_the_list(reads_buffer: bool) -> None:
    async with open_runtime(RuntimeConfig()) as runtime:
        sub = await runtime.events.subscribe("tandem.*.kv_events")
        engine = Recording(reads_buffer)
        worker = Worker(engine, runtime, WorkerConfig())
        instance = await worker.start()
        request = PreprocessedRequest(
            request_id="r", model="smollm2", token_ids=PROMPT, stop=StopConditions(max_tokens=3)
        )
        hashes = sequence_hashes(PROMPT, 16)
        payload = encode_request(request, block_hashes=hashes, hash_block_size=16)
        tokens = []
        async for chunk in runtime.stream(instance, payload, request_id="r"):
            out = decode_output(chunk)
            tokens += out.token_ids
            if out.finish_reason:
                break
        stored: list[int] = []

        async def read() -> None:
            async for _, data in sub:
                batch = decode_batch(data)
                stored.extend(h for e in batch.events if isinstance(e, BlockStored)
                              for h in e.block_hashes)  # fmt: skip
                if len(stored) >= len(hashes):
                    return

        await asyncio.wait_for(read(), 5)
        await worker.stop()
        await sub.close()
    (seen,) = engine.seen
    assert len(tokens) == 3
    assert seen.num_prompt_tokens == len(PROMPT)
    assert (seen.token_ids == []) is reads_buffer
    assert seen.block_hashes == hashes and seen.hash_block_size == 16
    assert stored[: len(hashes)] == hashes
