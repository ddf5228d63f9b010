"""The `Router` protocol the frontend (or `tandem router`) drives.

`make_router(policy, ...)` in tandem.router.registry builds one by name:
round_robin, random, least_loaded, kv.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.protocols.engine import KvFetchHint, PreprocessedRequest
from tandem.router.config import RouterConfig
from tandem.router.metrics import RouterMetrics


@dataclass(frozen=True, slots=True, kw_only=True)
class RouteDecision:
    instance_id: str
    address: str
    overlap_blocks: int = 0  # prompt blocks the chosen worker already holds
    request_blocks: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    # the prompt's chained block hashes the KV router computed, and their block size (None, 0
    # for a policy that hashes nothing); they travel with the request (encode_request)
    block_hashes: list[int] | None = None
    block_size: int = 0
    # the KV router's peer fetch for the chosen worker (router/fetch.py); it travels with
    # the request (PreprocessedRequest.kv_fetch)
    kv_fetch: KvFetchHint | None = None


class RouteHistory(Protocol):
    """What a router remembers of its recent choices (`/dashboard`); `DecisionLog` is one."""

    @property
    def num_decisions(self) -> int: ...

    def num_routed(self, worker_id: str) -> int: ...

    def blocks(self) -> tuple[int, int]:
        """(prefix blocks found cached, prompt blocks) routed to every worker."""
        ...

    def hit_rate(self, worker_id: str | None = None) -> float | None:
        """Cached / prompt blocks routed (to `worker_id`, or to all); None before any."""
        ...

    def snapshot(self, limit: int) -> list[dict[str, Any]]:
        """The last `limit` decisions, newest first, as JSON-ready dicts."""
        ...


class Router(Protocol):
    @property
    def policy(self) -> str:
        """The routing policy's name (`round_robin`, `kv`, ..., `remote`)."""
        ...

    @property
    def decisions(self) -> RouteHistory:
        """The recent choices; empty for a router whose choices are made elsewhere
        (`remote`: the router service's own)."""
        ...

    @property
    def config(self) -> RouterConfig: ...

    @property
    def metrics(self) -> RouterMetrics | None:
        """This router's counters (the frontend's /metrics); None when they live elsewhere
        (`remote`: the router service exports its own)."""
        ...

    @property
    def num_queued(self) -> int:
        """Requests waiting in this router's queue for a worker that is not busy."""
        ...

    async def start(self) -> None:
        """Begin following instances and events (idempotent)."""
        ...

    async def route(
        self, request: PreprocessedRequest, *, exclude: frozenset[str] = frozenset()
    ) -> RouteDecision:
        """Pick an instance for `request` (honouring request.routing.worker_id) and record
        it as active there. Raises NoWorkersAvailable when none serves the model, or
        Overloaded(retry_after_s) when all are busy. Never picks an id in `exclude`."""
        ...

    def on_first_token(self, request_id: str) -> None:
        """The request's prefill finished."""
        ...

    def on_finish(self, request_id: str, output_tokens: int | None = None) -> None:
        """The request finished, failed or was cancelled (idempotent), after its worker
        generated `output_tokens` for this dispatch (None: not known)."""
        ...

    def explain(self, request: PreprocessedRequest) -> dict[str, Any]:
        """Every candidate's inputs to the choice and the choice, without routing."""
        ...

    async def explain_choice(self, request: PreprocessedRequest) -> dict[str, Any]:
        """`explain` from where the choice is made (`remote`: the router service's)."""
        ...

    def worker_loads(self) -> dict[str, dict[str, float]]:
        """Per-worker load as the router sees it (for /metrics)."""
        ...

    async def close(self) -> None: ...
