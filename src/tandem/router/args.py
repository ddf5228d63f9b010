"""Router flags → `RouterConfig` (defaults from it). Env and config-file values:
`tandem.runtime.flag_parser`."""

from __future__ import annotations

import argparse

from tandem.router.config import RouterConfig
from tandem.router.lora import add_lora_args, lora_config_from_args


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """Add the router flags; their defaults are RouterConfig's."""
    from tandem.router.registry import POLICIES

    d = RouterConfig()
    g = parser.add_argument_group("router")
    g.add_argument(
        "--router",
        default="round_robin",
        metavar="POLICY",
        help=f"routing policy: {', '.join(sorted(POLICIES))}",
    )
    g.add_argument(
        "--kv-overlap-weight",
        type=float,
        default=d.overlap_weight,
        help="weight of prefill blocks in the KV cost",
    )
    g.add_argument(
        "--router-temperature",
        type=float,
        default=d.temperature,
        help="0 = pick the cheapest worker; > 0 = softmax sampling",
    )
    g.add_argument(
        "--busy-active-blocks-fraction",
        type=float,
        default=None,
        help="skip workers whose active KV blocks exceed this fraction of capacity",
    )
    g.add_argument(
        "--busy-prefill-tokens",
        type=int,
        default=None,
        help="skip workers with more active prefill tokens than this",
    )
    g.add_argument(
        "--busy-inflight-requests",
        type=int,
        default=None,
        help="any policy: a worker with this many requests in flight from this router takes "
        "no more; the rest wait in the router queue (--router-queue), by priority class, "
        "tenant share and deadline",
    )
    g.add_argument(
        "--batch-headroom-requests",
        type=int,
        default=d.batch_headroom_requests,
        help="with --busy-inflight-requests N: the batch class may use only N minus this many "
        "slots per worker, so the batch lane runs in idle capacity (0 = all N)",
    )
    g.add_argument(
        "--router-queue",
        type=int,
        default=d.queue_size,
        metavar="N",
        help="queue up to N requests when all workers are busy (0 = 503)",
    )
    g.add_argument(
        "--router-queue-timeout-s",
        type=float,
        default=d.queue_timeout_s,
        help="a queued request answers 503 after this long",
    )
    g.add_argument(
        "--router-session-ttl-s",
        type=float,
        default=d.session_ttl_s,
        help="a request's x-session-id binds it to the worker of its last turn for this long, "
        "shared by router replicas (0 = no session affinity)",
    )
    g.add_argument(
        "--router-session-slack",
        type=int,
        default=d.session_slack,
        help="a session's bound worker is passed over (and the binding moves) when busy or "
        "this many requests in flight above the least loaded candidate",
    )
    g.add_argument(
        "--no-kv-events",
        action="store_true",
        help="approximate mode: predict caches from the router's own decisions",
    )
    g.add_argument(
        "--router-approx-ttl-s",
        "--router-ttl-s",  # the original name, kept so existing command lines still work
        dest="router_approx_ttl_s",
        type=float,
        default=d.approx_ttl_s,
        help="approximate mode only: seconds a routed prefix counts as cached",
    )
    g.add_argument(
        "--router-active-ttl-s",
        type=float,
        default=d.active_ttl_s,
        help="every mode: an active request with no finish after this many seconds is "
        "swept from the router's load bookkeeping",
    )
    g.add_argument(
        "--router-max-blocks",
        type=int,
        default=d.approx_max_blocks,
        help="approximate mode: recorded blocks per worker before pruning",
    )
    g.add_argument(
        "--router-replica-sync",
        action="store_true",
        help="share active-request state with other routers over the event plane",
    )
    g.add_argument(
        "--router-remote-timeout-s",
        type=float,
        default=d.remote_timeout_s,
        help="--router remote: seconds a route call to the router service may take",
    )
    g.add_argument(
        "--router-seed", type=int, default=None, help="seed of the router's random choices"
    )
    g.add_argument(
        "--kv-fetch",
        action=argparse.BooleanOptionalAction,
        default=None,  # None: RouterConfig's (on); `tandem serve` passes an explicit one on
        help="kv policy: let a worker pull a cached prefix from the busy worker holding it "
        "(both started with worker --kv-fetch) when the transfer beats recomputing it "
        "(default on; `tandem serve --kv-fetch` also starts its workers with --kv-fetch)",
    )
    g.add_argument(
        "--kv-fetch-setup-ms",
        type=float,
        default=d.kv_fetch_setup_s * 1e3,
        help="fixed cost charged per peer KV fetch (its round trips), in ms, until the "
        "fetching worker publishes its measured one (the median of its recent fetches)",
    )
    g.add_argument(
        "--kv-events-zmq",
        action="append",
        default=None,
        metavar="WORKER=ENDPOINT",
        help="read vLLM/SGLang ZMQ KV events directly: worker_id=tcp://host:port; repeat for "
        "several (env: comma-separated)",
    )
    add_lora_args(g)


def router_config_from_args(ns: argparse.Namespace) -> RouterConfig:
    """Build the config from parsed flags; unset flags keep the RouterConfig defaults."""
    values: dict[str, object] = {
        "overlap_weight": ns.kv_overlap_weight,
        "temperature": ns.router_temperature,
        "busy_active_blocks_fraction": ns.busy_active_blocks_fraction,
        "busy_prefill_tokens": None
        if ns.busy_prefill_tokens is None
        else int(ns.busy_prefill_tokens),
        "busy_inflight_requests": getattr(ns, "busy_inflight_requests", None),
        "batch_headroom_requests": getattr(ns, "batch_headroom_requests", None),
        "queue_size": ns.router_queue,
        "queue_timeout_s": ns.router_queue_timeout_s,
        "session_ttl_s": getattr(ns, "router_session_ttl_s", None),
        "session_slack": getattr(ns, "router_session_slack", None),
        "approx_ttl_s": ns.router_approx_ttl_s,
        "active_ttl_s": ns.router_active_ttl_s,
        "approx_max_blocks": None if ns.router_max_blocks is None else int(ns.router_max_blocks),
        "remote_timeout_s": ns.router_remote_timeout_s,
        "seed": ns.router_seed,
        "kv_fetch": getattr(ns, "kv_fetch", None),
        "kv_fetch_setup_s": None
        if getattr(ns, "kv_fetch_setup_ms", None) is None
        else ns.kv_fetch_setup_ms / 1e3,
    }
    zmq = ns.kv_events_zmq or []
    kwargs = {k: v for k, v in values.items() if v is not None}
    return RouterConfig(
        use_kv_events=not ns.no_kv_events,
        replica_sync=bool(ns.router_replica_sync),
        zmq_endpoints=tuple(zmq),
        lora=lora_config_from_args(ns),
        **kwargs,  # type: ignore[arg-type]
    )
