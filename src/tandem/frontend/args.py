"""`tandem frontend` flags → FrontendConfig (+ RuntimeConfig). `TANDEM_*` env fallbacks."""

from __future__ import annotations

import argparse
import os

from tandem.disagg.args import add_disagg_route_args, disagg_route_config_from_args
from tandem.frontend.config import FrontendConfig, HttpConfig
from tandem.frontend.response_store import add_response_store_args, response_store_config_from_args
from tandem.frontend.watchdog import StallConfig
from tandem.multimodal.args import add_image_args, image_config_from_args
from tandem.router.args import add_router_args, router_config_from_args
from tandem.runtime.args import add_runtime_args


def _env(name: str, default: str) -> str:
    return os.environ.get(f"TANDEM_{name}", default)


def add_frontend_args(parser: argparse.ArgumentParser, *, with_runtime: bool = True) -> None:
    """HTTP, migration and admission flags, then the router's and (optionally) runtime's."""
    g = parser.add_argument_group("frontend")
    g.add_argument("--host", default=_env("HTTP_HOST", "127.0.0.1"), help="HTTP bind address")
    g.add_argument("--port", type=int, default=int(_env("HTTP_PORT", "8000")), help="HTTP port")
    g.add_argument(
        "--migration-limit",
        type=int,
        default=int(_env("MIGRATION_LIMIT", "0")),
        metavar="N",
        help="re-send a stream broken by a dead worker to another worker up to N times",
    )
    g.add_argument(
        "--max-inflight-requests",
        type=int,
        default=int(_env("MAX_INFLIGHT_REQUESTS", "1024")),
        metavar="N",
        help="admit at most N requests at once; past it answer 503 + Retry-After "
        "(env TANDEM_MAX_INFLIGHT_REQUESTS)",
    )
    g.add_argument(
        "--max-fanout",
        type=int,
        default=int(_env("MAX_FANOUT", "128")),
        metavar="N",
        help="one request may fan out to at most N engine requests (prompts × n); beyond it "
        "answer 400 (env TANDEM_MAX_FANOUT)",
    )
    g.add_argument(
        "--request-timeout-s",
        type=float,
        default=float(_env("REQUEST_TIMEOUT_S", "600")),
        help="deadline of each request",
    )
    g.add_argument(
        "--health-stale-s",
        type=float,
        default=float(_env("HEALTH_STALE_S", "5")),
        help="/health counts a worker as not alive when its load metrics are this old "
        "(env TANDEM_HEALTH_STALE_S)",
    )
    g.add_argument(
        "--first-token-timeout-s",
        type=float,
        default=float(_env("FIRST_TOKEN_TIMEOUT_S", "30")),
        help="a stream with no first output this long, from a worker silent on every stream "
        "for --stall-timeout-s, is treated like a dead worker's (0: off)",
    )
    g.add_argument(
        "--stall-timeout-s",
        type=float,
        default=float(_env("STALL_TIMEOUT_S", "10")),
        help="the same for each later output; the worker is kept out of routing until it "
        "answers a probe (0: off; env TANDEM_STALL_TIMEOUT_S)",
    )
    _add_http_args(parser)
    _add_auth_args(parser)
    add_image_args(parser)
    add_response_store_args(parser)
    add_router_args(parser)
    add_disagg_route_args(parser)
    if with_runtime:
        add_runtime_args(parser)


# HttpConfig field -> (flag, env suffix, type, help); defaults come from HttpConfig
_HTTP_FLAGS: dict[str, tuple[str, str, type, str]] = {
    "max_body_bytes": ("--max-body-bytes", "MAX_BODY_BYTES", int, "largest request body (413)"),
    "max_header_bytes": (
        "--http-max-header-bytes", "HTTP_MAX_HEADER_BYTES", int,
        "largest request line + headers (431)",
    ),
    "max_header_count": (
        "--http-max-headers", "HTTP_MAX_HEADERS", int, "most header fields in a request (431)"
    ),
    "header_timeout_s": (
        "--http-header-timeout-s", "HTTP_HEADER_TIMEOUT_S", float,
        "seconds from a request's first byte to the end of its headers (408)",
    ),
    "body_timeout_s": (
        "--http-body-timeout-s", "HTTP_BODY_TIMEOUT_S", float,
        "seconds from the end of a request's headers to the end of its body (408)",
    ),
    "idle_timeout_s": (
        "--http-idle-timeout-s", "HTTP_IDLE_TIMEOUT_S", float,
        "seconds a keep-alive connection may wait for its next request",
    ),
    "max_connections": (
        "--http-max-connections", "HTTP_MAX_CONNECTIONS", int,
        "open HTTP connections at most (lowered to fit RLIMIT_NOFILE); past it 503 + close",
    ),
    "drain_grace_s": (
        "--http-drain-grace-s", "HTTP_DRAIN_GRACE_S", float,
        "on SIGTERM: stop accepting, let in-flight responses finish for this long, then close",
    ),
}  # fmt: skip


def _add_http_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("HTTP limits")
    for name, (flag, env, kind, help_) in _HTTP_FLAGS.items():
        default = getattr(HttpConfig(), name)
        g.add_argument(
            flag,
            dest=f"http_{name}",
            type=kind,
            metavar="N" if kind is int else "SECONDS",
            default=kind(_env(env, str(default))),
            help=f"{help_} (default {default}; env TANDEM_{env})",
        )
    g.add_argument(
        "--http-reuse-port",
        action="store_true",
        default=_env("HTTP_REUSE_PORT", "") not in ("", "0", "false"),
        help="bind with SO_REUSEPORT so several frontend processes share the port; such a "
        "frontend listens only once a model is ready (env TANDEM_HTTP_REUSE_PORT)",
    )


def _add_auth_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("authentication")
    g.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on the OpenAI routes and /metrics; repeat for "
        "several keys (also env TANDEM_API_KEY, comma-separated); /health and /live stay open",
    )
    g.add_argument(
        "--api-key-file",
        default=_env("API_KEY_FILE", "") or None,
        metavar="PATH",
        help="file of API keys, one per line or comma-separated (env TANDEM_API_KEY_FILE)",
    )
    g.add_argument(
        "--admin-api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="key for the admin routes (POST /v1/route/explain), which are off without one "
        "(also env TANDEM_ADMIN_API_KEY, comma-separated)",
    )
    g.add_argument(
        "--admin-api-key-file",
        default=_env("ADMIN_API_KEY_FILE", "") or None,
        metavar="PATH",
        help="file of admin API keys (env TANDEM_ADMIN_API_KEY_FILE)",
    )


def api_keys(flags: list[str], path: str | None, env: str) -> tuple[str, ...]:
    """Keys from flags, else from the file, else from the env var (comma-separated)."""
    raw: list[str] = list(flags)
    if not raw and path:
        try:
            with open(path) as f:
                raw = [f.read()]
        except OSError as exc:
            raise SystemExit(f"cannot read API key file {path}: {exc}") from exc
    if not raw:
        raw = [os.environ.get(f"TANDEM_{env}", "")]
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
        api_keys=api_keys(ns.api_key, ns.api_key_file, "API_KEY"),
        admin_api_keys=api_keys(ns.admin_api_key, ns.admin_api_key_file, "ADMIN_API_KEY"),
        health_stale_s=ns.health_stale_s,
        disagg=disagg_route_config_from_args(ns),
        images=image_config_from_args(ns),
        responses_store=response_store_config_from_args(ns),
        stall=StallConfig(
            first_token_timeout_s=ns.first_token_timeout_s, stall_timeout_s=ns.stall_timeout_s
        ),
    )
