"""Disaggregated pools scaled live: the planner (load mode) owns a prefill pool and a decode
pool of `tandem worker --engine mocker --disagg-mode ...` processes (local connector, file
discovery, ZMQ events), the frontend splits each request over them (prefill-first), and under
load each pool grows on its own signal (prefill: TTFT, decode: ITL) and shrinks after."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from tests.support.eventually import eventually
from tests.support.planner_stack import PlannerStack, planner_config

from tandem.disagg.config import DisaggRouteConfig
from tandem.planner.config import PoolConfig
from tandem.planner.connector.local import LocalConnector
from tandem.runtime.config import RuntimeConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(120)]

COMMON = ["--engine", "mocker", "--block-size", "16", "--num-blocks", "4096",
          "--max-num-batched-tokens", "2048", "--disagg-transfer-backends", "shm,tcp",
          "--log-level", "WARNING"]  # fmt: skip
ARGV = {
    "prefill": [*COMMON, "--disagg-mode", "prefill"],
    "backend": [*COMMON, "--disagg-mode", "decode"],
}


async def test_prefill_and_decode_pools_scale_up_and_down_live_under_load(
    tmp_path: Path,
) -> None:
    rc = RuntimeConfig(namespace="plandis", discovery="file",
                       discovery_dir=str(tmp_path / "discovery"), events="zmq")  # fmt: skip
    async with AsyncExitStack() as stack:
        s = PlannerStack(stack, rc)
        await s.start_frontend(disagg=DisaggRouteConfig(enabled=True))
        pools = (
            PoolConfig(component="prefill", kind="prefill", min_workers=1, max_workers=2),
            PoolConfig(component="backend", kind="decode", min_workers=1, max_workers=2),
        )
        cfg = planner_config(pools=pools, ttft_target_ms=150.0, itl_target_ms=12.0,
                             scale_down_margin=0.85, ready_timeout_s=30.0,
                             cooldown_down_s=1.5)  # fmt: skip
        service = await s.start_planner(
            cfg,
            connector=lambda rt: LocalConnector(rt.config, ARGV, drain_grace_s=30.0,
                                                log_dir=str(tmp_path)),
        )  # fmt: skip
        await eventually(lambda: s.ready("prefill") == 1 and s.ready("backend") == 1,
                         timeout_s=40)  # fmt: skip
        await s.wait_serving()
        peak = {"prefill": 0, "backend": 0}

        async def sample() -> None:
            while True:
                for pool in peak:
                    peak[pool] = max(peak[pool], s.ready(pool))
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        await s.load(rate=60, duration_s=8, prompt_len=1200, max_tokens=30)
        sampler.cancel()
        assert peak == {"prefill": 2, "backend": 2}, peak
        assert s.failures == []
        try:
            await eventually(lambda: s.ready("prefill") == 1 and s.ready("backend") == 1,
                             timeout_s=40)  # fmt: skip
        except TimeoutError:
            why = {c: p.last_reason for c, p in service.planner.pools.items()}
            raise AssertionError(f"pools did not shrink: {why}") from None
        actions = [(a.kind, a.component) for t in service.timeline for a in t.actions]
        for pool in ("prefill", "backend"):
            assert ("add", pool) in actions and ("remove", pool) in actions, actions
