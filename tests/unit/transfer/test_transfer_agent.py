from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Iterator

import numpy as np
import pytest
from tests.support import transfer_agents

from tandem.errors import TransferError
from tandem.transfer import (
    OpRef,
    OpStatus,
    RegionLayout,
    TransferAgent,
    TransferAgentConfig,
    TransferOp,
)
from tandem.transfer.shm import ShmBackend
from tandem.transfer.tcp import TcpBackend

pytestmark = pytest.mark.timeout(20)
LAYOUT = RegionLayout.for_kv_cache(
    num_layers=4, num_blocks=16, block_size=4, num_kv_heads=2, head_dim=8, dtype="float16"
)


def make_agent(name: str, backends: tuple[str, ...], *, shm: bool, seed: int) -> TransferAgent:
    return transfer_agents.make_agent(name, backends, LAYOUT, shm=shm, seed=seed)


@pytest.fixture(params=["shm", "tcp"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[TransferAgent, TransferAgent]]:
    """(owner, initiator): the owner's region is in /dev/shm; tcp forces the TCP path."""
    backends = ("shm", "tcp") if request.param == "shm" else ("tcp",)
    owner = make_agent("owner", ("shm", "tcp"), shm=True, seed=1)
    initiator = make_agent("initiator", backends, shm=False, seed=2)
    yield owner, initiator
    initiator.close()
    owner.close()


def blocks(agent: TransferAgent, ids: list[int], layers: slice = slice(None)) -> np.ndarray:
    return agent.region("kv").blocks()[layers, :, ids].copy()


def test_pull_copies_exact_bytes_and_completes_both_sides(pair) -> None:
    owner, initiator = pair
    released: list[TransferOp] = []
    op = owner.create_readable("kv", [3, 4, 5, 11], on_release=released.append)
    result = initiator.pull(op.meta, "kv", [0, 1, 2, 9], timeout_s=5)
    assert np.array_equal(blocks(initiator, [0, 1, 2, 9]), blocks(owner, [3, 4, 5, 11]))
    assert result.num_bytes == 4 * 4 * 2 * LAYOUT.block_bytes
    assert result.backend == initiator.backend_names[0]
    assert owner.wait(op.op_id, 1) is OpStatus.COMPLETE
    assert released == [op]
    assert owner.stats.num_complete == 1 and owner.stats.bytes_sent == result.num_bytes


def test_push_fills_a_writable_op_and_wakes_its_waiter(pair) -> None:
    owner, initiator = pair
    untouched = blocks(owner, [0, 1])
    op = owner.create_writable("kv", [7, 2], layers=(1, 3))
    initiator.push("kv", [5, 6], op.meta, timeout_s=5)
    assert owner.wait(op.op_id, 1) is OpStatus.COMPLETE
    assert np.array_equal(
        blocks(owner, [7, 2], slice(1, 3)), blocks(initiator, [5, 6], slice(1, 3))
    )
    assert not np.array_equal(
        blocks(owner, [7, 2], slice(0, 1)), blocks(initiator, [5, 6], slice(0, 1))
    )
    assert np.array_equal(blocks(owner, [0, 1]), untouched)


def test_push_may_arrive_before_the_writable_op_exists(pair) -> None:
    owner, initiator = pair
    ref = OpRef(address=owner.address, op_id="req-1", agent_id="owner")
    results: list[object] = []
    pusher = threading.Thread(
        target=lambda: results.append(initiator.push("kv", [1], ref, timeout_s=5))
    )
    pusher.start()
    owner.create_writable("kv", [9], op_id="req-1")
    assert owner.wait("req-1", 5) is OpStatus.COMPLETE
    pusher.join(5)
    assert len(results) == 1
    assert np.array_equal(blocks(owner, [9]), blocks(initiator, [1]))


def test_pull_may_arrive_before_the_readable_op_exists(pair) -> None:
    owner, initiator = pair
    ref = OpRef(address=owner.address, op_id="req-2")
    errors: list[BaseException] = []

    def pull() -> None:
        try:
            initiator.pull(ref, "kv", [4, 5], timeout_s=5)
        except BaseException as exc:
            errors.append(exc)

    puller = threading.Thread(target=pull)
    puller.start()
    owner.create_readable("kv", [12, 13], op_id="req-2")
    assert owner.wait("req-2", 5) is OpStatus.COMPLETE
    puller.join(5)
    assert errors == []
    assert np.array_equal(blocks(initiator, [4, 5]), blocks(owner, [12, 13]))


def test_unclaimed_readable_op_expires_released_and_counted() -> None:
    with make_agent("owner", ("shm", "tcp"), shm=True, seed=1) as owner:
        released = threading.Event()
        op = owner.create_readable("kv", [1, 2], ttl_s=0.05, on_release=lambda _: released.set())
        assert released.wait(5)
        assert op.status is OpStatus.EXPIRED
        assert owner.stats.num_expired == 1
        with pytest.raises(TransferError, match="expired"):
            owner.wait(op.op_id, 1)


def test_pull_of_an_expired_op_fails_with_the_reason(pair) -> None:
    owner, initiator = pair
    op = owner.create_readable("kv", [1], ttl_s=0.01)
    with pytest.raises(TransferError, match=r"op=.* expired") as info:
        op.wait(5)
    with pytest.raises(TransferError, match="expired") as info:
        initiator.pull(op.meta, "kv", [1], timeout_s=2)
    assert op.op_id in str(info.value) and "owner" in str(info.value)


def test_owner_cancel_before_pull_refuses_it(pair) -> None:
    owner, initiator = pair
    op = owner.create_readable("kv", [1])
    owner.cancel(op.op_id, "request aborted")
    with pytest.raises(TransferError, match="cancelled"):
        initiator.pull(op.meta, "kv", [1], timeout_s=2)
    assert owner.stats.num_cancelled == 1


def test_owner_cancel_during_transfer_fails_the_initiator(pair, monkeypatch) -> None:
    owner, initiator = pair
    op = owner.create_readable("kv", [1, 2])
    backend = initiator.backend(initiator.backend_names[0])
    original = backend.pull

    def cancel_then_pull(sock, remote, local, ids):  # the owner cancels mid-flight
        owner.cancel(remote.op_id, "prefill aborted")
        return original(sock, remote, local, ids)

    monkeypatch.setattr(backend, "pull", cancel_then_pull)
    with pytest.raises(TransferError, match=f"op={op.op_id}"):
        initiator.pull(op.meta, "kv", [3, 4], timeout_s=2)
    assert op.status is OpStatus.CANCELLED


def test_initiator_cancels_remote_op_which_releases_it(pair) -> None:
    owner, initiator = pair
    released = threading.Event()
    op = owner.create_writable("kv", [1], on_release=lambda _: released.set())
    assert initiator.query_remote(op.meta) == "initialized"
    assert initiator.cancel_remote(op.meta, "decode aborted") == "cancelled"
    assert released.is_set()
    with pytest.raises(TransferError, match="decode aborted"):
        owner.wait(op.op_id, 1)


def test_wait_times_out_with_transfer_error_and_leaves_op_live(pair) -> None:
    owner, _ = pair
    op = owner.create_writable("kv", [1])
    with pytest.raises(TransferError, match=f"op={op.op_id}.*not complete after"):
        owner.wait(op.op_id, 0.05)
    assert op.status is OpStatus.INITIALIZED


def test_pull_of_an_op_that_never_appears_times_out(pair) -> None:
    owner, initiator = pair
    # the owner answers min(0.25 s, timeout/4) before the initiator's deadline; 1 s leaves that
    # reply 0.25 s to arrive on a loaded CI host (at 0.2 s, 50 ms was not always enough)
    with pytest.raises(TransferError, match=r"op=ghost.*no op ghost appeared"):
        initiator.pull(OpRef(address=owner.address, op_id="ghost"), "kv", [1], timeout_s=1.0)


def test_second_claim_of_a_completed_op_is_refused(pair) -> None:
    owner, initiator = pair
    op = owner.create_readable("kv", [1])
    initiator.pull(op.meta, "kv", [1], timeout_s=2)
    with pytest.raises(TransferError, match="is complete"):
        initiator.pull(op.meta, "kv", [2], timeout_s=2)


def test_mismatched_block_count_errors_the_op_with_the_reason(pair) -> None:
    owner, initiator = pair
    op = owner.create_readable("kv", [1, 2])
    with pytest.raises(TransferError, match="1 local blocks for 2 remote blocks"):
        initiator.pull(op.meta, "kv", [1], timeout_s=2)
    assert owner.find_op(op.op_id).status is OpStatus.ERRORED


def test_unreachable_peer_is_a_transfer_error(pair) -> None:
    owner, initiator = pair
    op = owner.create_readable("kv", [1])
    owner.close()
    with pytest.raises(TransferError, match=f"op={op.op_id} peer=owner"):
        initiator.pull(op.meta, "kv", [1], timeout_s=1)


def test_close_cancels_live_ops() -> None:
    agent = make_agent("a", ("tcp",), shm=False, seed=0)
    released = threading.Event()
    op = agent.create_readable("kv", [0], on_release=lambda _: released.set())
    agent.close()
    assert released.is_set() and op.status is OpStatus.CANCELLED


def test_create_validates_blocks_and_layers() -> None:
    with make_agent("a", ("tcp",), shm=False, seed=0) as agent:
        with pytest.raises(ValueError, match=r"outside \[0, 16\)"):
            agent.create_readable("kv", [16])
        with pytest.raises(ValueError, match="layers"):
            agent.create_readable("kv", [1], layers=(2, 9))
        agent.create_readable("kv", [1], op_id="x")
        with pytest.raises(ValueError, match="already exists"):
            agent.create_readable("kv", [1], op_id="x")


def test_unknown_backend_name_lists_the_known_ones() -> None:
    with pytest.raises(ValueError, match="unknown transfer backend 'rdma'; expected one of: shm"):
        TransferAgentConfig(backends=("rdma",))


def test_selection_logs_info_for_shm_and_warning_for_fallback(caplog) -> None:
    caplog.set_level(logging.INFO, logger="tandem.transfer")
    owner = make_agent("owner", ("shm", "tcp"), shm=False, seed=1)  # region not in shm
    initiator = make_agent("initiator", ("shm", "tcp"), shm=False, seed=2)
    try:
        result = initiator.pull(owner.create_readable("kv", [1]).meta, "kv", [1], timeout_s=2)
        assert result.backend == "tcp"
        warning = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert any("FALLBACK" in r.getMessage() and "not in shared memory" in r.getMessage()
                   for r in warning)  # fmt: skip
        shm_owner = make_agent("shm-owner", ("shm", "tcp"), shm=True, seed=3)
        with shm_owner:
            meta = shm_owner.create_readable("kv", [1]).meta
            assert initiator.pull(meta, "kv", [1], timeout_s=2).backend == "shm"
        info = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
        assert any("peer=shm-owner backend=shm (fastest path)" in m for m in info)
    finally:
        initiator.close()
        owner.close()


def test_backends_are_the_selected_kinds(pair) -> None:
    _, initiator = pair
    first = initiator.backend(initiator.backend_names[0])
    assert isinstance(first, ShmBackend | TcpBackend)


async def test_async_wrappers_round_trip(pair) -> None:
    owner, initiator = pair
    op = owner.create_writable("kv", [3])
    await initiator.push_async("kv", [4], op.meta, timeout_s=2)
    assert await owner.wait_async(op.op_id, 1) is OpStatus.COMPLETE


SECRET = secrets.token_hex(32)  # as `openssl rand -hex 32` makes one


def _secured(name: str, secret: str | None, seed: int) -> TransferAgent:
    agent = TransferAgent(
        TransferAgentConfig(agent_id=name, backends=("tcp",), cluster_secret=secret)
    )
    region = agent.register_region("kv", np.zeros(LAYOUT.span_bytes, np.uint8), LAYOUT)
    region.data[:] = np.random.default_rng(seed).integers(0, 256, region.data.size, np.uint8)
    return agent


def test_agents_sharing_the_secret_transfer() -> None:
    with _secured("owner", SECRET, 1) as owner, _secured("peer", SECRET, 2) as peer:
        op = owner.create_readable("kv", [1, 2])
        peer.pull(op.meta, "kv", [5, 6], timeout_s=5)
        assert np.array_equal(blocks(peer, [5, 6]), blocks(owner, [1, 2]))
        assert owner.wait(op.op_id, 1) is OpStatus.COMPLETE


@pytest.mark.parametrize("secret", [None, "another-clusters-secret-0123456789"])
def test_owner_with_secret_refuses_a_peer_without_it(secret, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="tandem.transfer")
    with _secured("owner", SECRET, 1) as owner, _secured("thief", secret, 2) as thief:
        op = owner.create_readable("kv", [1, 2])
        before = blocks(thief, [5, 6])
        with pytest.raises(TransferError, match="refused the connection: authentication failed"):
            thief.pull(op.meta, "kv", [5, 6], timeout_s=5)
        with pytest.raises(TransferError, match="authentication failed"):
            thief.cancel_remote(op.meta)
        assert np.array_equal(blocks(thief, [5, 6]), before)  # no byte moved
        assert owner.find_op(op.op_id) is op and op.status is OpStatus.INITIALIZED  # not claimed
        assert "refused a connection" in caplog.text


def test_peer_with_secret_refuses_an_owner_without_one() -> None:
    with _secured("owner", None, 1) as owner, _secured("peer", SECRET, 2) as peer:
        op = owner.create_readable("kv", [1])
        with pytest.raises(TransferError, match="does not authenticate"):
            peer.pull(op.meta, "kv", [5], timeout_s=5)


def test_raw_begin_without_handshake_is_refused() -> None:
    """A client that skips the handshake (as protocol v1 did) never claims an op."""
    import socket

    from tandem.transfer.wire import AuthReply, Begin, Hello, recv_frame, send_frame

    with _secured("owner", SECRET, 1) as owner:
        op = owner.create_readable("kv", [1])
        with socket.create_connection(op.meta.address, timeout=5) as sock:
            send_frame(sock, Begin(op_id=op.op_id, direction="pull", peer="x", timeout_s=1.0))
            assert isinstance(recv_frame(sock), Hello)
            reply = recv_frame(sock)
            assert isinstance(reply, AuthReply) and "expected Auth" in reply.error
        assert op.status is OpStatus.INITIALIZED
