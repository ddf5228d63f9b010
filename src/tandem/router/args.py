"""Router flags → `RouterConfig`. Flags first, `TANDEM_*` environment variables as fallbacks."""

from __future__ import annotations

import argparse
import os

from tandem.router.config import RouterConfig


def _env(name: str, default: str | None = None) -> str | None:
    return os.environ.get(f"TANDEM_{name}", default)


def _env_float(name: str) -> float | None:
    value = _env(name)
    return None if value in (None, "") else float(value)


def add_router_args(parser: argparse.ArgumentParser) -> None:
    """Add the router flags; defaults come from TANDEM_ROUTER, TANDEM_KV_OVERLAP_WEIGHT, ..."""
    from tandem.router.registry import POLICIES

    g = parser.add_argument_group("router")
    g.add_argument(
        "--router",
        default=_env("ROUTER", "round_robin"),
        metavar="POLICY",
        help=f"routing policy: {', '.join(sorted(POLICIES))} (TANDEM_ROUTER)",
    )
    g.add_argument(
        "--kv-overlap-weight",
        type=float,
        default=_env_float("KV_OVERLAP_WEIGHT"),
        help="weight of prefill blocks in the KV cost (default 4.0)",
    )
    g.add_argument(
        "--router-temperature",
        type=float,
        default=_env_float("ROUTER_TEMPERATURE"),
        help="0 = pick the cheapest worker; > 0 = softmax sampling (default 0)",
    )
    g.add_argument(
        "--busy-active-blocks-fraction",
        type=float,
        default=_env_float("BUSY_ACTIVE_BLOCKS_FRACTION"),
        help="skip workers whose active KV blocks exceed this fraction of capacity",
    )
    g.add_argument(
        "--busy-prefill-tokens",
        type=int,
        default=_env_float("BUSY_PREFILL_TOKENS"),
        help="skip workers with more active prefill tokens than this",
    )
    g.add_argument(
        "--router-queue",
        type=int,
        default=int(_env("ROUTER_QUEUE", "0") or 0),
        metavar="N",
        help="queue up to N requests when all workers are busy (0 = 503)",
    )
    g.add_argument(
        "--router-queue-timeout-s", type=float, default=_env_float("ROUTER_QUEUE_TIMEOUT_S")
    )
    g.add_argument(
        "--no-kv-events",
        action="store_true",
        default=_env("NO_KV_EVENTS", "") not in ("", "0", "false"),
        help="approximate mode: predict caches from the router's own decisions",
    )
    g.add_argument(
        "--router-approx-ttl-s",
        "--router-ttl-s",  # the original name, kept so existing command lines still work
        dest="router_approx_ttl_s",
        type=float,
        default=_env_float("ROUTER_APPROX_TTL_S") or _env_float("ROUTER_TTL_S"),
        help="approximate mode only: seconds a routed prefix counts as cached (120)",
    )
    g.add_argument(
        "--router-active-ttl-s",
        type=float,
        default=_env_float("ROUTER_ACTIVE_TTL_S"),
        help="every mode: an active request with no finish after this many seconds is "
        "swept from the router's load bookkeeping (600)",
    )
    g.add_argument(
        "--router-max-blocks",
        type=int,
        default=_env_float("ROUTER_MAX_BLOCKS"),
        help="approximate mode: recorded blocks per worker before pruning",
    )
    g.add_argument(
        "--router-replica-sync",
        action="store_true",
        default=_env("ROUTER_REPLICA_SYNC", "") not in ("", "0", "false"),
        help="share active-request state with other routers over the event plane",
    )
    g.add_argument(
        "--router-remote-timeout-s",
        type=float,
        default=_env_float("ROUTER_REMOTE_TIMEOUT_S"),
        help="--router remote: seconds a route call to the router service may take (35)",
    )
    g.add_argument("--router-seed", type=int, default=None)
    g.add_argument(
        "--kv-events-zmq",
        action="append",
        default=None,
        metavar="WORKER=ENDPOINT",
        help="read vLLM/SGLang ZMQ KV events directly: worker_id=tcp://host:port",
    )


def router_config_from_args(ns: argparse.Namespace) -> RouterConfig:
    """Build the config from parsed flags; unset flags keep the RouterConfig defaults."""
    values: dict[str, object] = {
        "overlap_weight": ns.kv_overlap_weight,
        "temperature": ns.router_temperature,
        "busy_active_blocks_fraction": ns.busy_active_blocks_fraction,
        "busy_prefill_tokens": None
        if ns.busy_prefill_tokens is None
        else int(ns.busy_prefill_tokens),
        "queue_size": ns.router_queue,
        "queue_timeout_s": ns.router_queue_timeout_s,
        "approx_ttl_s": ns.router_approx_ttl_s,
        "active_ttl_s": ns.router_active_ttl_s,
        "approx_max_blocks": None if ns.router_max_blocks is None else int(ns.router_max_blocks),
        "remote_timeout_s": ns.router_remote_timeout_s,
        "seed": ns.router_seed,
    }
    zmq = ns.kv_events_zmq or [s for s in (_env("KV_EVENTS_ZMQ") or "").split(",") if s]
    kwargs = {k: v for k, v in values.items() if v is not None}
    return RouterConfig(
        use_kv_events=not ns.no_kv_events,
        replica_sync=bool(ns.router_replica_sync),
        zmq_endpoints=tuple(zmq),
        **kwargs,  # type: ignore[arg-type]
    )
