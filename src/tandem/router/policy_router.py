"""`PolicyRouter`: what every routing policy shares — candidates, pinning, in-flight counts,
load metrics, the bounded wait when every worker is busy. Subclasses implement `_choose`: the
load-only policies here (round_robin, random, least_loaded), the KV policy in `kv_router`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Required, TypedDict

from tandem.engines import step_policy
from tandem.errors import DeadlineExceeded, InvalidRequest, NoWorkersAvailable, Overloaded
from tandem.protocols.discovery import Instance, InstanceEvent
from tandem.protocols.engine import PreprocessedRequest
from tandem.protocols.kv_events import LoadMetrics
from tandem.protocols.lora import lora_events_subject
from tandem.protocols.tenancy import BATCH_PRIORITY, DEFAULT_TENANT
from tandem.router.base import RouteDecision
from tandem.router.config import RouterConfig
from tandem.router.cost import CandidateCost
from tandem.router.decision_log import DecisionLog
from tandem.router.load import LoadTracker
from tandem.router.lora import LoraPlacement, Plan
from tandem.router.lora_link import ColdUnloads, follow_lora_events
from tandem.router.metrics import RouterMetrics
from tandem.router.queue import RequestQueue, Waiter
from tandem.router.session import SessionSync, SessionTable
from tandem.router.source import EventSource, InstanceSource
from tandem.runtime import tracing
from tandem.runtime.base import RequestClient, Subscription

logger = logging.getLogger(__name__)


class PolicyRouterWiring(TypedDict, total=False):
    """What a policy router is wired to besides its config (`PolicyRouter.__init__`'s keywords):
    the workers' instances, the event plane (load metrics, KV events), the namespace of the
    subjects, a clock and a random source (tests pass their own)."""

    instances: Required[InstanceSource]
    events: EventSource | None
    namespace: str
    clock: Callable[[], float]
    rng: random.Random | None


class AllBusy(Exception):
    """Raised by `_choose` when every candidate is over a busy threshold."""


class _Waker:
    """`set()` runs `dispatch` once soon (calls in one loop iteration coalesce), or at once
    outside an event loop; nothing while `pending()` says there is nothing to dispatch (load
    updates arrive many times a second on an idle router)."""

    def __init__(self, dispatch: Callable[[], None], pending: Callable[[], bool]) -> None:
        self._dispatch = dispatch
        self._pending = pending
        self._scheduled = False

    def set(self) -> None:
        if self._scheduled or not self._pending():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._dispatch()
            return
        self._scheduled = True
        loop.call_soon(self._run)

    def _run(self) -> None:
        self._scheduled = False
        self._dispatch()


class PolicyRouter:
    """Base of the routers. One asyncio loop; `route` may be called concurrently."""

    policy = "base"

    def __init__(
        self,
        config: RouterConfig,
        *,
        instances: InstanceSource,
        events: EventSource | None = None,
        namespace: str = "tandem",
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.config = config
        self.namespace = namespace
        self._instances = instances
        self._events = events
        self._clock = clock
        self._rng = rng or random.Random(config.seed)
        self._wake = _Waker(self._dispatch, lambda: len(self.queue) > 0)
        self.loads = LoadTracker(on_update=self._wake.set)
        self._inflight: dict[str, int] = {}
        self._request_worker: dict[str, str] = {}
        self._routed: dict[str, PreprocessedRequest] = {}  # in flight, for `_overbookable`
        # waiting for a worker that is not busy: by class, tenant share, deadline (queue.py)
        self.queue = RequestQueue()
        # session id -> the worker of its last turn (session.py), shared with replicas
        self.sessions = SessionTable(ttl_s=config.session_ttl_s)
        self._session_sync: SessionSync | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._started = False
        self.metrics = RouterMetrics()
        self.metrics.tenants, self.metrics.sessions = self.queue, self.sessions
        self.decisions = DecisionLog()  # the last routing decisions, for /dashboard
        # LoRA adapters: residency, placement, replicas (router/lora.py); None when off. The
        # plan `candidates` made last, which `_book` reads in the same synchronous turn
        self.lora: LoraPlacement | None = None
        if config.lora.enabled:
            self.lora = LoraPlacement(config.lora, self._clock, self.metrics.lora)
        self._lora_plan: tuple[str, Plan] | None = None
        self._lora_requests: set[str] = set()  # routed with an adapter, until they finish
        # asks workers to unload cold adapters (the KV router sets it: it has a client)
        self.lora_client: RequestClient | None = None
        self._lora_unloads = ColdUnloads()

    def subject(self, name: str) -> str:
        return f"{self.namespace}.{self.config.worker_component}.{name}"

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        await self._instances.start()
        self._instances.add_listener(self._on_instance_event)
        if self.lora is not None:
            for instance in list(self._instances.instances.values()):
                self.lora.apply_instance(instance)
            if self._events is not None:
                subject = lora_events_subject(self.namespace, self.config.worker_component)
                lora_sub = await self._events.subscribe(subject)
                self._spawn(
                    follow_lora_events(lora_sub, self.lora, self._instances),
                    "lora_events",
                )
        if self._events is not None:
            sub = await self._events.subscribe(self.subject("load_metrics"))
            self._spawn(self._follow_loads(sub), "load_metrics")
            if self.config.session_ttl_s > 0:
                self._session_sync = SessionSync(
                    self.sessions,
                    self._events,
                    f"{self.namespace}.router.sessions",
                    router_clock=self._clock,
                )
                await self._session_sync.start()
        await self._start_extra()

    async def _start_extra(self) -> None:
        """Hook for subclasses (KV events, replica sync)."""

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        task = asyncio.create_task(coro, name=f"router-{name}")
        task.add_done_callback(self._log_task_end)
        self._tasks.append(task)

    @staticmethod
    def _log_task_end(task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            logger.error("router task %s failed", task.get_name(), exc_info=task.exception())

    async def _follow_loads(self, sub: Subscription) -> None:
        try:
            async for _subject, payload in sub:
                metrics = self.loads.apply_payload(payload)
                if metrics is not None:
                    self._on_load(metrics)
        finally:
            await sub.close()

    def _on_load(self, metrics: LoadMetrics) -> None:
        """Hook: the KV router checks the worker's reported KV event id."""

    async def close(self) -> None:
        self._lora_unloads.cancel_all()
        if self._session_sync is not None:
            await self._session_sync.close()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
            except Exception:
                logger.debug("router task ended with an error at close", exc_info=True)
        self._tasks.clear()

    def _on_instance_event(self, event: InstanceEvent) -> None:
        if self.lora is not None:
            if event.kind == "removed":
                self.lora.forget(event.instance.instance_id)
            else:
                self.lora.apply_instance(event.instance)
        if event.kind == "removed":
            self._forget_worker(event.instance.instance_id)
        else:
            self._on_worker_added(event.instance.instance_id)
        self._wake.set()

    def _on_worker_added(self, worker_id: str) -> None:
        """Hook: the KV router syncs a new worker's block set."""

    def _forget_worker(self, worker_id: str) -> None:
        self.loads.remove_worker(worker_id)
        self.decisions.forget(worker_id)
        self.sessions.forget_worker(worker_id)

    # ------------------------------------------------------------ routing
    def candidates(
        self, request: PreprocessedRequest, exclude: frozenset[str] = frozenset()
    ) -> list[Instance]:
        """Live instances allowed for `request`: the pinned one, or all not in `exclude`.

        Raises InvalidRequest for an unknown pinned id, NoWorkersAvailable for none."""
        live = self._instances.instances
        pinned = request.routing.worker_id if request.routing else None
        if pinned is not None:
            if pinned not in live:  # the live ids are the operator's, not the client's
                shown = pinned if len(pinned) <= 64 else pinned[:64] + "..."
                raise InvalidRequest(
                    f"pinned worker_id '{shown}' is unknown or not live; expected the id of a "
                    "live worker (the operator's /health lists them)",
                    param="worker_id",
                )
            if pinned in exclude:
                raise NoWorkersAvailable(f"pinned worker_id '{pinned}' is excluded (failed)")
            return [live[pinned]]
        out = [inst for iid, inst in sorted(live.items()) if iid not in exclude]
        if not out:
            raise NoWorkersAvailable(
                f"no live instance of {self.subject('generate')} "
                f"({len(live)} live, {len(exclude)} excluded)",
                retry_after_s=self.config.retry_after_s,
            )
        if self.lora is not None and request.lora_name:
            plan = self.lora.plan(request.lora_name, out)  # holders, or where it is placed
            self._lora_plan = (request.request_id, plan)
            return plan.allowed
        return out

    def _choose(
        self, request: PreprocessedRequest, candidates: Sequence[Instance]
    ) -> tuple[Instance, dict[str, Any]]:
        raise NotImplementedError

    async def route(
        self, request: PreprocessedRequest, *, exclude: frozenset[str] = frozenset()
    ) -> RouteDecision:
        span = queue_span = None
        if tracing.enabled:
            span = tracing.start("route", policy=self.policy, pool=self.config.worker_component)
        try:
            self._check_deadline(request, None)
            started = time.perf_counter()
            cands = self.candidates(request, exclude)
            decision = None
            if self.queue.outranks_all(request):  # nobody waiting comes before it
                with contextlib.suppress(AllBusy):
                    decision = self._book(request, *self._choose_for(request, cands), started)
            if decision is None:
                if span is not None:
                    queue_span = tracing.start("queue", parent=span)
                decision = await self._wait_in_queue(request, exclude)
        except BaseException as exc:
            if span is not None:
                tracing.end(queue_span, exc)
                tracing.end(span, exc)
            raise
        if span is not None:
            tracing.end(queue_span)
            tracing.end(span, worker_id=decision.instance_id,
                        overlap_blocks=decision.overlap_blocks,
                        request_blocks=decision.request_blocks)  # fmt: skip
        return decision

    def _book(
        self,
        request: PreprocessedRequest,
        chosen: Instance,
        details: dict[str, Any],
        started: float,
    ) -> RouteDecision:
        """Record `request` as routed to `chosen` (synchronously: the next choice sees it)."""
        self.on_finish(request.request_id)  # a re-route (migration) replaces the old entry
        self._book_lora(request, chosen, details)
        self._request_worker[request.request_id] = chosen.instance_id
        self._routed[request.request_id] = request
        self._inflight[chosen.instance_id] = self._inflight.get(chosen.instance_id, 0) + 1
        self.queue.charge(request)
        if request.session_id and self.config.session_ttl_s > 0:
            if self.sessions.bind(request.session_id, chosen.instance_id, self._clock()):
                details["session"] = "rebound"
            if self._session_sync is not None:
                self._session_sync.publish(request.session_id, chosen.instance_id)
        decision = self._record(request, chosen, details)
        self.metrics.observe_route(
            chosen.instance_id,
            decision.overlap_blocks,
            decision.request_blocks,
            time.perf_counter() - started,
        )
        self.decisions.record(request, decision, self._decision_costs())
        return decision

    async def _wait_in_queue(
        self, request: PreprocessedRequest, exclude: frozenset[str]
    ) -> RouteDecision:
        """Queue `request` until `_dispatch` gives it a worker, its deadline or the queue
        timeout passes, or it is cancelled."""
        if len(self.queue) >= self.config.queue_size:
            raise Overloaded(
                f"all workers are busy and the router queue is full "
                f"({len(self.queue)}/{self.config.queue_size}); retry later",
                retry_after_s=self.config.retry_after_s,
            )
        waiter = self.queue.push(request, exclude, self._clock())
        waiter.done = asyncio.get_running_loop().create_future()
        self._wake.set()  # a worker may be free for it already (it queued behind others)
        timeout, by_deadline = self.config.queue_timeout_s, False
        if request.deadline_s is not None and request.deadline_s - time.time() < timeout:
            timeout, by_deadline = request.deadline_s - time.time(), True
        missed = False
        try:
            decision: RouteDecision = await asyncio.wait_for(waiter.done, timeout=timeout)
            return decision
        except DeadlineExceeded:
            missed = True
            raise
        except TimeoutError:
            if by_deadline:
                missed = True
                self._check_deadline(request, waiter, now_s=math.inf)
            raise Overloaded(
                f"all workers stayed busy for {self.config.queue_timeout_s}s in the router queue",
                retry_after_s=self.config.retry_after_s,
            ) from None
        finally:
            self.queue.remove(waiter)
            wait_s = self._clock() - waiter.enqueued_s
            self.metrics.observe_queue_wait(request, wait_s, missed=missed)

    def _check_deadline(
        self, request: PreprocessedRequest, waiter: Waiter | None, *, now_s: float | None = None
    ) -> None:
        """DeadlineExceeded when `request`'s deadline has passed (by `now_s`, default the
        wall clock): never serve it late."""
        now_s = time.time() if now_s is None else now_s
        if request.deadline_s is None or request.deadline_s > now_s:
            return
        waited = "" if waiter is None else (
            f" after {self._clock() - waiter.enqueued_s:.3f}s in the router queue "
            f"({len(self.queue) - 1} other requests waiting)"
        )  # fmt: skip
        raise DeadlineExceeded(
            f"request {request.request_id} missed its deadline{waited}; it was not served "
            "late. Allow a longer x-tandem-deadline-ms, a higher priority, or retry later"
        )

    def _dispatch(self) -> None:
        """Offer free workers to the queued requests in queue order (`_wake.set` calls it:
        a finish, a load update, an instance change). When every worker is busy for one,
        a later one of another class or tenant may still go to a worker that preempts for it
        (`_overbookable`)."""
        blocked: set[tuple[int, str]] = set()  # `offers` skips these keys
        for waiter in self.queue.offers(blocked):
            if waiter.done is None or waiter.done.done():
                continue
            request = waiter.request
            key = (request.priority, waiter.tenant)
            started = time.perf_counter()
            try:
                self._check_deadline(request, waiter)
                cands = self.candidates(request, waiter.exclude)
                chosen, details = self._choose_for(request, cands, is_queued=True)
            except AllBusy:
                pinned = request.routing is not None and request.routing.worker_id is not None
                if not pinned and not waiter.exclude:
                    blocked.add(key)
                    if len(blocked) >= self.queue.num_keys:
                        return  # every (class, tenant) waiting found every worker busy
                continue  # another waiter may still fit elsewhere
            except Exception as exc:  # its own error (deadline, no workers): fail it alone
                self.queue.remove(waiter)
                waiter.done.set_exception(exc)
                continue
            self.queue.remove(waiter)
            waiter.done.set_result(self._book(request, chosen, details, started))

    def _choose_for(
        self,
        request: PreprocessedRequest,
        candidates: Sequence[Instance],
        *,
        is_queued: bool = False,
    ) -> tuple[Instance, dict[str, Any]]:
        """`_choose` among the candidates under `busy_inflight_requests` (AllBusy when none),
        but a session's request goes back to its bound worker while that one is a candidate,
        not busy and not `session_slack` requests above the least loaded."""
        cap = self.config.busy_inflight_requests
        if cap is not None and request.priority >= BATCH_PRIORITY:
            cap = max(cap - self.config.batch_headroom_requests, 1)
        pinned = request.routing is not None and request.routing.worker_id is not None
        if cap is not None and not pinned:
            free = [c for c in candidates if self.inflight(c.instance_id) < cap]
            candidates = free or self._overbookable(request, candidates, cap, is_queued)
            if not candidates:
                raise AllBusy
        sid = request.session_id
        if sid and self.config.session_ttl_s > 0:
            bound_id = self.sessions.get(sid, self._clock())
            bound = next((c for c in candidates if c.instance_id == bound_id), None)
            if bound is not None:
                least = min(self.inflight(c.instance_id) for c in candidates)
                if self.inflight(bound.instance_id) < least + self.config.session_slack:
                    with contextlib.suppress(AllBusy):
                        chosen, details = self._choose(request, [bound])
                        self.sessions.num_hits += 1
                        return chosen, {**details, "session": "bound"}
        return self._choose(request, candidates)

    def _overbookable(
        self,
        request: PreprocessedRequest,
        candidates: Sequence[Instance],
        cap: int,
        is_queued: bool,
    ) -> list[Instance]:
        """The busy candidates whose engine preempts for `request` (engines/step_policy.py,
        `may_overbook`): work of a less urgent class there, or a tenant over its share there
        while `request`'s has room and nothing else queued. The mocker and native engines
        preempt for it; another engine serves it as its own scheduler does."""
        num_queued = self.queue.num_waiting(request.priority, request.tenant or DEFAULT_TENANT)
        is_backlogged = num_queued > (1 if is_queued else 0)
        by_worker: dict[str, list[PreprocessedRequest]] = {}
        for request_id, routed in self._routed.items():
            by_worker.setdefault(self._request_worker[request_id], []).append(routed)
        return [
            c for c in candidates
            if step_policy.may_overbook(by_worker.get(c.instance_id, []), request, cap,
                                        is_backlogged=is_backlogged)
        ]  # fmt: skip

    def _decision_costs(self) -> Sequence[CandidateCost] | None:
        """Hook: the per-candidate costs of the decision `_record` just booked (KV router)."""
        return None

    def _record(
        self, request: PreprocessedRequest, chosen: Instance, details: dict[str, Any]
    ) -> RouteDecision:
        """Book the choice (subclasses track more) and build the decision."""
        return RouteDecision(
            instance_id=chosen.instance_id, address=chosen.address, details=details
        )

    def on_first_token(self, request_id: str) -> None:
        """Nothing to do for load-only policies."""

    def _unload_cold(self, worker_id: str, name: str) -> None:
        """Ask `worker_id` to unload the cold adapter `name` (router/lora_unload.py)."""
        instance = self._instances.instances.get(worker_id)
        if instance is not None and self.lora_client is not None:
            subject = f"{self.namespace}.{self.config.worker_component}"
            self._lora_unloads.ask(self.lora_client, instance, subject, name)

    def _book_lora(
        self, request: PreprocessedRequest, chosen: Instance, details: dict[str, Any]
    ) -> None:
        """Count a request with an adapter and hold the adapter on `chosen` (router/lora.py)."""
        last, self._lora_plan = self._lora_plan, None
        if self.lora is None or last is None or last[0] != request.request_id:
            return
        details["lora"] = last[1].summary()
        self.lora.routed(request.request_id, chosen.instance_id, last[1],
                         request.num_prompt_tokens)  # fmt: skip
        self._lora_requests.add(request.request_id)

    def on_finish(self, request_id: str, output_tokens: int | None = None) -> None:
        self.queue.settle(request_id, output_tokens)  # its fair-share charge, by what it made
        if request_id in self._lora_requests:  # a request without an adapter skips lora.py
            self._lora_requests.discard(request_id)
            assert self.lora is not None
            cold = self.lora.finished(request_id)
            if cold is not None and self.lora_client is not None:
                self._unload_cold(*cold)
        worker = self._request_worker.pop(request_id, None)
        self._routed.pop(request_id, None)
        if worker is None:
            return
        left = self._inflight.get(worker, 1) - 1
        if left > 0:
            self._inflight[worker] = left
        else:
            self._inflight.pop(worker, None)
        self._wake.set()

    @property
    def num_queued(self) -> int:
        """Requests waiting in this router's queue for a worker that is not busy."""
        return len(self.queue)

    def inflight(self, worker_id: str) -> int:
        return self._inflight.get(worker_id, 0)

    def explain(self, request: PreprocessedRequest) -> dict[str, Any]:
        cands = self.candidates(request)
        rows = [{"worker_id": c.instance_id, **self._load_row(c.instance_id)} for c in cands]
        return {"policy": self.policy, "candidates": rows, "choice": None,
                **self.explain_lora(request)}  # fmt: skip

    def explain_lora(self, request: PreprocessedRequest) -> dict[str, Any]:
        """The `lora` part of explain (after `candidates`): the plan for the request's adapter
        (holders, wanted replicas, where it goes and why) and every worker's residency."""
        last, self._lora_plan = self._lora_plan, None
        if self.lora is None or last is None or last[0] != request.request_id:
            return {}
        return {"lora": {**last[1].summary(), "residency": self.lora.residency()}}

    async def explain_choice(self, request: PreprocessedRequest) -> dict[str, Any]:
        """`explain`: this router makes the choice itself."""
        return self.explain(request)

    def _load_row(self, worker_id: str) -> dict[str, float]:
        row: dict[str, float] = {"inflight": float(self.inflight(worker_id))}
        load = self.loads.get(worker_id)
        if load is not None:
            row["active_blocks"] = float(load.num_active_blocks)
            row["total_blocks"] = float(load.num_total_blocks)
            row["waiting"] = float(load.num_waiting)
            row["running"] = float(load.num_running)
        return row

    def worker_loads(self) -> dict[str, dict[str, float]]:
        return {wid: self._load_row(wid) for wid in sorted(self._instances.instances)}

    def metrics_text(self) -> str:
        """Prometheus text lines the frontend appends to /metrics."""
        return self.metrics.render()


class RoundRobinRouter(PolicyRouter):
    """Cycles through the live instances in id order."""

    policy = "round_robin"
    _counter = 0

    def _choose(
        self, request: PreprocessedRequest, candidates: Sequence[Instance]
    ) -> tuple[Instance, dict[str, Any]]:
        chosen = candidates[self._counter % len(candidates)]
        self._counter += 1
        return chosen, {"policy": self.policy}


class RandomRouter(PolicyRouter):
    """Uniformly random live instance (seeded by `RouterConfig.seed`)."""

    policy = "random"

    def _choose(
        self, request: PreprocessedRequest, candidates: Sequence[Instance]
    ) -> tuple[Instance, dict[str, Any]]:
        return self._rng.choice(list(candidates)), {"policy": self.policy}


class LeastLoadedRouter(PolicyRouter):
    """Fewest requests in flight from this router, then fewest waiting on the worker (its
    LoadMetrics), then lowest KV usage; remaining ties at random."""

    policy = "least_loaded"

    def _key(self, worker_id: str) -> tuple[int, int, float]:
        load = self.loads.get(worker_id)
        if load is None:
            return (self.inflight(worker_id), 0, 0.0)
        return (self.inflight(worker_id), load.num_waiting, load.active_fraction)

    def _choose(
        self, request: PreprocessedRequest, candidates: Sequence[Instance]
    ) -> tuple[Instance, dict[str, Any]]:
        keys = {c.instance_id: self._key(c.instance_id) for c in candidates}
        best = min(keys.values())
        tied = [c for c in candidates if keys[c.instance_id] == best]
        chosen = self._rng.choice(tied)
        return chosen, {"policy": self.policy, "inflight": best[0], "waiting": best[1]}
