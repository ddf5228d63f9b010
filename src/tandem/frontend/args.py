"""`tandem frontend` flags → FrontendConfig (+ RuntimeConfig). `TANDEM_*` env fallbacks."""

from __future__ import annotations

import argparse
import os

from tandem.disagg.args import add_disagg_route_args, disagg_route_config_from_args
from tandem.frontend.config import FrontendConfig
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
    g.add_argument("--max-body-bytes", type=int, default=int(_env("MAX_BODY_BYTES", str(8 << 20))))
    add_image_args(parser)
    add_router_args(parser)
    add_disagg_route_args(parser)
    if with_runtime:
        add_runtime_args(parser)


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
        max_body_bytes=ns.max_body_bytes,
        disagg=disagg_route_config_from_args(ns),
        images=image_config_from_args(ns),
    )
