"""Route a request and stream its engine outputs, moving it to another worker when the
stream breaks (PeerGone) before it finished: the new worker gets prompt + tokens generated so
far with max_tokens reduced, so the caller sees one stream (DESIGN.md §3 step 7).

A stream that stops making progress (`tandem.frontend.watchdog`) breaks like a dead worker's
(`StreamStalled`, a PeerGone); its worker is kept out of routing until it answers again, and
its pooled request-plane connection is dropped, so it is probed and served over a fresh one.

A worker that leaves discovery and does not answer a PING (`worker_left`: its lease expired
because its host or process is gone or frozen) loses its streams at once (`WorkerLeft`),
without the stall timeout, and its connection is dropped. One that leaves and still answers is
draining (it unregistered to shut down gracefully): its streams finish there."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing, nullcontext
from typing import TYPE_CHECKING, Any

import msgspec

from tandem.disagg.params import PINNED_ANNOTATION
from tandem.disagg.vllm_fetch import needs_export, with_export
from tandem.errors import NoWorkersAvailable, PeerGone
from tandem.frontend.watchdog import (
    StallConfig,
    StreamStalled,
    StreamWatch,
    WorkerHealth,
    WorkerLeft,
)
from tandem.protocols.engine import (
    EngineOutput,
    PreprocessedRequest,
    StopConditions,
    decode_output,
    encode,
    encode_request,
)
from tandem.router.base import RouteDecision, Router
from tandem.runtime import tracing
from tandem.runtime.base import RequestClient, ResponsePayloads
from tandem.runtime.task import cancel_and_wait

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import Span

logger = logging.getLogger(__name__)

# a worker that left discovery and does not answer a PING within this long is gone, not
# draining (a live one answers in milliseconds; its event loop would have to be blocked)
LEFT_ANSWER_S = 1.0
_NO_SPAN = nullcontext()


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
        self._departures: set[asyncio.Task[bool]] = set()  # worker_left checks under way

    async def close(self) -> None:
        await cancel_and_wait(list(self._departures))
        if self.health is not None:
            await self.health.close()

    def worker_removed(self, worker_id: str, address: str) -> None:
        """An instance listener's entry to `worker_left` (which waits for a PING's answer):
        runs it in a task of its own."""
        task = asyncio.create_task(self.worker_left(worker_id, address), name=f"left-{worker_id}")
        self._departures.add(task)
        task.add_done_callback(self._departures.discard)

    async def worker_left(self, worker_id: str, address: str) -> bool:
        """`worker_id` (at `address`) left discovery. Unless its connection answers a PING
        within LEFT_ANSWER_S (a draining worker: its streams finish there), it is gone: its
        connection is dropped and its streams migrate now. Returns whether it was gone."""
        if await self._client.answers(address, LEFT_ANSWER_S):
            logger.info("worker %s left discovery and still answers: draining", worker_id)
            return False
        logger.warning(
            "worker %s left discovery and does not answer; its streams migrate now", worker_id
        )
        self._client.drop(address, f"worker {worker_id} left discovery and stopped answering")
        if self.health is not None:
            self.health.left(worker_id)
        return True

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
        run = _Run(request)
        health = self.health
        first_s, stall_s = _stall_limits(health)
        try:
            while True:
                decision, stream = await self._dispatch(run, router)
                rid, run.has_token = run.current.request_id, False
                made_before = len(run.generated)  # this dispatch's tokens settle its charge
                chunks = aiter(stream)
                next_ready = stream.next_ready  # a payload already here is taken without awaiting
                started = False
                watch = health.stream_opened(decision.instance_id) if health is not None else None
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
                        batch = run.take_ready(payload, next_ready, router)
                        started = True
                        yield batch
                        if batch[-1].finish_reason is not None:
                            return
                    raise PeerGone(f"stream from {decision.instance_id} ended without finishing")
                except (PeerGone, NoWorkersAvailable) as exc:
                    self._after_loss(run, decision.instance_id, decision.address, exc, started)
                finally:
                    router.on_finish(rid, len(run.generated) - made_before)
                    if health is not None and watch is not None:
                        health.stream_closed(watch)
                    await stream.aclose()
        finally:
            if run.span is not None:  # a migration's, with tracing on
                tracing.end(run.span)

    async def _dispatch(self, run: _Run, router: Router) -> tuple[RouteDecision, ResponsePayloads]:
        """Route `run.current` (never to a worker it left or a suspect one) and open its
        stream; inside the current migration's span."""
        health = self.health
        suspects = health.excluded() if health is not None else frozenset()
        current = run.current
        # inside a migration's span (tracing on) its route and worker spans are its children
        with _NO_SPAN if run.span is None else tracing.use(run.span):
            asked = time.perf_counter()
            decision = await router.route(current, exclude=frozenset(run.excluded) | suspects)
            if self._on_routed is not None:
                self._on_routed(current.model, time.perf_counter() - asked)
            sent = current  # a peer fetch hint is for this dispatch only (never a re-route)
            hint = decision.kv_fetch
            if hint is not None and needs_export(hint):  # vLLM's: the holder exports first
                hint = await with_export(self._client, self._path, current, hint)
            if hint is not None:
                sent = msgspec.structs.replace(current, kv_fetch=hint)
            payload = encode_request(
                sent, block_hashes=decision.block_hashes, hash_block_size=decision.block_size
            )
            stream = self._client.stream(
                decision.address,
                self._path,
                payload,
                request_id=current.request_id,
                deadline_s=current.deadline_s,
            )
        return decision, stream

    def _after_loss(
        self,
        run: _Run,
        worker_id: str,
        address: str,
        exc: PeerGone | NoWorkersAvailable,
        started: bool,
    ) -> None:
        """The stream from `worker_id` broke: route the request again (nothing reached the
        caller: no migration spent), migrate it with the tokens generated so far, or raise
        `exc` (migration limit spent, or not a lost worker)."""
        run.excluded.add(worker_id)
        if isinstance(exc, StreamStalled) and self.health is not None:
            self._client.drop(address, f"worker {worker_id} stalled: {exc}")
            self.health.stalled(worker_id, self._probe(address, run.current))
        request = run.request
        if not started:
            logger.info(
                "request_id=%s not taken by worker %s (%s); routing it again",
                request.request_id,
                worker_id,
                exc,
            )
            run.current = _without_handoff(run.current)
            return
        if run.attempt >= self._limit or not isinstance(exc, PeerGone):
            raise exc
        run.attempt += 1
        run.current = _continuation(request, run.generated, run.attempt)
        logger.warning(
            "request_id=%s lost worker %s (%s); migrating with %d tokens (attempt %d/%d)",
            request.request_id,
            worker_id,
            exc,
            len(run.generated),
            run.attempt,
            self._limit,
        )
        if self._on_migrate is not None:
            self._on_migrate(request.model)
        if tracing.enabled:
            tracing.end(run.span)
            run.span = tracing.start(
                "migration", attempt=run.attempt, from_worker=worker_id,
                num_tokens=len(run.generated), reason=str(exc),
            )  # fmt: skip

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
                await stream.aclose()

        return probe


class _Run:
    """One request's way through its dispatches: the request to send next, the tokens
    generated so far, the workers it left, and the span of the current migration (tracing
    on)."""

    __slots__ = ("attempt", "current", "excluded", "generated", "has_token", "request", "span")

    def __init__(self, request: PreprocessedRequest) -> None:
        self.request = self.current = request
        self.generated: list[int] = []
        self.excluded: set[str] = set()
        self.attempt = 0  # migrations so far
        self.has_token = False  # of the current dispatch: the router heard of its first token
        self.span: Span | None = None

    def take_ready(
        self, payload: bytes | None, next_ready: Callable[[], bytes | None], router: Router
    ) -> list[EngineOutput]:
        """`payload` and every payload already here after it, decoded in order, up to the
        finished one; the router hears of the first token once per dispatch."""
        batch = []
        while payload is not None:
            out = decode_output(payload)
            batch.append(out)
            if not self.has_token and out.token_ids:
                self.has_token = True
                router.on_first_token(self.current.request_id)
            self.generated.extend(out.token_ids)
            if out.finish_reason is not None:
                break
            payload = next_ready()
        return batch


def _stall_limits(health: WorkerHealth | None) -> tuple[float, float]:
    """(first output, next output) timeouts of the watchdog; zeros without one."""
    if health is None:
        return 0.0, 0.0
    return health.config.first_token_timeout_s, health.config.stall_timeout_s


def _stalled(watch: StreamWatch, started: bool) -> PeerGone | None:
    """The error to raise for a CancelledError that came from `watch` (its stall rule held,
    or its worker left), with the cancellation taken back; None when the cancel came from
    elsewhere."""
    task = asyncio.current_task()
    if not watch.fired or task is None or task.uncancel() != 0:
        return None
    if watch.gone:
        return WorkerLeft(f"worker {watch.worker_id} left discovery and stopped answering")
    cfg = watch.config
    what = "next output" if started else "first output"
    limit = cfg.stall_timeout_s if started else cfg.first_token_timeout_s
    return StreamStalled(f"worker {watch.worker_id} made no progress: no {what} within {limit:g} s")


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
