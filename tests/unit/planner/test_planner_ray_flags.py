"""`tandem planner --connector ray` from the command line (issue 30 item 6): --ray-address (and
RAY_ADDRESS) reach the connector, worker actors get the CPUs/GPUs the flags give and are spread
across nodes, a ray flag without the ray connector is an error, and --worker-log-dir is honoured
by the actor that runs the worker (on its node)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

import pytest

import tandem.planner.connector.ray as ray_module
from tandem.errors import ConfigError
from tandem.planner.args import add_planner_args, planner_config_from_args, ray_options
from tandem.planner.connector.ray import WorkerActor
from tandem.planner.main import build_connector
from tandem.runtime.config import RuntimeConfig

pytestmark = pytest.mark.timeout(30)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_planner_args(parser)
    return parser.parse_args(list(argv))


class FakeRuntime:
    config = RuntimeConfig(namespace="t", discovery="etcd", events="nats")


def built_with(monkeypatch: pytest.MonkeyPatch, ns: argparse.Namespace) -> dict[str, Any]:
    seen: dict[str, Any] = {}

    class Recorder:
        def __init__(self, runtime_config: RuntimeConfig, argv: object, **kw: Any) -> None:
            seen.update(kw)

    monkeypatch.setattr(ray_module, "RayConnector", Recorder)
    build_connector(ns, planner_config_from_args(ns), FakeRuntime())  # type: ignore[arg-type]
    return seen


def test_ray_address_and_resources_reach_the_connector(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ns = parse("--connector", "ray", "--ray-address", "10.0.0.5:6379", "--ray-worker-cpus", "2",
               "--ray-worker-gpus", "1", "--worker-log-dir", "/var/log/tandem")  # fmt: skip
    kw = built_with(monkeypatch, ns)
    assert kw["address"] == "10.0.0.5:6379"
    assert (kw["num_cpus"], kw["num_gpus"], kw["spread"]) == (2.0, 1.0, True)
    assert kw["log_dir"] == "/var/log/tandem"


def test_ray_address_falls_back_to_the_ray_address_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert built_with(monkeypatch, parse("--connector", "ray"))["address"] == "ray://head:10001"
    ns = parse("--connector", "ray", "--ray-address", "10.0.0.5:6379")
    assert built_with(monkeypatch, ns)["address"] == "10.0.0.5:6379"  # the flag wins
    monkeypatch.delenv("RAY_ADDRESS")
    assert built_with(monkeypatch, parse("--connector", "ray"))["address"] is None  # own head


def test_pack_placement_and_bad_values() -> None:
    assert (
        ray_options(parse("--connector", "ray", "--ray-placement", "pack"), {})["spread"] is False
    )
    with pytest.raises(ConfigError, match=r"ray_worker_cpus=-1.0 out of range"):
        ray_options(parse("--connector", "ray", "--ray-worker-cpus", "-1"), {})
    with pytest.raises(ConfigError, match="--ray-address given without --connector ray"):
        ray_options(parse("--ray-address", "10.0.0.5:6379"), {})
    assert ray_options(parse(), {"RAY_ADDRESS": "x:1"}) == {}  # local connector: env unused


def test_the_actor_writes_its_worker_log_where_asked(tmp_path: Path) -> None:
    log = tmp_path / "node-logs" / "worker-abc.log"
    actor = WorkerActor(["--help"], str(log))
    assert asyncio.run(actor.run()) == "drained"  # `tandem worker --help` exits 0
    assert "usage: tandem worker" in log.read_text()
