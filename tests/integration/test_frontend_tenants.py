"""Tenants at the HTTP edge (issue 33), on a frontend and a mocker worker in one process: an
API key's tenant, the x-tenant-id header, priority classes capped by the tenant's ceiling,
deadlines, requests/min and tokens/min limits (429 + Retry-After + OpenAI's x-ratelimit-*
headers), the tenants file reloaded without a restart; bad values are 400s naming them."""

from __future__ import annotations

import asyncio
import os
import re
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from tests.support.frontend_stack import COMPLETIONS, FrontendStack
from tests.support.smollm2 import smollm2_gguf

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine

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


async def start(stack: AsyncExitStack, tmp_path: Path, text: str) -> tuple[FrontendStack, Path]:
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    s = FrontendStack(stack)
    await s.add_worker(
        MockerEngine(
            MockerConfig(
                num_blocks=256,
                block_size=16,
                speedup_ratio=0,
                tokenizer=f"gguf:{smollm2_gguf()}",
                model_name=MODEL,
            )
        )
    )
    await s.start_frontend(
        body(),
        ready_path=COMPLETIONS,
        api_keys=("sk-user-key",),
        admin_api_keys=(ADMIN,),
        tenants_file=path,
    )
    return s, path


def as_key(s: FrontendStack, key: str, **headers: str) -> None:
    s.headers = {"authorization": f"Bearer {key}", **headers}


async def test_tenant_identity_priority_and_bad_values(tmp_path: Path) -> None:
    async with AsyncExitStack() as stack:
        s, _ = await start(stack, tmp_path, tenants_yaml(tmp_path))
        as_key(s, "sk-acme-key-1")  # a key only the tenants file lists is a valid API key
        status, _, _ = await s.post(COMPLETIONS, body(priority=1))
        assert status == 200
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
        s, path = await start(stack, tmp_path, tenants_yaml(tmp_path, acme_rpm=2))
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
        await s.add_worker(
            MockerEngine(
                MockerConfig(num_blocks=256, block_size=16, speedup_ratio=0,
                             tokenizer=f"gguf:{smollm2_gguf()}", model_name=MODEL)
            )
        )  # fmt: skip
        await s.start_frontend(body(), ready_path=COMPLETIONS)
        s.headers = {"x-tandem-priority": "low", "x-session-id": "s1"}
        assert (await s.post(COMPLETIONS, body()))[0] == 200
        s.headers = {"x-tandem-deadline-ms": "soon"}
        status, reply, _ = await s.post(COMPLETIONS, body())
        assert status == 400 and reply["error"]["param"] == "x-tandem-deadline-ms"
        s.headers = {"x-tenant-id": "acme"}
        status, reply, _ = await s.post(COMPLETIONS, body())
        assert status == 400 and "no tenants are configured" in reply["error"]["message"]
