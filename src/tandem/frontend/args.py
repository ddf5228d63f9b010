"""`tandem frontend` flags → FrontendConfig (+ RuntimeConfig). Env and config-file values come
from `tandem.runtime.flag_parser` (TANDEM_<FLAG>), applied by the entry point."""

from __future__ import annotations

import argparse
from pathlib import Path

from tandem.disagg.args import add_disagg_route_args, disagg_route_config_from_args
from tandem.frontend.api.responses.store import (
    add_response_store_args,
    response_store_config_from_args,
)
from tandem.frontend.batch.config import add_batch_args, batch_config_from_args
from tandem.frontend.config import FrontendConfig
from tandem.frontend.http.config import HttpConfig
from tandem.frontend.lora_config import add_lora_args, lora_config_from_args
from tandem.frontend.watchdog import StallConfig
from tandem.multimodal.args import add_image_args, image_config_from_args
from tandem.router.args import add_router_args, router_config_from_args
from tandem.runtime.args import add_runtime_args


def add_frontend_args(parser: argparse.ArgumentParser, *, with_runtime: bool = True) -> None:
    """HTTP, migration and admission flags, then the router's and (optionally) runtime's."""
    g = parser.add_argument_group("frontend")
    g.add_argument("--http-host", "--host", dest="host", default="127.0.0.1",
                   help="HTTP bind address")  # fmt: skip
    g.add_argument("--http-port", "--port", dest="port", type=int, default=8000, help="HTTP port")
    g.add_argument(
        "--migration-limit",
        type=int,
        default=3,
        metavar="N",
        help="re-send a stream broken by a dead or frozen worker to another worker (prompt + "
        "tokens so far; the client sees one stream) up to N times; 0: fail it instead "
        "(default: 3, so a lost worker loses no request)",
    )
    g.add_argument(
        "--max-inflight-requests",
        type=int,
        default=1024,
        metavar="N",
        help="admit at most N requests at once; past it answer 503 + Retry-After",
    )
    g.add_argument(
        "--max-fanout",
        type=int,
        default=128,
        metavar="N",
        help="one request may fan out to at most N engine requests (prompts × n); beyond it "
        "answer 400",
    )
    g.add_argument(
        "--request-timeout-s",
        type=float,
        default=600.0,
        help="deadline of each request",
    )
    g.add_argument(
        "--health-stale-s",
        type=float,
        default=5.0,
        help="/health counts a worker as not alive when its load metrics are this old",
    )
    g.add_argument(
        "--first-token-timeout-s",
        type=float,
        default=30.0,
        help="a stream with no first output this long, from a worker silent on every stream "
        "for --stall-timeout-s, is treated like a dead worker's (0: off)",
    )
    g.add_argument(
        "--stall-timeout-s",
        type=float,
        default=10.0,
        help="the same for each later output; the worker is kept out of routing until it "
        "answers a probe (0: off)",
    )
    _add_http_args(parser)
    _add_auth_args(parser)
    add_image_args(parser)
    add_response_store_args(parser)
    add_lora_args(parser)
    add_batch_args(parser)
    add_router_args(parser)
    add_disagg_route_args(parser)
    if with_runtime:
        add_runtime_args(parser)


# HttpConfig field -> (flag, type, help); defaults come from HttpConfig
_HTTP_FLAGS: dict[str, tuple[str, type, str]] = {
    "max_body_bytes": ("--max-body-bytes", int, "largest request body (413)"),
    "max_header_bytes": (
        "--http-max-header-bytes", int,
        "largest request line + headers (431)",
    ),
    "max_header_count": (
        "--http-max-headers", int, "most header fields in a request (431)"
    ),
    "header_timeout_s": (
        "--http-header-timeout-s", float,
        "seconds from a request's first byte to the end of its headers (408)",
    ),
    "body_timeout_s": (
        "--http-body-timeout-s", float,
        "seconds from the end of a request's headers to the end of its body (408)",
    ),
    "idle_timeout_s": (
        "--http-idle-timeout-s", float,
        "seconds a keep-alive connection may wait for its next request",
    ),
    "max_connections": (
        "--http-max-connections", int,
        "open HTTP connections at most (lowered to fit RLIMIT_NOFILE); past it 503 + close",
    ),
    "drain_grace_s": (
        "--http-drain-grace-s", float,
        "on SIGTERM: stop accepting, let in-flight responses finish for this long, then close",
    ),
}  # fmt: skip


def _add_http_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("HTTP limits")
    for name, (flag, kind, help_) in _HTTP_FLAGS.items():
        default = getattr(HttpConfig(), name)
        g.add_argument(
            flag,
            dest=f"http_{name}",
            type=kind,
            metavar="N" if kind is int else "SECONDS",
            default=default,
            help=help_,
        )
    g.add_argument(
        "--http-reuse-port",
        action="store_true",
        help="bind with SO_REUSEPORT so several frontend processes share the port; such a "
        "frontend listens only once a model is ready",
    )


def _add_auth_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("authentication")
    g.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on the OpenAI routes and /metrics; repeat for "
        "several keys (env: comma-separated); /health and /live stay open",
    )
    g.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="file of API keys, one per line or comma-separated",
    )
    g.add_argument(
        "--admin-api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="key for the admin routes (POST /v1/route/explain), which are off without one "
        "(env: comma-separated)",
    )
    g.add_argument(
        "--admin-api-key-file",
        default=None,
        metavar="PATH",
        help="file of admin API keys",
    )
    g.add_argument(
        "--tenants-file",
        default=None,
        metavar="PATH",
        help="YAML of tenants (API keys -> tenant, weight, priority ceiling, requests/tokens per "
        "minute, isolated); read again when it changes (README: Tenants). Without it every "
        "request is the default tenant's and the router queue is FIFO within a class",
    )


def api_keys(flags: list[str], path: str | None) -> tuple[str, ...]:
    """The keys of the flag (also from its env variable or config) and of the file."""
    raw: list[str] = list(flags)
    if path:
        try:
            with open(path) as f:
                raw.append(f.read())
        except OSError as exc:
            raise SystemExit(f"cannot read API key file {path}: {exc}") from exc
    keys = (k.strip() for item in raw for line in item.splitlines() for k in line.split(","))
    return tuple(dict.fromkeys(k for k in keys if k))


def http_config_from_args(ns: argparse.Namespace) -> HttpConfig:
    return HttpConfig(
        **{name: getattr(ns, f"http_{name}") for name in _HTTP_FLAGS},
        reuse_port=bool(getattr(ns, "http_reuse_port", False)),
    )


def frontend_config_from_args(ns: argparse.Namespace) -> FrontendConfig:
    return FrontendConfig(
        host=ns.host,
        port=ns.port,
        router_policy=ns.router,
        router=router_config_from_args(ns),
        migration_limit=ns.migration_limit,
        max_inflight_requests=ns.max_inflight_requests,
        max_fanout=ns.max_fanout,
        request_timeout_s=ns.request_timeout_s,
        http=http_config_from_args(ns),
        api_keys=api_keys(ns.api_key, ns.api_key_file),
        admin_api_keys=api_keys(ns.admin_api_key, ns.admin_api_key_file),
        tenants_file=Path(ns.tenants_file) if ns.tenants_file else None,
        health_stale_s=ns.health_stale_s,
        disagg=disagg_route_config_from_args(ns),
        images=image_config_from_args(ns),
        responses_store=response_store_config_from_args(ns),
        lora=lora_config_from_args(ns),
        batch=batch_config_from_args(ns),
        stall=StallConfig(
            first_token_timeout_s=ns.first_token_timeout_s, stall_timeout_s=ns.stall_timeout_s
        ),
    )
