"""`DisaggStreamer`: the frontend's two-leg request flow (DESIGN.md §4).

Same interface as the aggregated `EngineStreamer` it wraps (``stream(request, router)``
with the *decode* pool's router). Per request:
1. No prefill worker for the model: aggregated on the decode pool with `decode_fallback`,
   else `NoWorkersAvailable` (503) saying how to fix it.
2. Route the decode worker (KV-aware over the decode pool); if the prompt is short or mostly
   cached there (`min_prefill_tokens`, `min_uncached_ratio`), or the prefill pool is busy
   (every prefill worker has `max_prefill_queue` legs queued, or the prefill router finds
   all over its busy thresholds), serve it there whole.
3. prefill-first: the prefill router (KV-aware over the prefill pool) picks a prefill worker,
   which returns the first token + `disagg_params`; the first token goes to the client at
   once and the decode leg (prompt + first token, the params) goes to the chosen decode
   worker. decode-first (`tandem.disagg.decode_first`): both legs start together; the
   decode publishes a rendezvous op, the prefill's first token goes to the client at once
   and the prefill pushes the KV and that token into the rendezvous.
A prefill leg that fails (no prefill worker left, worker died) falls back to the decode
worker; a first token that is never handed to a decode (client gone, stop string) has its
pins cancelled at once rather than at TTL. The decode leg keeps migration: a continuation
drops the params and the pin and prefills wherever it lands.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator
from typing import Any

import msgspec

from tandem.disagg.config import DisaggRouteConfig
from tandem.disagg.decode_first import decode_first
from tandem.disagg.legs import PoolStreamer
from tandem.disagg.params import PINNED_ANNOTATION, DisaggParams, without_image_bytes
from tandem.disagg.pool import PrefillPool
from tandem.errors import EngineError, NoWorkersAvailable, Overloaded, PeerGone, TransferError
from tandem.protocols.engine import (
    EngineOutput,
    PreprocessedRequest,
    RoutingHints,
    decode_output,
    encode,
)
from tandem.router.base import RouteDecision, Router
from tandem.router.source import InstanceSource
from tandem.runtime.base import RequestClient
from tandem.runtime.tls import TlsFiles
from tandem.transfer import OpRef, cancel_soon, decode_meta

logger = logging.getLogger(__name__)


class DisaggStreamer:
    """Streams like the aggregated streamer it wraps (`stream`, `stream_batches`): the
    frontend's `Streamer`. It is the `LegPair` its decode-first legs run on."""

    def __init__(
        self,
        aggregated: PoolStreamer,  # EngineStreamer over the decode pool
        pool: PrefillPool,
        decode_instances: InstanceSource,  # the decode pool (metadata: agent address)
        client: RequestClient,
        prefill_path: str,
        config: DisaggRouteConfig,
        *,
        cluster_secret: str | None = None,  # to cancel ops at the workers' transfer agents
        transfer_tls: TlsFiles | None = None,  # their TLS, when they use it
    ) -> None:
        self.cluster_secret, self.transfer_tls = cluster_secret, transfer_tls
        self.aggregated, self.pool, self.decode_instances = aggregated, pool, decode_instances
        self.client, self.prefill_path, self.config = client, prefill_path, config
        self.num_local = self.num_remote = self.num_prefill_failures = 0
        self.num_rejoined = 0  # decode-first legs that disagreed on the first token
        self.num_busy = 0  # of num_local: kept on the decode worker as the prefill pool was busy

    async def stream(
        self, request: PreprocessedRequest, router: Router
    ) -> AsyncGenerator[EngineOutput, None]:
        prefill_router = await self.pool.router_for(request.model)
        if prefill_router is None:
            if not self.config.decode_fallback:
                raise NoWorkersAvailable(
                    f"no prefill worker serves model '{request.model}' (component "
                    f"'{self.config.prefill_component}'); start one with `tandem worker "
                    "--disagg-mode prefill`, or pass --decode-fallback to serve aggregated"
                )
            stream = self.aggregated.stream(request, router)
        else:
            decision = await router.route(request)
            prefill_at = None
            if self._worth_splitting(request, decision):
                prefill_at = await self._route_prefill(request, prefill_router)
            stream = self._split(request, router, prefill_router, decision, prefill_at)
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    yield out
        finally:
            if prefill_router is not None:  # a prefill routed but never run is not in flight
                prefill_router.on_finish(request.request_id)

    async def stream_batches(
        self, request: PreprocessedRequest, router: Router
    ) -> AsyncGenerator[list[EngineOutput], None]:
        """`stream` in the frontend's batch form: one output per batch (the two legs'
        outputs are not gathered)."""
        outputs = self.stream(request, router)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                yield [out]

    def _split(
        self,
        request: PreprocessedRequest,
        router: Router,
        prefill_router: Router,
        decision: RouteDecision,
        prefill_at: RouteDecision | None,
    ) -> AsyncGenerator[EngineOutput, None]:
        pinned = _pin(request, decision.instance_id)
        if prefill_at is None:
            self.num_local += 1
            return self.aggregated.stream(pinned, router)
        self.num_remote += 1
        if self.config.flow == "decode-first":
            return self._decode_first(request, pinned, router, prefill_router, decision, prefill_at)
        return self._prefill_first(request, pinned, router, prefill_router, prefill_at)

    async def _route_prefill(
        self, request: PreprocessedRequest, prefill_router: Router
    ) -> RouteDecision | None:
        """The prefill worker for ``request``, or None when the prefill pool is busy (every
        worker at `max_prefill_queue` legs, or over the router's busy thresholds) or gone:
        the decode worker then prefills itself rather than wait in a queue."""
        why = self._pool_queue_full(prefill_router)
        if not why:
            try:
                return await prefill_router.route(request)
            except Overloaded as exc:
                why = exc.message
            except NoWorkersAvailable:
                return None
        self.num_busy += 1
        logger.debug("request_id=%s: prefill pool busy (%s); prefilling on the decode worker",
                     request.request_id, why)  # fmt: skip
        return None

    def _pool_queue_full(self, prefill_router: Router) -> str:
        """Why every prefill worker's queue is full ('' when one has room): its depth is
        the larger of this frontend's prefill legs in flight there and the worker's own
        reported waiting requests."""
        limit = self.config.max_prefill_queue
        if not limit:
            return ""
        loads = prefill_router.worker_loads()
        depths = [max(row.get("inflight", 0.0), row.get("waiting", 0.0)) for row in loads.values()]
        if not depths or min(depths) < limit:
            return ""
        return f"all {len(depths)} prefill workers have >= {limit} prefills queued"

    def _worth_splitting(self, request: PreprocessedRequest, decision: RouteDecision) -> bool:
        """Conditional disaggregation: is the uncached part on the decode worker big enough?"""
        inst = self.decode_instances.instances.get(decision.instance_id)
        block_size = inst.model.block_size if inst is not None and inst.model else 0
        num_prompt = len(request.token_ids)
        uncached = max(num_prompt - decision.overlap_blocks * block_size, 0)
        return (
            uncached >= max(self.config.min_prefill_tokens, 1)
            and uncached >= self.config.min_uncached_ratio * num_prompt
        )

    async def _prefill_first(
        self,
        request: PreprocessedRequest,
        pinned: PreprocessedRequest,
        router: Router,
        prefill_router: Router,
        prefill_at: RouteDecision,
    ) -> AsyncGenerator[EngineOutput, None]:
        first = await self.prefill_or_none(request, prefill_router, prefill_at)
        if first is None:
            async for out in self.aggregated.stream(pinned, router):
                yield out
            return
        params = first.disagg_params
        if params is None:
            yield first
            return
        handed = False
        try:
            yield msgspec.structs.replace(first, disagg_params=None, finish_reason=None)
            decode_req = _decode_leg(pinned, first.token_ids, params)
            async for out in self.aggregated.stream(decode_req, router):
                handed = True
                yield msgspec.structs.replace(out, num_cached_tokens=None)
        finally:
            if not handed:
                _cancel_source_soon(
                    params,
                    "the decode leg never started (client gone or failed)",
                    self.cluster_secret,
                    self.transfer_tls,
                )

    async def _decode_first(
        self,
        request: PreprocessedRequest,
        pinned: PreprocessedRequest,
        router: Router,
        prefill_router: Router,
        decision: RouteDecision,
        prefill_at: RouteDecision,
    ) -> AsyncGenerator[EngineOutput, None]:
        inst = self.decode_instances.instances.get(decision.instance_id)
        metadata = inst.metadata if inst is not None else {}
        address = metadata.get("kv_transfer_address")
        if address is None:  # not a decode-mode worker: it can only serve aggregated
            async for out in self.aggregated.stream(pinned, router):
                yield out
            return
        agent_id = str(metadata.get("kv_transfer_agent_id", ""))
        room = OpRef(address=(str(address[0]), int(address[1])), op_id="", agent_id=agent_id)
        legs = decode_first(self, request, pinned, router, prefill_router, prefill_at, room)
        async with contextlib.aclosing(legs):
            async for out in legs:
                yield out

    async def prefill_or_none(
        self,
        request: PreprocessedRequest,
        router: Router,
        first_at: RouteDecision,
        head: asyncio.Future[EngineOutput | None] | None = None,
    ) -> EngineOutput | None:
        """The prefill leg's final output, or None when no prefill worker could do it.
        ``head`` (decode-first) gets the first output with tokens as soon as it streams in,
        or None if none came."""
        try:
            async with asyncio.timeout(self.config.prefill_timeout_s):
                return await self._prefill_leg(request, router, first_at, head)
        except (PeerGone, NoWorkersAvailable, Overloaded, TransferError, EngineError,
                TimeoutError) as exc:  # fmt: skip
            self.num_prefill_failures += 1
            logger.warning("request_id=%s: prefill leg failed (%s); serving on the decode worker",
                           request.request_id, exc)  # fmt: skip
            return None
        finally:
            if head is not None and not head.done():
                head.set_result(None)

    async def _prefill_leg(
        self,
        request: PreprocessedRequest,
        router: Router,
        first_at: RouteDecision,
        head: asyncio.Future[EngineOutput | None] | None,
    ) -> EngineOutput:
        excluded: set[str] = set()
        rid = request.request_id
        decision: RouteDecision | None = first_at
        while True:  # bounded: route raises NoWorkersAvailable once all are excluded
            if decision is None:
                decision = await router.route(request, exclude=frozenset(excluded))
            stream = self.client.stream(decision.address, self.prefill_path, encode(request),
                                        request_id=rid, deadline_s=request.deadline_s)  # fmt: skip
            try:
                async for payload in stream:
                    out = decode_output(payload)
                    if out.finish_reason == "error" or out.error is not None:
                        raise EngineError(f"prefill worker failed: {out.error}")
                    if head is not None and out.token_ids and not head.done():
                        router.on_first_token(rid)
                        head.set_result(out)  # decode-first: the client's first token
                    if out.finish_reason is not None:
                        router.on_first_token(rid)
                        return out
                raise PeerGone(f"prefill stream from {decision.instance_id} ended early")
            except PeerGone as exc:
                logger.info("request_id=%s: prefill worker %s lost (%s); trying another",
                            rid, decision.instance_id, exc)  # fmt: skip
                excluded.add(decision.instance_id)
                decision = None
            finally:
                router.on_finish(rid)
                await stream.aclose()


def _pin(request: PreprocessedRequest, instance_id: str) -> PreprocessedRequest:
    routing = request.routing or RoutingHints()
    if routing.worker_id is not None:
        return request
    return msgspec.structs.replace(
        request,
        routing=msgspec.structs.replace(routing, worker_id=instance_id),
        annotations=[*request.annotations, PINNED_ANNOTATION],
    )


def _decode_leg(
    pinned: PreprocessedRequest, first_tokens: list[int], params: dict[str, Any]
) -> PreprocessedRequest:
    """Prompt + the prefill's first token(s), the rest of the budget, the handoff params;
    images travel as their mm_hashes only (the KV carries them, DESIGN.md §10 step 4)."""
    return msgspec.structs.replace(
        without_image_bytes(pinned).continued_after(first_tokens),
        disagg_params=params,
    )


def _cancel_source_soon(
    params: dict[str, Any], reason: str, cluster_secret: str | None, tls: TlsFiles | None
) -> None:
    """Release a prefill's pins now (best effort, in a thread); the TTL is the backstop.
    An engine's own handoff params (vLLM's NixlConnector: no ``mode``) expire on the engine's
    own timeout."""
    if "mode" not in params:
        return
    meta = decode_meta(DisaggParams.from_dict(params).meta)
    cancel_soon(meta, reason, sender_id="frontend", cluster_secret=cluster_secret, tls=tls)
