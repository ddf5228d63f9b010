"""Peer KV fetch between two mocker workers in one process (real transfer agents): the
fetcher pulls the holder's cached prefix (after the blocks it caches itself), prefills only
the rest (reported as cached), emits the aggregated tokens, and caches the fetched blocks; a
holder that evicted them, or one that is gone, costs a recompute, never the request. Each
worker's `tandem_kv_fetch_*` series (what its /metrics exposes) count both."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import time

import pytest

from tandem.disagg.config import DisaggWorkerConfig
from tandem.disagg.worker_engine import DisaggEngine
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.protocols.engine import (
    EngineOutput,
    KvFetchHint,
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
)
from tandem.runtime.metrics import Families, parse, render
from tandem.tokens.hashing import sequence_hashes

pytestmark = pytest.mark.timeout(30)
FAST = ("shm", "tcp")
WORKER = DisaggWorkerConfig(backends=FAST, kv_fetch=True, kv_fetch_timeout_s=5.0)
HASTY = DisaggWorkerConfig(backends=FAST, kv_fetch=True, kv_fetch_timeout_s=0.5)
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


def scrape(engine: DisaggEngine) -> dict[str, float]:
    """The engine's ``tandem_kv_fetch_*`` series as a worker's /metrics renders them."""
    text = render(Families(engine.metric_families())).decode()
    return {name: value for name, series in parse(text).items()
            if name.startswith("tandem_kv_fetch_") for value in series.values()}  # fmt: skip


def fetch_counts(engine: DisaggEngine) -> tuple[float, ...]:
    """Fetches started, succeeded, fell back; blocks and bytes fetched; exports served."""
    m = scrape(engine)
    return tuple(m[f"tandem_kv_fetch_{name}_total"] for name in
                 ("started", "succeeded", "fell_back", "blocks", "bytes", "exported"))  # fmt: skip


async def started(n: int, config: DisaggWorkerConfig = WORKER) -> list[DisaggEngine]:
    engines = [DisaggEngine(MockerEngine(MOCKER), config) for _ in range(n)]
    for e in engines:
        await e.start()
    return engines


@pytest.mark.parametrize("own", [0, 3], ids=["cold", "own-prefix"])
async def test_fetch_pulls_the_prefix_and_matches_recompute(own: int) -> None:
    """The fetcher pulls the holder's 7 blocks of the prompt, or with ``own`` = 3 (an
    earlier, shorter prompt cached its first 3 blocks) keeps those and pulls the other 4,
    and answers what recomputing would."""
    holder, fetcher, plain = await started(3)
    try:
        ref, _ = await run(plain, request("ref"))
        await run(holder, request("warm"))
        if own:
            await run(fetcher, request("own", n=4 * own + 1))  # blocks 0..own-1 (4 tokens each)
        tokens, cached = await run(fetcher, request("r1", hint=hint_to(holder, request("x"))))
        assert tokens == ref
        assert cached == 28  # 7 full blocks of 4 fetched; (30 - 1) // 4 = 7
        assert fetcher.fetch is not None and fetcher.fetch.stats.num_succeeded == 1
        assert holder.fetch is not None and holder.fetch.stats.num_exported == 1
        if own:  # only the blocks after its own moved
            assert fetcher.fetch.stats.num_blocks == 4
            assert holder.fetch.stats.num_export_blocks == 4
        moved = 7 - own  # blocks pulled, of 4 tokens each
        assert fetch_counts(fetcher) == (1, 1, 0, moved, moved * 4 * MOCKER.kv_bytes_per_token, 0)
        assert fetch_counts(holder) == (0, 0, 0, 0, 0, 1)
        assert scrape(holder)["tandem_kv_fetch_exported_blocks_total"] == moved
        measured = scrape(fetcher)
        assert measured["tandem_kv_fetch_bandwidth_bytes_per_second"] == (
            fetcher.fetch.stats.bandwidth_bytes_per_s)  # fmt: skip
        assert measured["tandem_kv_fetch_setup_seconds"] == fetcher.fetch.stats.setup_s
        assert plain.load().kv_fetch_bytes_per_s is None  # published once it measured one
        assert (fetcher.load().kv_fetch_bytes_per_s or 0) > 0
        assert fetcher.load().kv_fetch_setup_s is not None
        # the fetched blocks joined the fetcher's own cache
        again, cached = await run(fetcher, request("r2"))
        assert again == ref and cached == 28
        for e in (holder, fetcher):
            await _settled(e)
    finally:
        for e in (holder, fetcher, plain):
            await e.stop()


async def test_fetch_falls_back_when_the_holder_lacks_or_is_gone() -> None:
    holder, fetcher = await started(2, HASTY)
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
        assert fetch_counts(fetcher) == (2, 0, 2, 0, 0, 0)
        with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, never answers
            r3_hashes = sequence_hashes(request("r3", first=900).token_ids, MOCKER.block_size)
            slow = KvFetchHint(**{**_fields(gone), "address": silent.getsockname(),
                                  "block_hashes": r3_hashes})  # fmt: skip
            began = time.monotonic()
            tokens, cached = await run(fetcher, request("r3", hint=slow, first=900))
            assert cached == 0 and fetcher.fetch.stats.num_fell_back == 3
            assert fetch_counts(fetcher) == (3, 0, 3, 0, 0, 0)
            assert time.monotonic() - began < HASTY.kv_fetch_timeout_s + 2.0
        await _settled(fetcher)
    finally:
        await fetcher.stop()


async def run_direct(
    engine: DisaggEngine, req: PreprocessedRequest
) -> tuple[list[int], int | None, int]:
    """`run` with a direct sink the engine may hand outputs (never the last): the tokens of
    both paths in order, the first cached count, and how many outputs the sink took."""
    assert engine.capabilities.accepts_direct_sink
    outs: list[EngineOutput] = []
    taken = 0

    def sink(out: EngineOutput) -> bool:
        nonlocal taken
        if out.finish_reason is not None or taken >= 2:  # refuse some: both paths run
            return False
        outs.append(out)
        taken += 1
        return True

    async for out in engine.generate(req, direct=sink):
        outs.append(out)
    cached = next((o.num_cached_tokens for o in outs if o.num_cached_tokens is not None), None)
    return [t for out in outs for t in out.token_ids], cached, taken


async def test_a_direct_sink_takes_outputs_on_every_path_and_changes_none() -> None:
    """A peer-fetch worker takes the Worker's direct sink and hands it outputs (the first
    of them counting what was fetched as cached) whether the request had no hint, a fetch
    that fetched nothing, or a fetched prefix; the tokens are those of the plain path. A
    decode worker takes none."""
    holder, fetcher = await started(2)
    try:
        ref, _ = await run(holder, request("ref"))
        assert fetcher.capabilities.accepts_direct_sink
        assert not DisaggEngine(
            MockerEngine(MOCKER), DisaggWorkerConfig(mode="decode")
        ).capabilities.accepts_direct_sink
        tokens, cached, taken = await run_direct(fetcher, request("plain", first=300))
        assert taken > 0 and len(tokens) == 6 and cached == 0
        ref2, _ = await run(holder, request("ref2", first=500))
        other_size = KvFetchHint(  # fetches nothing: the computed path
            **{**_fields(hint_to(holder, request("y", first=500))), "block_size": 8}
        )
        tokens, cached, taken = await run_direct(
            fetcher, request("fell-back", first=500, hint=other_size)
        )
        assert tokens == ref2 and taken > 0 and cached == 0
        assert fetcher.fetch is not None and fetcher.fetch.stats.num_started == 0
        hint = hint_to(holder, request("x"))
        tokens, cached, taken = await run_direct(fetcher, request("fetched", hint=hint))
        assert fetcher.fetch.stats.num_succeeded == 1
        assert tokens == ref and taken > 0 and cached == 28  # 7 blocks of 4 fetched
        for e in (holder, fetcher):
            await _settled(e)
    finally:
        for e in (holder, fetcher):
            await e.stop()


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


HOLDER_SCRIPT = """
import asyncio, json, sys
from tandem.disagg.config import DisaggWorkerConfig
from tandem.disagg.worker_engine import DisaggEngine
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions

async def main():
    cfg = MockerConfig(num_blocks=256, block_size=4, speedup_ratio=0, tokenizer=None)
    engine = DisaggEngine(MockerEngine(cfg), DisaggWorkerConfig(backends=("shm", "tcp"),
                                                                kv_fetch=True))
    await engine.start()
    req = PreprocessedRequest(request_id="warm", model=cfg.model_name,
                              token_ids=list(range(100, 130)),
                              sampling=SamplingParams(temperature=0.0),
                              stop=StopConditions(max_tokens=6, ignore_eos=True))
    async for _ in engine.generate(req):
        pass
    print(json.dumps([list(engine.agent.address), engine.agent.agent_id]), flush=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


async def test_fetch_falls_back_when_the_holder_is_killed_mid_fetch() -> None:
    """The holder (its own process) exported the blocks, then dies (SIGKILL) before the
    fetcher's pull: the fetcher computes the prompt itself and answers the same tokens."""
    holder = await asyncio.create_subprocess_exec(
        sys.executable, "-c", HOLDER_SCRIPT, stdout=asyncio.subprocess.PIPE
    )
    (fetcher,) = await started(1)
    try:
        assert holder.stdout is not None
        line = await asyncio.wait_for(holder.stdout.readline(), 20.0)
        address, agent_id = json.loads(line)
        hint = KvFetchHint(source_instance_id="holder", address=tuple(address),
                           agent_id=agent_id, block_size=MOCKER.block_size,
                           block_hashes=sequence_hashes(request("x").token_ids, 4))  # fmt: skip
        assert fetcher.agent is not None
        real_pull = fetcher.agent.pull

        def pull_after_kill(*args: object, **kwargs: object) -> object:
            holder.kill()  # the export went through: its op and pins die with it
            _wait_refused(tuple(address))
            return real_pull(*args, **kwargs)  # type: ignore[arg-type]

        fetcher.agent.pull = pull_after_kill  # type: ignore[method-assign]
        tokens, cached = await run(fetcher, request("r", hint=hint))
        assert cached == 0 and tokens == await aggregated(request("ref"))
        assert fetcher.fetch is not None
        assert (fetcher.fetch.stats.num_started, fetcher.fetch.stats.num_fell_back) == (1, 1)
        await _settled(fetcher)
    finally:
        if holder.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                holder.kill()
        await fetcher.stop()


def _wait_refused(address: tuple[str, int], timeout_s: float = 10.0) -> None:
    """Until the killed holder's transfer port refuses connections (its process is gone)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection(address, timeout=1.0).close()
        except OSError:
            return
        time.sleep(0.02)
    raise AssertionError(f"the killed holder still accepts on {address}")


async def aggregated(req: PreprocessedRequest) -> list[int]:
    engine = MockerEngine(MOCKER)
    await engine.start()
    tokens = [t async for out in engine.generate(req) for t in out.token_ids]
    await engine.stop()
    return tokens
