"""Wiring of `tandem planner`: runtime → connector → PlannerService, until SIGTERM/SIGINT.

`run_planner` also runs embedded (`tandem serve --planner`) with the caller's runtime.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os

from tandem.planner.args import planner_config_from_args, ray_options, worker_argv
from tandem.planner.config import PlannerConfig
from tandem.planner.connector.base import Connector
from tandem.planner.control_loop import PlannerService
from tandem.runtime.runtime import Runtime

logger = logging.getLogger(__name__)


def build_connector(ns: argparse.Namespace, config: PlannerConfig, runtime: Runtime) -> Connector:
    """The `--connector` named; its workers are `tandem worker` processes with `--worker-args`.
    Raises ValueError for another name (`inprocess` is built by tests, with engines)."""
    argv = worker_argv(config, ns.worker_args)
    if ns.connector == "local":
        from tandem.planner.connector.local import LocalConnector

        return LocalConnector(
            runtime.config,
            argv,
            drain_grace_s=ns.worker_drain_grace_s,
            log_dir=ns.worker_log_dir,
            guard_run_dir=getattr(ns, "worker_guard_run_dir", None),  # tandem serve --planner
        )
    if ns.connector == "ray":
        from tandem.planner.connector.ray import RayConnector

        return RayConnector(
            runtime.config,
            argv,
            drain_grace_s=ns.worker_drain_grace_s,
            log_dir=ns.worker_log_dir,
            **ray_options(ns, os.environ),  # type: ignore[arg-type]
        )
    raise ValueError(f"unknown connector '{ns.connector}'; expected one of: local, ray")


async def run_planner(
    ns: argparse.Namespace, runtime: Runtime, stop: asyncio.Event
) -> PlannerService:
    """Run the planner on `runtime` until `stop`; its connector's workers are drained on exit."""
    config = planner_config_from_args(ns)
    profile = None
    if config.profile_path is not None:
        from tandem.engines.profile import load_profile

        profile = load_profile(config.profile_path)
    connector = build_connector(ns, config, runtime)
    service = PlannerService(runtime, connector, config, profile=profile)
    await service.start()
    logger.info("planner ready: mode=%s pools=%s connector=%s", config.mode,
                ", ".join(p.component for p in config.pools), ns.connector)  # fmt: skip
    try:
        await service.run(stop)
    finally:
        await service.close()
        await connector.close()
    return service
