"""`FrontendConfig`: every knob of the OpenAI frontend, validated once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from tandem.config_check import check_range
from tandem.disagg.config import DisaggRouteConfig
from tandem.frontend.api.responses.store import ResponseStoreConfig
from tandem.frontend.batch.config import BatchConfig
from tandem.frontend.http.config import HttpConfig
from tandem.frontend.lora_config import LoraApiConfig
from tandem.frontend.watchdog import StallConfig
from tandem.multimodal.config import ImageConfig
from tandem.router.config import RouterConfig


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
    tenants_file: Path | None = None  # issue 33: tenants, weights, limits (frontend/tenancy.py)
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
    # the bounded store behind /v1/responses' previous_response_id (frontend/api/responses/store.py)
    responses_store: ResponseStoreConfig = field(default_factory=ResponseStoreConfig)
    # LoRA adapters: `--lora` at start, `--lora-dir` for runtime loads (frontend/adapters.py)
    lora: LoraApiConfig = field(default_factory=LoraApiConfig)
    # the batch lane: /v1/files, /v1/batches, its database and runner (frontend/batch/)
    batch: BatchConfig = field(default_factory=BatchConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port={self.port} out of range; expected [0, 65535]")
        check_range("migration_limit", self.migration_limit, low=0)
        check_range("max_inflight_requests", self.max_inflight_requests, low=1)
        check_range("max_fanout", self.max_fanout, low=1)
        check_range("request_timeout_s", self.request_timeout_s, low=0.001)
        check_range("retry_after_s", self.retry_after_s, low=0)
        check_range("health_stale_s", self.health_stale_s, low=0.1)
        for name, keys in (("api_keys", self.api_keys), ("admin_api_keys", self.admin_api_keys)):
            if any(not key or key != key.strip() for key in keys):
                raise ValueError(f"{name} holds an empty key or one with spaces around it")
        check_range("request_stats_interval_s", self.request_stats_interval_s, low=0)
