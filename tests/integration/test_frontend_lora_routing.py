"""LoRA routing through a frontend and real Workers (issue 32), in one process: the router
learns residency from the workers' LoraEvents, sends an adapter's requests to its holder,
and when no worker holds it places it by rendezvous hashing on the worker the frontend's own
load would pick; that worker loads it on demand. Memory discovery and events, TCP request
plane, mocker workers with adapter slots."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from tests.integration.test_frontend_lora import LOAD, adapter_dir, chat, engine_of, started
from tests.support.frontend_stack import CHAT

from tandem.frontend.lora_config import LoraApiConfig

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def stack() -> AsyncIterator[AsyncExitStack]:
    async with AsyncExitStack() as s:
        yield s


async def test_requests_follow_the_holder_and_a_miss_is_placed_where_it_was(
    stack: AsyncExitStack, tmp_path: Path
) -> None:
    adapter_dir(tmp_path, "sql")
    fs, workers = await started(
        stack,
        workers=4,
        max_loras=2,
        router_policy="kv",
        lora=LoraApiConfig(lora_dir=str(tmp_path)),
        admin_api_keys=("admin",),
    )
    fs.headers = {"authorization": "Bearer admin"}  # the load and route/explain are admin's
    status, _, _ = await fs.post(LOAD, {"lora_name": "sql", "lora_path": "sql"})
    assert status == 200
    (holder,) = [w for w in workers if engine_of(w).loras() == ["sql"]]
    for w in workers:
        engine_of(w).lora_names.clear()
    for _ in range(6):
        status, _, _ = await fs.post(CHAT, chat("sql"))
        assert status == 200
    seen = {w.instance_id: engine_of(w).lora_names.count("sql") for w in workers}
    assert seen[holder.instance_id] == 6 and sum(seen.values()) == 6, seen
    status, explain, _ = await fs.post("/v1/route/explain", chat("sql"))
    assert status == 200 and explain["lora"]["holders"] == [holder.instance_id]
    assert explain["lora"]["residency"][holder.instance_id]["resident"] == ["sql"]

    # the worker drops it (its event reaches the router); the next request is a miss, placed
    # by rendezvous hashing on the same worker, which loads it from the catalog on demand
    assert holder.loras is not None
    await holder.loras.unload("sql")
    status, explain, _ = await fs.post("/v1/route/explain", chat("sql"))
    assert explain["lora"]["holders"] == [] and explain["lora"]["reason"] == "placed"
    assert explain["lora"]["allowed"] == [holder.instance_id]
    status, _, _ = await fs.post(CHAT, chat("sql"))
    assert status == 200 and engine_of(holder).loras() == ["sql"]
    _, metrics = await fs.get("/metrics")
    assert 'tandem_router_lora_requests_total{adapter="sql"' in metrics
