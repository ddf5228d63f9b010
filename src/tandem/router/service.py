"""`RouterService`: one Router (usually `kv`) served on the request plane, so that several
frontends started with `--router remote` share one view of the workers' caches and load.

It follows the worker instances of `{ns}.{worker_component}.generate` and the event plane
like an in-frontend router does, and serves the endpoints of tandem.router.messages under
component `router` (the `route` endpoint is registered in discovery, so frontends find it)."""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator
from typing import Any

import msgspec

from tandem.errors import InvalidRequest
from tandem.protocols.discovery import Instance
from tandem.router.base import Router
from tandem.router.config import RouterConfig
from tandem.router.messages import (
    ROUTER_COMPONENT,
    RouteResponse,
    encode,
    notice_decoder,
    route_request_decoder,
)
from tandem.router.registry import make_router
from tandem.runtime import tracing
from tandem.runtime.base import RequestContext
from tandem.runtime.runtime import Runtime

logger = logging.getLogger(__name__)


def _decode(decoder: msgspec.msgpack.Decoder[Any], payload: bytes, what: str) -> Any:
    try:
        return decoder.decode(payload)
    except msgspec.MsgspecError as exc:
        raise InvalidRequest(f"bad {what}: {exc}") from exc


class RouterService:
    """Not reusable: `start` once, `close` once; one event loop. `policy` may not be
    `remote` (a service forwarding to itself)."""

    def __init__(self, runtime: Runtime, policy: str, config: RouterConfig) -> None:
        if policy == "remote":
            raise ValueError("router service policy='remote' would forward to itself")
        self.runtime = runtime
        self.workers = runtime.instance_set(config.worker_component, "generate")
        self.router: Router = make_router(
            policy,
            config,
            instances=self.workers,
            events=runtime.events,
            client=runtime.client,
            namespace=runtime.namespace,
        )
        self.instance: Instance | None = None

    async def start(self) -> Instance:
        """Start following workers, serve the notice endpoints, then register `route`."""
        await self.router.start()
        server, path = self.runtime.server, self.runtime.endpoint_path
        server.register(path(ROUTER_COMPONENT, "first_token"), self._first_token)
        server.register(path(ROUTER_COMPONENT, "free"), self._free)
        server.register(path(ROUTER_COMPONENT, "explain"), self._explain)
        self.instance = await self.runtime.serve_endpoint(ROUTER_COMPONENT, "route", self._route)
        return self.instance

    async def close(self) -> None:
        """Unregister first (frontends stop sending), then stop following workers."""
        if self.instance is not None:
            await self.runtime.discovery.unregister(self.instance.instance_id)
        await self.router.close()
        await self.workers.close()

    async def _route(self, payload: bytes, ctx: RequestContext) -> AsyncGenerator[bytes, None]:
        msg = _decode(route_request_decoder, payload, "RouteRequest")
        # the frontend's span (request plane) is the parent of this router's `route` span
        with tracing.use(ctx.traceparent):
            decision = await self.router.route(msg.request, exclude=frozenset(msg.exclude))
        yield encode(
            RouteResponse(
                instance_id=decision.instance_id,
                address=decision.address,
                overlap_blocks=decision.overlap_blocks,
                request_blocks=decision.request_blocks,
                details=decision.details,
                kv_fetch=decision.kv_fetch,
            )
        )

    async def _first_token(
        self, payload: bytes, ctx: RequestContext
    ) -> AsyncGenerator[bytes, None]:
        for request_id in _decode(notice_decoder, payload, "RouterNoticeMsg").request_ids:
            self.router.on_first_token(request_id)
        return
        yield b""  # an async generator with no output

    async def _free(self, payload: bytes, ctx: RequestContext) -> AsyncGenerator[bytes, None]:
        msg = _decode(notice_decoder, payload, "RouterNoticeMsg")
        made = msg.output_tokens or []
        for i, request_id in enumerate(msg.request_ids):
            tokens = made[i] if i < len(made) and made[i] >= 0 else None
            self.router.on_finish(request_id, tokens)
        return
        yield b""

    async def _explain(self, payload: bytes, ctx: RequestContext) -> AsyncGenerator[bytes, None]:
        msg = _decode(route_request_decoder, payload, "RouteRequest")
        yield encode(self.router.explain(msg.request))
