"""`FrontendConfig`: every knob of the OpenAI frontend, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tandem.disagg.config import DisaggRouteConfig
from tandem.frontend.response_store import ResponseStoreConfig
from tandem.frontend.watchdog import StallConfig
from tandem.multimodal.config import ImageConfig
from tandem.router.config import RouterConfig


def _check(name: str, value: float, low: float, allowed: str) -> None:
    if value < low:
        raise ValueError(f"{name}={value} out of range; expected {allowed}")


@dataclass(frozen=True, slots=True, kw_only=True)
class HttpConfig:
    """Limits of the HTTP edge (STYLE: every socket reader has sizes, timeouts and a cap).

    `header_timeout_s` bounds the time from a request's first byte to the end of its headers,
    `body_timeout_s` from there to the end of its body, `idle_timeout_s` a keep-alive connection
    with no request; a peer past them gets 408 (idle: a plain close). `max_connections` is
    lowered at start to what RLIMIT_NOFILE leaves after a reserve for discovery, the event bus
    and the request plane. `drain_grace_s`: on SIGTERM, how long in-flight responses may run.
    `reuse_port`: bind with SO_REUSEPORT, so several frontend processes share one port and the
    kernel spreads new connections over them (`tandem serve --frontend-processes`)."""

    max_body_bytes: int = 8 << 20
    max_header_bytes: int = 64 << 10
    max_header_count: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    idle_timeout_s: float = 30.0
    max_connections: int = 10_000
    drain_grace_s: float = 30.0
    reuse_port: bool = False

    def __post_init__(self) -> None:
        _check("max_body_bytes", self.max_body_bytes, 1024, ">= 1024")
        _check("max_header_bytes", self.max_header_bytes, 1024, ">= 1024")
        _check("max_header_count", self.max_header_count, 8, ">= 8")
        _check("header_timeout_s", self.header_timeout_s, 0.01, ">= 0.01")
        _check("body_timeout_s", self.body_timeout_s, 0.01, ">= 0.01")
        _check("idle_timeout_s", self.idle_timeout_s, 0.01, ">= 0.01")
        _check("max_connections", self.max_connections, 1, ">= 1")
        _check("drain_grace_s", self.drain_grace_s, 0.0, ">= 0")


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontendConfig:
    """HTTP listener, routing policy, migration and admission limits.

    `max_inflight_requests` bounds the engine requests admitted at once (every queue is
    bounded; a request counts its fan-out, prompts × n); past it a request gets 503 +
    Retry-After. `max_fanout` caps one request's fan-out (400 beyond).
    `request_timeout_s` becomes each request's deadline on the request plane.
    `api_keys`: when any, the OpenAI routes and /metrics need `Authorization: Bearer <key>`;
    `admin_api_keys`: the admin routes (`POST /v1/route/explain`) need one of them and are
    off (403) when there are none. `health_stale_s`: a worker whose load metrics have not
    arrived for this long counts as not alive in /health."""

    host: str = "127.0.0.1"
    port: int = 8000
    router_policy: str = "round_robin"
    router: RouterConfig = field(default_factory=RouterConfig)
    # a stream broken by a dead or frozen worker moves on (migration costs the frontend
    # nothing it does not keep anyway: it tracks each stream's tokens): see args.py
    migration_limit: int = 3
    max_inflight_requests: int = 1024
    max_fanout: int = 128
    http: HttpConfig = field(default_factory=HttpConfig)
    api_keys: tuple[str, ...] = ()
    admin_api_keys: tuple[str, ...] = ()
    health_stale_s: float = 5.0
    request_timeout_s: float = 600.0
    retry_after_s: float = 1.0
    worker_component: str = "backend"
    worker_endpoint: str = "generate"
    tokenizer_cache_dir: Path | None = None
    # per-interval request stats on the event plane for the planner (DESIGN.md §11); 0 = off
    request_stats_interval_s: float = 1.0
    # prefill/decode split over the `prefill` and worker_component pools (tandem.disagg)
    disagg: DisaggRouteConfig = field(default_factory=DisaggRouteConfig)
    # image parts of chat requests: URL policy and limits (tandem.multimodal)
    images: ImageConfig = field(default_factory=ImageConfig)
    # progress watchdog: stalled streams break like dead workers' (frontend/watchdog.py)
    stall: StallConfig = field(default_factory=StallConfig)
    # the bounded store behind /v1/responses' previous_response_id (frontend/response_store.py)
    responses_store: ResponseStoreConfig = field(default_factory=ResponseStoreConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} out of range; expected [0, 65535]")
        _check("migration_limit", self.migration_limit, 0, ">= 0")
        _check("max_inflight_requests", self.max_inflight_requests, 1, ">= 1")
        _check("max_fanout", self.max_fanout, 1, ">= 1")
        _check("request_timeout_s", self.request_timeout_s, 0.001, "> 0")
        _check("retry_after_s", self.retry_after_s, 0.0, ">= 0")
        _check("health_stale_s", self.health_stale_s, 0.1, ">= 0.1")
        for name, keys in (("api_keys", self.api_keys), ("admin_api_keys", self.admin_api_keys)):
            if any(not key or key != key.strip() for key in keys):
                raise ValueError(f"{name} holds an empty key or one with spaces around it")
        _check("request_stats_interval_s", self.request_stats_interval_s, 0.0, ">= 0")
