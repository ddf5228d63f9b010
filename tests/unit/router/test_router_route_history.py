"""What the dashboard reads of a router's recent choices (`RouteHistory`): per-worker routed
counts and the block totals behind the prefix-hit rate; a policy router explains its choice
itself (`explain_choice`)."""

from __future__ import annotations

from tandem.protocols.engine import PreprocessedRequest, StopConditions
from tandem.router.base import RouteDecision
from tandem.router.decision_log import DecisionLog


def _request(request_id: str) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=request_id, model="m", token_ids=[1, 2, 3], stop=StopConditions(max_tokens=1)
    )


def test_routed_counts_and_blocks_per_worker() -> None:
    log = DecisionLog()
    assert log.num_routed("w0") == 0 and log.blocks() == (0, 0) and log.hit_rate() is None
    decisions = [("w0", 2, 4), ("w0", 1, 4), ("w1", 0, 2)]
    for i, (worker, overlap, blocks) in enumerate(decisions):
        decision = RouteDecision(
            instance_id=worker, address="a", overlap_blocks=overlap, request_blocks=blocks
        )
        log.record(_request(f"r{i}"), decision, None)
    assert (log.num_routed("w0"), log.num_routed("w1"), log.num_routed("w2")) == (2, 1, 0)
    assert log.blocks() == (3, 10) and log.hit_rate() == 0.3
    log.forget("w0")
    assert log.num_routed("w0") == 0 and log.blocks() == (0, 2)


async def test_a_policy_router_explains_its_own_choice() -> None:
    from tests.support.instances import backend_instance

    from tandem.router.config import RouterConfig
    from tandem.router.registry import make_router
    from tandem.router.source import StaticInstanceSet

    router = make_router(
        "round_robin", RouterConfig(), instances=StaticInstanceSet([backend_instance(0)])
    )
    assert await router.explain_choice(_request("r")) == router.explain(_request("r"))
    assert router.decisions.num_decisions == 0 and router.policy == "round_robin"
