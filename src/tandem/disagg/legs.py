"""What the two-leg flow's pieces need of each other, as protocols (so `orchestrator` and
`decode_first` import these, never each other).

`PoolStreamer` is what `DisaggStreamer` needs of the aggregated streamer it wraps (the
frontend's `EngineStreamer` over the decode pool): `stream(request, router)`. `LegPair` is
what the decode-first leg pair (`decode_first`) needs of the `DisaggStreamer` that starts
it: the decode pool's streamer, the prefill leg, the cluster secret to cancel a rendezvous
with, and the count of legs that disagreed on the first token.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Protocol

from tandem.protocols.engine import EngineOutput, PreprocessedRequest
from tandem.router.base import RouteDecision, Router
from tandem.runtime.tls import TlsFiles


class PoolStreamer(Protocol):
    def stream(
        self, request: PreprocessedRequest, router: Router
    ) -> AsyncGenerator[EngineOutput, None]:
        """The request's outputs from the worker `router` picks (migrating on loss)."""
        ...


class LegPair(Protocol):
    @property
    def aggregated(self) -> PoolStreamer: ...

    @property
    def cluster_secret(self) -> str | None: ...

    @property
    def transfer_tls(self) -> TlsFiles | None: ...

    num_rejoined: int  # decode-first legs that disagreed on the first token

    async def prefill_or_none(
        self,
        request: PreprocessedRequest,
        router: Router,
        first_at: RouteDecision,
        head: asyncio.Future[EngineOutput | None] | None = None,
    ) -> EngineOutput | None:
        """The prefill leg's final output, or None when no prefill worker could do it;
        `head` gets the first output with tokens as soon as it streams in (None if none)."""
        ...
