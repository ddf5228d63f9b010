"""The optional RDMA-capable backends (Mooncake over its TCP transport, NIXL over UCX) move
blocks exactly, each tried with TCP as the fallback. `make venv` installs both; where one is
absent or its engine does not start the test skips, except under CI=true, where it fails."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import pytest
from tests.support.optional import in_ci, require

from tandem.transfer import OpStatus, RegionLayout, TransferAgent, TransferAgentConfig

pytestmark = pytest.mark.timeout(60)

LAYOUT = RegionLayout.for_kv_cache(
    num_layers=3, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8, dtype="float16"
)


class Backend(NamedTuple):
    name: str
    module: str  # imported first: a skip (CI: a failure) says why it does not import
    install: str
    agent_prefix: str


BACKENDS = [
    Backend("mooncake", "mooncake.engine", "make venv installs mooncake-transfer-engine-non-cuda "
            "and Debian's libibverbs1 (make libibverbs)", "mc"),
    Backend("nixl", "nixl", "make venv installs nixl==1.5.1", "nixl"),
]  # fmt: skip


@pytest.fixture(scope="module", params=BACKENDS, ids=lambda b: b.name)
def agents(request):
    backend: Backend = request.param
    require(backend.module, backend.install)
    backends = (backend.name, "tcp")
    a = TransferAgent(TransferAgentConfig(agent_id=f"{backend.agent_prefix}-a", backends=backends))
    b = TransferAgent(TransferAgentConfig(agent_id=f"{backend.agent_prefix}-b", backends=backends))
    if backend.name not in a.backend_names:  # the reason is in the INFO log
        reason = f"{backend.name} imports but its engine did not start on 127.0.0.1"
        pytest.fail(reason) if in_ci() else pytest.skip(reason)
    rng = np.random.default_rng(5)
    a.register_region("kv", rng.integers(0, 256, LAYOUT.span_bytes, np.uint8), LAYOUT)
    b.register_region("kv", np.zeros(LAYOUT.span_bytes, np.uint8), LAYOUT)
    yield backend.name, a, b
    b.close()
    a.close()


def test_pull_and_push_are_exact(agents) -> None:
    name, a, b = agents
    op = a.create_readable("kv", [1, 6, 2])
    assert b.pull(op.meta, "kv", [0, 3, 7], timeout_s=10).backend == name
    assert a.wait(op.op_id, 5) is OpStatus.COMPLETE
    got, want = b.region("kv").blocks(), a.region("kv").blocks()
    assert np.array_equal(got[:, :, [0, 3, 7]], want[:, :, [1, 6, 2]])
    writable = a.create_writable("kv", [5], layers=(2, 3))
    before = want[:2, :, 5].copy()
    assert b.push("kv", [4], writable.meta, timeout_s=10).backend == name
    assert a.wait(writable.op_id, 5) is OpStatus.COMPLETE
    assert np.array_equal(want[2, :, 5], got[2, :, 4])
    assert np.array_equal(want[:2, :, 5], before)


def test_regions_registered_later_are_reachable(agents) -> None:
    _, a, b = agents
    small = RegionLayout.contiguous(num_blocks=2, block_bytes=64)
    a.register_region("late", np.full(small.span_bytes, 7, np.uint8), small)
    b.register_region("late", np.zeros(small.span_bytes, np.uint8), small)
    op = a.create_readable("late", [1])
    b.pull(op.meta, "late", [0], timeout_s=10)
    assert (b.region("late").blocks()[0, 0, 0] == 7).all()
