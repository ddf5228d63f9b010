"""`tandem.runtime.address`: the address a process binds and the one it advertises.

Before, a worker started without `--host` advertised 127.0.0.1 and one with `--host 0.0.0.0`
advertised 0.0.0.0: a frontend on another host excluded it and answered 503 to every request."""

from __future__ import annotations

import argparse

import pytest

from tandem.runtime import address
from tandem.runtime.address import AddressError, resolve_addresses
from tandem.runtime.args import add_runtime_args, runtime_config_from_args
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.flag_parser import parse_args


def _route_to(monkeypatch: pytest.MonkeyPatch, ip: str | None) -> list[str]:
    asked: list[str] = []

    def route(target: str) -> str | None:
        asked.append(target)
        return ip

    monkeypatch.setattr(address, "route_source", route)
    monkeypatch.setattr(address, "is_local_address", lambda host: host in ("10.9.0.2", "127.0.0.1"))
    return asked


def test_one_host_stays_on_loopback() -> None:
    resolved = resolve_addresses(RuntimeConfig())
    assert (resolved.host, resolved.advertise_host) == ("127.0.0.1", "127.0.0.1")


def test_etcd_on_another_host_binds_and_advertises_the_route_to_it(monkeypatch) -> None:
    asked = _route_to(monkeypatch, "10.9.0.2")
    config = RuntimeConfig(discovery="etcd", etcd_url="http://10.9.0.1:2379")
    resolved = resolve_addresses(config)
    assert asked == ["10.9.0.1"]
    assert (resolved.host, resolved.advertise_host) == ("10.9.0.2", "10.9.0.2")


def test_nats_on_another_host_counts_too(monkeypatch) -> None:
    asked = _route_to(monkeypatch, "10.9.0.2")
    config = RuntimeConfig(discovery="file", events="nats", nats_url="nats://10.9.0.1:4222")
    assert resolve_addresses(config).advertise_host == "10.9.0.2"
    assert asked == ["10.9.0.1"]


def test_a_wildcard_bind_never_advertises_0_0_0_0(monkeypatch) -> None:
    _route_to(monkeypatch, "10.9.0.2")
    resolved = resolve_addresses(RuntimeConfig(host="0.0.0.0"))
    assert (resolved.host, resolved.advertise_host) == ("0.0.0.0", "10.9.0.2")
    remote = RuntimeConfig(host="0.0.0.0", discovery="etcd", etcd_url="http://10.9.0.1:2379")
    assert resolve_addresses(remote).advertise_host == "10.9.0.2"


def test_a_wildcard_bind_without_any_route_advertises_loopback(monkeypatch) -> None:
    _route_to(monkeypatch, None)
    assert resolve_addresses(RuntimeConfig(host="::")).advertise_host == "127.0.0.1"


def test_an_explicit_bind_or_advertise_host_wins(monkeypatch) -> None:
    asked = _route_to(monkeypatch, "10.9.0.2")
    remote = {"discovery": "etcd", "etcd_url": "http://10.9.0.1:2379"}
    bound = resolve_addresses(RuntimeConfig(host="10.9.0.7", **remote))
    assert (bound.host, bound.advertise_host) == ("10.9.0.7", "10.9.0.7")
    told = resolve_addresses(RuntimeConfig(advertise_host="10.9.0.2", **remote))
    assert (told.host, told.advertise_host) == ("10.9.0.2", "10.9.0.2")
    assert asked == []
    nat = resolve_addresses(RuntimeConfig(advertise_host="203.0.113.5", **remote))
    assert (nat.host, nat.advertise_host) == ("0.0.0.0", "203.0.113.5")  # not ours: bind all


def test_advertising_loopback_while_etcd_is_remote_is_refused(monkeypatch) -> None:
    _route_to(monkeypatch, "10.9.0.2")
    config = RuntimeConfig(
        discovery="etcd", etcd_url="http://10.9.0.1:2379", advertise_host="127.0.0.1"
    )
    with pytest.raises(AddressError, match="--advertise-host"):
        resolve_addresses(config)
    _route_to(monkeypatch, None)  # no route to etcd at all
    with pytest.raises(AddressError, match=r"10\.9\.0\.1"):
        resolve_addresses(RuntimeConfig(discovery="etcd", etcd_url="http://10.9.0.1:2379"))


def test_resolving_twice_changes_nothing(monkeypatch) -> None:
    _route_to(monkeypatch, "10.9.0.2")
    once = resolve_addresses(RuntimeConfig(discovery="etcd", etcd_url="http://10.9.0.1:2379"))
    assert resolve_addresses(once) == once


def test_the_route_source_of_loopback_is_loopback() -> None:
    assert address.route_source("127.0.0.1") == "127.0.0.1"
    assert address.route_source("no-such-host.invalid") is None


def _parsed(argv: list[str], *, http_host: bool = False) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    if http_host:
        parser.add_argument("--host", default="0.0.0.0")
        parser.add_argument("--port", type=int, default=8000)
    add_runtime_args(parser)
    return parse_args(parser, argv)


def test_the_flags_and_the_env_variable(monkeypatch) -> None:
    assert runtime_config_from_args(_parsed(["--advertise-host", "10.9.0.2"])).advertise_host == (
        "10.9.0.2"
    )
    monkeypatch.setenv("TANDEM_ADVERTISE_HOST", "10.9.0.3")
    assert runtime_config_from_args(_parsed([])).advertise_host == "10.9.0.3"


def test_a_command_whose_host_is_http_gets_runtime_host() -> None:
    ns = _parsed(["--host", "0.0.0.0", "--runtime-host", "10.9.0.2"], http_host=True)
    assert ns.host == "0.0.0.0"
    assert runtime_config_from_args(ns).host == "10.9.0.2"


def test_ports_are_pinned_by_flag_and_a_bad_one_is_refused() -> None:
    config = runtime_config_from_args(_parsed(["--port", "7001", "--events-port", "7002"]))
    assert (config.port, config.events_port) == (7001, 7002)
    ns = _parsed(["--port", "8000", "--runtime-port", "7001"], http_host=True)
    assert runtime_config_from_args(ns).port == 7001
    with pytest.raises(ValueError, match="events_port"):
        RuntimeConfig(events_port=70000)


def test_a_url_given_alone_chooses_its_backend() -> None:
    """`tandem worker --etcd-url URL --nats-url URL` (the issue's first multi-host attempt):
    before, the worker stayed on in-process discovery and events, seen by no frontend."""
    config = runtime_config_from_args(
        _parsed(["--etcd-url", "http://10.9.0.1:2379", "--nats-url", "nats://10.9.0.1:4222"])
    )
    assert (config.discovery, config.events) == ("etcd", "nats")
    chosen = runtime_config_from_args(
        _parsed(["--discovery", "file", "--events", "zmq", "--etcd-url", "http://h:2379"])
    )
    assert (chosen.discovery, chosen.events) == ("file", "zmq")
    plain = runtime_config_from_args(_parsed([]))
    assert (plain.discovery, plain.events, plain.etcd_url) == (
        "memory",
        "memory",
        "http://127.0.0.1:2379",
    )
