"""What `/health` and `/live` report, truthfully.

`/live`: the process runs and its event loop answers (the lag of a periodic tick is shown).
`/health`: ready only when discovery and the event bus are followed, and every model served
has a complete topology (a disaggregated model needs prefill and decode workers; a model whose
workers encode images only remotely, E/PD, needs an encode worker) whose
engines are all alive, its router and tokenizer loaded. A worker's engine counts as alive
while its load metrics keep arriving on the event plane (a worker publishes them at least
every second, busy or idle); a worker silent for `stale_s` (frozen, SIGSTOPped, engine loop
dead, event plane cut) is named in the report. A worker counts, too, only while the request
plane reaches it: its pooled connection is open and answered within `UNANSWERED_S` (the
client pings an idle one every second; an instance without a connection is connected to at
once, and again every `REACH_INTERVAL_S` while that fails), and while the stall watchdog has
not excluded it. Each worker that does not count is named with why: unreachable at its
address (e.g. a loopback address advertised to another host), silent, excluded by the
watchdog, or stale load metrics. Otherwise 503 with what is missing.
The /health report names the namespace the frontend serves (the global router checks it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import msgspec

from tandem.frontend.models import ModelRegistry
from tandem.protocols.discovery import Instance, InstanceEvent
from tandem.protocols.kv_events import decode_load
from tandem.runtime.base import EventBus, Subscription
from tandem.runtime.instances import InstanceSet
from tandem.runtime.task import cancel_and_wait

logger = logging.getLogger(__name__)

LAG_TICK_S = 0.5
REACH_INTERVAL_S = 1.0  # an unconnected worker is connected to this often
REACH_TIMEOUT_S = 3.0  # for a connection and its handshake
UNANSWERED_S = 3.0  # a connection that heard nothing (three PINGs) for this long does not count
LOOPBACK_PREFIXES = ("127.", "localhost:", "[::1]:", "::1:", "0.0.0.0:")


class RequestPlane(Protocol):
    """What /health asks of the request-plane client (`TcpRequestClient`)."""

    async def connect(self, address: str, timeout_s: float | None = None) -> None: ...

    def peer_silent_s(self, address: str) -> float | None: ...


class HealthMonitor:
    """Follows worker liveness and the event loop's lag; `health()` and `live()` build the
    two reports. Call `start` once on the serving loop, `close` at shutdown; not thread-safe.

    `workers`, `prefill` and `encoders` are the pools' instance sets; `subjects` are the
    load-metrics subjects to follow on `events`."""

    def __init__(
        self,
        *,
        registry: ModelRegistry,
        workers: InstanceSet,
        prefill: InstanceSet | None,
        events: EventBus | None,
        subjects: list[str],
        stale_s: float,
        encoders: InstanceSet | None = None,
        clock: Callable[[], float] = time.monotonic,
        namespace: str = "",
        client: RequestPlane | None = None,
        excluded: Callable[[], frozenset[str]] | None = None,
    ) -> None:
        """`client`: reachability of each worker's request plane (None: not checked);
        `excluded`: the workers the stall watchdog keeps out of routing."""
        self.namespace = namespace  # reported, so a global router can check which pool it is
        self._client, self._excluded = client, excluded
        self._reach_errors: dict[str, str] = {}  # address -> why the last connection failed
        self._reaching: dict[str, asyncio.Task[None]] = {}  # address -> its connection attempt
        self._registry, self._workers, self._prefill = registry, workers, prefill
        self._encoders = encoders
        self._events, self._subjects, self._stale_s, self._clock = events, subjects, stale_s, clock
        self._last_seen: dict[str, float] = {}  # worker_id -> last load metrics (or join) time
        self._tasks: list[asyncio.Task[None]] = []  # load-metrics subscriptions
        self._ticker: asyncio.Task[None] | None = None
        self.loop_lag_s = 0.0
        for source in (workers, prefill):
            if source is not None:
                source.add_listener(self._on_instance)
                for instance_id in source.instances:
                    self._last_seen.setdefault(instance_id, clock())

    async def start(self) -> None:
        if self._events is not None:
            for subject in self._subjects:
                sub = await self._events.subscribe(subject)
                self._spawn(self._follow_loads(sub), f"health-{subject}")
        self._ticker = asyncio.create_task(self._tick(), name="health-loop-lag")
        if self._client is not None:
            self._spawn(self._reach_loop(), "health-reach")

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self._tasks.append(asyncio.create_task(coro, name=name))

    def _on_instance(self, event: InstanceEvent) -> None:
        if event.kind == "added":  # a new worker gets `stale_s` to publish its first load
            self._last_seen.setdefault(event.instance.instance_id, self._clock())
            if self._ticker is not None:  # started: connect to it now, not at the next round
                self._reach(event.instance.address)
        else:
            self._last_seen.pop(event.instance.instance_id, None)
            self._reach_errors.pop(event.instance.address, None)

    async def _reach_loop(self) -> None:
        while True:
            for source in (self._workers, self._prefill):
                for inst in list(source.instances.values()) if source is not None else ():
                    self._reach(inst.address)
            await asyncio.sleep(REACH_INTERVAL_S)

    def _reach(self, address: str) -> None:
        """Connect to `address` unless connected or connecting; remember why it failed."""
        client = self._client
        if client is None or address in self._reaching or client.peer_silent_s(address) is not None:
            return

        async def attempt() -> None:
            try:
                await client.connect(address, REACH_TIMEOUT_S)
                self._reach_errors.pop(address, None)
            except Exception as exc:
                self._reach_errors[address] = str(exc)
            finally:
                self._reaching.pop(address, None)

        self._reaching[address] = asyncio.create_task(attempt(), name=f"health-reach-{address}")

    async def _follow_loads(self, sub: Subscription) -> None:
        try:
            async for _subject, payload in sub:
                try:
                    worker_id = decode_load(payload).worker_id
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue
                if worker_id in self._last_seen:
                    self._last_seen[worker_id] = self._clock()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("health: load metrics subscription failed")
        finally:
            await sub.close()

    async def _tick(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            before = loop.time()
            await asyncio.sleep(LAG_TICK_S)
            self.loop_lag_s = max(0.0, loop.time() - before - LAG_TICK_S)

    async def close(self) -> None:
        await cancel_and_wait([*self._tasks, self._ticker, *self._reaching.values()])
        self._tasks.clear()
        self._ticker = None

    def last_seen_age_s(self, worker_id: str) -> float | None:
        """Seconds since the worker's last load metrics (or its join); None if unknown."""
        seen = self._last_seen.get(worker_id)
        return None if seen is None else max(self._clock() - seen, 0.0)

    @property
    def stale_s(self) -> float:
        return self._stale_s

    # ------------------------------------------------------------------ reports
    def live(self) -> tuple[bool, dict[str, Any]]:
        ticking = self._ticker is not None and not self._ticker.done()
        body = {"status": "live" if ticking else "not_live", "loop_lag_ms": self._lag_ms()}
        return ticking, body

    def _lag_ms(self) -> float:
        return round(self.loop_lag_s * 1000, 1)

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(healthy, report). The report names every reason the answer is no."""
        problems: list[str] = []
        discovery = self._source_status(self._workers, "workers", problems)
        if self._prefill is not None:
            discovery["prefill"] = self._source_status(self._prefill, "prefill workers", problems)
        event_bus = self._event_bus_status(problems)
        models = {name: self._model_status(name) for name in self._model_names()}
        if not models:
            problems.append("no model is served: no worker has registered")
        for name, status in models.items():
            problems.extend(f"model '{name}': {m}" for m in status["missing"])
        healthy = not problems
        body = {
            "status": "healthy" if healthy else "unhealthy",
            "namespace": self.namespace,
            "missing": problems,
            "models": models,
            "discovery": discovery,
            "event_bus": event_bus,
            "instances": {
                name: sorted(m.instances.instances) for name, m in self._registry.models.items()
            },
        }
        return healthy, body

    @staticmethod
    def _source_status(source: InstanceSet, what: str, problems: list[str]) -> dict[str, Any]:
        if source.is_healthy:
            return {"status": "ok"}
        error = source.error or "watch stopped"
        problems.append(f"discovery of {what} is not followed: {error}")
        return {"status": "failed", "error": error}

    def _event_bus_status(self, problems: list[str]) -> dict[str, Any]:
        if self._events is None:
            return {"status": "none"}
        error = self._events.error
        dead = [t.get_name() for t in self._tasks if t.done()]
        if dead:
            error = error or f"subscription ended: {', '.join(dead)}"
        if error:
            problems.append(f"event bus: {error}")
            return {"status": "failed", "error": error}
        return {"status": "ok"}

    def _model_names(self) -> list[str]:
        names = {name for name, m in self._registry.models.items() if m.instances.instances}
        names.update(_by_model(self._prefill).keys() if self._prefill is not None else ())
        return sorted(names)

    def _model_status(self, name: str) -> dict[str, Any]:
        model = self._registry.models.get(name)
        decode = sorted(model.instances.instances) if model is not None else []
        missing: list[str] = []
        status: dict[str, Any] = {"workers": decode}
        if self._prefill is not None:
            prefill = sorted(_by_model(self._prefill).get(name, []))
            status["prefill_workers"] = prefill
            if not prefill:
                missing.append("no prefill worker (disaggregated: needs prefill and decode)")
            if not decode:
                missing.append("no decode worker (disaggregated: needs prefill and decode)")
        elif not decode:
            missing.append("no worker")
        if self._needs_encoder(decode + status.get("prefill_workers", [])):
            status["encode_workers"] = sorted(self._encoders.instances if self._encoders else [])
            if not status["encode_workers"]:
                missing.append("no encode worker (its workers encode images only remotely: E/PD)")
        not_counted: dict[str, str] = {}
        for worker_id in decode + status.get("prefill_workers", []):
            why = self._why_not_counted(worker_id)
            if why is not None:
                not_counted[worker_id] = why
                missing.append(f"worker {worker_id} is {why}")
        if not_counted:
            status["not_counted"] = not_counted
        if model is not None:
            error = model.load_error
            if error is not None:
                missing.append(f"failed to load: {error}")
            elif not model.is_loaded:
                missing.append("router or tokenizer still loading")
        status["status"] = "ready" if not missing else "not_ready"
        status["missing"] = missing
        return status

    def _why_not_counted(self, worker_id: str) -> str | None:
        """Why `worker_id` does not count as serving (None: it does): excluded by the
        watchdog, its request plane unreachable or silent, or its load metrics stale."""
        if self._excluded is not None and worker_id in self._excluded():
            return "excluded by the stall watchdog (no progress; probed until it answers)"
        inst = self._instance(worker_id)
        if self._client is not None and inst is not None:
            address = inst.address
            silent_s = self._client.peer_silent_s(address)
            if silent_s is None:
                error = self._reach_errors.get(address)
                if error is None:
                    return f"not connected yet (request plane at {address})"
                hint = ""
                if address.startswith(LOOPBACK_PREFIXES):
                    hint = (
                        " (it advertises a loopback address: start it with --advertise-host "
                        "(or TANDEM_ADVERTISE_HOST) set to an address this frontend can reach)"
                    )
                return f"unreachable at {address}{hint}: {error}"
            if silent_s > UNANSWERED_S:
                return (
                    f"silent on the request plane at {address} for {silent_s:.1f}s "
                    "(PINGs unanswered)"
                )
        now = self._clock()
        age = now - self._last_seen.get(worker_id, now)
        if self._events is not None and age > self._stale_s:
            return f"not alive: no load metrics for {age:.1f}s (limit {self._stale_s:g}s)"
        return None

    def _instance(self, worker_id: str) -> Instance | None:
        for source in (self._workers, self._prefill):
            inst = source.instances.get(worker_id) if source is not None else None
            if inst is not None:
                return inst
        return None

    def _needs_encoder(self, worker_ids: list[str]) -> bool:
        for source in (self._workers, self._prefill):
            for worker_id in worker_ids:
                inst = source.instances.get(worker_id) if source is not None else None
                if inst is not None and inst.metadata.get("needs_encoder"):
                    return True
        return False


def _by_model(source: InstanceSet) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    inst: Instance
    for instance_id, inst in source.instances.items():
        if inst.model is not None:
            out.setdefault(inst.model.name, []).append(instance_id)
    return out
