"""The local connector: the planner starts `tandem worker --engine mocker` processes under load
and drains them (SIGTERM) when it falls, over file discovery and the ZMQ event plane."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from tests.support.eventually import eventually
from tests.support.planner_stack import PlannerStack, planner_config

from tandem.planner.config import PoolConfig
from tandem.planner.connector.local import LocalConnector
from tandem.runtime.config import RuntimeConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(120)]

WORKER_ARGS = ["--engine", "mocker", "--block-size", "16", "--num-blocks", "4096",
               "--max-num-batched-tokens", "2048", "--log-level", "WARNING"]  # fmt: skip


async def test_local_connector_scales_a_mocker_fleet_up_and_down_under_load(
    tmp_path: Path,
) -> None:
    rc = RuntimeConfig(namespace="plan", discovery="file",
                       discovery_dir=str(tmp_path / "discovery"), events="zmq")  # fmt: skip
    async with AsyncExitStack() as stack:
        s = PlannerStack(stack, rc)
        await s.start_frontend()
        cfg = planner_config(pools=(PoolConfig(min_workers=1, max_workers=3),),
                             ready_timeout_s=30.0, cooldown_down_s=1.5)  # fmt: skip
        service = await s.start_planner(
            cfg,
            connector=lambda rt: LocalConnector(rt.config, {"backend": WORKER_ARGS},
                                                drain_grace_s=30.0, log_dir=str(tmp_path)),
        )  # fmt: skip
        await eventually(lambda: s.ready() == 1, timeout_s=30)
        await s.wait_serving()
        load = asyncio.create_task(s.load(rate=60, duration_s=10, prompt_len=600, max_tokens=30))
        await eventually(lambda: s.ready() >= 2, timeout_s=30)
        await load
        assert s.failures == []
        await eventually(lambda: s.ready() == 1, timeout_s=30)
        await eventually(lambda: len(s.connector.procs) == 1, timeout_s=30)  # drained ones exited
        removes = [a for t in service.timeline for a in t.actions if a.kind == "remove"]
        assert removes
