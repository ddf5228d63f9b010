"""KV transfer over TLS (throw-away CA): a TLS initiator pulls and pushes exact blocks over
the tcp backend from a TLS owner and cancels its ops; an initiator without TLS, or trusting
another CA, is refused (the owner logs why) and the op stays unclaimed."""

from __future__ import annotations

import logging
import secrets
import time
from pathlib import Path

import numpy as np
import pytest
from tests.support.certs import Pki, make_pki

from tandem.errors import TransferError
from tandem.runtime.tls import TlsFiles
from tandem.transfer import OpStatus, RegionLayout, TransferAgent, TransferAgentConfig

pytestmark = pytest.mark.timeout(30)
LAYOUT = RegionLayout.for_kv_cache(
    num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, dtype="float16"
)
SECRET = secrets.token_hex(32)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _tls(pki: Pki, ca: Path | None = None) -> TlsFiles:
    return TlsFiles(cert_file=str(pki.server.cert), key_file=str(pki.server.key),
                    ca_file=str(ca or pki.ca), require_client_cert=True)  # fmt: skip


def _agent(name: str, tls: TlsFiles | None, seed: int) -> TransferAgent:
    config = TransferAgentConfig(agent_id=name, backends=("tcp",), cluster_secret=SECRET, tls=tls)
    agent = TransferAgent(config)
    region = agent.register_region("kv", np.zeros(LAYOUT.span_bytes, np.uint8), LAYOUT)
    region.data[:] = np.random.default_rng(seed).integers(0, 256, region.data.size, np.uint8)
    return agent


def _blocks(agent: TransferAgent, ids: list[int]) -> np.ndarray:
    return agent.region("kv").blocks()[:, :, ids].copy()


def test_pull_push_cancel_over_tls(pki: Pki) -> None:
    owner, initiator = _agent("owner", _tls(pki), 1), _agent("initiator", _tls(pki), 2)
    try:
        op = owner.create_readable("kv", [3, 4])
        result = initiator.pull(op.meta, "kv", [0, 1], timeout_s=5)
        assert result.backend == "tcp"
        assert np.array_equal(_blocks(initiator, [0, 1]), _blocks(owner, [3, 4]))
        writable = owner.create_writable("kv", [6])
        initiator.push("kv", [5], writable.meta, timeout_s=5)
        assert owner.wait(writable.op_id, 2) is OpStatus.COMPLETE
        assert np.array_equal(_blocks(owner, [6]), _blocks(initiator, [5]))
        pending = owner.create_readable("kv", [7])
        assert initiator.cancel_remote(pending.meta, "test") == "cancelled"
    finally:
        initiator.close()
        owner.close()


@pytest.mark.parametrize("how", ["plaintext", "other-ca"])
def test_initiator_without_the_right_tls_is_refused(pki: Pki, how: str, caplog) -> None:
    caplog.set_level(logging.DEBUG, logger="tandem.transfer.server")
    tls = None if how == "plaintext" else _tls(pki, ca=pki.other_ca)
    owner, initiator = _agent("owner", _tls(pki), 1), _agent("initiator", tls, 2)
    try:
        op = owner.create_readable("kv", [3])
        with pytest.raises(TransferError):
            initiator.pull(op.meta, "kv", [0], timeout_s=2)
        assert owner.find_op(op.op_id).status is OpStatus.INITIALIZED  # never claimed
        # the owner logs the refusal from its connection's thread, after the initiator has
        # given up: wait for it (bounded) rather than close the owner under it
        deadline = time.monotonic() + 10.0
        while "TLS failed" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        initiator.close()
        owner.close()
    assert "refusing transfer connection" in caplog.text and "TLS failed" in caplog.text
