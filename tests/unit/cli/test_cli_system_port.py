"""`--system-port`: `tandem serve` refuses it (all its workers would bind the one port; they are
scraped through the frontend's /metrics/workers); `tandem worker` checks its range."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from tandem.cli import serve, worker
from tandem.errors import StartupError


@pytest.mark.parametrize("flag", [["--system-port", "9100"], ["--system-port=9100"]])
def test_serve_refuses_a_system_port_for_all_its_workers(flag: list[str]) -> None:
    with pytest.raises(SystemExit, match="/metrics/workers"):
        serve.main(["--engine", "mocker", *flag])


def test_worker_system_port_out_of_range_names_the_flag() -> None:
    args = argparse.Namespace(system_port=70000, system_host="127.0.0.1")
    with pytest.raises(StartupError, match="--system-port=70000"):  # one line, exit 1
        asyncio.run(worker._start_system_server(None, args))  # type: ignore[arg-type]
