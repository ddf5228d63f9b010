"""Queue wait reaches the planner: with every worker over the KV router's busy threshold,
requests wait in the router's queue; the frontend measures that wait per dispatch, publishes
it in its request stats, and the planner's traffic (and the load mode's TTFT) carries it."""

from __future__ import annotations

import asyncio
import time
from contextlib import AsyncExitStack

import pytest
from tests.support.eventually import eventually
from tests.support.planner_stack import PlannerStack, planner_config

from tandem.planner.config import PoolConfig
from tandem.router.config import RouterConfig

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]


async def _max_queue_wait(s: PlannerStack, until: float) -> float:
    """The largest mean queue wait the planner's ticks saw (polls its timeline)."""
    assert s.service is not None
    best = 0.0
    while time.monotonic() < until:
        best = max([best, *(t.queue_wait_ms or 0.0 for t in s.service.timeline)])
        await asyncio.sleep(0.1)
    return best


async def test_router_queue_wait_is_measured_and_reaches_the_planner() -> None:
    async with AsyncExitStack() as stack:
        s = PlannerStack(stack)
        # one worker; any prompt not yet prefilled makes it busy: the rest queue in the router
        router = RouterConfig(busy_prefill_tokens=1, queue_size=64, queue_timeout_s=30.0)
        await s.start_frontend(router_policy="kv", router=router)
        cfg = planner_config(pools=(PoolConfig(min_workers=1, max_workers=1),))
        await s.start_planner(cfg)
        await eventually(lambda: s.ready() == 1, timeout_s=20)
        await s.wait_serving()
        # alone: no queue, the wait is the routing decision only
        await s.request(prompt_len=200, max_tokens=2)
        alone = await _max_queue_wait(s, time.monotonic() + 0.6)
        assert alone < 50.0
        # eight at once: seven wait for the prompts ahead of them to be prefilled
        load = asyncio.gather(*(s.request(prompt_len=1500, max_tokens=2) for _ in range(8)))
        seen = await _max_queue_wait(s, time.monotonic() + 4.0)
        await load
        assert s.failures == []
        # each 1500-token prompt takes the mocker ~40 ms: the mean wait is ~100 ms or more
        assert seen > max(4 * alone, 30.0), f"mean queue wait {seen:.1f} ms, alone {alone:.1f}"
