"""Shared memory on proof, not by name (issue 30 item 5): a peer process with the same hostname
and boot id but its own /dev/shm (`unshare -m` and a tmpfs there: two containers on one
machine) gets TCP, chosen once per peer without an shm attempt or a warning, and exact blocks;
a peer on the same /dev/shm gets shm. The peer is tests/integration/test_transfer_processes.py
run as a script."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from tests.integration.test_transfer_processes import LAYOUT, Peer

import tandem.transfer.shm as shm_module
from tandem.transfer import TransferAgent, TransferAgentConfig

pytestmark = pytest.mark.timeout(60)
PEER_SCRIPT = Path(__file__).with_name("test_transfer_processes.py")


class ContainedPeer(Peer):
    """A `Peer` in its own mount namespace with a private tmpfs on /dev/shm."""

    def __init__(self, agent_id: str, *, seed: int) -> None:
        script = 'mount -t tmpfs none /dev/shm && exec "$@"'
        argv = [sys.executable, str(PEER_SCRIPT), agent_id, "shm,tcp", "1", str(seed)]
        self.proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh", *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        hello = self.read(60)
        self.address, self.pid = tuple(hello["address"]), hello["pid"]

    def stderr(self) -> str:
        self.close()
        assert self.proc.stderr is not None
        return self.proc.stderr.read()


def _can_unshare() -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "a private /dev/shm needs root and unshare"
    done = subprocess.run(
        ["unshare", "-m", "sh", "-c", "mount -t tmpfs none /dev/shm"], capture_output=True
    )
    return None if done.returncode == 0 else f"unshare -m failed: {done.stderr!r}"


@pytest.fixture
def local() -> Iterator[TransferAgent]:
    agent = TransferAgent(TransferAgentConfig(agent_id="local", backends=("shm", "tcp")))
    agent.create_region("kv", LAYOUT).data[:] = np.random.default_rng(9).integers(
        0, 256, LAYOUT.span_bytes, np.uint8)  # fmt: skip
    yield agent
    agent.close()


@pytest.fixture
def probe_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The probes this process read back (each a look into /dev/shm)."""
    reads: list[str] = []
    real = shm_module._read_back

    def counted(probe: str, digest: bytes) -> str | None:
        reads.append(probe)
        return real(probe, digest)

    monkeypatch.setattr(shm_module, "_read_back", counted)
    return reads


def test_same_hostname_separate_dev_shm_is_tcp_on_proof(
    local: TransferAgent, probe_reads: list[str], caplog: pytest.LogCaptureFixture
) -> None:
    if (why := _can_unshare()) is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    caplog.set_level(logging.DEBUG, logger="tandem.transfer")
    peer = ContainedPeer("contained", seed=4)
    try:
        for i in range(5):  # pulls from the contained peer's regions
            blocks = [i, i + 5]
            meta = peer.meta("readable", blocks)
            assert local.pull(meta, "kv", [20 + i, 26 + i], timeout_s=10).backend == "tcp"
            got = local.region("kv").blocks()[:, :, [20 + i, 26 + i]]
            assert np.array_equal(got, peer.blocks(blocks))
        for i in range(3):  # and the peer pulls from ours: tcp its way too
            op = local.create_readable("kv", [i])
            answer = peer.call("pull", meta=_meta_b64(op.meta), blocks=[30], timeout_s=10)
            assert answer == {"backend": "tcp"}
            assert np.array_equal(peer.blocks([30]), local.region("kv").blocks()[:, :, [i]])
    finally:
        peer_log = peer.stderr()
    assert len(probe_reads) == 1  # the verdict is kept per peer, not tried per transfer
    selection = [r for r in caplog.records if r.name == "tandem.transfer.selection"]
    assert [r.levelno for r in selection] == [logging.INFO] + [logging.DEBUG] * 4
    assert "no shared /dev/shm with peer" in selection[0].getMessage()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert "FALLBACK" not in peer_log and "cannot map" not in peer_log, peer_log


def test_same_dev_shm_is_shm(local: TransferAgent, probe_reads: list[str]) -> None:
    peer = Peer("sibling", seed=5)
    try:
        for i in range(3):
            meta = peer.meta("readable", [i])
            assert local.pull(meta, "kv", [10 + i], timeout_s=10).backend == "shm"
            assert np.array_equal(local.region("kv").blocks()[:, :, [10 + i]], peer.blocks([i]))
        op = local.create_readable("kv", [1])
        assert peer.call("pull", meta=_meta_b64(op.meta), blocks=[31], timeout_s=10) == {
            "backend": "shm"
        }
    finally:
        peer.close()
    assert len(probe_reads) == 1


def _meta_b64(meta: object) -> str:
    import base64

    from tandem.transfer import encode_meta

    return base64.b64encode(encode_meta(meta)).decode()  # type: ignore[arg-type]
