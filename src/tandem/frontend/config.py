"""`FrontendConfig`: every knob of the OpenAI frontend, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tandem.disagg.config import DisaggRouteConfig
from tandem.multimodal.config import ImageConfig
from tandem.router.config import RouterConfig


def _check(name: str, value: float, low: float, allowed: str) -> None:
    if value < low:
        raise ValueError(f"{name}={value} out of range; expected {allowed}")


@dataclass(frozen=True, slots=True, kw_only=True)
class FrontendConfig:
    """HTTP listener, routing policy, migration and admission limits.

    `max_inflight_requests` bounds the engine requests admitted at once (every queue is
    bounded; a request counts its fan-out, prompts × n); past it a request gets 503 +
    Retry-After. `max_fanout` caps one request's fan-out (400 beyond).
    `request_timeout_s` becomes each request's deadline on the request plane."""

    host: str = "127.0.0.1"
    port: int = 8000
    router_policy: str = "round_robin"
    router: RouterConfig = field(default_factory=RouterConfig)
    migration_limit: int = 0
    max_inflight_requests: int = 1024
    max_fanout: int = 128
    max_body_bytes: int = 8 << 20
    request_timeout_s: float = 600.0
    retry_after_s: float = 1.0
    worker_component: str = "backend"
    worker_endpoint: str = "generate"
    tokenizer_cache_dir: Path | None = None
    # prefill/decode split over the `prefill` and worker_component pools (tandem.disagg)
    disagg: DisaggRouteConfig = field(default_factory=DisaggRouteConfig)
    # image parts of chat requests: URL policy and limits (tandem.multimodal)
    images: ImageConfig = field(default_factory=ImageConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} out of range; expected [0, 65535]")
        _check("migration_limit", self.migration_limit, 0, ">= 0")
        _check("max_inflight_requests", self.max_inflight_requests, 1, ">= 1")
        _check("max_fanout", self.max_fanout, 1, ">= 1")
        _check("max_body_bytes", self.max_body_bytes, 1024, ">= 1024")
        _check("request_timeout_s", self.request_timeout_s, 0.001, "> 0")
        _check("retry_after_s", self.retry_after_s, 0.0, ">= 0")
