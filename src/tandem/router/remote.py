"""`RemoteRouter` (`--router remote`): the frontend side of the `tandem router` service.

Finds the service's instances at `{ns}.router.route` in discovery, asks one of them to route
each request (trying the next one when a service is unreachable), and tells the service that
routed a request about its first token and its end. Notices are batched and sent by one
task in order; a full notice queue drops the oldest (the service sweeps what it never hears
about after its active TTL)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import defaultdict
from typing import Any

from tandem.errors import NoWorkersAvailable, PeerGone
from tandem.protocols.engine import PreprocessedRequest
from tandem.router.base import RouteDecision
from tandem.router.config import RouterConfig
from tandem.router.decision_log import DecisionLog
from tandem.router.messages import (
    ROUTER_COMPONENT,
    RouteRequest,
    RouterNoticeMsg,
    encode,
    route_response_decoder,
)
from tandem.router.metrics import RouterMetrics
from tandem.runtime.base import Discovery, RequestClient
from tandem.runtime.instances import InstanceSet
from tandem.runtime.task import cancel_and_wait

logger = logging.getLogger(__name__)

MAX_PENDING_NOTICES = 100_000


class RemoteRouter:
    """Implements the `Router` protocol by forwarding; one event loop."""

    policy = "remote"

    def __init__(
        self,
        config: RouterConfig,
        *,
        discovery: Discovery | None,
        client: RequestClient | None,
        namespace: str = "tandem",
    ) -> None:
        if discovery is None or client is None:
            raise ValueError("router policy 'remote' needs the runtime's discovery and client")
        self.config = config
        self._client = client
        self._prefix = f"{namespace}.{ROUTER_COMPONENT}"
        self.services = InstanceSet(discovery, f"{self._prefix}.route")
        self._next = 0
        self._routed: dict[str, str] = {}  # request_id -> address of the service that routed it
        # (address, kind, request id, output tokens or -1)
        self._notices: asyncio.Queue[tuple[str, str, str, int]] = asyncio.Queue(MAX_PENDING_NOTICES)
        self._sender: asyncio.Task[None] | None = None
        self.decisions = DecisionLog()  # stays empty: the service makes (and logs) the choices

    async def start(self) -> None:
        if self._sender is None:
            await self.services.start()
            self._sender = asyncio.create_task(self._send_notices(), name="remote-router-notices")

    async def close(self) -> None:
        await cancel_and_wait([self._sender])
        await self.services.close()

    # ------------------------------------------------------------ routing
    async def route(
        self, request: PreprocessedRequest, *, exclude: frozenset[str] = frozenset()
    ) -> RouteDecision:
        """Raises what the service raises (Overloaded, NoWorkersAvailable, InvalidRequest),
        or NoWorkersAvailable when no service instance answers."""
        self.on_finish(request.request_id)  # a re-route (migration) replaces the old entry
        payload = encode(RouteRequest(request=_hashes_only(request), exclude=sorted(exclude)))
        services = sorted(self.services.instances.values(), key=lambda i: i.instance_id)
        errors: list[str] = []
        for k in range(len(services)):
            service = services[(self._next + k) % len(services)]
            try:
                reply = await self._call(
                    service.address, "route", payload, self.config.remote_timeout_s
                )
            except (PeerGone, TimeoutError) as exc:
                errors.append(f"{service.instance_id}: {exc}")
                continue
            self._next = (self._next + k + 1) % len(services)
            self._routed[request.request_id] = service.address
            msg = route_response_decoder.decode(reply[0])
            return RouteDecision(
                instance_id=msg.instance_id,
                address=msg.address,
                overlap_blocks=msg.overlap_blocks,
                request_blocks=msg.request_blocks,
                details=msg.details,
                kv_fetch=msg.kv_fetch,
            )
        raise NoWorkersAvailable(
            f"no router service answered at {self._prefix}.route "
            f"({len(services)} registered{': ' + '; '.join(errors) if errors else ''}); "
            "start one with `tandem router`",
            retry_after_s=self.config.retry_after_s,
        )

    async def _call(
        self, address: str, endpoint: str, payload: bytes, timeout_s: float | None = None
    ) -> list[bytes]:
        timeout_s = timeout_s or self.config.kv_state_timeout_s
        async with asyncio.timeout(timeout_s):
            return [
                chunk
                async for chunk in self._client.stream(
                    address,
                    f"{self._prefix}.{endpoint}",
                    payload,
                    request_id=f"router-{uuid.uuid4().hex[:12]}",
                    deadline_s=time.time() + timeout_s,
                )
            ]

    def on_first_token(self, request_id: str) -> None:
        address = self._routed.get(request_id)
        if address is not None:
            self._enqueue(address, "first_token", request_id, -1)

    def on_finish(self, request_id: str, output_tokens: int | None = None) -> None:
        address = self._routed.pop(request_id, None)
        if address is not None:
            self._enqueue(
                address, "free", request_id, -1 if output_tokens is None else output_tokens
            )

    def _enqueue(self, address: str, kind: str, request_id: str, tokens: int) -> None:
        if self._notices.full():
            self._notices.get_nowait()
            logger.warning("router notice queue full; dropping the oldest notice")
        self._notices.put_nowait((address, kind, request_id, tokens))

    async def _send_notices(self) -> None:
        """Per batch and service: first_token notices before free ones, so a request's
        order holds (a free never overtakes its own first_token)."""
        while True:
            batch = [await self._notices.get()]
            while not self._notices.empty():
                batch.append(self._notices.get_nowait())
            grouped: dict[tuple[str, str], list[tuple[str, int]]] = defaultdict(list)
            for address, kind, request_id, tokens in batch:
                grouped[(address, kind)].append((request_id, tokens))
            ordered = sorted(grouped.items(), key=lambda item: item[0][1] != "first_token")
            for (address, kind), notices in ordered:
                ids = [rid for rid, _ in notices]
                made = [n for _, n in notices] if kind == "free" else None
                try:
                    msg = RouterNoticeMsg(request_ids=ids, output_tokens=made)
                    await self._call(address, kind, encode(msg))
                except Exception as exc:  # a lost notice is swept by the service's TTL
                    logger.warning("router %s notice to %s failed: %r", kind, address, exc)

    # ------------------------------------------------------------ introspection
    def explain(self, request: PreprocessedRequest) -> dict[str, Any]:
        """Only what this side knows; the choice itself is the service's (its `explain`
        endpoint answers with the service's view)."""
        return {
            "policy": self.policy,
            "services": sorted(self.services.instances),
            "explain_endpoint": f"{self._prefix}.explain",
        }

    async def explain_choice(self, request: PreprocessedRequest) -> dict[str, Any]:
        """The service's `explain` of `request` (first service that answers)."""
        import msgspec

        payload = encode(RouteRequest(request=_hashes_only(request)))
        for service in sorted(self.services.instances.values(), key=lambda i: i.instance_id):
            with contextlib.suppress(PeerGone, TimeoutError):
                reply = await self._call(service.address, "explain", payload)
                return dict(msgspec.msgpack.decode(reply[0]))
        raise NoWorkersAvailable(f"no router service answered at {self._prefix}.explain")

    def worker_loads(self) -> dict[str, dict[str, float]]:
        return {}

    @property
    def metrics(self) -> RouterMetrics | None:
        """None: the router service exports its counters itself."""
        return None

    @property
    def num_queued(self) -> int:
        """0: requests queue in the router service, not here."""
        return 0

    def metrics_text(self) -> str:
        return ""


def _hashes_only(request: PreprocessedRequest) -> PreprocessedRequest:
    """What the router service needs of a request's images: mm_hash and rows, not the bytes."""
    if not request.mm_items:
        return request
    import msgspec

    items = [msgspec.structs.replace(i, image_bytes=None) for i in request.mm_items]
    return msgspec.structs.replace(request, mm_items=items)
