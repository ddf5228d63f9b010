"""Transfers between two processes: this file is also the peer (run as a script).

The peer speaks JSON lines on stdin/stdout: one command in, one answer out.
"""

from __future__ import annotations

import base64
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import numpy as np
import pytest

from tandem.errors import TransferError
from tandem.transfer import (
    OpRef,
    OpStatus,
    RegionLayout,
    TransferAgent,
    TransferAgentConfig,
    decode_meta,
    encode_meta,
)
from tandem.transfer.region import SHM_DIR, sweep_stale_segments

LAYOUT = RegionLayout.for_kv_cache(
    num_layers=4, num_blocks=32, block_size=8, num_kv_heads=2, head_dim=16, dtype="bfloat16"
)
pytestmark = pytest.mark.timeout(30)


# -- the peer process ----------------------------------------------------------------------
def _peer_main(agent_id: str, backends: str, shm: bool, seed: int) -> None:
    agent = TransferAgent(
        TransferAgentConfig(agent_id=agent_id, backends=tuple(backends.split(",")))
    )
    region = agent.create_region("kv", LAYOUT) if shm else agent.register_region(
        "kv", np.zeros(LAYOUT.span_bytes, np.uint8), LAYOUT)  # fmt: skip
    region.data[:] = np.random.default_rng(seed).integers(0, 256, region.data.size, np.uint8)
    _answer({"address": list(agent.address), "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            _answer(_peer_command(agent, cmd))
        except TransferError as exc:
            _answer({"error": str(exc)})
    agent.close()


def _peer_command(agent: TransferAgent, cmd: dict) -> dict:
    name = cmd.pop("cmd")
    if name in ("readable", "writable"):
        create = agent.create_readable if name == "readable" else agent.create_writable
        op = create("kv", cmd["blocks"], op_id=cmd.get("op_id"), ttl_s=cmd.get("ttl_s", 30))
        return {"meta": _b64(encode_meta(op.meta))}
    if name in ("pull", "push"):
        target = decode_meta(base64.b64decode(cmd["meta"])) if "meta" in cmd else OpRef(
            address=tuple(cmd["address"]), op_id=cmd["op_id"])  # fmt: skip
        if name == "pull":
            result = agent.pull(target, "kv", cmd["blocks"], timeout_s=cmd["timeout_s"])
        else:
            result = agent.push("kv", cmd["blocks"], target, timeout_s=cmd["timeout_s"])
        return {"backend": result.backend}
    if name == "wait":
        return {"status": agent.wait(cmd["op_id"], cmd["timeout_s"]).value}
    if name == "blocks":
        return {"data": _b64(agent.region("kv").blocks()[:, :, cmd["blocks"]].tobytes())}
    if name == "die_mid_transfer":  # the next transfer moves half its bytes, then the process dies
        _install_death(agent)
        return {}
    raise ValueError(name)


def _install_death(agent: TransferAgent) -> None:
    import socket as socket_module

    real_sendall = socket_module.socket.sendall

    def sendall(sock, data, *args):  # used for tcp byte streams
        view = memoryview(data).cast("B")
        if len(view) >= 1024:
            real_sendall(sock, view[: len(view) // 2])
            os._exit(9)
        return real_sendall(sock, data, *args)

    real_recv_into = socket_module.socket.recv_into

    def recv_into(sock, buffer, *args):  # used for tcp byte streams into our region
        if len(memoryview(buffer)) >= 1024:
            real_recv_into(sock, buffer, *args)
            os._exit(9)
        return real_recv_into(sock, buffer, *args)

    socket_module.socket.sendall = sendall  # type: ignore[method-assign]
    socket_module.socket.recv_into = recv_into  # type: ignore[method-assign]
    if "shm" in agent.backend_names:
        backend = agent.backend("shm")
        backend.push = backend.pull = lambda *a: os._exit(9)  # type: ignore[method-assign]


def _answer(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# -- the test side -------------------------------------------------------------------------
class Peer:
    def __init__(
        self, agent_id: str, backends: str = "shm,tcp", *, shm: bool = True, seed: int = 1
    ):
        args = [sys.executable, __file__, agent_id, backends, "1" if shm else "0", str(seed)]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = self.read(60)  # nixl imports torch (to find CUDA): seconds on a busy host
        self.address, self.pid = tuple(hello["address"]), hello["pid"]

    def send(self, cmd: str, **kwargs: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"cmd": cmd, **kwargs}) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout_s: float = 10) -> dict:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        assert ready, "peer did not answer"
        line = self.proc.stdout.readline()
        assert line, f"peer exited with {self.proc.wait(5)}"
        return json.loads(line)

    def call(self, cmd: str, **kwargs: object) -> dict:
        self.send(cmd, **kwargs)
        return self.read()

    def meta(self, kind: str, blocks: list[int], **kwargs: object):
        return decode_meta(base64.b64decode(self.call(kind, blocks=blocks, **kwargs)["meta"]))

    def blocks(self, ids: list[int]) -> np.ndarray:
        raw = base64.b64decode(self.call("blocks", blocks=ids)["data"])
        return np.frombuffer(raw, np.uint8).reshape(LAYOUT.num_layers, 2, len(ids), -1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def segments_of(pid: int) -> list[str]:
    return [n for n in os.listdir(SHM_DIR) if n.startswith(f"tandem-{pid}-")]


# each backend with the ones it is tried before (nixl: UCX between the two processes, its
# progress thread in each; only the exactness tests run it, the faults are the layer's own)
BACKENDS = {"shm": "shm,tcp", "nixl": "nixl,tcp", "mooncake": "mooncake,tcp", "tcp": "tcp"}
OPTIONAL = {  # what `make venv` installs for them
    "nixl": ("nixl", "make venv installs nixl==1.5.1"),
    "mooncake": ("mooncake.engine", "make venv installs mooncake-transfer-engine-non-cuda and "
                 "Debian's libibverbs1 (its TCP transport needs no RDMA device)"),
}  # fmt: skip
EVERY_BACKEND = pytest.mark.parametrize("backend", list(BACKENDS), indirect=True)
# nixl imports torch to find CUDA: its peer and agent take many seconds on a busy 2-core host
SLOW_START = pytest.mark.timeout(120)


@pytest.fixture(params=["shm", "tcp"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param in OPTIONAL:
        from tests.support.optional import require  # not importable where this file is the peer

        require(*OPTIONAL[request.param])
    return str(request.param)


@pytest.fixture
def local(backend: str) -> Iterator[TransferAgent]:
    backends = tuple(BACKENDS[backend].split(","))
    agent = TransferAgent(TransferAgentConfig(agent_id="local", backends=backends))
    agent.create_region("kv", LAYOUT).data[:] = np.random.default_rng(9).integers(
        0, 256, LAYOUT.span_bytes, np.uint8)  # fmt: skip
    yield agent
    pid = os.getpid()
    agent.close()
    assert segments_of(pid) == []


@pytest.fixture
def peer(backend: str) -> Iterator[Peer]:
    p = Peer("peer", BACKENDS[backend])
    yield p
    p.close()
    if p.proc.returncode != 0:  # killed: its segment stays until an agent sweeps it
        sweep_stale_segments()
    assert segments_of(p.pid) == []


def local_blocks(agent: TransferAgent, ids: list[int]) -> np.ndarray:
    return agent.region("kv").blocks()[:, :, ids]


@EVERY_BACKEND
@SLOW_START
def test_pull_from_another_process_is_exact(local: TransferAgent, peer: Peer, backend: str) -> None:
    meta = peer.meta("readable", [5, 6, 7, 20])
    result = local.pull(meta, "kv", [0, 1, 2, 3], timeout_s=5)
    assert result.backend == backend
    assert np.array_equal(local_blocks(local, [0, 1, 2, 3]), peer.blocks([5, 6, 7, 20]))


@EVERY_BACKEND
@SLOW_START
def test_push_into_another_process_is_exact(local: TransferAgent, peer: Peer, backend: str) -> None:
    op = local.create_writable("kv", [10, 11, 30])
    peer.send(
        "push", meta=base64.b64encode(_encode(op.meta)).decode(), blocks=[1, 2, 3], timeout_s=5
    )
    assert local.wait(op.op_id, 5) is OpStatus.COMPLETE
    assert peer.read() == {"backend": backend}
    assert np.array_equal(local_blocks(local, [10, 11, 30]), peer.blocks([1, 2, 3]))


def test_peer_push_may_arrive_before_the_writable_op(local: TransferAgent, peer: Peer) -> None:
    peer.send("push", address=list(local.address), op_id="req-7", blocks=[4, 5], timeout_s=5)
    op = local.create_writable("kv", [8, 9], op_id="req-7")  # the peer is already waiting
    assert local.wait(op.op_id, 5) is OpStatus.COMPLETE
    assert "backend" in peer.read()
    assert np.array_equal(local_blocks(local, [8, 9]), peer.blocks([4, 5]))


def test_peer_pull_may_arrive_before_the_readable_op(local: TransferAgent, peer: Peer) -> None:
    peer.send("pull", address=list(local.address), op_id="req-8", blocks=[12, 13], timeout_s=5)
    op = local.create_readable("kv", [1, 2], op_id="req-8")
    assert local.wait(op.op_id, 5) is OpStatus.COMPLETE
    assert "backend" in peer.read()
    assert np.array_equal(peer.blocks([12, 13]), local_blocks(local, [1, 2]))


def test_peer_cancels_our_op_and_we_cancel_theirs(local: TransferAgent, peer: Peer) -> None:
    theirs = peer.meta("readable", [1])
    assert local.cancel_remote(theirs, "decode aborted") == "cancelled"
    with pytest.raises(TransferError, match="cancelled by peer local: decode aborted"):
        local.pull(theirs, "kv", [1], timeout_s=2)
    ours = local.create_writable("kv", [2])
    local.cancel(ours.op_id, "decode aborted")
    answer = peer.call("push", meta=base64.b64encode(_encode(ours.meta)).decode(), blocks=[2],
                       timeout_s=2)  # fmt: skip
    assert "cancelled" in answer["error"]


def test_pusher_killed_mid_transfer_fails_our_waiter_fast(local: TransferAgent, peer: Peer) -> None:
    op = local.create_writable("kv", list(range(16)))
    peer.call("die_mid_transfer")
    peer.send("push", meta=base64.b64encode(_encode(op.meta)).decode(), blocks=list(range(16)),
              timeout_s=5)  # fmt: skip
    started = time.monotonic()
    with pytest.raises(TransferError, match=f"op={op.op_id}.*errored.*peer peer failed"):
        local.wait(op.op_id, 5)
    assert time.monotonic() - started < 3
    assert peer.proc.wait(5) == 9


def test_owner_killed_mid_pull_fails_the_puller(
    local: TransferAgent, peer: Peer, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    meta = peer.meta("readable", list(range(16)))
    if backend == "tcp":
        peer.call("die_mid_transfer")  # the owner streams half the bytes, then dies
    else:  # we copy the bytes ourselves: the owner dies while we copy, before Done
        shm = local.backend("shm")
        copy = shm.pull

        def kill_owner_then_copy(*args):
            peer.proc.kill()
            peer.proc.wait(5)
            return copy(*args)

        monkeypatch.setattr(shm, "pull", kill_owner_then_copy)
    started = time.monotonic()
    with pytest.raises(TransferError, match=f"op={meta.op_id} peer=peer"):
        local.pull(meta, "kv", list(range(16)), timeout_s=5)
    assert time.monotonic() - started < 3
    assert peer.proc.wait(5) != 0


def test_puller_killed_mid_transfer_errors_and_releases_our_op(
    local: TransferAgent, peer: Peer
) -> None:
    released = threading.Event()
    op = local.create_readable("kv", list(range(16)), on_release=lambda _: released.set())
    peer.call("die_mid_transfer")
    peer.send("pull", meta=base64.b64encode(_encode(op.meta)).decode(), blocks=list(range(16)),
              timeout_s=5)  # fmt: skip
    assert released.wait(5)
    assert op.status is OpStatus.ERRORED and "peer peer failed mid-transfer" in op.reason


def test_stalled_peer_times_out_with_transfer_error(local: TransferAgent, peer: Peer) -> None:
    meta = peer.meta("readable", [1, 2])
    os.kill(peer.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with pytest.raises(TransferError, match=r"timed out after 0\.5s"):
            local.pull(meta, "kv", [1, 2], timeout_s=0.5)
        assert time.monotonic() - started < 2
    finally:
        os.kill(peer.pid, signal.SIGCONT)


def test_killed_peer_segment_is_swept_by_the_next_agent() -> None:
    peer = Peer("victim")
    assert len(segments_of(peer.pid)) == 2  # its kv region and its shared-memory probe
    peer.proc.kill()
    peer.proc.wait(5)
    with TransferAgent(TransferAgentConfig(agent_id="sweeper", backends=("tcp",))):
        assert segments_of(peer.pid) == []


def _encode(meta) -> bytes:
    return encode_meta(meta)


if __name__ == "__main__":
    _peer_main(sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4]))
