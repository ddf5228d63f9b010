"""The global router in front of two pools (each a namespace with its own frontend and mocker
worker): targets pick the pool, priority overrides, a dead pool hands over to a faster one
before the first byte."""

from __future__ import annotations

import socket
from contextlib import AsyncExitStack
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from tests.support.eventually import eventually
from tests.support.planner_stack import PlannerStack

from tandem.planner.global_router.app import GlobalRouterApp
from tandem.planner.global_router.config import GlobalRouterConfig, GlobalRouterFile

pytestmark = pytest.mark.timeout(60)


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"  # closed again: connection refused


async def _pool(stack: AsyncExitStack, namespace: str, **frontend: Any) -> PlannerStack:
    pool = PlannerStack(stack, namespace=namespace)
    await pool.start_frontend(**frontend)
    rt = await pool.runtime()
    from tests.support.planner_stack import mocker_engine

    from tandem.planner.connector.inprocess import InProcessConnector

    connector = InProcessConnector(rt, mocker_engine)
    stack.push_async_callback(connector.close)
    await connector.add_worker("backend")
    await eventually(lambda: len(connector.workers) == 1 and all(
        w.instance is not None for w in connector.workers.values()), timeout_s=10)  # fmt: skip
    return pool


async def test_global_router_sends_each_request_to_the_pool_of_its_targets() -> None:
    async with AsyncExitStack() as stack:
        fast, cheap = await _pool(stack, "fast"), await _pool(stack, "cheap")
        raw = {
            "pools": [{"name": "fast", "namespace": "fast", "url": fast.base},
                      {"name": "cheap", "namespace": "cheap", "url": cheap.base},
                      {"name": "gone", "namespace": "gone", "url": _dead_url()}],
            "aggregated": {"ttft_ms": [200, 2000, 10_000], "itl_ms": [50],
                           "pools": [["fast"], ["cheap"], ["gone"]]},
            "priority": [{"min": 5, "max": 9, "pool": "fast"}],
        }  # fmt: skip
        config = GlobalRouterConfig(msgspec.convert(raw, GlobalRouterFile))
        router = GlobalRouterApp(config, tokenizer=None)
        runner = web.AppRunner(router.app())
        await runner.setup()
        stack.push_async_callback(runner.cleanup)
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        http = await stack.enter_async_context(aiohttp.ClientSession())

        async def ask(**extra: Any) -> tuple[str, dict[str, Any]]:
            body = {"model": "smollm2", "prompt": "hello there", "max_tokens": 4, **extra}
            async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return r.headers["x-tandem-pool"], await r.json()

        pool, reply = await ask()  # default targets: the middle (2000 ms) → cheap
        assert pool == "cheap" and reply["usage"]["completion_tokens"] == 4
        assert (await ask(tandem={"ttft_target_ms": 100}))[0] == "fast"
        assert (await ask(tandem={"ttft_target_ms": 1500}, priority=7))[0] == "fast"
        # the slowest pool is down: the request walks to the next faster pool
        assert (await ask(tandem={"ttft_target_ms": 9000}))[0] == "cheap"
        async with http.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "smollm2", "prompt": "x", "tandem": {"ttft": 1}},
        ) as r:
            assert (
                r.status == 400 and "unknown 'tandem' field" in (await r.json())["error"]["message"]
            )
        assert router.num_routed == {"cheap": 2, "fast": 2}
