"""A scale-down chosen while the victim serves requests loses none: the planner (load mode,
local connector, real `tandem worker --engine mocker` processes) removes a worker that has
requests in flight; the worker unregisters, finishes them, then exits 0. Migration is off in
the frontend, so a request cut by the exit would fail: every request must end with its whole
answer (every token asked for, then [DONE])."""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import pytest
from tests.support.eventually import eventually
from tests.support.planner_stack import MODEL, PlannerStack, planner_config

from tandem.planner.config import PoolConfig
from tandem.planner.connector.local import LocalConnector
from tandem.planner.observation import PoolObservation
from tandem.planner.planner import ScaleAction
from tandem.runtime.config import RuntimeConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(120)]

WORKER_ARGS = ["--engine", "mocker", "--block-size", "16", "--num-blocks", "4096",
               "--max-num-batched-tokens", "2048", "--log-level", "WARNING"]  # fmt: skip
LONG_TOKENS = 400  # ~3 s of decode steps: the victim is mid-answer when it is chosen


async def _complete(s: PlannerStack, max_tokens: int, out: list[tuple[int, int, bool]]) -> None:
    """One streamed request: (status, completion tokens received, saw [DONE])."""
    assert s.http is not None
    prompt = [s.rng.randrange(100, 40000) for _ in range(32)]  # little KV: long but light
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    tokens, done = 0, False
    async with s.http.post(f"{s.base}/v1/completions", json=body) as resp:
        async for raw in resp.content:
            line = raw.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                usage = json.loads(line[6:]).get("usage")
                if usage:
                    tokens = usage["completion_tokens"]
        out.append((resp.status, tokens, done))


async def test_scale_down_of_a_busy_worker_drains_it_and_loses_no_request(
    tmp_path: Path,
) -> None:
    rc = RuntimeConfig(namespace="plandrain", discovery="file",
                       discovery_dir=str(tmp_path / "discovery"), events="zmq")  # fmt: skip
    async with AsyncExitStack() as stack:
        s = PlannerStack(stack, rc)
        await s.start_frontend(migration_limit=0)
        cfg = planner_config(pools=(PoolConfig(min_workers=1, max_workers=2),),
                             itl_target_ms=80.0, ready_timeout_s=30.0,
                             cooldown_down_s=1.0)  # fmt: skip
        procs: dict[str, Any] = {}

        def connector(rt: Any) -> LocalConnector:
            c = LocalConnector(rt.config, {"backend": WORKER_ARGS}, drain_grace_s=30.0,
                               log_dir=str(tmp_path))  # fmt: skip
            add = c.add_worker

            async def tracked(component: str) -> str:
                wid = await add(component)
                procs[wid] = c.procs[wid]
                return wid

            c.add_worker = tracked  # type: ignore[method-assign]
            return c

        service = await s.start_planner(cfg, connector=connector)
        decisions: list[tuple[PoolObservation, ScaleAction]] = []
        tick = service.planner.tick

        def recording(now: float, obs: dict[str, PoolObservation]) -> list[ScaleAction]:
            actions = tick(now, obs)
            decisions.extend((obs["backend"], a) for a in actions if a.kind == "remove")
            return actions

        service.planner.tick = recording  # type: ignore[method-assign]
        await eventually(lambda: s.ready() == 1, timeout_s=30)
        await s.wait_serving()
        # a burst makes the planner add a second worker ...
        burst = asyncio.create_task(s.load(rate=60, duration_s=4, prompt_len=600, max_tokens=30))
        await eventually(lambda: s.ready() == 2, timeout_s=30)
        # ... then a light stream of long answers keeps both busy while it chooses to drop one
        results: list[tuple[int, int, bool]] = []
        long_ones: list[asyncio.Task[None]] = []
        deadline = time.monotonic() + 40
        while not decisions and time.monotonic() < deadline:
            long_ones.append(asyncio.create_task(_complete(s, LONG_TOKENS, results)))
            await asyncio.sleep(0.2)
        await burst
        async with asyncio.timeout(60):
            await asyncio.gather(*long_ones)
        why = service.planner.pools["backend"].last_reason
        assert decisions, f"the planner never chose a scale-down: {why}"
        obs, remove = decisions[0]
        victim = next(w for w in obs.ready if w.worker_id == remove.worker_id)
        assert victim.num_inflight > 0, f"the victim was idle when chosen: {victim}"
        assert s.failures == []  # the burst's requests
        assert len(results) == len(long_ones)
        assert all(r == (200, LONG_TOKENS, True) for r in results), results
        # the victim drained: it left, after finishing its requests, with status 0
        proc = procs[remove.worker_id]
        async with asyncio.timeout(30):
            assert await proc.wait() == 0
        assert s.ready() == 1
