"""`make_router(policy, config, ...)`: build a Router by policy name."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from tandem.router.base import Router
from tandem.router.config import RouterConfig
from tandem.router.policy_router import (
    LeastLoadedRouter,
    PolicyRouterWiring,
    RandomRouter,
    RoundRobinRouter,
)
from tandem.router.source import EventSource, InstanceSource
from tandem.runtime.base import Discovery, RequestClient

__all__ = ["POLICIES", "RouterConfig", "make_router"]

POLICIES = ("kv", "least_loaded", "random", "remote", "round_robin")


def make_router(
    policy: str,
    config: RouterConfig,
    *,
    instances: InstanceSource,
    events: EventSource | None = None,
    client: RequestClient | None = None,
    discovery: Discovery | None = None,
    namespace: str = "tandem",
    clock: Callable[[], float] = time.monotonic,
    rng: random.Random | None = None,
) -> Router:
    """A router of `policy` over `instances` (an InstanceSet of the worker `generate`
    endpoint). `events` (EventBus) feeds load metrics and KV events; `client`
    (RequestClient) asks workers for their KV state. `remote` forwards to a `tandem router`
    service found through `discovery` (a Discovery). Call `await router.start()` next.

    Raises ValueError for an unknown policy name."""
    common = PolicyRouterWiring(
        instances=instances, events=events, namespace=namespace, clock=clock, rng=rng
    )
    if policy == "round_robin":
        return RoundRobinRouter(config, **common)
    if policy == "random":
        return RandomRouter(config, **common)
    if policy == "least_loaded":
        return LeastLoadedRouter(config, **common)
    if policy == "kv":
        from tandem.router.kv_router import KvRouter

        return KvRouter(config, client=client, **common)
    if policy == "remote":
        from tandem.router.remote import RemoteRouter

        return RemoteRouter(config, discovery=discovery, client=client, namespace=namespace)
    raise ValueError(f"unknown router policy '{policy}'; expected one of: {', '.join(POLICIES)}")
