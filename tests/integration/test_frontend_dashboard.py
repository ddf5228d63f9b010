"""`/dashboard/state` is built from the frontend's live objects (registry, routers, prefill
pool, health) and guarded like an operator view; `/dashboard` is the static page. In one
process: memory discovery/events, TCP request plane, mocker workers."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from tests.integration.test_frontend_health_auth import MODEL, cluster
from tests.support.eventually import eventually

from tandem.disagg.config import DisaggRouteConfig

pytestmark = pytest.mark.timeout(60)
PROMPT = " ".join(f"w{i}" for i in range(60))  # several 16-token blocks


async def _state(c: Any, **kw: Any) -> dict[str, Any]:
    status, _, raw = await c.get("/dashboard/state", **kw)
    assert status == 200, raw
    return dict(json.loads(raw))


async def _poll_state(c: Any, pred: Any, timeout_s: float = 10.0) -> dict[str, Any]:
    """The first state `pred` accepts (polled every 20 ms)."""
    async with asyncio.timeout(timeout_s):
        while not pred(state := await _state(c)):  # noqa: ASYNC110 - state of several tasks
            await asyncio.sleep(0.02)
    return state


async def _complete(c: Any, suffix: str) -> str:
    status, _, raw = await c.get(
        "/v1/completions",
        method="POST",
        json={"model": MODEL, "prompt": PROMPT + suffix, "max_tokens": 2},
    )
    assert status == 200, raw
    return str(json.loads(raw)["id"])


async def test_state_shows_workers_decisions_and_hit_rates() -> None:
    async with cluster() as c:
        workers = [await c.add_worker(), await c.add_worker()]
        await c.start_frontend(router_policy="kv")
        ids = {w.instance_id for w in workers}
        status, headers, page = await c.get("/dashboard")
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert b"/dashboard/state" in page and b"<script" in page

        state = await _poll_state(
            c, lambda s: bool(s["models"]) and len(s["models"][0]["workers"]) == 2
        )
        rows = state["models"][0]["workers"]
        assert {r["instance_id"] for r in rows} == ids
        assert {r["role"] for r in rows} == {"aggregated"}
        assert all(r["total_blocks"] == 256 and r["routed"] == 0 for r in rows)
        # issue 32: each mocker worker's LoRA slots (--max-loras 4) and resident adapters
        assert all(r["loras"] == {"resident": [], "slots": 4} for r in rows)

        first = await _complete(c, " a")
        await eventually(lambda: any(w.engine.load().num_cached_blocks for w in workers))
        second = await _complete(c, " b")
        state = await _poll_state(
            c, lambda s: sum(r["cached_blocks"] or 0 for r in s["models"][0]["workers"]) > 0
        )
        model = state["models"][0]
        decisions = {d["request_id"]: d for d in model["decisions"]}
        assert set(decisions) == {first, second}
        assert decisions[second]["worker_id"] == decisions[first]["worker_id"]  # prefix reuse
        assert decisions[second]["overlap_blocks"] > 0
        assert {x["worker_id"] for x in decisions[second]["candidates"]} == ids
        assert model["router"]["policy"] == "kv" and model["router"]["num_decisions"] == 2
        assert 0 < model["router"]["hit_rate"] < 1
        chosen = next(
            r for r in model["workers"] if r["instance_id"] == decisions[first]["worker_id"]
        )
        assert chosen["routed"] == 2 and chosen["hit_rate"] > 0
        assert (await _state(c))["frontend"]["inflight"] == 0


async def test_disaggregated_state_names_prefill_decode_and_encode_workers() -> None:
    async with cluster() as c:
        decode = await c.add_worker("backend")
        prefill = await c.add_worker("prefill")
        encoder = await c.add_worker("encoder")  # listed from discovery (ns.encoder.*)
        await c.start_frontend(disagg=DisaggRouteConfig(enabled=True))
        state = await _poll_state(c, lambda s: sum(len(m["workers"]) for m in s["models"]) == 3)
        roles = {r["instance_id"]: r["role"] for m in state["models"] for r in m["workers"]}
        assert roles == {
            decode.instance_id: "decode",
            prefill.instance_id: "prefill",
            encoder.instance_id: "encode",
        }


async def test_state_needs_the_admin_key_once_keys_are_configured() -> None:
    async with cluster() as c:
        await c.add_worker()
        await c.start_frontend(api_keys=("user-key",), admin_api_keys=("admin-key",))
        assert (await c.get("/dashboard"))[0] == 200  # the page carries no data
        assert (await c.get("/dashboard/state"))[0] == 401
        user = {"Authorization": "Bearer user-key"}
        assert (await c.get("/dashboard/state", headers=user))[0] == 401
        await _state(c, headers={"Authorization": "Bearer admin-key"})
    async with cluster() as c:
        await c.add_worker()
        await c.start_frontend(api_keys=("user-key",))
        status, _, raw = await c.get("/dashboard/state", headers=user)
        assert status == 403 and "--admin-api-key" in json.loads(raw)["error"]["message"]
