"""`tandem planner`: the planner service (DESIGN.md §11).

Watches the pools' workers and the frontends' request stats on the runtime's planes, and adds
or drains workers through a connector (`local`: `tandem worker` processes on this host; `ray`:
workers as Ray actors). The planes must reach other processes: file or etcd discovery, zmq or
nats events. Runs until SIGTERM/SIGINT, then drains the workers it started.
"""

from __future__ import annotations

import argparse
import asyncio
import os

from tandem.planner.args import add_planner_args
from tandem.runtime.args import add_runtime_args, runtime_config_from_args
from tandem.runtime.process_setup import add_log_format_arg, configure_logging, run_async


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_planner_args(parser)
    parser.add_argument("--log-level", default="INFO", help="logging level")
    add_log_format_arg(parser)
    add_runtime_args(parser)


async def serve(args: argparse.Namespace) -> None:
    from tandem.planner.main import run_planner
    from tandem.runtime.lifecycle import install_signal_handlers
    from tandem.runtime.runtime import open_runtime

    stop = asyncio.Event()
    install_signal_handlers(stop)
    async with open_runtime(runtime_config_from_args(args)) as runtime:
        await run_planner(args, runtime, stop)


def run(args: argparse.Namespace) -> int:
    from tandem.errors import ConfigError, StartupError
    from tandem.planner.args import ray_options

    try:  # a ray flag without --connector ray, a negative resource: one line, before anything
        ray_options(args, os.environ)
    except ConfigError as exc:
        raise StartupError(str(exc)) from exc
    configure_logging(args.log_level, args.log_format)
    run_async(serve(args))
    return 0
