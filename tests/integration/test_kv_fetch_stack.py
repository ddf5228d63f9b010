"""Peer KV fetch through the frontend's streamer and the KV router over two mocker workers
(real request plane and transfer agents, memory discovery and events): the worker holding a
prompt is busy, so the router sends it to the idle one with a fetch hint; that worker pulls the
prefix (counted cached), and both counters, router and worker, say so, as do the dashboard's
state and the load metrics the fetcher publishes (its measured fetch bandwidth and setup)."""

from __future__ import annotations

import asyncio
import sys
from contextlib import AsyncExitStack
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from support.disagg_stack import start_stack
from support.eventually import eventually
from tandem.disagg.config import DisaggRouteConfig, DisaggWorkerConfig
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.frontend.observability.dashboard import Dashboard
from tandem.protocols.engine import (
    PreprocessedRequest,
    RoutingHints,
    SamplingParams,
    StopConditions,
)
from tandem.protocols.kv_events import LoadMetrics, decode_load
from tandem.router.config import RouterConfig
from tandem.router.source import StaticInstanceSet
from tandem.tokens.hashing import sequence_hashes

pytestmark = pytest.mark.timeout(30)
MOCKER = MockerConfig(num_blocks=512, block_size=16, speedup_ratio=0, tokenizer=None)
PROMPT = list(range(1000, 1000 + 16 * 12 + 5))  # 12 full blocks and a partial one


def request(rid: str, worker_id: str | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model=MOCKER.model_name,
        token_ids=PROMPT,
        sampling=SamplingParams(temperature=0.0),
        stop=StopConditions(max_tokens=4, ignore_eos=True),
        routing=RoutingHints(worker_id=worker_id) if worker_id else None,
    )


async def first_and_tokens(stack, req: PreprocessedRequest) -> tuple[int | None, list[int]]:
    cached, tokens = None, []
    async for out in stack.streamer.stream(req, stack.router):
        if cached is None:
            cached = out.num_cached_tokens
        tokens += out.token_ids
        if out.finish_reason is not None:
            break
    return cached, tokens


async def test_idle_worker_fetches_the_busy_holders_prefix() -> None:
    async with AsyncExitStack() as stack:
        s = await start_stack(
            stack,
            lambda: MockerEngine(MOCKER),
            num_prefill=0,
            num_decode=2,
            worker=DisaggWorkerConfig(backends=("shm", "tcp"), kv_fetch=True),
            route=DisaggRouteConfig(enabled=True, decode_fallback=True),
            policy="kv",
            router_config=RouterConfig(kv_fetch_setup_s=0.0, seed=0),
        )
        holder, other = (w.instance.instance_id for w in s.workers)  # type: ignore[union-attr]
        loads = await s.workers[0].runtime.events.subscribe("t.backend.load_metrics")
        published: list[LoadMetrics] = []

        async def read_loads() -> None:
            async for _, payload in loads:
                published.append(decode_load(payload))

        reader = asyncio.create_task(read_loads())
        stack.push_async_callback(loads.close)
        stack.callback(reader.cancel)
        _, expected = await first_and_tokens(s, request("warm", worker_id=holder))
        hashes = sequence_hashes(PROMPT, MOCKER.block_size)
        await eventually(lambda: s.router.indexer.find_matches(hashes), timeout_s=10.0)
        for i in range(4):  # the holder is busy prefilling others (as the router sees it)
            s.router.active.add(f"busy{i}", holder, [i], 4096)
        cached, tokens = await first_and_tokens(s, request("r"))
        assert tokens == expected
        assert cached == 16 * 12  # every full block fetched
        assert s.router.metrics.kv_fetches == 1
        fetcher = next(e for e, w in zip(s.decode, s.workers, strict=True)
                       if w.instance.instance_id == other)  # type: ignore[union-attr]  # fmt: skip
        assert fetcher.fetch is not None and fetcher.fetch.stats.num_succeeded == 1
        # the fetcher publishes what its fetch measured, for the router's next fetch plans
        stats = fetcher.fetch.stats
        assert stats.setup_s is not None and stats.bandwidth_bytes_per_s > 0

        def measured() -> bool:
            return any(m.worker_id == other and m.kv_fetch_bytes_per_s is not None
                       for m in published)  # fmt: skip

        await eventually(measured, timeout_s=5.0)
        mine = [m for m in published if m.worker_id == other and m.kv_fetch_bytes_per_s]
        assert (mine[-1].kv_fetch_bytes_per_s, mine[-1].kv_fetch_setup_s) == (
            stats.bandwidth_bytes_per_s, stats.setup_s)  # fmt: skip
        assert all(m.kv_fetch_bytes_per_s is None for m in published if m.worker_id == holder)
        await _dashboard_counts_the_fetch(s, holder, other)
        # the fetched blocks joined the fetcher's cache: its KV events reach the router
        await eventually(
            lambda: any(k.worker_id == other for k in s.router.indexer.find_matches(hashes)),
            timeout_s=10.0,
        )


async def _dashboard_counts_the_fetch(s, holder: str, fetcher: str) -> None:  # type: ignore[no-untyped-def]
    """`/dashboard/state` over the stack's router: the model's and its pool's fetch counts,
    and the decision that hinted the fetch names the holder and the 12 blocks."""
    instances = StaticInstanceSet([w.instance for w in s.workers])
    served = SimpleNamespace(router=s.router, instances=instances)
    registry = SimpleNamespace(models={MOCKER.model_name: served})
    dashboard = Dashboard(registry=registry, num_inflight=lambda: 0, max_inflight=8)  # type: ignore[arg-type]
    (model,) = (await dashboard.state())["models"]
    assert model["router"]["kv_fetches"] == 1
    assert [p["kv_fetches"] for p in model["router"]["pools"]] == [1]
    decision = next(d for d in model["decisions"] if d["request_id"] == "r")
    assert decision["worker_id"] == fetcher
    assert decision["kv_fetch"] == {"source": holder, "blocks": 12}
