"""`tandem frontend`: the OpenAI HTTP frontend as its own process (discovers workers)."""

from __future__ import annotations

import argparse

from tandem.runtime.flag_parser import parse_args
from tandem.runtime.process_setup import (
    add_log_format_arg,
    add_tracing_args,
    configure_logging,
    configure_tracing,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tandem.frontend.args import add_frontend_args

    add_frontend_args(parser)
    parser.add_argument("--log-level", default="INFO", help="logging level")
    add_log_format_arg(parser)
    add_tracing_args(parser, "tandem-frontend")


def run(args: argparse.Namespace) -> int:
    from tandem.frontend.args import frontend_config_from_args
    from tandem.frontend.main import run as run_frontend
    from tandem.runtime.args import runtime_config_from_args

    configure_logging(args.log_level, args.log_format)
    configure_tracing(args)
    return run_frontend(frontend_config_from_args(args), runtime_config_from_args(args))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tandem frontend", description=__doc__)
    add_arguments(parser)
    return run(parse_args(parser, argv))
