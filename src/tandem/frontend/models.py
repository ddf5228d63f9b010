"""Which models are served: follows the worker instances in discovery, one router and one
tokenizer per model name (the ModelCard of its instances)."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
from pathlib import Path

from tandem.errors import InvalidRequest, ModelNotFound, ModelUnavailable, ServingError
from tandem.frontend.config import FrontendConfig
from tandem.frontend.pipeline.parsers.registry import (
    DEFAULT_TOOL_PARSER,
    detect_reasoning_parser,
    detect_tool_parser,
)
from tandem.protocols.discovery import InstanceEvent, ModelCard
from tandem.protocols.lora import LoraCard
from tandem.router.base import Router
from tandem.router.registry import make_router
from tandem.router.source import InstancesByModel, StaticInstanceSet
from tandem.runtime.base import EventBus, RequestClient
from tandem.runtime.blobs.base import BlobError, BlobStore
from tandem.runtime.instances import InstanceSet
from tandem.tokens.chat_template import ChatTemplate
from tandem.tokens.model_files import tokenizer_from_files
from tandem.tokens.tokenizer import ModelTokenizer, load_tokenizer

logger = logging.getLogger(__name__)

GC_YOUNG_THRESHOLD = 10_000


class ModelFilesError(Exception):
    """A model file named by the workers' cards is missing, corrupt or does not parse."""


def freeze_long_lived() -> None:
    """Collect garbage, then move every object alive now out of the cyclic collector's
    generations; and collect the young generation every 10 000 net allocations instead of 700.

    Called once the long-lived objects exist (startup, a model's tokenizer and template):
    otherwise every full collection walks them again (~10 ms CPU for the SmolLM2 tokenizer,
    50-100 ms of wall time on a busy host), a stall of every stream in flight. A request
    leaves only ~5 objects in reference cycles, so rarer young collections lose nothing and
    save most of their cost (~2 % of the frontend's CPU at the default threshold)."""
    gc.collect()
    gc.freeze()
    young, *older = gc.get_threshold()
    if young < GC_YOUNG_THRESHOLD:
        gc.set_threshold(GC_YOUNG_THRESHOLD, *older)


class ServedModel:
    """One model name: its card, instances, router and (lazily loaded) tokenizer."""

    # the LoRA adapter a request for this name applies (AdapterModel); None: the base model
    lora_name: str | None = None

    def __init__(
        self,
        card: ModelCard,
        router: Router,
        instances: StaticInstanceSet,
        blobs: BlobStore | None = None,
    ) -> None:
        self.name, self.card, self.router, self.instances = card.name, card, router, instances
        self.blobs = blobs  # where the card's files are (None: only the tokenizer path)
        self.created = int(time.time())
        self.tokenizer: ModelTokenizer | None = None
        self.chat_template: ChatTemplate | None = None
        # how its output's tool calls and reasoning are read (the card's, else the template's)
        self.tool_call_parser: str = card.tool_call_parser or DEFAULT_TOOL_PARSER
        self.reasoning_parser: str | None = card.reasoning_parser
        self.eos_token_ids: list[int] = list(card.eos_token_ids)
        self._ready: asyncio.Task[None] | None = None
        self._router_started = False
        self._cache_dir: Path | None = None

    def start(self, cache_dir: Path | None) -> None:
        self._cache_dir = cache_dir
        self.instances.add_listener(self._on_instance)
        self._ready = asyncio.create_task(self._prepare(cache_dir), name=f"model-{self.name}")

    def _on_instance(self, event: InstanceEvent) -> None:
        """A worker registering after the model failed to load has it loaded again, from that
        worker's card (it may name a tokenizer path this host has, or carry the files)."""
        card = event.instance.model
        if event.kind != "added" or card is None or self.load_error is None:
            return
        logger.info(
            "model %s: worker %s registered; loading again after: %s",
            self.name,
            event.instance.instance_id,
            self.load_error,
        )
        self.card = card
        self._ready = asyncio.create_task(self._prepare(self._cache_dir), name=f"model-{self.name}")

    async def _prepare(self, cache_dir: Path | None) -> None:
        if not self._router_started:
            await self.router.start()
            self._router_started = True
        if self.card.tokenizer is None:
            return
        tok = await self._load_tokenizer(self.card.tokenizer, cache_dir)
        await asyncio.to_thread(tok.prewarm)  # before any prompt: none pays a cold cache's BPE
        bos = tok.token_text(tok.bos_token_id) if tok.bos_token_id is not None else None
        eos = tok.token_text(tok.eos_token_ids[0]) if tok.eos_token_ids else None
        self.chat_template = ChatTemplate(
            tok.chat_template, bos_token=bos or "", eos_token=eos or ""
        )
        self.eos_token_ids = self.eos_token_ids or list(tok.eos_token_ids)
        self._choose_parsers(tok.chat_template)
        self.tokenizer = tok
        freeze_long_lived()
        logger.info(
            "model %s ready (tokenizer %s, tool call parser %s, reasoning parser %s)",
            self.name,
            self.card.tokenizer,
            self.tool_call_parser,
            self.reasoning_parser or "none",
        )

    def _choose_parsers(self, template: str | None) -> None:
        """The card's parsers (the worker's flags), else what the template makes certain."""
        card = self.card
        self.tool_call_parser = (
            card.tool_call_parser or detect_tool_parser(template) or DEFAULT_TOOL_PARSER
        )
        self.reasoning_parser = card.reasoning_parser or detect_reasoning_parser(template)

    async def _load_tokenizer(self, spec: str, cache_dir: Path | None) -> ModelTokenizer:
        """From the tokenizer's path where this host has it, else from the files the workers
        put in the cluster's blob store (a frontend host needs no model files)."""
        _, _, location = spec.partition(":")
        here = await asyncio.to_thread(Path(location).exists)
        if here or not self.card.files or self.blobs is None:
            return await asyncio.to_thread(load_tokenizer, spec, cache_dir=cache_dir)
        files: dict[str, bytes] = {}
        for name, ref in sorted(self.card.files.items()):
            try:
                files[name] = await self.blobs.get(ref.sha256)
            except BlobError as exc:
                raise ModelFilesError(
                    f"model '{self.name}': file {name} (sha256 {ref.sha256[:16]}…, {ref.size} "
                    f"bytes) from {self.blobs.where}: {exc}"
                ) from exc
        try:
            tok = await asyncio.to_thread(tokenizer_from_files, files)
        except ValueError as exc:
            raise ModelFilesError(f"model '{self.name}': {exc}") from exc
        logger.info(
            "model %s: tokenizer from the workers' registration (%s; %s is not on this host)",
            self.name,
            self.blobs.where,
            location,
        )
        return tok

    async def ready(self) -> None:
        """Wait for the router and tokenizer; a model that failed to load raises
        ModelUnavailable (503) naming the model and what failed (a missing file...)."""
        try:
            if self._ready is not None and not self._ready.done():
                await asyncio.shield(self._ready)
            elif self._ready is not None:
                self._ready.result()
        except ServingError:
            raise
        except Exception as exc:  # what loading raised: the request gets its message, not 500
            raise ModelUnavailable(
                f"model '{self.name}' failed to load: {type(exc).__name__}: {exc}",
                param="model",
            ) from exc

    @property
    def is_loaded(self) -> bool:
        """Router started and tokenizer loaded, without error."""
        return self._ready is not None and self._ready.done() and self.load_error is None

    @property
    def load_error(self) -> str | None:
        ready = self._ready
        if ready is None or not ready.done() or ready.cancelled() or ready.exception() is None:
            return None
        return f"{type(ready.exception()).__name__}: {ready.exception()}"

    def require_tokenizer(self, what: str) -> ModelTokenizer:
        if self.tokenizer is None:
            raise InvalidRequest(
                f"model '{self.name}' has no tokenizer; {what} needs one (send token ids to "
                "/v1/completions instead)",
                param="model",
            )
        return self.tokenizer

    def require_task(self, task: str, endpoint: str) -> ModelCard:
        """The card of an instance that serves `task` ("generate", "embed"); raises
        InvalidRequest naming the model when its instances serve only other tasks (an
        embedding-only model asked to generate, or the reverse). With no instance at all it
        returns the model's card: routing then answers 503."""
        cards = [i.model for i in self.instances.instances.values() if i.model is not None]
        for card in cards:
            if task in card.tasks:
                return card
        if not cards:
            return self.card
        served = sorted({t for card in cards for t in card.tasks})
        raise InvalidRequest(
            f"model '{self.name}' does not serve {endpoint}; its workers serve: "
            f"{', '.join(served)}",
            param="model",
        )

    async def close(self) -> None:
        if self._ready is not None and not self._ready.done():
            self._ready.cancel()
        await self.router.close()


class AdapterModel(ServedModel):
    """A LoRA adapter served on top of a base model (issue 32): the base model's router,
    instances, tokenizer and template under the adapter's name, so every endpoint serves it as
    it serves the base, and its requests carry `lora_name`. A view: what the base model loads
    later (its tokenizer) is seen here at once."""

    def __init__(self, base: ServedModel, card: LoraCard) -> None:  # no super(): a view
        self.base, self.adapter = base, card
        self.name = self.lora_name = card.name

    def __getattr__(self, attr: str) -> object:
        return getattr(self.base, attr)

    def require_task(self, task: str, endpoint: str) -> ModelCard:
        if task != "generate":
            raise InvalidRequest(
                f"model '{self.name}' is a LoRA adapter of '{self.base.name}'; {endpoint} with "
                f"an adapter is not served (engines apply adapters when generating); ask the "
                f"base model '{self.base.name}' instead",
                param="model",
            )
        return self.base.require_task(task, endpoint)


class ModelRegistry:
    """Follows `instances` (an InstanceSet of `ns.backend.generate`); not thread-safe."""

    def __init__(
        self,
        config: FrontendConfig,
        instance_set: InstanceSet,
        *,
        events: EventBus,
        client: RequestClient,
        namespace: str,
        blobs: BlobStore | None = None,
    ) -> None:
        self._config, self._set, self._blobs = config, instance_set, blobs
        self._events, self._client, self._namespace = events, client, namespace
        self._by_model = InstancesByModel(instance_set, self._add)
        self.models: dict[str, ServedModel] = {}
        # LoRA adapters by name, as the catalog last read held them (frontend/adapters.py)
        self.adapters: dict[str, LoraCard] = {}
        # set once some model's preparation ended (loaded, or failed: its requests then get
        # the load error rather than a 404 from a frontend that has not seen the model)
        self.any_prepared = asyncio.Event()

    async def start(self) -> None:
        await self._by_model.start()

    def _add(self, card: ModelCard, view: StaticInstanceSet) -> None:
        router = make_router(
            self._config.router_policy,
            self._config.router,
            instances=view,
            events=self._events,
            client=self._client,
            discovery=self._set.discovery,  # `remote` finds its service
            namespace=self._namespace,
        )
        model = ServedModel(card, router, view, self._blobs)
        self.models[card.name] = model
        model.start(self._config.tokenizer_cache_dir)
        assert model._ready is not None

        model._ready.add_done_callback(lambda _: self.any_prepared.set())
        logger.info("model %s appeared (engine %s)", card.name, card.engine)

    def live(self) -> list[ServedModel]:
        return [m for m in self.models.values() if m.instances.instances]

    def get(self, name: str) -> ServedModel:
        """The served model `name`, or the LoRA adapter `name` on its base model; raises
        ModelNotFound listing the served names."""
        model = self.models.get(name)
        if model is None:
            card = self.adapters.get(name)
            base = self.models.get(card.base_model) if card is not None else None
            if card is not None and base is not None:
                return AdapterModel(base, card)
            served = ", ".join(sorted([*self.models, *self.adapters])) or "none"
            raise ModelNotFound(
                f"model '{name}' does not exist; served models: {served}", param="model"
            )
        return model

    def live_adapters(self) -> list[LoraCard]:
        """The adapters whose base model has live workers (what /v1/models lists)."""
        live = {m.name for m in self.live()}
        return [c for _, c in sorted(self.adapters.items()) if c.base_model in live]

    def worker_loads(self) -> dict[str, dict[str, dict[str, float]]]:
        return {name: m.router.worker_loads() for name, m in self.models.items()}

    def cards(self) -> list[tuple[ModelCard, int]]:
        """(model card, live instances) of every model, for the model metrics."""
        return [(m.card, len(m.instances.instances)) for m in self.models.values()]

    def routers(self) -> list[tuple[str, Router]]:
        """(model name, router) of every model, for the router metrics."""
        return [(name, m.router) for name, m in self.models.items()]

    async def close(self) -> None:
        for model in self.models.values():
            await model.close()
        await self._set.close()
