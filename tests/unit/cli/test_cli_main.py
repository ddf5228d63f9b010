"""`tandem <command>` finds each command's module: `tandem.cli.<command>`, or the entry point of
a service package with its own (`tandem frontend` is `tandem.frontend.main`, as
`python -m tandem.frontend` is)."""

from __future__ import annotations

import argparse
import importlib

import pytest

from tandem.cli.main import COMMANDS, ENTRY_POINTS, command_module
from tandem.frontend import main as frontend_main
from tandem.runtime.flag_parser import parse_args


def test_a_command_is_its_cli_module_with_dashes_as_underscores() -> None:
    assert command_module("worker") == "tandem.cli.worker"
    assert command_module("global-router") == "tandem.cli.global_router"


def test_the_frontend_is_its_own_packages_entry_point() -> None:
    assert command_module("frontend") == "tandem.frontend.main"
    assert set(ENTRY_POINTS) <= set(COMMANDS)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_command_module_can_be_run(command: str) -> None:
    module = importlib.import_module(command_module(command))
    assert hasattr(module, "main") or (
        hasattr(module, "add_arguments") and hasattr(module, "run")
    ), command


def test_the_frontend_main_parses_its_flags_with_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_HTTP_PORT", "8123")
    parser = argparse.ArgumentParser(prog="tandem frontend")
    frontend_main.add_arguments(parser)
    args = parse_args(parser, ["--log-format", "json"])
    assert (args.port, args.log_format, args.log_level) == (8123, "json", "INFO")
