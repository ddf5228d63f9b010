"""Session affinity (issue 33): a session's turns go back to its worker; an overloaded bound
worker is passed over and the binding moves; bindings expire and are shared by replicas."""

from __future__ import annotations

import pytest
from tests.support.eventually import eventually
from tests.support.instances import backend_instance

from tandem.protocols.engine import PreprocessedRequest, StopConditions
from tandem.router.config import RouterConfig
from tandem.router.policy_router import RoundRobinRouter
from tandem.router.source import StaticInstanceSet
from tandem.runtime.events.memory import MemoryEventBus

pytestmark = pytest.mark.timeout(20)


def req(rid: str, session: str | None) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid,
        model="m",
        token_ids=[1, 2, 3],
        stop=StopConditions(max_tokens=4),
        session_id=session,
    )


def router(
    clock: list[float], events: MemoryEventBus | None = None, **cfg: float
) -> RoundRobinRouter:
    return RoundRobinRouter(
        RouterConfig(**cfg),  # type: ignore[arg-type]
        instances=StaticInstanceSet([backend_instance(i) for i in range(4)]),
        events=events,
        clock=lambda: clock[0],
    )


async def test_turns_return_to_the_bound_worker_until_it_is_overloaded() -> None:
    clock = [0.0]
    r = router(clock, session_slack=2)
    await r.start()
    first = await r.route(req("t0", "agent-1"))
    for i in range(1, 5):  # round_robin alone would visit every worker
        r.on_finish(f"t{i - 1}")
        assert (await r.route(req(f"t{i}", "agent-1"))).instance_id == first.instance_id
    # t4 is in flight there; one more fits within the slack (2 above the least loaded: 0)
    assert (await r.route(req("p0", "agent-1"))).instance_id == first.instance_id
    moved = await r.route(req("t5", "agent-1"))
    assert moved.instance_id != first.instance_id and moved.details["session"] == "rebound"
    assert r.sessions.num_rebinds == 1
    assert (await r.route(req("t6", "agent-1"))).instance_id == moved.instance_id
    text = r.metrics.render()
    assert "tandem_router_session_rebinds_total 1" in text
    # the binding expires after the TTL of its last turn
    clock[0] += 601.0
    assert r.sessions.get("agent-1", clock[0]) is None
    await r.close()


async def test_replicas_share_bindings_over_the_event_plane() -> None:
    clock, bus = [0.0], MemoryEventBus()
    a, b = router(clock, bus), router(clock, bus)
    await a.start()
    await b.start()
    for i in range(3):  # move b's round robin off a's choice
        await b.route(req(f"b{i}", None))
    chosen = await a.route(req("t0", "agent-7"))
    await eventually(lambda: b.sessions.get("agent-7", clock[0]) is not None, timeout_s=5)
    assert (await b.route(req("t1", "agent-7"))).instance_id == chosen.instance_id
    await a.close()
    await b.close()


async def test_sessions_off_leaves_routing_alone() -> None:
    clock = [0.0]
    r = router(clock, session_ttl_s=0)
    await r.start()
    ids = {(await r.route(req(f"t{i}", "agent-1"))).instance_id for i in range(4)}
    assert len(ids) == 4 and len(r.sessions) == 0
    await r.close()
