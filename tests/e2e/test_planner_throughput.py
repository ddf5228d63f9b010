"""Throughput (SLA) mode closing the loop: the planner forecasts the frontends' measured rate
and sizes a fleet of `tandem worker --engine mocker` processes (local connector, file discovery
and ZMQ events) from an engine profile, up when the rate steps up and back to the floor when
it stops."""

from __future__ import annotations

import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from tests.support.eventually import eventually
from tests.support.planner_stack import PlannerStack, planner_config

from tandem.engines.profile import (
    DecodeGrid,
    EngineProfile,
    PrefillCurve,
    ProfileFile,
    load_profile,
)
from tandem.planner import throughput_mode
from tandem.planner.config import PoolConfig
from tandem.planner.connector.local import LocalConnector
from tandem.runtime.config import RuntimeConfig

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(150)]

WORKER_ARGS = ["--engine", "mocker", "--block-size", "16", "--num-blocks", "4096",
               "--max-num-batched-tokens", "2048", "--log-level", "WARNING"]  # fmt: skip
# an engine that takes 100 ms per 600-token prompt and 5 ms per decode step: one replica
# carries ~8 req/s within TTFT 1 s / ITL 50 ms (× the 0.7 margin), three carry ~20
PROFILE = EngineProfile(
    engine="mocker", model="smollm2", block_size=16, num_total_blocks=4096, max_num_seqs=256,
    max_num_batched_tokens=2048,
    prefill=PrefillCurve(isl=[128, 4096], ttft_ms=[100.0, 100.0]),
    decode=DecodeGrid(batch=[1, 256], context=[128, 4096], itl_ms=[[5.0, 5.0], [5.0, 5.0]]),
)  # fmt: skip
ISL, OSL = 600, 10


def _replicas(rate: float) -> int:
    f = throughput_mode.Forecast(request_rate=rate, isl=ISL, osl=OSL)
    return throughput_mode.replicas("aggregated", f, PROFILE, 1000.0, 50.0)


async def test_throughput_mode_follows_a_rate_step_up_and_down(tmp_path: Path) -> None:
    assert (_replicas(2.0), _replicas(20.0)) == (1, 3)  # what the profile says each phase needs
    profile_path = tmp_path / "profile.json"
    ProfileFile(profile_path).write(PROFILE)  # what `tandem planner --profile` would read
    rc = RuntimeConfig(namespace="plantp", discovery="file",
                       discovery_dir=str(tmp_path / "discovery"), events="zmq")  # fmt: skip
    async with AsyncExitStack() as stack:
        s = PlannerStack(stack, rc)
        await s.start_frontend()
        cfg = planner_config(mode="throughput", profile_path=str(profile_path),
                             predictor="moving_average", ttft_target_ms=1000.0,
                             itl_target_ms=50.0, interval_s=0.5, cooldown_up_s=1.0,
                             cooldown_down_s=1.0, ready_timeout_s=30.0,
                             pools=(PoolConfig(min_workers=1, max_workers=4),))  # fmt: skip
        service = await s.start_planner(
            cfg,
            connector=lambda rt: LocalConnector(rt.config, {"backend": WORKER_ARGS},
                                                drain_grace_s=30.0, log_dir=str(tmp_path)),
            profile=load_profile(profile_path),
        )  # fmt: skip
        await eventually(lambda: s.ready() == 1, timeout_s=30)
        await s.wait_serving()
        # low rate: the profile says one replica; the planner adds nothing
        await s.load(rate=2, duration_s=4, prompt_len=ISL, max_tokens=OSL)
        assert [a for t in service.timeline for a in t.actions if a.kind == "add"][1:] == []
        # the rate steps up ×10: the forecast follows and the fleet grows
        load = asyncio.create_task(s.load(rate=20, duration_s=10, prompt_len=ISL, max_tokens=OSL))
        await eventually(lambda: s.ready() >= 3, timeout_s=30)
        await load
        assert s.failures == []
        adds = [a for t in service.timeline for a in t.actions if a.kind == "add"][1:]
        assert len(adds) >= 2 and all(a.reason.startswith("forecast") for a in adds)
        # the rate falls to zero: back to the floor, drained workers gone
        await eventually(lambda: s.ready() == 1, timeout_s=40)
        await eventually(lambda: len(s.connector.procs) == 1, timeout_s=30)
        removes = [a for t in service.timeline for a in t.actions if a.kind == "remove"]
        assert removes and all(a.reason.startswith("forecast") for a in removes)
