"""Process lifecycle: SIGTERM/SIGINT → stop accepting → unregister → drain → exit."""

from __future__ import annotations

import asyncio
import logging
import signal

from tandem.runtime.runtime import Runtime

logger = logging.getLogger(__name__)


def install_signal_handlers(stop: asyncio.Event) -> None:
    """Set `stop` on SIGTERM or SIGINT (call from the running loop, main thread)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig, stop)


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    logger.info("received %s; shutting down", sig.name)
    stop.set()


async def drain(runtime: Runtime, grace_s: float | None = None) -> None:
    """Stop accepting new requests, unregister this process's instances, wait up to
    `grace_s` (default `config.drain_grace_s`) for in-flight requests, cancel the rest
    (their clients see PeerGone and may migrate)."""
    await runtime.shutdown(grace_s)
    logger.info("drained; %d requests were still in flight", runtime.server.num_inflight)


async def serve_until_stopped(
    runtime: Runtime, stop: asyncio.Event | None = None, grace_s: float | None = None
) -> None:
    """Block until SIGTERM/SIGINT (or `stop` is set), then `drain`."""
    if stop is None:
        stop = asyncio.Event()
        install_signal_handlers(stop)
    await stop.wait()
    await drain(runtime, grace_s)
