"""`tandem router`: the standalone router service (tandem.router.service).

Frontends started with `--router remote` find it in discovery (`{ns}.router.route`) and ask
it where each request goes; several frontends then share one view of caches and load.
Router flags are the frontend's (`--kv-overlap-weight`, `--busy-*`, ...); `--router` picks
the policy the service applies (default kv). Runs until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from typing import TYPE_CHECKING

from tandem.router.args import add_router_args, router_config_from_args
from tandem.runtime.args import add_runtime_args, runtime_config_from_args
from tandem.runtime.process_setup import (
    add_log_format_arg,
    add_tracing_args,
    configure_logging,
    configure_tracing,
    run_async,
)

if TYPE_CHECKING:
    from tandem.router.service import RouterService
    from tandem.runtime.system_server import SystemServer

logger = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_router_args(parser)
    parser.set_defaults(router="kv")
    parser.add_argument(
        "--worker-component", default="backend", help="component of the workers routed to"
    )
    parser.add_argument(
        "--system-port",
        type=int,
        default=0,
        help="serve the router's /metrics, /health and /live over HTTP on this port (0: off)",
    )
    parser.add_argument(
        "--system-host",
        default=None,
        help="bind address of --system-port (default: the request plane's bind address, so "
        "a router on another host than etcd/NATS serves it on its routable address)",
    )
    parser.add_argument("--log-level", default="INFO", help="logging level")
    add_log_format_arg(parser)
    add_tracing_args(parser, "tandem-router")
    add_runtime_args(parser)


async def serve(args: argparse.Namespace, stop: asyncio.Event | None = None) -> None:
    """Serve until `stop` is set (default: SIGTERM/SIGINT), then unregister and close."""
    import dataclasses

    from tandem.router.service import RouterService
    from tandem.runtime.address import resolve_addresses
    from tandem.runtime.lifecycle import install_signal_handlers
    from tandem.runtime.runtime import open_runtime

    config = dataclasses.replace(
        router_config_from_args(args), worker_component=args.worker_component
    )
    if stop is None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
    # resolved here so --system-host defaults to the address the request plane binds
    runtime_config = resolve_addresses(runtime_config_from_args(args))
    args.system_host = args.system_host or runtime_config.host
    async with open_runtime(runtime_config) as runtime:
        service = RouterService(runtime, args.router, config)
        system = await _start_system_server(service, args)
        instance = await service.start()
        logger.info(
            "router ready: policy=%s endpoint=%s address=%s",
            args.router,
            instance.path,
            instance.address,
        )
        try:
            await stop.wait()
        finally:
            await service.close()
            await runtime.shutdown(grace_s=0)
            if system is not None:
                await system.close()


async def _start_system_server(
    service: RouterService, args: argparse.Namespace
) -> SystemServer | None:
    """With --system-port: the router's metrics (tandem_router_*), /health and /live."""
    if not args.system_port:
        return None
    if not 0 < args.system_port < 65536:
        raise SystemExit(f"--system-port={args.system_port}; expected 1..65535 or 0 (off)")
    from tandem.router.metrics import router_families
    from tandem.runtime.metrics import Families, render
    from tandem.runtime.system_server import SystemServer

    labels = {"component": args.worker_component}
    server = SystemServer(
        metrics=lambda: render(Families(router_families([(labels, service.router)]))),
        health=lambda: (True, {"status": "ready", "policy": args.router}),
    )
    await server.start(args.system_host, args.system_port)
    return server


def run(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    configure_tracing(args)
    run_async(serve(args))
    return 0
