"""The Ray connector: a local Ray head on 127.0.0.1 (2 CPUs, no dashboard), workers as Ray
actors running `tandem worker --engine mocker`; the planner scales them up under load and
drains them back to the floor."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from tests.support.eventually import eventually
from tests.support.planner_stack import PlannerStack, planner_config

from tandem.planner.config import PoolConfig
from tandem.runtime.config import RuntimeConfig

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(180)]

WORKER_ARGS = ["--engine", "mocker", "--block-size", "16", "--num-blocks", "4096",
               "--max-num-batched-tokens", "2048", "--log-level", "WARNING"]  # fmt: skip


async def test_ray_connector_scales_a_mocker_fleet_up_and_down_under_load(tmp_path: Path) -> None:
    from tandem.planner.connector.ray import RayConnector

    rc = RuntimeConfig(namespace="planray", discovery="file",
                       discovery_dir=str(tmp_path / "discovery"), events="zmq")  # fmt: skip
    ray_dir = tempfile.mkdtemp(prefix="tray")  # short: Ray's socket paths must fit 107 bytes
    async with AsyncExitStack() as stack:
        stack.callback(shutil.rmtree, ray_dir, True)
        s = PlannerStack(stack, rc)
        await s.start_frontend()
        cfg = planner_config(pools=(PoolConfig(min_workers=1, max_workers=3),),
                             ready_timeout_s=60.0, cooldown_down_s=1.5)  # fmt: skip
        service = await s.start_planner(
            cfg,
            connector=lambda rt: RayConnector(rt.config, {"backend": WORKER_ARGS},
                                              drain_grace_s=30.0,
                                              ray_init={"_temp_dir": ray_dir}),
        )  # fmt: skip
        assert ray.is_initialized()
        await eventually(lambda: s.ready() == 1, timeout_s=60)
        await s.wait_serving()
        load = asyncio.create_task(s.load(rate=60, duration_s=10, prompt_len=600, max_tokens=30))
        await eventually(lambda: s.ready() >= 2, timeout_s=40)
        await load
        assert s.failures == []
        await eventually(lambda: s.ready() == 1, timeout_s=40)
        await eventually(lambda: len(s.connector.actors) == 1, timeout_s=30)  # drained: gone
        assert [a for t in service.timeline for a in t.actions if a.kind == "remove"]
    assert not ray.is_initialized()  # the connector stopped the head it started
