"""`tandem worker --transfer-host`: a prefill/decode worker's KV transfer agent and an encode
worker's embedding agent listen on (and advertise) the worker's request-plane `--host` unless
`--transfer-host` names another address, so workers on different hosts can reach each other."""

from __future__ import annotations

import argparse

import pytest

from tandem.cli import worker
from tandem.disagg.worker_engine import DisaggEngine
from tandem.multimodal import encode_args
from tandem.runtime.flag_parser import parse_args


def _args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tandem worker")
    worker.add_arguments(parser, argv)
    return parse_args(parser, argv)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [([], "127.0.0.1"), (["--host", "127.0.0.2"], "127.0.0.2"),
     (["--host", "127.0.0.2", "--transfer-host", "127.0.0.3"], "127.0.0.3")],
)  # fmt: skip
def test_the_kv_transfer_agent_listens_on_the_workers_host(extra, expected) -> None:
    argv = ["--engine", "mocker", "--disagg-mode", "prefill", *extra]
    engine = worker.build_engine(_args(argv))
    assert isinstance(engine, DisaggEngine)
    assert engine._agent_config.host == expected


def test_the_embedding_agent_listens_on_the_workers_host() -> None:
    args = _args(["--engine", "encoder", "--host", "127.0.0.2"])
    args.transfer_host = args.transfer_host or args.runtime_host  # as build_engine does
    assert encode_args.config_from_args(args).transfer_host == "127.0.0.2"


def test_the_transfer_port_is_pinned_by_flag() -> None:
    argv = ["--engine", "mocker", "--disagg-mode", "prefill", "--transfer-port", "7003"]
    engine = worker.build_engine(_args(argv))
    assert isinstance(engine, DisaggEngine)
    assert engine._agent_config.port == 7003
    args = _args(["--engine", "encoder", "--transfer-port", "7004"])
    assert encode_args.config_from_args(args).transfer_port == 7004
