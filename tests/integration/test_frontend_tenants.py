"""Tenants at the HTTP edge (issue 33), on a frontend and a mocker worker in one process: an
API key's tenant, the x-tenant-id header, priority classes capped by the tenant's ceiling and
deadlines, all as the engine receives them; a deadline that passes in the router queue is a
504, never a late answer; the `user` field as a session id when the file says so; requests/min
and tokens/min limits (429 + Retry-After + OpenAI's x-ratelimit-* headers), the tenants file
reloaded without a restart; bad values are 400s naming them."""

from __future__ import annotations

import asyncio
import os
import re
import time
from collections.abc import AsyncGenerator
from contextlib import AsyncExitStack, aclosing
from pathlib import Path
from typing import Any

import pytest
from tests.support.frontend_stack import COMPLETIONS, FrontendStack
from tests.support.smollm2 import smollm2_mocker

from tandem.engines.mocker.engine import MockerEngine
from tandem.protocols.engine import EngineOutput, PreprocessedRequest
from tandem.router.config import RouterConfig

pytestmark = pytest.mark.timeout(60)
MODEL = "smollm2"
ADMIN = "sk-operator-key"


def tenants_yaml(tmp_path: Path, *, acme_rpm: int = 1000, extra: str = "") -> str:
    return f"""
limits_db: {tmp_path / "limits.sqlite"}
tenants:
  default: {{}}
  acme:
    weight: 2
    max_priority: normal
    requests_per_minute: {acme_rpm}
    api_keys: [sk-acme-key-1]
  tiny:
    tokens_per_minute: 100
    api_keys: [sk-tiny-key-1]
{extra}"""


def body(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": [1000 + i for i in range(40)], "max_tokens": 2, **fields}


class EngineTap:
    """Wraps a mocker's `generate`: records every request the engine is given (`seen`, its
    tenant, class, deadline and session as the frontend stamped them) and, while `running` is
    clear, holds each before its first step (a busy worker); `arrived` is set on each."""

    def __init__(self, engine: MockerEngine) -> None:
        self.seen: list[PreprocessedRequest] = []
        self.running, self.arrived = asyncio.Event(), asyncio.Event()
        self.running.set()
        self._generate = engine.generate
        engine.generate = self.generate  # type: ignore[method-assign]

    async def generate(
        self, request: PreprocessedRequest, **kwargs: Any
    ) -> AsyncGenerator[EngineOutput, None]:
        self.seen.append(request)
        self.arrived.set()
        await self.running.wait()
        async with aclosing(self._generate(request, **kwargs)) as outputs:
            async for out in outputs:
                yield out


async def start(
    stack: AsyncExitStack, tmp_path: Path, text: str, **config: Any
) -> tuple[FrontendStack, Path, EngineTap]:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    s = FrontendStack(stack)
    engine = smollm2_mocker(MODEL)
    tap = EngineTap(engine)
    await s.add_worker(engine)
    await s.start_frontend(
        body(),
        ready_path=COMPLETIONS,
        api_keys=("sk-user-key",),
        admin_api_keys=(ADMIN,),
        tenants_file=path,
        **config,
    )
    tap.seen.clear()  # the ready requests
    return s, path, tap


def as_key(s: FrontendStack, key: str, **headers: str) -> None:
    s.headers = {"authorization": f"Bearer {key}", **headers}


async def metrics_text(s: FrontendStack) -> str:
    assert s.http is not None
    async with s.http.get(
        f"{s.base}/metrics", headers={"authorization": f"Bearer {ADMIN}"}
    ) as resp:
        return await resp.text()


def session_hits(metrics: str) -> float:
    pattern = r"^tandem_router_session_hits_total\{[^}]*\} (\S+)$"
    return sum(float(v) for v in re.findall(pattern, metrics, re.M))


async def test_tenant_identity_priority_and_bad_values(tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        s, _, tap = await start(stack, tmp_path, tenants_yaml(tmp_path))
        as_key(s, "sk-acme-key-1")  # a key only the tenants file lists is a valid API key
        status, _, _ = await s.post(COMPLETIONS, body(priority=1))
        assert status == 200
        # the body's class (vLLM's `priority`) reaches the engine, as the key's tenant's
        assert (tap.seen[-1].tenant, tap.seen[-1].priority) == ("acme", 1)
        # the key's tenant wins over a header naming another
        as_key(s, "sk-acme-key-1", **{"x-tenant-id": "tiny"})
        assert (await s.post(COMPLETIONS, body()))[0] == 200
        assert s.http is not None
        async with s.http.get(f"{s.base}/metrics", headers=s.headers) as resp:
            metrics = await resp.text()
        assert re.search(r'tandem_router_tenant_routed_tokens_total\{[^}]*tenant="acme"', metrics)
        assert 'tenant="tiny"' not in metrics

        status, reply, _ = await s.post(COMPLETIONS, body(priority=-1))  # above its ceiling
        assert status == 400 and "above tenant 'acme'" in reply["error"]["message"]
        assert reply["error"]["param"] == "priority"
        status, reply, _ = await s.post(COMPLETIONS, body(priority=7))
        assert status == 400 and "unknown priority class 7" in reply["error"]["message"]
        assert "0 (normal)" in reply["error"]["message"]
        as_key(s, ADMIN, **{"x-tandem-priority": "urgent"})
        status, reply, _ = await s.post(COMPLETIONS, body())
        assert status == 400 and reply["error"]["param"] == "x-tandem-priority"
        as_key(s, ADMIN, **{"x-tenant-id": "nobody"})
        status, reply, _ = await s.post(COMPLETIONS, body())
        assert status == 400 and "unknown tenant 'nobody'" in reply["error"]["message"]
        for bad in ("soon", "0", "-5", "1e3"):
            as_key(s, ADMIN, **{"x-tandem-deadline-ms": bad})
            status, reply, _ = await s.post(COMPLETIONS, body())
            assert status == 400 and reply["error"]["param"] == "x-tandem-deadline-ms", bad
        as_key(s, ADMIN, **{"x-tenant-id": "tiny", "x-tandem-priority": "high"})
        assert (await s.post(COMPLETIONS, body()))[0] == 200  # header tenant, its ceiling high
        assert (tap.seen[-1].tenant, tap.seen[-1].priority) == ("tiny", -1)
        # a header deadline (ms from arrival) replaces the frontend's 600 s request timeout
        as_key(s, ADMIN, **{"x-tandem-deadline-ms": "5000"})
        sent_s = time.time()
        assert (await s.post(COMPLETIONS, body()))[0] == 200
        deadline_s = tap.seen[-1].deadline_s
        assert deadline_s is not None and sent_s + 5 <= deadline_s <= time.time() + 5
        # a session's second turn goes back to its worker (the router counts the hit)
        as_key(s, ADMIN, **{"x-session-id": "agent-1"})
        assert [(await s.post(COMPLETIONS, body()))[0] for _ in range(2)] == [200, 200]
        async with s.http.get(f"{s.base}/metrics", headers=s.headers) as resp:
            metrics = await resp.text()
        assert re.search(r"tandem_router_session_hits_total\{[^}]*\} 1", metrics), metrics
        async with s.http.get(f"{s.base}/dashboard/state", headers=s.headers) as resp:
            (pool,) = (await resp.json())["models"][0]["router"]["pools"]
        assert pool["tenant_tokens"]["acme"] > 0 and pool["sessions"]["hits"] == 1


async def test_limits_answer_429_with_openai_headers_and_reload(tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        s, path, _ = await start(stack, tmp_path, tenants_yaml(tmp_path, acme_rpm=2))
        as_key(s, "sk-acme-key-1")
        statuses = []
        for _ in range(3):
            status, reply, headers = await s.post(COMPLETIONS, body())
            statuses.append(status)
        assert statuses == [200, 200, 429]
        assert "reached its limit of 2 requests/min" in reply["error"]["message"]
        assert int(headers["Retry-After"]) >= 1
        assert headers["x-ratelimit-limit-requests"] == "2"
        assert headers["x-ratelimit-remaining-requests"] == "0"
        assert headers["x-ratelimit-reset-requests"].endswith("s")

        # tokens/min: a 40-token prompt fits tiny's 100 twice, not three times
        as_key(s, "sk-tiny-key-1")
        codes = [(await s.post(COMPLETIONS, body()))[0] for _ in range(3)]
        assert codes == [200, 200, 429]
        assert s.http is not None
        async with s.http.get(
            f"{s.base}/metrics", headers={"authorization": f"Bearer {ADMIN}"}
        ) as resp:
            metrics = await resp.text()
        assert (
            'tandem_frontend_tenant_rate_limited_total{tenant="acme",limit="requests"} 1' in metrics
        )
        assert (
            'tandem_frontend_tenant_rate_limited_total{tenant="tiny",limit="tokens"} 1' in metrics
        )
        assert 'tandem_frontend_tenant_tokens_total{tenant="tiny",kind="prompt"} 80' in metrics

        # a reload raises acme's limit without a restart; a broken file keeps it in force
        path.write_text(tenants_yaml(tmp_path, acme_rpm=100000))
        os.utime(path, ns=(1, 10**18))
        as_key(s, "sk-acme-key-1")
        async with asyncio.timeout(10):
            while (await s.post(COMPLETIONS, body()))[0] != 200:  # noqa: ASYNC110 - over HTTP
                await asyncio.sleep(0.2)
        path.write_text("tenants: [not, a, mapping]")
        os.utime(path, ns=(1, 2 * 10**18))
        await asyncio.sleep(1.2)
        assert (await s.post(COMPLETIONS, body()))[0] == 200  # still acme's key, still valid


async def test_without_a_tenants_file_the_headers_still_hold(tmp_path: Path) -> None:
    """No --tenants-file: every request is the default tenant's, but a class, a deadline or a
    tenant named in a header is honoured or refused, never silently ignored."""
    async with AsyncExitStack() as stack:
        s = FrontendStack(stack)
        await s.add_worker(smollm2_mocker(MODEL))
        await s.start_frontend(body(), ready_path=COMPLETIONS)
        s.headers = {"x-tandem-priority": "low", "x-session-id": "s1"}
        assert (await s.post(COMPLETIONS, body()))[0] == 200
        s.headers = {"x-tandem-deadline-ms": "soon"}
        status, reply, _ = await s.post(COMPLETIONS, body())
        assert status == 400 and reply["error"]["param"] == "x-tandem-deadline-ms"
        s.headers = {"x-tenant-id": "acme"}
        status, reply, _ = await s.post(COMPLETIONS, body())
        assert status == 400 and "no tenants are configured" in reply["error"]["message"]


async def test_a_deadline_that_passes_in_the_router_queue_is_a_504_not_a_late_answer(
    tmp_path: Path,
) -> None:
    """The router gives its one worker one request at a time; a request whose
    x-tandem-deadline-ms passes while it waits behind a held one is answered 504 at its
    deadline, not served once the worker frees up."""
    async with AsyncExitStack() as stack:
        router = RouterConfig(busy_inflight_requests=1, queue_size=8)
        s, _, tap = await start(stack, tmp_path, tenants_yaml(tmp_path), router=router)
        as_key(s, "sk-acme-key-1")
        tap.running.clear()
        tap.arrived.clear()
        holder = asyncio.create_task(s.post(COMPLETIONS, body()))
        await asyncio.wait_for(tap.arrived.wait(), 10)  # the worker is busy with it
        as_key(s, "sk-acme-key-1", **{"x-tandem-deadline-ms": "300"})
        queued = asyncio.create_task(s.post(COMPLETIONS, body()))
        try:
            await asyncio.wait({queued}, timeout=10)
            answered_while_busy = queued.done()
        finally:
            tap.running.set()  # a late answer (the deadline ignored) comes now, as a 200
        status, reply, _ = await queued
        assert status == 504, reply
        assert answered_while_busy
        message = reply["error"]["message"]
        assert reply["error"]["type"] == "timeout"
        assert "missed its deadline after" in message and "in the router queue" in message
        assert "it was not served late" in message
        assert (await holder)[0] == 200
        assert len(tap.seen) == 1  # the engine never saw the late request
        pattern = r'tandem_router_tenant_deadline_misses_total\{[^}]*tenant="acme"[^}]*\} 1'
        assert re.search(pattern, await metrics_text(s))


@pytest.mark.parametrize("configured", [True, False])
async def test_the_user_field_is_a_session_only_with_session_from_user(
    tmp_path: Path, configured: bool
) -> None:
    """`session_from_user: true` in the tenants file: the body's `user` binds a session, and
    its second turn is a session hit at the router; without it `user` binds nothing."""
    extra = f"session_from_user: {str(configured).lower()}"
    async with AsyncExitStack() as stack:
        s, _, tap = await start(stack, tmp_path, tenants_yaml(tmp_path, extra=extra))
        as_key(s, "sk-acme-key-1")
        for _ in range(2):
            assert (await s.post(COMPLETIONS, body(user="agent-7")))[0] == 200
        session = "agent-7" if configured else None
        assert [r.session_id for r in tap.seen] == [session, session]
        assert session_hits(await metrics_text(s)) == (1 if configured else 0)
