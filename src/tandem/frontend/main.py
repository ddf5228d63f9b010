"""The `tandem frontend` process: the OpenAI HTTP frontend as its own process (discovers
workers): parse its flags, open the runtime, serve the frontend (`serve.py`) until
SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import contextlib

from tandem.errors import StartupError
from tandem.frontend.args import add_frontend_args, frontend_config_from_args
from tandem.frontend.config import FrontendConfig
from tandem.frontend.serve import serve_frontend
from tandem.runtime.args import runtime_config_from_args
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.flag_parser import parse_args
from tandem.runtime.process_setup import (
    add_log_format_arg,
    add_tracing_args,
    configure_logging,
    configure_tracing,
    run_async,
)
from tandem.runtime.runtime import open_runtime

DESCRIPTION = "`tandem frontend`: the OpenAI HTTP frontend as its own process (discovers workers)."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_frontend_args(parser)
    parser.add_argument("--log-level", default="INFO", help="logging level")
    add_log_format_arg(parser)
    add_tracing_args(parser, "tandem-frontend")


async def run_frontend(config: FrontendConfig, runtime_config: RuntimeConfig) -> None:
    """The `tandem frontend` process: open the runtime, serve until SIGTERM/SIGINT."""
    from tandem.runtime.lifecycle import install_signal_handlers

    stop = asyncio.Event()
    async with contextlib.AsyncExitStack() as resources:
        try:
            runtime = await resources.enter_async_context(open_runtime(runtime_config))
        except (OSError, ValueError) as exc:  # etcd or NATS not reachable, ...
            raise StartupError(f"cannot open the runtime: {exc}") from exc
        install_signal_handlers(stop)
        await serve_frontend(config, runtime, stop=stop)


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    configure_tracing(args)
    config, runtime_config = frontend_config_from_args(args), runtime_config_from_args(args)
    with contextlib.suppress(KeyboardInterrupt):
        run_async(run_frontend(config, runtime_config))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem frontend", description=DESCRIPTION)
    add_arguments(parser)
    return run(parse_args(parser, argv))
