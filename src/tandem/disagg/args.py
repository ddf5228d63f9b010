"""Disaggregation flags: the worker's role (`tandem worker`) and the frontend's split
(`tandem frontend` / `tandem serve`). Env and config-file values: `tandem.runtime.flag_parser`."""

from __future__ import annotations

import argparse

from tandem.disagg.config import (
    DISAGG_MODES,
    FAILURE_POLICIES,
    FLOWS,
    DisaggRouteConfig,
    DisaggWorkerConfig,
)
from tandem.transfer.base import BACKEND_NAMES, LAZY_BACKENDS
from tandem.transfer.config import backends_from_spec


def add_disagg_worker_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("disaggregation (worker)")
    g.add_argument(
        "--disagg-mode",
        choices=DISAGG_MODES,
        default="none",
        help="prefill: compute prompts and hand their KV over (component 'prefill'); "
        "decode: receive KV and decode (component 'backend')",
    )
    g.add_argument(
        "--disagg-transfer-backends",
        default="auto",
        help="KV transfer backends, fastest preferred first (any of "
        f"{', '.join(BACKEND_NAMES)}); the missing optional ones are skipped. 'auto': all "
        f"of them, with {', '.join(LAZY_BACKENDS)} started only when a peer on another "
        "host needs them (named explicitly, they start at once)",
    )
    g.add_argument(
        "--disagg-pin-ttl-s",
        type=float,
        default=30.0,
        help="a prefill releases pinned KV blocks no decode claimed after this",
    )
    g.add_argument(
        "--disagg-transfer-timeout-s",
        type=float,
        default=10.0,
        help="the most a decode waits for its KV before --disagg-on-transfer-failure",
    )
    g.add_argument("--disagg-on-transfer-failure", choices=FAILURE_POLICIES,
                   default="local",
                   help="local: prefill on the decode worker; fail: end it with an error",
                   )  # fmt: skip
    g.add_argument(
        "--kv-fetch",
        action="store_true",
        help="peer KV fetch: serve this worker's cached blocks to peers and pull a prefix the "
        "KV router names from the peer caching it (a transfer agent; --disagg-transfer-*)",
    )
    g.add_argument(
        "--kv-fetch-timeout-s",
        type=float,
        default=DisaggWorkerConfig().kv_fetch_timeout_s,
        help="a peer KV fetch not done after this is given up: the prompt is recomputed",
    )


def disagg_worker_config_from_args(ns: argparse.Namespace) -> DisaggWorkerConfig:
    backends, lazy = backends_from_spec(ns.disagg_transfer_backends)
    return DisaggWorkerConfig(
        mode=ns.disagg_mode,
        backends=backends,
        lazy_backends=lazy,
        pin_ttl_s=ns.disagg_pin_ttl_s,
        transfer_timeout_s=ns.disagg_transfer_timeout_s,
        on_transfer_failure=ns.disagg_on_transfer_failure,
        kv_fetch=bool(getattr(ns, "kv_fetch", False)),
        kv_fetch_timeout_s=getattr(ns, "kv_fetch_timeout_s", None) or 2.0,
        transfer_host=getattr(ns, "transfer_host", None) or "127.0.0.1",
        transfer_port=getattr(ns, "transfer_port", None) or 0,
    )


def add_disagg_route_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("disaggregation (frontend)")
    g.add_argument(
        "--disagg",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="send prompts to prefill workers (component --disagg-prefill-component) "
        "and decode on the backend workers",
    )
    g.add_argument(
        "--disagg-flow",
        choices=FLOWS,
        default="prefill-first",
        help="prefill-first: prefill, then decode pulls the KV; decode-first: decode "
        "allocates a rendezvous, prefill pushes into it",
    )
    g.add_argument(
        "--disagg-min-prefill-tokens",
        type=int,
        default=0,
        help="prefill remotely only when the decode worker lacks at least this many "
        "prompt tokens in its cache (shorter prompts stay on the decode worker)",
    )
    g.add_argument(
        "--disagg-min-uncached-ratio",
        type=float,
        default=0.0,
        help="... and at least this share of the prompt (mostly cached prompts stay)",
    )
    g.add_argument(
        "--disagg-max-prefill-queue",
        type=int,
        default=0,
        help="a prefill worker with this many prefills in flight or waiting is busy; when "
        "all are (or all are over the --busy-* thresholds), the decode worker prefills "
        "itself (0 = only the --busy-* thresholds)",
    )
    g.add_argument(
        "--decode-fallback",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="with no prefill worker, serve aggregated on the decode workers instead "
        "of answering 503",
    )
    g.add_argument(
        "--disagg-prefill-component",
        default="prefill",
        help="component the prefill workers register",
    )


def disagg_route_config_from_args(ns: argparse.Namespace) -> DisaggRouteConfig:
    return DisaggRouteConfig(
        enabled=ns.disagg,
        flow=ns.disagg_flow,
        min_prefill_tokens=ns.disagg_min_prefill_tokens,
        min_uncached_ratio=ns.disagg_min_uncached_ratio,
        max_prefill_queue=ns.disagg_max_prefill_queue,
        decode_fallback=ns.decode_fallback,
        prefill_component=ns.disagg_prefill_component,
    )
