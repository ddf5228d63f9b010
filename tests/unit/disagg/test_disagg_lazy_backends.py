"""Lazy optional transfer backends: with ``lazy_backends`` a single-host pair never starts
them (NIXL's progress thread busy-polls half a core); the first transfer with a peer on
another host starts them on both sides and prefers them over tcp; named eagerly they start
at once. A stand-in "nixl" (TCP underneath) keeps the test free of the real library."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Iterator

import numpy as np
import pytest

import tandem.transfer.registry as registry
from tandem.disagg.args import add_disagg_worker_args, disagg_worker_config_from_args
from tandem.transfer import RegionLayout, TransferAgent, TransferAgentConfig
from tandem.transfer.tcp import TcpBackend

pytestmark = pytest.mark.timeout(20)
LAYOUT = RegionLayout.contiguous(num_blocks=8, block_bytes=256, num_layers=2)
LAZY = TransferAgentConfig(backends=("shm", "nixl", "tcp"), lazy_backends=("nixl",))


class StandInNixl(TcpBackend):
    name = "nixl"

    def register(self, region):  # type: ignore[no-untyped-def]
        return b"nixl-handle"


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Agent ids that started the stand-in nixl backend, in order."""
    calls: list[str] = []
    real = registry.create_backend

    def create(name: str, *, agent_id: str, host: str):  # type: ignore[no-untyped-def]
        if name == "nixl":
            calls.append(agent_id)
            return StandInNixl()
        return real(name, agent_id=agent_id, host=host)

    monkeypatch.setattr(registry, "is_installed", lambda name: True)
    monkeypatch.setattr(registry, "create_backend", create)
    yield calls


def agent(name: str, config: TransferAgentConfig, far: bool = False) -> TransferAgent:
    """An agent; `far`: one that cannot read any peer's shm probe back (another host)."""
    cfg = TransferAgentConfig(agent_id=name, backends=config.backends,
                              lazy_backends=config.lazy_backends)  # fmt: skip
    a = TransferAgent(cfg)
    if far:
        a.why_not_shared = lambda probe, digest: "another host"  # type: ignore[method-assign]
    region = a.create_region("kv", LAYOUT)
    region.data[:] = np.random.default_rng(len(name)).integers(0, 256, region.data.size, np.uint8)
    return a


def test_single_host_pair_never_starts_the_lazy_backend(started: list[str]) -> None:
    with agent("a", LAZY) as a, agent("b", LAZY) as b:
        assert a.backend_names == ("shm", "tcp")
        op = a.create_readable("kv", [1, 2])
        assert b.pull(op.meta, "kv", [3, 4], timeout_s=5).backend == "shm"
        assert started == []


def test_peer_on_another_host_starts_it_on_both_sides(
    started: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tandem.transfer.agent")
    with agent("owner", LAZY) as owner, agent("far", LAZY, far=True) as far:
        op = owner.create_readable("kv", [1, 2, 5])  # created before nixl started
        assert "nixl" not in op.meta.backends
        result = far.pull(op.meta, "kv", [0, 6, 7], timeout_s=5)
        assert result.backend == "nixl"  # preferred over tcp once started
        assert sorted(started) == ["far", "owner"]
        want = owner.region("kv").blocks()[:, :, [1, 2, 5]]
        assert np.array_equal(far.region("kv").blocks()[:, :, [0, 6, 7]], want)
        assert owner.backend_names == far.backend_names == ("shm", "nixl", "tcp")
        far.pull(owner.create_readable("kv", [3]).meta, "kv", [1], timeout_s=5)
        assert len(started) == 2  # started once per agent
    assert "shares no memory with this one (another host or container); started backends nixl" in (
        caplog.text
    )


def test_named_explicitly_it_starts_at_once(started: list[str]) -> None:
    eager = TransferAgentConfig(backends=("shm", "nixl", "tcp"))
    with agent("e", eager) as e:
        assert e.backend_names == ("shm", "nixl", "tcp") and started == ["e"]


def test_worker_flag_auto_is_lazy_and_a_list_is_eager() -> None:
    parser = argparse.ArgumentParser()
    add_disagg_worker_args(parser)
    auto = disagg_worker_config_from_args(parser.parse_args(["--disagg-mode", "decode"]))
    assert "nixl" in auto.backends and set(auto.lazy_backends) == {"nixl", "mooncake"}
    named = disagg_worker_config_from_args(
        parser.parse_args(["--disagg-transfer-backends", "nixl,tcp"])
    )
    assert (named.backends, named.lazy_backends) == (("nixl", "tcp"), ())
    with pytest.raises(ValueError, match="keep one of"):
        TransferAgentConfig(backends=("nixl",), lazy_backends=("nixl",))
