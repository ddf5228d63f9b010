"""Transfer agents with one KV region of random bytes, for the transfer plane's tests."""

from __future__ import annotations

import numpy as np

from tandem.transfer import RegionLayout, TransferAgent, TransferAgentConfig


def make_agent(
    name: str, backends: tuple[str, ...], layout: RegionLayout, *, shm: bool, seed: int
) -> TransferAgent:
    """An agent whose region "kv" (in /dev/shm when `shm`, else registered process memory)
    holds random bytes drawn from `seed`."""
    agent = TransferAgent(TransferAgentConfig(agent_id=name, backends=backends))
    if shm:
        region = agent.create_region("kv", layout)
    else:
        region = agent.register_region("kv", np.zeros(layout.span_bytes, np.uint8), layout)
    region.data[:] = np.random.default_rng(seed).integers(0, 256, region.data.size, np.uint8)
    return agent
