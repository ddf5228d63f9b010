"""The router queue (issue 33): classes in order, earliest deadline first within a class, tenants'
shares by weighted tokens (VTC) with no burst for a tenant back from idle, a deadline that
passes in the queue answered with DeadlineExceeded, never served late."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
from tests.support.instances import backend_instance

from tandem.errors import DeadlineExceeded
from tandem.protocols.discovery import Instance
from tandem.protocols.engine import PreprocessedRequest, StopConditions
from tandem.router.base import RouteDecision
from tandem.router.config import RouterConfig
from tandem.router.policy_router import AllBusy, RoundRobinRouter
from tandem.router.queue import RequestQueue, request_cost
from tandem.router.source import StaticInstanceSet

pytestmark = pytest.mark.timeout(20)


class OneSlot(RoundRobinRouter):
    """One request at a time per worker: the rest queue."""

    def _choose(
        self, request: PreprocessedRequest, candidates: Sequence[Instance]
    ) -> tuple[Instance, dict[str, Any]]:
        free = [c for c in candidates if self.inflight(c.instance_id) == 0]
        if not free:
            raise AllBusy
        return super()._choose(request, free)


def req(
    rid: str,
    *,
    priority: int = 0,
    tenant: str | None = None,
    weight: float = 1.0,
    deadline_s: float | None = None,
    num_tokens: int = 8,
) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model="m",
        token_ids=list(range(num_tokens)),
        stop=StopConditions(max_tokens=4),
        priority=priority,
        tenant=tenant,
        tenant_weight=weight,
        deadline_s=deadline_s,
    )


async def start_router() -> OneSlot:
    router = OneSlot(
        RouterConfig(queue_size=100, queue_timeout_s=10),
        instances=StaticInstanceSet([backend_instance(0)]),
    )
    await router.start()
    return router


async def served_order(router: OneSlot, requests: list[PreprocessedRequest]) -> list[str]:
    """Occupy the worker, queue `requests`, then free the worker one request at a time."""
    await router.route(req("blocker"))
    tasks = [asyncio.create_task(router.route(r)) for r in requests]
    await asyncio.sleep(0.01)
    assert router.num_queued == len(requests)
    order: list[str] = []
    for _ in requests:
        router.on_finish(_rid(router))
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED, timeout=5)
        task = done.pop()
        tasks.remove(task)
        task.result()
        order.append(_rid(router))
    return order


def _rid(router: OneSlot) -> str:
    (rid,) = router._request_worker  # the one request in flight
    return rid


async def test_higher_classes_first_then_earliest_deadline() -> None:
    router = await start_router()
    now = time.time()
    order = await served_order(
        router,
        [
            req("low", priority=1),
            req("normal-late", deadline_s=now + 60),
            req("normal-none"),
            req("high", priority=-1),
            req("normal-soon", deadline_s=now + 30),
            req("batch", priority=2),
        ],
    )
    assert order == ["high", "normal-soon", "normal-late", "normal-none", "low", "batch"]
    await router.close()


async def test_backlogged_tenants_share_by_weight_in_tokens() -> None:
    """a (weight 1) sends requests twice as long as b's (weight 1): b gets twice as many."""
    router = await start_router()
    requests = [req(f"a{i}", tenant="a", num_tokens=200) for i in range(30)]
    requests += [req(f"b{i}", tenant="b", num_tokens=96) for i in range(30)]
    order = await served_order(router, requests)
    first = order[:30]
    a_tokens = sum(request_cost(requests[0]) for r in first if r.startswith("a"))
    b_tokens = sum(request_cost(requests[30]) for r in first if r.startswith("b"))
    assert 0.8 <= a_tokens / b_tokens <= 1.25, (first, a_tokens, b_tokens)
    # request-count fairness would have served 15 each
    assert sum(r.startswith("b") for r in first) >= 19
    await router.close()


def test_weights_scale_the_share() -> None:
    queue = RequestQueue()
    for i in range(40):
        queue.push(req(f"a{i}", tenant="a", weight=1.0), frozenset(), 0.0)
        queue.push(req(f"c{i}", tenant="c", weight=2.0), frozenset(), 0.0)
    served = []
    for _ in range(30):
        head = queue.ordered()[0]
        queue.remove(head)
        queue.charge(head.request)
        served.append(head.tenant)
    assert served.count("c") == 20 and served.count("a") == 10


def test_a_tenant_back_from_idle_gets_no_burst() -> None:
    """a was served alone for a long time (no competitor: work-conserving); b then arrives;
    a, idle meanwhile, comes back: it is lifted to b's counter, not served 50 in a row."""
    queue = RequestQueue()
    for i in range(50):  # b alone: its counter climbs
        waiter = queue.push(req(f"b{i}", tenant="b"), frozenset(), 0.0)
        queue.remove(waiter)
        queue.charge(waiter.request)
    for i in range(10):
        queue.push(req(f"b-more{i}", tenant="b"), frozenset(), 0.0)
    for i in range(10):  # a returns from idle with counter 0
        queue.push(req(f"a{i}", tenant="a"), frozenset(), 0.0)
    served = []
    for _ in range(6):
        head = queue.ordered()[0]
        queue.remove(head)
        queue.charge(head.request)
        served.append(head.tenant)
    assert served.count("a") <= 4, served  # alternating, not a's ten first


def test_one_pass_picks_the_lowest_counter_again_after_every_dispatch() -> None:
    """a queued four with deadlines before all of b's four, at equal counters: a pass that
    frees four slots at once serves two of each (each dispatch charges its tenant), not a's
    four as an order fixed at the pass's start would; and a removal
    from the middle of a tenant's waiters keeps the rest in order."""
    queue = RequestQueue()
    for t, latest in (("a", 50.0), ("b", 100.0)):  # a's deadlines all before b's
        for i in range(4):
            queue.push(req(f"{t}{i}", tenant=t, deadline_s=latest - i), frozenset(), 0.0)
    served = []
    for waiter in queue.offers(set()):
        queue.remove(waiter)
        queue.charge(waiter.request)
        served.append(waiter.request.request_id)
        if len(served) == 4:
            break
    assert sorted(served) == ["a2", "a3", "b2", "b3"], served  # earliest deadlines first
    (b1,) = [w for w in queue.ordered() if w.request.request_id == "b1"]
    queue.remove(b1)
    assert [w.request.request_id for w in queue.ordered()] == ["a1", "a0", "b0"]
    assert len(queue) == 3 and queue.depth() == {(0, "a"): 2, (0, "b"): 1}


async def test_a_share_is_charged_the_tokens_generated_not_max_tokens() -> None:
    """Both tenants ask max_tokens 400 with equal prompts; a's answers stop after 10 tokens,
    b's run to 400. Settled at finish by what each generated, a is served many requests per
    one of b's (tokens, not requests, are shared); charged max_tokens, they would alternate."""
    router = await start_router()
    await router.route(req("blocker"))
    made = {"a": 10, "b": 400, "blocker": 0}

    def asking(rid: str, tenant: str) -> PreprocessedRequest:
        return msgspec.structs.replace(req(rid, tenant=tenant), stop=StopConditions(max_tokens=400))

    tasks = [asyncio.create_task(router.route(asking(f"{t}{i}", t)))
             for i in range(30) for t in ("a", "b")]  # fmt: skip
    await asyncio.sleep(0.01)
    served: list[str] = []
    for _ in range(24):
        rid = _rid(router)
        router.on_finish(rid, made[rid.rstrip("0123456789")])
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED, timeout=5)
        tasks.remove(done.pop())
        served.append(_rid(router)[0])  # the tenant of the request dispatched next
    assert served.count("a") >= 18, served
    router.queue.settle("unknown", 5)  # an id never charged, or settled twice: nothing
    for task in tasks:
        task.cancel()
    await router.close()


async def test_deadline_passed_in_queue_is_an_error_not_a_late_answer() -> None:
    router = await start_router()
    await router.route(req("blocker"))
    late = asyncio.create_task(router.route(req("late", deadline_s=time.time() + 0.2)))
    with pytest.raises(DeadlineExceeded, match=r"missed its deadline after .* router queue"):
        await asyncio.wait_for(late, 5)
    assert router.num_queued == 0
    text = router.metrics.render()
    assert (
        'tandem_router_tenant_deadline_misses_total{priority_class="normal",tenant="default"} 1'
        in text
    )
    with pytest.raises(DeadlineExceeded):  # already past at arrival
        await router.route(req("past", deadline_s=time.time() - 1))
    await router.close()


async def test_queue_metrics_by_class_and_tenant() -> None:
    router = await start_router()
    await router.route(req("blocker", tenant="a"))
    waiting = asyncio.create_task(router.route(req("w", tenant="b", priority=1)))
    await asyncio.sleep(0.01)
    text = router.metrics.render()
    assert 'tandem_router_tenant_queued_requests{priority_class="low",tenant="b"} 1' in text
    router.on_finish("blocker")
    decision: RouteDecision = await asyncio.wait_for(waiting, 5)
    assert decision.instance_id
    text = router.metrics.render()
    assert (
        'tandem_router_tenant_queue_wait_seconds_count{priority_class="low",tenant="b"} 1' in text
    )
    assert 'tandem_router_tenant_routed_tokens_total{tenant="a"}' in text
    await router.close()


async def test_busy_inflight_requests_queues_any_policy() -> None:
    router = RoundRobinRouter(
        RouterConfig(queue_size=4, busy_inflight_requests=1),
        instances=StaticInstanceSet([backend_instance(0), backend_instance(1)]),
    )
    await router.start()
    a, b = await router.route(req("a")), await router.route(req("b"))
    assert {a.instance_id, b.instance_id} == {"w0", "w1"}
    third = asyncio.create_task(router.route(req("c")))
    await asyncio.sleep(0.01)
    assert router.num_queued == 1 and not third.done()
    router.on_finish("b")
    assert (await asyncio.wait_for(third, 5)).instance_id == b.instance_id
    await router.close()


async def test_a_new_arrival_does_not_overtake_an_equal_waiter() -> None:
    """A worker frees and, before the queue's dispatch runs, a new request of the same class
    and tenant arrives: the one that waited gets the worker."""
    router = await start_router()
    await router.route(req("blocker"))
    waiting = asyncio.create_task(router.route(req("waited")))
    await asyncio.sleep(0.01)

    async def finish_then_arrive() -> RouteDecision:
        router.on_finish("blocker")  # the dispatch is scheduled, not yet run
        return await router.route(req("late"))

    late = asyncio.create_task(finish_then_arrive())
    await asyncio.wait_for(waiting, 5)
    assert _rid(router) == "waited" and not late.done()
    router.on_finish("waited")
    await asyncio.wait_for(late, 5)
    await router.close()


async def test_the_batch_class_leaves_headroom_for_interactive_requests() -> None:
    """With 2 slots per worker and 1 of headroom, batch lines take one slot a worker; an
    interactive request then still starts at once."""
    router = RoundRobinRouter(
        RouterConfig(queue_size=8, busy_inflight_requests=2, batch_headroom_requests=1),
        instances=StaticInstanceSet([backend_instance(0), backend_instance(1)]),
    )
    await router.start()
    lines = [asyncio.create_task(router.route(req(f"line{i}", priority=2))) for i in range(4)]
    await asyncio.sleep(0.01)
    assert sum(t.done() for t in lines) == 2 and router.num_queued == 2
    chat = await asyncio.wait_for(router.route(req("chat")), 1)  # no wait for a batch line
    assert chat.instance_id in ("w0", "w1")
    for task in lines:
        task.cancel()
    await router.close()


async def test_load_updates_schedule_no_dispatch_while_nothing_is_queued() -> None:
    """An idle router gets load updates many times a second: they must not each schedule a
    dispatch pass (one ran outside any task and showed in the request walk's idle window);
    with a request queued they do."""
    router = await start_router()
    dispatches = 0
    original = router._dispatch

    def counted() -> None:
        nonlocal dispatches
        dispatches += 1
        original()

    router._wake._dispatch = counted
    for _ in range(5):
        router._wake.set()
    await asyncio.sleep(0.01)
    assert dispatches == 0
    await router.route(req("a"))  # takes the only slot
    waiting = asyncio.create_task(router.route(req("b")))
    await asyncio.sleep(0.01)
    before = dispatches
    router._wake.set()
    await asyncio.sleep(0.01)
    assert dispatches > before
    router.on_finish("a")
    await asyncio.wait_for(waiting, 5)
    await router.close()
