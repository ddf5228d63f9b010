"""`Streamer`: what the generate pipeline needs of the engine side — a request's outputs,
routed by the model's router (the aggregated `EngineStreamer` with migration, or
disaggregation's two-leg `DisaggStreamer`)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Protocol

from tandem.protocols.engine import EngineOutput, PreprocessedRequest
from tandem.router.base import Router


class Streamer(Protocol):
    def stream(
        self, request: PreprocessedRequest, router: Router
    ) -> AsyncGenerator[EngineOutput, None]:
        """The request's outputs, one at a time, until one has a `finish_reason`."""
        ...

    def stream_batches(
        self, request: PreprocessedRequest, router: Router
    ) -> AsyncGenerator[list[EngineOutput], None]:
        """The request's outputs in batches: each time every output already arrived."""
        ...
