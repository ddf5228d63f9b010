"""`tandem <command>`: each command lives in `tandem.cli.<command>`, or in the `main.py` of
a service package with its own entry point (`ENTRY_POINTS`: `tandem frontend` is
`tandem.frontend.main`, also `python -m tandem.frontend`), and exposes either
`add_arguments(parser)` + `run(args) -> int`, or `main(argv) -> int` (commands with their own
sub-commands, like `bench`). Modules are imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

from tandem.errors import StartupError
from tandem.runtime.flag_parser import parse_args

EXIT_STARTUP_FAILED = 1

COMMANDS = {
    "serve": "all-in-one on one host: frontend + N workers",
    "frontend": "OpenAI HTTP frontend (discovers workers)",
    "worker": "a worker process hosting one engine",
    "router": "standalone KV-aware router service",
    "planner": "adds and drains workers to meet TTFT/ITL targets (local processes, Ray)",
    "profile": "measure an engine over a grid of ISL and batch/context sizes -> profile JSON",
    "global-router": "sends each request to the pool that meets its latency target",
    "convert": "write a GGUF model as a HF safetensors folder (for vLLM)",
    "bench": "benchmarks: load generator, indexer, engine, transfer",
}
# commands whose package has its own process entry point: command -> its module
ENTRY_POINTS = {"frontend": "tandem.frontend.main"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser = argparse.ArgumentParser(prog="tandem", description="tandem LLM inference server")
        sub = parser.add_subparsers(dest="command", metavar="COMMAND")
        for name, help_ in COMMANDS.items():
            sub.add_parser(name, help=help_)
        if argv and argv[0] not in ("-h", "--help"):
            parser.error(
                f"unknown command '{argv[0]}'; expected one of: {', '.join(sorted(COMMANDS))}"
            )
        parser.print_help()
        return 0 if argv else 2
    try:
        return _run_command(argv[0], argv[1:])
    except StartupError as exc:  # one clear line, no traceback (issue 12: start-up truth)
        print(f"tandem {argv[0]}: error: {exc}", file=sys.stderr, flush=True)
        return EXIT_STARTUP_FAILED


def _run_command(command: str, argv: list[str]) -> int:
    module = importlib.import_module(command_module(command))
    if hasattr(module, "main"):
        return int(module.main(argv) or 0)
    parser = argparse.ArgumentParser(prog=f"tandem {command}", description=COMMANDS[command])
    module.add_arguments(parser)
    args = parse_args(parser, argv)
    return int(module.run(args) or 0)


def command_module(command: str) -> str:
    """The module that implements `tandem <command>`."""
    return ENTRY_POINTS.get(command) or f"tandem.cli.{command.replace('-', '_')}"


if __name__ == "__main__":
    raise SystemExit(main())
