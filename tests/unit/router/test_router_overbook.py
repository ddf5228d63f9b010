"""A busy worker still takes a request its engine preempts for (issue 33,
engines/step_policy.may_overbook): a more urgent class than some of its work, or a tenant
with nothing queued while another tenant is over its share there; a backlogged tenant waits
in the router queue for its fair turn."""

from __future__ import annotations

import asyncio

import pytest
from tests.support.instances import backend_instance
from tests.unit.router.test_router_queue import req

from tandem.router.config import RouterConfig
from tandem.router.policy_router import LeastLoadedRouter
from tandem.router.queue import RequestQueue
from tandem.router.source import StaticInstanceSet

pytestmark = pytest.mark.timeout(20)


async def _full_router(tenant: str, priority: int = 0) -> LeastLoadedRouter:
    """Two workers, two slots each, every slot taken by `tenant`."""
    router = LeastLoadedRouter(
        RouterConfig(queue_size=16, busy_inflight_requests=2, batch_headroom_requests=0),
        instances=StaticInstanceSet([backend_instance(0), backend_instance(1)]),
    )
    await router.start()
    for i in range(4):
        await router.route(req(f"{tenant}{i}", tenant=tenant, priority=priority))
    return router


async def test_a_light_tenant_takes_a_busy_worker_from_a_flooding_one() -> None:
    router = await _full_router("a")
    queued = asyncio.create_task(router.route(req("a-queued", tenant="a")))
    await asyncio.sleep(0.01)
    assert router.num_queued == 1 and not queued.done()  # a's own waits its turn
    b = await asyncio.wait_for(router.route(req("b0", tenant="b")), 10)
    assert router.inflight(b.instance_id) == 3
    b2 = await asyncio.wait_for(router.route(req("b1", tenant="b")), 10)  # share: 1 a worker
    assert b2.instance_id != b.instance_id
    third = asyncio.create_task(router.route(req("b2", tenant="b")))
    await asyncio.sleep(0.01)
    assert not third.done() and router.num_queued == 2  # no room left for b either
    queued.cancel()
    third.cancel()
    await router.close()


async def test_a_more_urgent_class_takes_a_busy_worker_from_a_less_urgent_one() -> None:
    router = await _full_router("bulk", priority=2)
    high = await asyncio.wait_for(router.route(req("h0", tenant="bulk", priority=0)), 10)
    assert router.inflight(high.instance_id) == 3
    await router.close()


async def test_a_lone_tenant_or_one_at_its_share_waits_for_a_free_slot() -> None:
    router = await _full_router("a")
    lone = asyncio.create_task(router.route(req("a4", tenant="a")))  # nobody else to yield
    await asyncio.sleep(0.01)
    assert not lone.done()
    router2 = await _full_router("x")
    waiting = [asyncio.create_task(router2.route(req(f"b{i}", tenant="b"))) for i in range(3)]
    await asyncio.sleep(0.01)
    # b's first two take its room on each worker; its third finds none left
    assert sum(t.done() for t in waiting) == 2
    for task in [lone, *waiting]:
        task.cancel()
    await router.close()
    await router2.close()


def test_the_queue_counts_its_waiters_per_class_and_tenant() -> None:
    queue = RequestQueue()
    a1 = queue.push(req("a1", tenant="a"), frozenset(), 0.0)
    a2 = queue.push(req("a2", tenant="a"), frozenset(), 0.0)
    b1 = queue.push(req("b1", tenant="b", priority=2), frozenset(), 0.0)
    assert queue.num_waiting(0, "a") == 2 and queue.num_waiting(2, "b") == 1
    assert queue.num_keys == 2
    queue.remove(a1)
    queue.remove(a1)  # idempotent
    assert queue.num_waiting(0, "a") == 1 and queue.num_keys == 2
    queue.remove(a2)
    queue.remove(b1)
    assert queue.num_keys == 0 and queue.num_waiting(0, "a") == 0
