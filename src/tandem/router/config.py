"""`RouterConfig`: every knob of the routers (DESIGN.md §7), validated once."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.config_check import check_range
from tandem.router.lora import LoraPlacementConfig


@dataclass(frozen=True, slots=True, kw_only=True)
class RouterConfig:
    """Knobs shared by all policies; the KV policy reads most of them.

    `busy_*` thresholds exclude a worker from the choice; `queue_size` 0 means a request
    that finds every worker busy fails at once with Overloaded(retry_after_s).
    """

    worker_component: str = "backend"
    # 4, not 1: a prefill block costs far more TTFT than an active decode block costs ITL, and
    # with long prompts a decode term at weight 1 outvotes the cache (requests leave the worker
    # holding their prefix for one with a few fewer active blocks). Measured with `tandem bench
    # routers`, 8 mocker workers: shared-prefix synthetic (250 groups x 4, 8k prefix, 32 in
    # flight) hit 21 % -> 54 %, TTFT p50 213 -> 122 ms; Mooncake trace hit 30 % -> 41 %,
    # TTFT p50 395 -> 181 ms.
    overlap_weight: float = 4.0
    temperature: float = 0.0
    busy_active_blocks_fraction: float | None = None  # active KV blocks / total blocks
    busy_prefill_tokens: int | None = None  # active prefill tokens
    # requests in flight from this router (every policy): at it, a worker takes no more and
    # requests wait in the router queue, where classes, deadlines and fair shares apply
    busy_inflight_requests: int | None = None
    # of those, the slots per worker the batch class (protocols/tenancy.BATCH_PRIORITY) may
    # not take (one always stays theirs): the batch lane runs in idle capacity, interactive
    # requests find a free slot
    batch_headroom_requests: int = 1
    queue_size: int = 0
    queue_timeout_s: float = 30.0
    # sessions (router/session.py): a session's turns go to its last worker for this long
    # (0 = off) unless that worker is busy or `session_slack` requests above the least loaded
    session_ttl_s: float = 600.0
    session_slack: int = 4
    retry_after_s: float = 1.0
    use_kv_events: bool = True
    approx_ttl_s: float = 120.0  # --no-kv-events: how long a routed prefix counts as cached
    approx_max_blocks: int = 100_000  # --no-kv-events: cap of recorded blocks per worker
    active_ttl_s: float = 600.0  # an active request not finished after this is swept
    host_overlap_credit: float = 0.5
    disk_overlap_credit: float = 0.25
    block_size: int | None = None  # None = from the workers' model card (else 16)
    replica_sync: bool = False
    # LoRA adapters (router/lora.py): to holders, misses placed by rendezvous hashing, replicas
    lora: LoraPlacementConfig = field(default_factory=LoraPlacementConfig)
    kv_state_timeout_s: float = 5.0
    remote_timeout_s: float = 35.0  # --router remote: a route call (service queue included)
    zmq_endpoints: tuple[str, ...] = ()  # engine KV event publishers: "worker_id=tcp://h:p"
    seed: int | None = None
    # peer KV fetch (router/fetch.py): between workers started with --kv-fetch only, so on by
    # default; the fixed cost of one fetch (export + pull round trips) until the fetcher
    # publishes its measured one, and the prefill speed
    # assumed for a worker that publishes none (fast: it fetches only when clearly cheaper)
    kv_fetch: bool = True
    kv_fetch_setup_s: float = 0.005
    kv_fetch_prefill_s_per_token: float = 1e-4

    def __post_init__(self) -> None:
        check_range("overlap_weight", self.overlap_weight, low=0.0)
        check_range("temperature", self.temperature, low=0.0)
        if self.busy_active_blocks_fraction is not None:
            check_range(
                "busy_active_blocks_fraction", self.busy_active_blocks_fraction, low=0.0, high=1.0
            )
        if self.busy_prefill_tokens is not None:
            check_range("busy_prefill_tokens", self.busy_prefill_tokens, low=1)
        if self.busy_inflight_requests is not None:
            check_range("busy_inflight_requests", self.busy_inflight_requests, low=1)
        check_range("batch_headroom_requests", self.batch_headroom_requests, low=0)
        check_range("queue_size", self.queue_size, low=0)
        check_range("queue_timeout_s", self.queue_timeout_s, low=0.0)
        check_range("session_ttl_s", self.session_ttl_s, low=0.0, high=7 * 86400.0)
        check_range("session_slack", self.session_slack, low=0)
        check_range("retry_after_s", self.retry_after_s, low=0.0)
        check_range("approx_ttl_s", self.approx_ttl_s, low=0.001)
        check_range("approx_max_blocks", self.approx_max_blocks, low=1)
        check_range("active_ttl_s", self.active_ttl_s, low=0.001)
        check_range("host_overlap_credit", self.host_overlap_credit, low=0.0, high=1.0)
        check_range("disk_overlap_credit", self.disk_overlap_credit, low=0.0, high=1.0)
        if self.block_size is not None:
            check_range("block_size", self.block_size, low=1)
        check_range("kv_state_timeout_s", self.kv_state_timeout_s, low=0.001)
        check_range("remote_timeout_s", self.remote_timeout_s, low=0.001)
        check_range("kv_fetch_setup_s", self.kv_fetch_setup_s, low=0.0, high=60.0)
        check_range(
            "kv_fetch_prefill_s_per_token", self.kv_fetch_prefill_s_per_token, low=1e-9, high=10.0
        )
        for spec in self.zmq_endpoints:
            if "=" not in spec:
                raise ValueError(
                    f"zmq_endpoints entry {spec!r} malformed; expected 'worker_id=tcp://host:port'"
                )
