"""Peer KV fetch (issue 31): whether a candidate should pull a cached prefix from the worker
that holds it instead of recomputing it, and what that costs. Pure functions.

A candidate holding ``local_blocks`` of the prompt's prefix, beside a holder with
``holder_blocks`` > ``local_blocks``, can pull the holder's blocks after its own (the
fetcher keeps its cached leading blocks and fills fresh ones after them) over the transfer
plane:

    fetch_s     = setup_s + (holder_blocks − local_blocks) · B · bytes_per_token / bandwidth
    recompute_s = (holder_blocks − local_blocks) · B · prefill_s_per_token

It pays when fetch_s < recompute_s. The KV cost then counts the fetched blocks as cached,
less the fetch's time in recompute-equivalent blocks (``credit_blocks``), so the fetch
competes with the holder's own cache hit and its queue on one scale.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tandem.protocols.engine import FETCH_METADATA_KEY


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchSource:
    """A worker's peer-fetch endpoint and transfer figures, from its discovery metadata."""

    address: tuple[str, int]  # its transfer agent
    agent_id: str
    bytes_per_token: int  # KV bytes of one token (all layers)
    bandwidth_bytes_per_s: float  # its transfer plane's, measured or declared
    prefill_s_per_token: float | None  # its own prefill speed, when it knows it
    # how its KV moves (KvFetchHint.protocol): None, tandem's transfer agents; a fetcher
    # pulls only from a holder of its own protocol
    protocol: str | None = None

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> FetchSource | None:
        """None when the worker offers no peer fetch (or a malformed entry)."""
        entry = metadata.get(FETCH_METADATA_KEY)
        if not isinstance(entry, Mapping):
            return None
        try:
            host, port = entry["address"]
            prefill = entry.get("prefill_s_per_token")
            protocol = entry.get("protocol")
            return cls(
                address=(str(host), int(port)),
                agent_id=str(entry["agent_id"]),
                bytes_per_token=int(entry["bytes_per_token"]),
                bandwidth_bytes_per_s=float(entry["bandwidth_bytes_per_s"]),
                prefill_s_per_token=None if prefill is None else float(prefill),
                protocol=None if protocol is None else str(protocol),
            )
        except (KeyError, TypeError, ValueError):
            return None


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchPlan:
    """One candidate's fetch from one holder: what moves and what it saves."""

    source_id: str
    first_block: int  # the candidate's own prefix: the pull starts after it
    num_blocks: int  # the holder's prefix blocks pulled (after first_block)
    num_bytes: int
    fetch_ms: float
    recompute_ms: float  # recomputing the blocks beyond the candidate's own prefix
    credit_blocks: float  # blocks the fetch adds to the candidate's overlap, net of its time

    @property
    def pays(self) -> bool:
        return self.fetch_ms < self.recompute_ms


def plan_fetch(
    *,
    source_id: str,
    local_blocks: int,
    holder_blocks: int,
    block_size: int,
    bytes_per_token: int,
    bandwidth_bytes_per_s: float,
    prefill_s_per_token: float,
    setup_s: float,
) -> FetchPlan | None:
    """The fetch of the holder's blocks after the ``local_blocks`` a candidate holds; None
    when the holder has nothing more. Whether it pays is `FetchPlan.pays`."""
    gained = holder_blocks - local_blocks
    if gained <= 0 or holder_blocks <= 0:
        return None
    num_bytes = gained * block_size * bytes_per_token
    fetch_s = setup_s + num_bytes / bandwidth_bytes_per_s
    recompute_s = gained * block_size * prefill_s_per_token
    block_s = block_size * prefill_s_per_token
    return FetchPlan(
        source_id=source_id,
        first_block=local_blocks,
        num_blocks=gained,
        num_bytes=num_bytes,
        fetch_ms=fetch_s * 1e3,
        recompute_ms=recompute_s * 1e3,
        credit_blocks=max(gained - fetch_s / block_s, 0.0),
    )


def best_holder(overlaps: Mapping[str, float], sources: Mapping[str, FetchSource]) -> str | None:
    """The worker offering peer fetch that holds the longest prefix (ties: smallest id)."""
    best: str | None = None
    for worker_id in sorted(sources):
        depth = int(overlaps.get(worker_id, 0.0))
        if depth > 0 and (best is None or depth > int(overlaps.get(best, 0.0))):
            best = worker_id
    return best
