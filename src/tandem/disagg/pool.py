"""`PrefillPool`: the prefill workers discovered separately (component ``prefill``), one
router per model over them, so the KV-aware cost applies to the prefill choice."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from tandem.protocols.discovery import ModelCard
from tandem.router.base import Router
from tandem.router.source import InstancesByModel, InstanceSource, StaticInstanceSet

logger = logging.getLogger(__name__)


class PrefillPool:
    """Follows an InstanceSet of ``ns.prefill.generate``; `make_router(view)` builds each
    model's router. One event loop; not thread-safe."""

    def __init__(
        self, instance_set: InstanceSource, make_router: Callable[[StaticInstanceSet], Router]
    ) -> None:
        self._by_model = InstancesByModel(instance_set, self._add_model)
        self.views = self._by_model.views
        self._make_router = make_router
        self._routers: dict[str, tuple[Router, asyncio.Task[None]]] = {}

    async def start(self) -> None:
        await self._by_model.start()

    def _add_model(self, card: ModelCard, view: StaticInstanceSet) -> None:
        router = self._make_router(view)
        task = asyncio.create_task(router.start(), name=f"prefill-router-{card.name}")
        self._routers[card.name] = (router, task)
        logger.info("prefill pool for model %s appeared", card.name)

    def routers(self) -> list[tuple[str, Router]]:
        """(model name, prefill router) of every model seen (for the router metrics)."""
        return [(model, router) for model, (router, _) in self._routers.items()]

    async def router_for(self, model: str) -> Router | None:
        """The model's prefill router, or None while no prefill instance serves it."""
        view = self.views.get(model)
        if view is None or not view.instances:
            return None
        router, started = self._routers[model]
        await asyncio.shield(started)
        return router

    def started_router(self, model: str) -> Router | None:
        """The model's prefill router if it has started (for introspection), else None."""
        entry = self._routers.get(model)
        return entry[0] if entry is not None and entry[1].done() else None

    async def close(self) -> None:
        for router, task in self._routers.values():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            await router.close()
        await self._by_model.source.close()
