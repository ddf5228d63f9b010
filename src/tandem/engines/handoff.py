"""The engine-side KV handoff contract of disaggregated prefill/decode (DESIGN.md §4).

An engine that can be split into prefill and decode workers offers a `KvHandoff`. The
prefill side runs a prompt to its first token and keeps the prompt's KV blocks *pinned*
(neither freed nor evicted) under the request id until `unpin`; the decode side
`allocate`s blocks for an incoming prompt, lets the transfer agent write the KV into them
and `resume`s decoding from there. `tandem.disagg.worker_engine` drives both halves and the
`TransferAgent`; engines never see the agent except through `adopt_kv_cache`.

It lives with the engines (not in `tandem.disagg`) because engines implement it and imports
flow down DESIGN.md §2's table: an engine module never imports `tandem.disagg`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.engines.output_stream import DirectSink
from tandem.protocols.engine import EngineOutput, PreprocessedRequest


@dataclass(frozen=True, slots=True, kw_only=True)
class KvCacheSpec:
    """Shape of an engine's KV cache tensor ``[layers, 2, blocks, block_size, kv_heads,
    head_dim]``; the transfer layer lays a shared-memory region out the same way."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "float32"

    @property
    def shape(self) -> tuple[int, ...]:
        return (
            self.num_layers, 2, self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim
        )  # fmt: skip


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchFigures:
    """KV bytes per token, the transfer bandwidth assumed until fetches measure it, and the
    engine's prefill seconds per token when it knows them (None: the router's default)."""

    bytes_per_token: int
    bandwidth_bytes_per_s: float
    prefill_s_per_token: float | None = None


class KvHandoff(Protocol):
    """Engine-side half of a prefill → decode KV handoff.

    Unless noted, methods run on the engine's event loop. `unpin` and `release` may be
    called from any thread (the transfer agent releases ops from its own threads) and are
    idempotent. Every block a handoff pins or allocates counts in the engine's
    `load().num_active_blocks` until it is unpinned, released or handed to a resumed
    request, so a leak shows there.
    """

    def kv_cache_spec(self) -> KvCacheSpec | None:
        """The real KV tensor's shape, or None when the engine moves no bytes (mocker)."""
        ...

    def adopt_kv_cache(self, tensor: Any) -> None:
        """Use ``tensor`` (shaped `kv_cache_spec().shape`, e.g. a shared-memory region) as
        the engine's KV cache from now on. Called once, before any request."""
        ...

    def fetch_figures(self) -> FetchFigures:
        """What a peer KV fetch to or from this engine costs, for the router (issue 31)."""
        ...

    def transfer_delay_s(self, num_tokens: int) -> float:
        """Extra simulated time a transfer of ``num_tokens`` tokens of KV takes (mocker)."""
        ...

    def prefill(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        """Run ``request`` to its first token (one output, finish_reason set). If it
        finished normally its prompt blocks stay pinned under its request id; an aborted or
        failed prefill pins nothing."""
        ...

    def pinned_blocks(self, request_id: str) -> list[int]:
        """Block ids holding the prompt KV of a finished prefill; KeyError if none pinned."""
        ...

    def unpin(self, request_id: str) -> None:
        """Release a prefill's pins (thread-safe, idempotent)."""
        ...

    def pin_cached(self, request_id: str, block_hashes: list[int]) -> list[int]:
        """Peer KV fetch, holder side: pin under ``request_id`` the cached blocks of the
        longest prefix of the chained ``block_hashes`` and return their ids ([] and no pin
        when the first is not cached); `unpin` releases them. Thread-safe, blocking: the
        transfer agent calls it from a connection thread."""
        ...

    async def cached_prefix_blocks(self, block_hashes: list[int]) -> int:
        """How many leading blocks of the chained ``block_hashes`` this engine's prefix cache
        holds now (no pin: a peer KV fetch pulls only the blocks after them)."""
        ...

    async def allocate(
        self,
        request: PreprocessedRequest,
        num_tokens: int,
        *,
        prefix_only: bool = False,
        num_cached_blocks: int = 0,
    ) -> list[int]:
        """Reserve blocks for the first ``num_tokens`` tokens of ``request`` on the decode
        side and return them in order; raises `Overloaded` when the pool cannot hold them
        now. Tokens beyond ``num_tokens`` are a decode-first prefill's first token, or with
        ``prefix_only`` (a peer KV fetch of a prompt prefix) prompt still to compute. The
        blocks are fresh, except the first ``num_cached_blocks``: those are the prefix
        cache's own blocks of the prompt, shared (a peer fetch pulls only what follows);
        `TransferError` when the cache no longer holds that many."""
        ...

    def release(self, request_id: str) -> None:
        """Free an allocation that will not be resumed (thread-safe, idempotent)."""
        ...

    def resume(
        self,
        request: PreprocessedRequest,
        num_computed: int,
        *,
        direct: DirectSink | None = None,
    ) -> AsyncIterator[EngineOutput]:
        """Decode ``request`` whose first ``num_computed`` tokens' KV now sits in its
        allocated blocks (``request.token_ids[num_computed:]`` are computed next). Streams
        like `Engine.generate`, ``direct`` as there (an engine that takes no direct sink
        ignores it); closing it early aborts the request. ``request.token_ids``
        may extend the tokens given to `allocate` (decode-first: the prefill's first token,
        already sent to the client): they are taken as given, never emitted again, and
        ``request.stop`` is the budget left after them."""
        ...
