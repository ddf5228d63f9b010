"""`tandem global-router --config FILE`: one OpenAI endpoint in front of several pools.

Each pool is a namespace with its own workers, local router and frontend; the config's grids
map a request's latency targets (request field `tandem: {ttft_target_ms, itl_target_ms}`,
default the grid's middle) and its ISL/context to a pool; `priority` ranges can override it
(tandem.planner.global_router.config). Every OpenAI route is forwarded with the client's
end-to-end headers; `--api-key` guards the router itself. Runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse

from tandem.runtime.process_setup import add_log_format_arg, configure_logging


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="global router JSON (pools and grids)")
    parser.add_argument("--host", help="overrides the config's host")
    parser.add_argument("--port", type=int, help="overrides the config's port")
    parser.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="require `Authorization: Bearer KEY` on every route but /health and /live (the "
        "header is forwarded, so pools started with --api-key must accept it too); repeat for "
        "several keys (env: comma-separated)",
    )
    parser.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="file of API keys, one per line or comma-separated",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level")
    add_log_format_arg(parser)


def run(args: argparse.Namespace) -> int:
    import asyncio

    from tandem.engines.mocker.config import default_tokenizer
    from tandem.frontend.args import api_keys
    from tandem.planner.global_router.app import GlobalRouterApp
    from tandem.planner.global_router.config import load_config
    from tandem.runtime.aiohttp_half_close import serve_app
    from tandem.tokens.tokenizer import load_tokenizer

    configure_logging(args.log_level, args.log_format)
    try:
        config = load_config(args.config)
    except ValueError as exc:
        raise SystemExit(f"tandem global-router: {exc}") from None
    spec = config.raw.tokenizer or default_tokenizer()
    tokenizer = load_tokenizer(spec) if spec else None
    router = GlobalRouterApp(config, tokenizer, api_keys=api_keys(args.api_key, args.api_key_file))
    # not web.run_app: its runner drops the answer to a client that half-closes after its request
    asyncio.run(serve_app(router.app(), args.host or config.raw.host, args.port or config.raw.port))
    return 0
