"""`cancel_soon` releases a peer's op from a thread, without blocking the loop; an agent's
`families()` are its counters as ``tandem_transfer_*``."""

from __future__ import annotations

import asyncio
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
    TransferOp,
    cancel_soon,
)

pytestmark = pytest.mark.timeout(20)
LAYOUT = RegionLayout.contiguous(num_blocks=8, block_bytes=64)


@pytest.fixture
def owner() -> Iterator[TransferAgent]:
    agent = TransferAgent(TransferAgentConfig(agent_id="owner", backends=("tcp",)))
    agent.register_region("kv", np.zeros(LAYOUT.span_bytes, np.uint8), LAYOUT)
    yield agent
    agent.close()


async def test_cancel_soon_releases_the_op_from_a_thread(owner: TransferAgent) -> None:
    released = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_release(op: TransferOp) -> None:
        loop.call_soon_threadsafe(released.set)

    op = owner.create_readable("kv", [1, 2], on_release=on_release)
    cancel_soon(op.meta, "request aborted", sender_id="frontend", cluster_secret=None)
    await asyncio.wait_for(released.wait(), 5)
    assert op.status is OpStatus.CANCELLED
    assert op.reason == "cancelled by peer frontend: request aborted"


async def test_an_agent_cancels_a_peer_op_soon(owner: TransferAgent) -> None:
    op = owner.create_writable("kv", [3])
    with TransferAgent(TransferAgentConfig(agent_id="peer", backends=("tcp",))) as peer:
        peer.cancel_remote_soon(OpRef(address=owner.address, op_id=op.op_id), "push failed")
        with pytest.raises(TransferError, match="cancelled by peer peer: push failed"):
            await owner.wait_async(op.op_id, 5)


def test_families_count_ops_by_final_status_and_bytes(owner: TransferAgent) -> None:
    with TransferAgent(TransferAgentConfig(agent_id="peer", backends=("tcp",))) as peer:
        peer.register_region("kv", np.zeros(LAYOUT.span_bytes, np.uint8), LAYOUT)
        done = owner.create_readable("kv", [0, 1])
        peer.pull(done.meta, "kv", [4, 5], timeout_s=5)
        owner.cancel(owner.create_readable("kv", [2]).op_id)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in owner.families()
        for s in family.samples
    }
    ops = "tandem_transfer_operations_total"
    assert samples[(ops, (("status", "created"),))] == 2
    assert samples[(ops, (("status", "complete"),))] == 1
    assert samples[(ops, (("status", "cancelled"),))] == 1
    assert samples[("tandem_transfer_bytes_total", (("direction", "sent"),))] == 2 * 64
