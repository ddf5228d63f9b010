"""The planner closing the loop in one process: frontend → mocker workers started and drained
by the in-process connector; each stuck scenario of other planners as a passing test."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack

import pytest
from tests.support.eventually import eventually
from tests.support.planner_stack import PlannerStack, mocker_engine, planner_config

from tandem.engines.base import Engine, EngineDefaults, EngineInfo
from tandem.planner.config import PoolConfig

pytestmark = pytest.mark.timeout(180)


async def test_scales_up_under_load_and_back_to_the_floor_when_traffic_stops() -> None:
    async with AsyncExitStack() as stack:
        s = PlannerStack(stack)
        await s.start_frontend()
        service = await s.start_planner(
            planner_config(pools=(PoolConfig(min_workers=1, max_workers=4),))
        )
        # generous waits: CI runs this beside the e2e tests, whose servers can take most of
        # the CPU for seconds (what is timed is the planner's decisions, not this host)
        await eventually(lambda: s.ready() == 1, timeout_s=30)
        await s.wait_serving()
        load = asyncio.create_task(s.load(rate=60, duration_s=6, prompt_len=600, max_tokens=30))
        await eventually(lambda: s.ready() >= 2, timeout_s=30)
        await load
        assert s.failures == []
        await eventually(lambda: s.ready() == 1, timeout_s=60)  # traffic 0 → the floor
        adds = [a for t in service.timeline for a in t.actions if a.kind == "add"]
        removes = [a for t in service.timeline for a in t.actions if a.kind == "remove"]
        assert len(adds) >= 2 and len(removes) == len(adds) - 1  # the first add was the floor


class NeverReady(EngineDefaults):
    """An engine whose start never returns (a worker stuck loading)."""

    async def start(self) -> EngineInfo:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    async def stop(self) -> None:
        return None


async def test_a_worker_that_never_becomes_ready_is_given_up_on_and_counted() -> None:
    made: list[str] = []

    def factory(component: str) -> Engine:
        made.append(component)
        return NeverReady() if len(made) == 2 else mocker_engine(component)  # type: ignore[return-value]

    async with AsyncExitStack() as stack:
        s = PlannerStack(stack)
        await s.start_frontend()
        service = await s.start_planner(
            planner_config(pools=(PoolConfig(min_workers=1, max_workers=3),), ready_timeout_s=2.0),
            factory,
        )
        await eventually(lambda: s.ready() == 1, timeout_s=10)
        await s.wait_serving()
        load = asyncio.create_task(s.load(rate=40, duration_s=8, prompt_len=600, max_tokens=30))
        pool = service.planner.pools["backend"]
        await eventually(lambda: pool.num_never_ready == 1, timeout_s=15)
        await eventually(lambda: s.ready() >= 2, timeout_s=15)  # the planner moved on
        await load
        assert s.failures == []
        assert s.connector is not None and len(made) >= 3


async def test_replicas_changed_outside_the_planner_are_reread_not_fought() -> None:
    async with AsyncExitStack() as stack:
        s = PlannerStack(stack)
        await s.start_frontend()
        cfg = planner_config(pools=(PoolConfig(min_workers=2, max_workers=4),),
                             cooldown_down_s=3.0)  # fmt: skip
        service = await s.start_planner(cfg)
        await eventually(lambda: s.ready() == 2, timeout_s=10)
        # an operator adds two workers by hand, and stops one of the planner's
        assert s.connector is not None
        for _ in range(2):
            await s.connector.add_worker("backend")
        await eventually(lambda: s.ready() == 4, timeout_s=10)
        pool = service.planner.pools["backend"]
        await eventually(lambda: pool.num_external_changes >= 1, timeout_s=5)
        ticks = len(service.timeline)
        await eventually(lambda: len(service.timeline) >= ticks + 5, timeout_s=5)
        assert s.ready() == 4  # not reverted within the cooldown that followed the change
        victim = sorted(s.connector.workers)[0]
        await s.connector.drain_worker("backend", victim)
        await eventually(lambda: pool.num_external_changes >= 2, timeout_s=10)
        # idle: it scales down from what it now sees, by one per cooldown, to its floor
        await eventually(lambda: s.ready() == 2, timeout_s=30)
        assert not [a for t in service.timeline for a in t.actions if a.kind == "add"][2:]


async def test_scale_down_under_load_fails_no_request() -> None:
    async with AsyncExitStack() as stack:
        s = PlannerStack(stack)
        await s.start_frontend()
        cfg = planner_config(pools=(PoolConfig(min_workers=1, max_workers=4),), cooldown_down_s=0.5)
        service = await s.start_planner(cfg)
        await eventually(lambda: s.ready() == 1, timeout_s=10)
        assert s.connector is not None
        for _ in range(3):  # start above the need: the planner will drain while serving
            await s.connector.add_worker("backend")
        await eventually(lambda: s.ready() == 4, timeout_s=10)
        # light but steady load with long streams: every victim has requests in flight
        await s.load(rate=15, duration_s=6, prompt_len=100, max_tokens=150)
        removes = [a for t in service.timeline for a in t.actions if a.kind == "remove"]
        assert removes, "the planner never scaled down"
        assert s.failures == []
        assert len(s.results) == 90
