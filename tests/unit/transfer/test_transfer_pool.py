"""The initiator reuses its authenticated connection to a peer (issue 31: a peer KV fetch's
setup was two dials and two handshakes), and a connection that breaks is dropped."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

import numpy as np
import pytest
from tests.support import transfer_agents

from tandem.errors import TransferError
from tandem.transfer import OpRef, RegionLayout, TransferAgent

pytestmark = pytest.mark.timeout(30)
LAYOUT = RegionLayout.for_kv_cache(
    num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, dtype="float16"
)


def make_agent(name: str, backends: tuple[str, ...], *, shm: bool, seed: int) -> TransferAgent:
    return transfer_agents.make_agent(name, backends, LAYOUT, shm=shm, seed=seed)


@pytest.fixture(params=["shm", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[TransferAgent, TransferAgent]]:
    """(holder, fetcher); the holder exports blocks 0..n-1 for whatever hashes it is asked."""
    backends = ("shm", "tcp") if request.param == "shm" else ("tcp",)
    holder = make_agent("holder", ("shm", "tcp"), shm=True, seed=1)
    fetcher = make_agent("fetcher", backends, shm=False, seed=2)

    def export(op_id: str, hashes: list[int], ttl_s: float) -> int:
        holder.create_readable("kv", list(range(len(hashes))), ttl_s=ttl_s, op_id=op_id)
        return len(hashes)

    holder.exporter = export
    yield holder, fetcher
    fetcher.close()
    holder.close()


def fetch(holder: TransferAgent, fetcher: TransferAgent, op_id: str) -> None:
    """A peer fetch's two exchanges: Export, then the pull."""
    target = OpRef(address=holder.address, agent_id=holder.agent_id, op_id=op_id)
    assert fetcher.request_export(target, [11, 12, 13], ttl_s=5, timeout_s=5) == 3
    fetcher.pull(target, "kv", [4, 5, 6], timeout_s=5)
    got = fetcher.region("kv").blocks()[:, :, [4, 5, 6]]
    assert np.array_equal(got, holder.region("kv").blocks()[:, :, [0, 1, 2]])


def test_fetches_after_the_first_open_no_connection(pair) -> None:
    holder, fetcher = pair
    fetch(holder, fetcher, "f1")
    assert fetcher.pool.num_opened == 1  # the export's connection served the pull too
    for i in range(2, 5):
        fetch(holder, fetcher, f"f{i}")
    assert fetcher.pool.num_opened == 1
    assert fetcher.pool.num_reused == 7
    assert fetcher.query_remote(OpRef(address=holder.address, op_id="f4")) == "complete"
    assert fetcher.pool.num_opened == 1


def _drop_server_connections(holder: TransferAgent) -> None:
    server = holder._server  # the test breaks the owner's side on purpose
    with server._lock:
        conns = list(server._conns)
    for conn in conns:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)


def test_an_idle_connection_the_holder_closed_is_not_reused(pair) -> None:
    holder, fetcher = pair
    fetch(holder, fetcher, "a")
    _drop_server_connections(holder)
    fetch(holder, fetcher, "b")  # the dead idle connection is noticed and a new one dialled
    assert fetcher.pool.num_opened == 2


def test_a_connection_broken_mid_fetch_is_dropped_and_the_fetch_errs(pair) -> None:
    holder, fetcher = pair
    fetch(holder, fetcher, "a")

    def broken_export(op_id: str, hashes: list[int], ttl_s: float) -> int:
        _drop_server_connections(holder)  # the holder's side breaks while it answers
        return 0

    holder.exporter = broken_export
    target = OpRef(address=holder.address, agent_id=holder.agent_id, op_id="b")
    with pytest.raises(TransferError):  # PeerFetch computes the prompt on TransferError
        fetcher.request_export(target, [1], ttl_s=5, timeout_s=5)
    holder.exporter = None
    with pytest.raises(TransferError, match="exports no KV"):  # a fresh connection answers
        fetcher.request_export(target, [1], ttl_s=5, timeout_s=5)
    assert fetcher.pool.num_opened == 2
