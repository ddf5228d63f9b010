"""Peer KV fetch between two mocker workers in one process (real transfer agents): the
fetcher pulls the holder's cached prefix, prefills only the rest (reported as cached), emits
the aggregated tokens, and caches the fetched blocks; a holder that evicted them, or one that
is gone, costs a recompute, never the request."""

from __future__ import annotations

import asyncio

import pytest

from tandem.disagg.config import DisaggWorkerConfig
from tandem.disagg.worker_engine import DisaggEngine
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.protocols.engine import (
    KvFetchHint,
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
)
from tandem.tokens.hashing import sequence_hashes

pytestmark = pytest.mark.timeout(30)
FAST = ("shm", "tcp")
WORKER = DisaggWorkerConfig(backends=FAST, kv_fetch=True, kv_fetch_timeout_s=2.0)
MOCKER = MockerConfig(num_blocks=256, block_size=4, speedup_ratio=0, tokenizer=None)


def request(
    rid: str, n: int = 30, hint: KvFetchHint | None = None, first: int = 100
) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model=MOCKER.model_name,
        token_ids=list(range(first, first + n)),
        sampling=SamplingParams(temperature=0.0),
        stop=StopConditions(max_tokens=6, ignore_eos=True),
        kv_fetch=hint,
    )


def hint_to(holder: DisaggEngine, req: PreprocessedRequest) -> KvFetchHint:
    assert holder.agent is not None
    hashes = sequence_hashes(req.token_ids, MOCKER.block_size)
    return KvFetchHint(source_instance_id="holder", address=holder.agent.address,
                       agent_id=holder.agent.agent_id, block_hashes=hashes,
                       block_size=MOCKER.block_size)  # fmt: skip


async def run(engine: DisaggEngine, req: PreprocessedRequest) -> tuple[list[int], int]:
    tokens: list[int] = []
    cached = -1
    async for out in engine.generate(req):
        if out.num_cached_tokens is not None and cached < 0:
            cached = out.num_cached_tokens
        tokens += out.token_ids
    return tokens, cached


async def started(n: int) -> list[DisaggEngine]:
    engines = [DisaggEngine(MockerEngine(MOCKER), WORKER) for _ in range(n)]
    for e in engines:
        await e.start()
    return engines


async def test_fetch_pulls_the_prefix_and_matches_recompute() -> None:
    holder, fetcher, plain = await started(3)
    try:
        ref, _ = await run(plain, request("ref"))
        await run(holder, request("warm"))
        tokens, cached = await run(fetcher, request("r1", hint=hint_to(holder, request("x"))))
        assert tokens == ref
        assert cached == 28  # 7 full blocks of 4 fetched; (30 - 1) // 4 = 7
        assert fetcher.fetch is not None and fetcher.fetch.stats.num_succeeded == 1
        assert holder.fetch is not None and holder.fetch.stats.num_exported == 1
        # the fetched blocks joined the fetcher's own cache
        again, cached = await run(fetcher, request("r2"))
        assert again == ref and cached == 28
        for e in (holder, fetcher):
            await _settled(e)
    finally:
        for e in (holder, fetcher, plain):
            await e.stop()


async def test_fetch_falls_back_when_the_holder_lacks_or_is_gone() -> None:
    holder, fetcher = await started(2)
    try:
        ref, _ = await run(holder, request("ref"))
        ref2, _ = await run(holder, request("ref2", first=500))
        hint = hint_to(holder, request("x"))
        evicted = KvFetchHint(
            **{**_fields(hint), "block_hashes": [h + 1 for h in hint.block_hashes]}
        )
        tokens, cached = await run(fetcher, request("r1", hint=evicted))
        assert tokens == ref and cached == 0
        gone = hint_to(holder, request("y", first=500))
        await holder.stop()  # its agent is gone: the export cannot connect
        tokens, cached = await run(fetcher, request("r2", hint=gone, first=500))
        assert tokens == ref2 and cached == 0
        assert fetcher.fetch is not None and fetcher.fetch.stats.num_fell_back == 2
        await _settled(fetcher)
    finally:
        await fetcher.stop()


def _fields(hint: KvFetchHint) -> dict[str, object]:
    return {f: getattr(hint, f) for f in hint.__struct_fields__}


async def _settled(engine: DisaggEngine) -> None:
    for _ in range(200):
        if engine.load().num_active_blocks == 0:
            break
        await asyncio.sleep(0.01)
    assert engine.load().num_active_blocks == 0
    assert isinstance(engine.engine, MockerEngine)
    engine.engine.scheduler.check_integrity()
