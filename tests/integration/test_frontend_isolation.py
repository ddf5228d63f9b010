"""KV isolation (issue 33): a request's `cache_salt` (vLLM's field, on chat, completions and
responses) and a tenant configured `isolated` never share KV blocks with other salts: not in
the router's index (`/v1/route/explain` overlap), not in the engine's prefix cache (usage's
cached tokens), not in the KV tiers (blocks offloaded to the mocker's simulated host tier still
credit the salt or tenant that wrote them, never another salt or tenant)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from tests.support.frontend_stack import FrontendStack
from tests.support.smollm2 import smollm2_gguf

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.kvbm.base import KvbmConfig
from tandem.router.config import RouterConfig

pytestmark = pytest.mark.timeout(90)
MODEL = "smollm2"
ADMIN = "sk-admin-isolation"
PROMPT = list(range(300, 364))  # 4 full blocks of 16
OPEN_PROMPT = list(range(700, 764))  # sent by tenant open only
ISO_PROMPT = list(range(800, 864))  # sent by tenant iso only


async def _until(pred: Callable[[], Awaitable[bool]], timeout_s: float = 30.0) -> None:
    """Poll an HTTP-observed condition (KV events reach the router's index asynchronously)."""
    async with asyncio.timeout(timeout_s):
        while not await pred():  # noqa: ASYNC110 - observed over HTTP
            await asyncio.sleep(0.02)


def _body(prompt: list[int] = PROMPT, **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 1, **extra}


async def test_salts_and_isolated_tenants_share_no_blocks_in_router_engine_or_tiers(
    tmp_path: Path,
) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text("tenants:\n  iso:\n    isolated: true\n  open: {}\n")
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        tiers = KvbmConfig(host_blocks=256, log_interval_s=0)
        await s.add_worker(
            MockerEngine(MockerConfig(num_blocks=16, block_size=16, speedup_ratio=0,
                                      tokenizer=f"gguf:{smollm2_gguf()}", kvbm=tiers))
        )  # fmt: skip
        await s.start_frontend(
            _body(), ready_path="/v1/completions", router_policy="kv",
            router=RouterConfig(seed=1), admin_api_keys=(ADMIN,), tenants_file=tenants,
        )  # fmt: skip
        s.headers = {"authorization": f"Bearer {ADMIN}"}

        async def overlap(tenant: str = "open", **extra: Any) -> float:
            s.headers["x-tenant-id"] = tenant
            status, body, _ = await s.post("/v1/route/explain", _body(**extra))
            assert status == 200, body
            return float(max(c["overlap_blocks"] for c in body["candidates"]))

        async def cached(tenant: str = "open", **extra: Any) -> int:
            s.headers["x-tenant-id"] = tenant
            status, body, _ = await s.post("/v1/completions", _body(**extra))
            assert status == 200, body
            return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])

        async def indexed() -> bool:
            return await overlap() == 4

        await _until(indexed)  # the ready request cached the prompt, unsalted
        # the router's index: a salted or isolated request finds none of it
        assert await overlap(cache_salt="alice") == 0
        assert await overlap("iso") == 0
        # the engine's prefix cache: likewise, while the unsalted prompt hits
        assert await cached(cache_salt="alice") == 0
        assert await cached("iso") == 0
        assert await cached("iso", cache_salt="alice") == 0  # iso's own salt, not alice's
        assert await cached() > 0
        assert await cached(cache_salt="alice") > 0  # one salt shares with itself
        # each tenant caches a prompt the other never sends
        assert await cached(prompt=OPEN_PROMPT) == 0
        assert await cached("iso", prompt=ISO_PROMPT) == 0
        # the host tier: churn the 16-block device pool so every block above is offloaded
        for i in range(6):
            other = list(range(1000 + 64 * i, 1064 + 64 * i))
            assert (await s.post("/v1/completions", _body(other)))[0] == 200

        def offloaded(tenant: str = "open", **extra: Any) -> Callable[[], Awaitable[bool]]:
            async def pred() -> bool:
                return 0 < await overlap(tenant, **extra) < 4  # host blocks: partial credit

            return pred

        await _until(offloaded())
        await _until(offloaded(prompt=OPEN_PROMPT))
        await _until(offloaded("iso", prompt=ISO_PROMPT))  # iso's own blocks, in the tier
        assert await overlap(cache_salt="bob") == 0
        assert await overlap("iso", cache_salt="bob") == 0
        # neither tenant matches the other's offloaded blocks of an identical prompt
        assert await overlap(prompt=ISO_PROMPT) == 0
        assert await overlap("iso", prompt=OPEN_PROMPT) == 0
        assert await cached(cache_salt="bob") == 0
        assert await cached(prompt=ISO_PROMPT) == 0
        assert await cached("iso", prompt=OPEN_PROMPT) == 0
        assert await cached("iso", prompt=ISO_PROMPT) > 0  # onboarded from the host tier
        # a client cannot name an isolated tenant's salt
        s.headers["x-tenant-id"] = "open"
        status, err, _ = await s.post("/v1/completions", _body(cache_salt="\x00tenant:iso"))
        assert status == 400 and err["error"]["param"] == "cache_salt"
