"""`SystemServer`: a process's own HTTP port for operators (`--system-port`, as Dynamo's
DYN_SYSTEM_PORT): `GET|HEAD /metrics` (Prometheus text), `/health` (200 when ready to serve,
else 503) and `/live` (200 while the event loop answers). Read-only; runs on the caller's loop.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web

from tandem.runtime.aiohttp_half_close import HalfCloseAppRunner
from tandem.runtime.metrics import CONTENT_TYPE

logger = logging.getLogger(__name__)

Check = Callable[[], tuple[bool, dict[str, Any]]]
SHUTDOWN_TIMEOUT_S = 2.0


class SystemServer:
    """Not reusable: `start` once, `close` once."""

    def __init__(self, *, metrics: Callable[[], bytes], health: Check) -> None:
        self._metrics, self._health = metrics, health
        app = web.Application()
        app.router.add_get("/metrics", self._get_metrics)
        app.router.add_get("/health", self._get_health)
        app.router.add_get("/live", self._get_live)
        # a probe that half-closes after its request (nc -N) still gets the answer
        self._runner = HalfCloseAppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)

    async def start(self, host: str, port: int) -> tuple[str, int]:
        """Listen on host:port (0 = a free port); returns the bound address. Raises OSError
        (e.g. address in use) with the address in the message."""
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except OSError as exc:
            await self._runner.cleanup()
            raise OSError(exc.errno, f"system port {host}:{port}: {exc.strerror}") from exc
        server = site._server
        assert server is not None and server.sockets  # type: ignore[attr-defined]
        bound = server.sockets[0].getsockname()  # type: ignore[attr-defined]
        logger.info("system server on http://%s:%d (/metrics, /health, /live)", *bound[:2])
        return str(bound[0]), int(bound[1])

    async def close(self) -> None:
        await self._runner.cleanup()

    async def _get_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self._metrics(), headers={"content-type": CONTENT_TYPE.decode()})

    async def _get_health(self, request: web.Request) -> web.Response:
        ok, body = self._health()
        return web.json_response(body, status=200 if ok else 503, dumps=json.dumps)

    async def _get_live(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "live"})
