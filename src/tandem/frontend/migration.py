"""Route a request and stream its engine outputs, moving it to another worker when the
stream breaks (PeerGone) before it finished: the new worker gets prompt + tokens generated so
far with max_tokens reduced, so the caller sees one stream (DESIGN.md §3 step 7).

A stream that stops making progress (`tandem.frontend.watchdog`) breaks like a dead worker's
(`StreamStalled`, a PeerGone); its worker is kept out of routing until it answers again."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

import msgspec

from tandem.disagg.params import PINNED_ANNOTATION
from tandem.errors import NoWorkersAvailable, PeerGone
from tandem.frontend.watchdog import StallConfig, StreamStalled, StreamWatch, WorkerHealth
from tandem.protocols.engine import (
    EngineOutput,
    PreprocessedRequest,
    StopConditions,
    decode_output,
    encode,
    encode_request,
)
from tandem.router.base import Router
from tandem.runtime import tracing
from tandem.runtime.base import RequestClient

logger = logging.getLogger(__name__)


class EngineStreamer:
    """Streams requests to workers over the request plane. Safe for concurrent requests."""

    def __init__(
        self,
        client: RequestClient,
        endpoint_path: str,
        *,
        migration_limit: int = 0,
        on_migrate: Callable[[str], None] | None = None,
        stall: StallConfig | None = None,
        on_routed: Callable[[str, float], None] | None = None,
    ) -> None:
        """`on_routed(model, seconds)`: each dispatch, the time its route call took (the
        router's queue, when every worker is busy, included): the planner's queue wait."""
        self._client = client
        self._path = endpoint_path
        self._limit = migration_limit
        self._on_migrate = on_migrate
        self._on_routed = on_routed
        stall = stall or StallConfig()
        self.health: WorkerHealth | None = WorkerHealth(stall) if stall.enabled else None

    async def close(self) -> None:
        if self.health is not None:
            await self.health.close()

    async def stream(
        self, request: PreprocessedRequest, router: Router
    ) -> AsyncGenerator[EngineOutput, None]:
        """`stream_batches`, one output at a time."""
        batches = self.stream_batches(request, router)
        async with aclosing(batches):
            async for batch in batches:
                for out in batch:
                    yield out

    async def stream_batches(
        self, request: PreprocessedRequest, router: Router
    ) -> AsyncGenerator[list[EngineOutput], None]:
        """Yield the request's EngineOutputs, in order, until one has `finish_reason`: each
        time every output that has already arrived (one or more), so a reader that fell
        behind catches up in one resume instead of one per token. Raises what
        routing raises (NoWorkersAvailable, Overloaded, ...), PeerGone once the migration
        limit is spent, and the worker's ServingError. Closing the iterator cancels the
        request on the worker.

        A worker that refuses or loses the request before its first output (draining,
        connection refused, died at once) costs no migration: nothing reached the caller, so
        the request is simply routed again, excluding that worker (bounded by the number of
        instances). A stalled stream (no progress within the StallConfig limits) counts as
        lost, and workers marked stalled are excluded until they answer again."""
        generated: list[int] = []
        excluded: set[str] = set()
        current = request
        attempt = 0
        health = self.health
        first_s, stall_s = (
            (health.config.first_token_timeout_s, health.config.stall_timeout_s)
            if health is not None
            else (0.0, 0.0)
        )
        migration = None  # the span of the current migration attempt (tracing on)
        try:
            while True:
                suspects = health.excluded() if health is not None else frozenset()
                with tracing.use(migration):  # its route and worker spans are its children
                    asked = time.perf_counter()
                    decision = await router.route(current, exclude=frozenset(excluded) | suspects)
                    if self._on_routed is not None:
                        self._on_routed(current.model, time.perf_counter() - asked)
                    rid = current.request_id
                    stream = self._client.stream(
                        decision.address,
                        self._path,
                        encode_request(
                            current,
                            block_hashes=decision.block_hashes,
                            hash_block_size=decision.block_size,
                        ),
                        request_id=rid,
                        deadline_s=current.deadline_s,
                    )
                chunks = aiter(stream)
                # a payload that has already arrived is taken without awaiting (TCP streams)
                next_ready = getattr(stream, "next_ready", _nothing_ready)
                started = has_token = False
                watch = None
                if health is not None:
                    watch = health.stream_opened(decision.instance_id)
                try:
                    while True:
                        payload = next_ready()
                        if payload is None:  # the watch is armed only while awaiting
                            if watch is not None:
                                watch.arm(stall_s if started else first_s)
                            try:
                                payload = await anext(chunks, None)
                            except asyncio.CancelledError:
                                if watch is not None and (stalled := _stalled(watch, started)):
                                    raise stalled from None
                                raise
                            finally:
                                if watch is not None:
                                    watch.disarm()
                            if payload is None:
                                break
                        if health is not None:
                            health.output(decision.instance_id)
                        batch = []
                        while payload is not None:  # the payloads already here, in order
                            out = decode_output(payload)
                            batch.append(out)
                            if not has_token and out.token_ids:
                                has_token = True
                                router.on_first_token(rid)
                            generated.extend(out.token_ids)
                            if out.finish_reason is not None:
                                break
                            payload = next_ready()
                        started = True
                        yield batch
                        if out.finish_reason is not None:
                            return
                    raise PeerGone(f"stream from {decision.instance_id} ended without finishing")
                except (PeerGone, NoWorkersAvailable) as exc:
                    excluded.add(decision.instance_id)
                    if isinstance(exc, StreamStalled) and health is not None:
                        health.stalled(decision.instance_id, self._probe(decision.address, current))
                    if not started:
                        logger.info(
                            "request_id=%s not taken by worker %s (%s); routing it again",
                            request.request_id,
                            decision.instance_id,
                            exc,
                        )
                        current = _without_handoff(current)
                        continue
                    if attempt >= self._limit or not isinstance(exc, PeerGone):
                        raise
                    attempt += 1
                    current = _continuation(request, generated, attempt)
                    logger.warning(
                        "request_id=%s lost worker %s (%s); migrating with %d tokens "
                        "(attempt %d/%d)",
                        request.request_id,
                        decision.instance_id,
                        exc,
                        len(generated),
                        attempt,
                        self._limit,
                    )
                    if self._on_migrate is not None:
                        self._on_migrate(request.model)
                    if tracing.is_enabled():
                        tracing.end(migration)
                        migration = tracing.start(
                            "migration", attempt=attempt, from_worker=decision.instance_id,
                            num_tokens=len(generated), reason=str(exc),
                        )  # fmt: skip
                finally:
                    router.on_finish(rid)
                    if health is not None and watch is not None:
                        health.stream_closed(watch)
                    await _close(stream)
        finally:
            tracing.end(migration)

    def _probe(self, address: str, request: PreprocessedRequest) -> Callable[[], Any]:
        """A one-token request to the worker at `address`: returns once it streams."""
        timeout_s = self.health.config.probe_timeout_s if self.health else 2.0

        async def probe() -> None:
            probe_request = PreprocessedRequest(
                request_id=f"probe-{uuid.uuid4().hex}",
                model=request.model,
                token_ids=request.token_ids[:1],
                stop=StopConditions(max_tokens=1, ignore_eos=True),
                deadline_s=time.time() + timeout_s,
            )
            stream = self._client.stream(
                address,
                self._path,
                encode(probe_request),
                request_id=probe_request.request_id,
                deadline_s=probe_request.deadline_s,
            )
            try:
                async for _ in stream:
                    return
                raise PeerGone(f"probe of {address} ended without output")
            finally:
                await _close(stream)

        return probe


def _nothing_ready() -> bytes | None:
    return None  # a stream without `next_ready`: every payload is awaited


def _stalled(watch: StreamWatch, started: bool) -> StreamStalled | None:
    """The error to raise for a CancelledError that came from `watch` (its stall rule held),
    with the cancellation taken back; None when the cancel came from elsewhere."""
    task = asyncio.current_task()
    if not watch.fired or task is None or task.uncancel() != 0:
        return None
    cfg = watch.config
    what = "next output" if started else "first output"
    limit = cfg.stall_timeout_s if started else cfg.first_token_timeout_s
    return StreamStalled(f"worker {watch.worker_id} made no progress: no {what} within {limit:g} s")


async def _close(stream: object) -> None:
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


def _continuation(
    request: PreprocessedRequest, generated: list[int], attempt: int
) -> PreprocessedRequest:
    continued = request.continued_after(generated)
    return _without_handoff(
        msgspec.structs.replace(continued, request_id=f"{request.request_id}-m{attempt}")
    )


def _without_handoff(request: PreprocessedRequest) -> PreprocessedRequest:
    """A disaggregated decode leg's KV handoff was for the lost worker (e.g. it died
    mid-pull, its claim on the prefill's op gone with it), and so was the frontend's pin of
    it: routed again, the request prefills wherever it lands."""
    routing = request.routing
    pinned = routing is not None and PINNED_ANNOTATION in request.annotations
    if request.disagg_params is None and not pinned:
        return request
    if routing is not None and pinned:
        routing = msgspec.structs.replace(routing, worker_id=None)
    return msgspec.structs.replace(request, disagg_params=None, routing=routing)
