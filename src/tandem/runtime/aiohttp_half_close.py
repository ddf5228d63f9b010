"""aiohttp servers that answer half-closed clients: `HalfCloseAppRunner` is `web.AppRunner`
whose connections keep their write side open when the client shuts down its own
(`shutdown(SHUT_WR)`, as `nc -N`, some health checkers and HTTP/1.0-style clients do).

aiohttp's `RequestHandler.eof_received` returns None, so asyncio closes the transport at the
client's EOF and a complete request that is still being handled (or still queued behind a
pipelined one) loses its answer. Here, at EOF: nothing owed (idle, nothing queued, or the
request being handled lacks part of its body) closes at once, as before; otherwise the
transport stays open, every complete request is answered in order, and the connection closes
after the last answer instead of waiting for the keep-alive timeout. A request whose body the
EOF cut short, queued behind others, is dropped (nothing more can arrive for it).

This leans on aiohttp internals (`RequestHandler._close`, `_messages`, `_waiter`,
`_request_count`, `_handle_request`; `Server._loop`, `_kwargs`), the same in 3.9.0 and 3.14.5:
where the installed aiohttp lacks one, the stock handler is used and a warning is logged once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from typing import Any

from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

logger = logging.getLogger(__name__)

_HANDLER_ATTRS = ("_close", "_messages", "_waiter", "_request_count", "_handle_request")
_warned = False
KEEPALIVE_TIMEOUT_S = 75.0  # web.run_app's


class HalfCloseRequestHandler(RequestHandler):
    """Answers what a half-closed client sent, then closes (see the module docstring)."""

    __slots__ = ("_body", "_peer_eof")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._peer_eof = False
        self._body: StreamReader | None = None  # the body of the request start() took last

    def eof_received(self) -> bool:  # type: ignore[override]  # asyncio.Protocol: bool | None
        """True keeps the transport open for writing: something is still owed."""
        self._peer_eof = True
        if self._body is not None and not self._body.is_eof():
            return False  # the request in hand lacks body bytes that can no longer come
        if self._messages:
            return True  # the last queued request closes the connection (_handle_request)
        if self._waiter is not None or self._request_count == 0:
            return False  # idle between requests, or nothing was sent: nothing owed
        self._close = True  # answering one: close after it (as close() does, less the waiter)
        return True

    async def _handle_request(self, request: BaseRequest, *args: Any, **kwargs: Any) -> Any:
        # start() has just taken `request` off the queue
        self._body = request.content
        if self._peer_eof:
            if not request.content.is_eof():
                # start() ends the connection on ConnectionError, answering nothing
                raise ConnectionResetError("the client's EOF cut this request's body short")
            if not self._messages:
                self._close = True  # the last request a half-closed client sent
        return await super()._handle_request(request, *args, **kwargs)


def _supported(handler: RequestHandler) -> bool:
    global _warned
    missing = [a for a in _HANDLER_ATTRS if not hasattr(handler, a)]
    if not missing:
        return True
    if not _warned:
        _warned = True
        logger.warning(
            "aiohttp's RequestHandler lacks %s: half-closed clients may get no answer",
            ", ".join(missing),
        )
    return False


class HalfCloseServer(web.Server):
    """`web.Server` whose connections use `HalfCloseRequestHandler`."""

    def __call__(self) -> RequestHandler:
        try:
            handler = HalfCloseRequestHandler(self, loop=self._loop, **self._kwargs)
        except (AttributeError, TypeError) as exc:
            logger.warning("half-close request handler unavailable (%s): using aiohttp's", exc)
            return super().__call__()
        return handler if _supported(handler) else super().__call__()


class HalfCloseAppRunner(web.AppRunner):
    """`web.AppRunner` that answers half-closed clients (same arguments)."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        if not (hasattr(server, "_loop") and hasattr(server, "_kwargs")):
            logger.warning(
                "aiohttp's Server lacks _loop/_kwargs: half-closed clients may get no answer"
            )
            return server
        return HalfCloseServer(
            server.request_handler,
            request_factory=server.request_factory,
            handler_cancellation=server.handler_cancellation,
            loop=server._loop,
            **server._kwargs,
        )


async def serve_app(
    app: web.Application,
    host: str,
    port: int,
    *,
    started: Callable[[tuple[str, int]], None] | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Serve `app` on host:port (0 = a free port) with `HalfCloseAppRunner` until `stop` is
    set (default: until SIGINT or SIGTERM), then clean up (aiohttp's graceful shutdown); as
    `web.run_app` with its defaults, which cannot be given another runner.
    `started` gets the bound address once listening. Raises OSError (e.g. address in use)."""
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
    runner = HalfCloseAppRunner(app, keepalive_timeout=KEEPALIVE_TIMEOUT_S)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        bound = runner.addresses[0]
        logger.info("serving on http://%s:%d", bound[0], bound[1])
        if started is not None:
            started((str(bound[0]), int(bound[1])))
        await stop.wait()
    finally:
        await runner.cleanup()
