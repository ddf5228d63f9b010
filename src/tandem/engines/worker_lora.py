"""The Worker's control of its engine's LoRA adapters (issue 32): the `load_lora`,
`unload_lora` and `lora_state` endpoints, the on-demand load of a cataloged adapter a request
names, and the residency events on `<ns>.<component>.lora_events`.

Only for an engine with `capabilities.lora`. Loads of one adapter name are serialized (the
second waits for the first and finds it resident). Every load and unload is followed by a
`LoraEvent` carrying the whole resident set; adapters that a load pushed out of a full set of
slots (the engine's LRU) are announced as `evicted`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tandem.engines.base import Engine
from tandem.errors import InvalidRequest, ModelNotFound
from tandem.protocols import lora as wire
from tandem.protocols.lora import LoraEvent, LoraEventKind, LoraLoaded
from tandem.runtime.base import RequestContext
from tandem.runtime.runtime import Runtime

logger = logging.getLogger(__name__)

_load_request = msgspec.msgpack.Decoder(wire.LoraLoadRequest)
_unload_request = msgspec.msgpack.Decoder(wire.LoraUnloadRequest)


def refuse_lora(engine_name: str, lora_name: str) -> InvalidRequest:
    """The error for a request naming an adapter on a worker whose engine applies none: never
    a silent base-model answer."""
    return InvalidRequest(
        f"model '{lora_name}' is a LoRA adapter, and this worker's engine ({engine_name}) "
        "serves no LoRA adapters",
        param="model",
    )


class WorkerLoras:
    """One worker's adapters; all methods on the runtime's loop."""

    def __init__(
        self,
        engine: Engine,
        runtime: Runtime,
        *,
        worker_id: str,
        component: str,
        max_loras: int,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self.engine, self.runtime = engine, runtime
        self.worker_id, self.component, self.max_loras = worker_id, component, max_loras
        self.subject = wire.lora_events_subject(runtime.namespace, component)
        self._loading: dict[str, asyncio.Lock] = {}  # one per adapter name ever loaded
        r, p = registry or CollectorRegistry(), "tandem_worker_lora"
        self.loads = Counter(f"{p}_loads", "adapter loads by adapter", ("adapter",), registry=r)
        self.unloads = Counter(
            f"{p}_unloads", "adapters dropped, by reason (unloaded, evicted)",
            ("adapter", "reason"), registry=r,
        )  # fmt: skip
        self.load_seconds = Histogram(
            f"{p}_load_seconds", "time to make an adapter resident", registry=r,
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )  # fmt: skip
        self.requests = Counter(
            f"{p}_requests", "generate requests by adapter", ("adapter",), registry=r
        )
        resident = Gauge(f"{p}_resident", "adapters resident now", registry=r)
        resident.set_function(lambda: len(self.engine.loras()))
        Gauge(f"{p}_slots", "adapter slots (--max-loras)", registry=r).set(max_loras)

    def metadata(self) -> dict[str, Any]:
        """What the instance's discovery record says (a router that starts late knows the
        slot limit and what was resident at registration; `lora_state` tells the rest)."""
        return {
            "lora_state_endpoint": wire.STATE_ENDPOINT,
            "max_loras": self.max_loras,
            "loras": sorted(self.engine.loras()),
        }

    def register(self) -> None:
        server, comp = self.runtime.server, self.component
        server.register(self.runtime.endpoint_path(comp, wire.LOAD_ENDPOINT), self._load_endpoint)
        server.register(
            self.runtime.endpoint_path(comp, wire.UNLOAD_ENDPOINT), self._unload_endpoint
        )
        server.register(self.runtime.endpoint_path(comp, wire.STATE_ENDPOINT), self._state)

    async def ensure(self, name: str) -> None:
        """Make adapter `name` resident before a request that names it runs: nothing to do
        when it is; else its catalog entry is loaded. ModelNotFound when the catalog has no
        such adapter; the engine's InvalidRequest when its files are bad."""
        self.requests.labels(name).inc()
        if name in self.engine.loras():
            return
        card = await self.runtime.loras.get(name)
        if card is None:
            raise ModelNotFound(
                f"model '{name}' does not exist: no LoRA adapter of that name is loaded "
                f"(catalog in {self.runtime.loras.where})",
                param="model",
            )
        await self.load(name, card.path)

    async def load(self, name: str, path: str) -> LoraLoaded:
        lock = self._loading.setdefault(name, asyncio.Lock())
        async with lock:
            before = set(self.engine.loras())
            loaded = await self.engine.load_lora(name, path)
            if name in before:
                return loaded  # already resident (same path: the engine checked)
            self.loads.labels(name).inc()
            self.load_seconds.observe(loaded.load_s)
            logger.info("LoRA adapter %s loaded from %s in %.3f s (rank %d)", name, path,
                        loaded.load_s, loaded.rank)  # fmt: skip
            after = set(self.engine.loras())
            for evicted in sorted(before - after):
                self.unloads.labels(evicted, "evicted").inc()
                await self._publish("evicted", evicted)
            await self._publish("loaded", name, loaded.load_s)
        return loaded

    async def unload(self, name: str) -> None:
        await self.engine.unload_lora(name)
        self.unloads.labels(name, "unloaded").inc()
        logger.info("LoRA adapter %s unloaded", name)
        await self._publish("unloaded", name)

    async def _publish(self, kind: LoraEventKind, name: str, load_s: float = 0.0) -> None:
        event = LoraEvent(
            kind=kind,
            name=name,
            load_s=load_s,
            worker_id=self.worker_id,
            resident=sorted(self.engine.loras()),
            max_loras=self.max_loras,
        )
        try:
            await self.runtime.events.publish(self.subject, wire.encode(event))
        except Exception:  # the event plane being down must not fail the load
            logger.warning("publishing LoRA event on %s failed", self.subject, exc_info=True)

    # ------------------------------------------------------------------ endpoints
    async def _load_endpoint(
        self, payload: bytes, ctx: RequestContext
    ) -> AsyncGenerator[bytes, None]:
        try:
            request = _load_request.decode(payload)
        except msgspec.MsgspecError as exc:
            raise InvalidRequest(f"bad LoraLoadRequest: {exc}") from exc
        yield wire.encode(await self.load(request.name, request.path))

    async def _unload_endpoint(
        self, payload: bytes, ctx: RequestContext
    ) -> AsyncGenerator[bytes, None]:
        try:
            request = _unload_request.decode(payload)
        except msgspec.MsgspecError as exc:
            raise InvalidRequest(f"bad LoraUnloadRequest: {exc}") from exc
        await self.unload(request.name)
        yield b""

    async def _state(self, payload: bytes, ctx: RequestContext) -> AsyncGenerator[bytes, None]:
        state = wire.LoraState(
            worker_id=self.worker_id,
            resident=sorted(self.engine.loras()),
            max_loras=self.max_loras,
        )
        yield wire.encode(state)
