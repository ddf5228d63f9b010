"""LoRA adapters through the frontend (issue 32): load and unload at run time (`POST
/v1/load_lora_adapter`, `/v1/unload_lora_adapter`, in `api/lora_routes.py`), the `--lora`
adapters of the start, and the registry's view of the adapter catalog.

A load is checked here (name, path under `--lora-dir`, base model) and then by a worker: the
frontend asks one worker of the base model (rendezvous hashing on the adapter name, as the
router places adapters) to load it; only a worker has the model's real shape and the files,
so the engine's PEFT reader (`engines/lora.py`) decides what is a bad adapter, one code path
for every engine. Only once that worker has it resident does the catalog take the adapter;
every frontend, router and worker then sees it, and a worker that has not loaded it does so
on demand when a request names it. An unload removes the catalog entry first (new requests get
404), then asks every worker of the base model to drop it; requests running with it finish.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
import uuid
from collections.abc import Iterable

import msgspec

from tandem.errors import Forbidden, InvalidRequest, ModelNotFound, NoWorkersAvailable
from tandem.frontend.lora_config import LoraApiConfig, LoraSpec, check_adapter_name
from tandem.frontend.models import ModelRegistry
from tandem.protocols import lora as wire
from tandem.protocols.discovery import Instance, endpoint_path
from tandem.protocols.lora import LoraCard, LoraLoaded
from tandem.runtime.base import RequestClient
from tandem.runtime.catalog.lora import LoraCatalog
from tandem.runtime.task import cancel_and_wait

logger = logging.getLogger(__name__)

_loaded = msgspec.msgpack.Decoder(LoraLoaded)
_RETRY_START_S = 0.5


def rendezvous(name: str, instances: Iterable[Instance]) -> Instance | None:
    """The instance with the highest hash of (adapter name, instance id): every frontend picks
    the same one without talking, and a departed worker moves only its own adapters."""

    def score(inst: Instance) -> bytes:
        return hashlib.blake2b(f"{name}\0{inst.instance_id}".encode(), digest_size=8).digest()

    return max(instances, key=score, default=None)


class LoraAdapters:
    """The adapters this frontend serves; keeps `registry.adapters` = the catalog."""

    def __init__(
        self,
        config: LoraApiConfig,
        catalog: LoraCatalog,
        registry: ModelRegistry,
        client: RequestClient,
    ) -> None:
        self.config, self.catalog, self.registry, self._client = config, catalog, registry, client
        self._tasks: list[asyncio.Task[None]] = []
        self._lock = asyncio.Lock()  # one load or unload at a time through this frontend
        # --lora adapters that failed to load at start, and why (their 404 says so)
        self.start_errors: dict[str, str] = {}

    async def start(self) -> None:
        """Read the catalog now (a restarted frontend serves what was loaded before), then
        follow it; load the `--lora` adapters in the background as workers come."""
        await self.refresh()
        self._tasks.append(asyncio.create_task(self._follow(), name="lora-catalog"))
        if self.config.adapters:
            start = asyncio.create_task(self._load_start_adapters(), name="lora-start")
            self._tasks.append(start)

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)
        self._tasks = []

    async def refresh(self) -> None:
        cards = await self.catalog.list()
        self.registry.adapters = {c.name: c for c in cards}

    async def _follow(self) -> None:
        while True:
            await asyncio.sleep(self.config.catalog_poll_s)
            try:
                await self.refresh()
            except Exception:  # the catalog's backend down: keep the last view, try again
                logger.warning("reading the LoRA catalog in %s failed", self.catalog.where,
                               exc_info=True)  # fmt: skip

    # ------------------------------------------------------------------ load
    async def load_request(self, name: str, path: str, base_model: str | None) -> LoraCard:
        """`POST /v1/load_lora_adapter`: `path` must resolve under `--lora-dir`."""
        root = self.config.resolved_dir
        if root is None:
            raise Forbidden(
                "loading LoRA adapters at run time is off; start the frontend with --lora-dir "
                "DIR (or TANDEM_LORA_DIR) to allow adapters from directories under DIR"
            )
        # an absolute path stays itself; symlinks are resolved, so none leads out of the root
        resolved = await asyncio.to_thread(os.path.realpath, os.path.join(root, path))
        if os.path.commonpath([root, resolved]) != root:
            raise Forbidden(
                f"lora_path {path!r} resolves to {resolved}, outside --lora-dir {root}",
                param="lora_path",
            )
        return await self.load(name, resolved, base_model)

    async def load(self, name: str, path: str, base_model: str | None) -> LoraCard:
        """Check, have a worker load it, then catalog it. InvalidRequest (400) naming the
        problem; NoWorkersAvailable (503) when no worker of the base model serves LoRA."""
        try:
            check_adapter_name(name)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="lora_name") from None
        if not await asyncio.to_thread(os.path.isdir, path):
            raise InvalidRequest(
                f"lora_path {path!r} is not a directory; expected a PEFT adapter directory "
                "(adapter_config.json + adapter_model.safetensors)",
                param="lora_path",
            )
        async with self._lock:
            base = self._base_model(name, base_model)
            existing = await self.catalog.get(name)
            if existing is not None:
                if existing.path == path and existing.base_model == base:
                    return existing  # the same adapter again (a restarted frontend's --lora)
                raise InvalidRequest(
                    f"The lora adapter '{name}' has already been loaded (from "
                    f"{existing.path}, base model '{existing.base_model}'); unload it first",
                    param="lora_name",
                )
            loaded = await self._load_on_worker(name, path, base)
            card = LoraCard(name=name, base_model=base, path=path, created_s=time.time())
            await self.catalog.put(card)
            self.registry.adapters[name] = card
        logger.info("LoRA adapter %s (base %s, rank %d) loaded from %s in %.3f s", name, base,
                    loaded.rank, path, loaded.load_s)  # fmt: skip
        return card

    def _base_model(self, name: str, requested: str | None) -> str:
        if name in self.registry.models:
            raise InvalidRequest(
                f"The lora adapter '{name}' conflicts with a served base model", param="lora_name"
            )
        live = sorted(m.name for m in self.registry.live())
        if requested is not None:
            if requested not in live:
                raise InvalidRequest(
                    f"base_model_name '{requested}' is not served; served models: "
                    f"{', '.join(live) or 'none'}",
                    param="base_model_name",
                )
            return requested
        if len(live) != 1:
            raise InvalidRequest(
                f"base_model_name is required when {len(live)} models are served "
                f"({', '.join(live) or 'none yet'}): which one is adapter '{name}' for?",
                param="base_model_name",
            )
        return live[0]

    def _lora_workers(self, base: str) -> list[Instance]:
        model = self.registry.models.get(base)
        if model is None:
            return []
        return [i for i in model.instances.instances.values()
                if i.metadata.get("lora_state_endpoint")]  # fmt: skip

    async def _load_on_worker(self, name: str, path: str, base: str) -> LoraLoaded:
        workers = self._lora_workers(base)
        target = rendezvous(name, workers)
        if target is None:
            model = self.registry.models.get(base)
            num = len(model.instances.instances) if model is not None else 0
            if num:
                engine = model.card.engine if model is not None else "?"
                raise InvalidRequest(
                    f"model '{base}' is served by {num} worker(s) whose engine ({engine}) "
                    "serves no LoRA adapters; start workers with an engine that does (native, "
                    "mocker, or vllm with vLLM's --enable-lora)",
                    param="lora_name",
                )
            raise NoWorkersAvailable(
                f"no worker of model '{base}' is up to load adapter '{name}'; retry later"
            )
        payload = wire.encode(wire.LoraLoadRequest(name=name, path=path))
        answers = await self._call(target, wire.LOAD_ENDPOINT, payload)
        return _loaded.decode(answers[0])

    async def _call(self, instance: Instance, endpoint: str, payload: bytes) -> list[bytes]:
        path = endpoint_path(instance.namespace, instance.component, endpoint)
        deadline = time.time() + self.config.load_timeout_s
        stream = self._client.stream(
            instance.address, path, payload, request_id=f"lora-{uuid.uuid4().hex[:12]}",
            deadline_s=deadline,
        )  # fmt: skip
        return [answer async for answer in stream]

    # ------------------------------------------------------------------ unload
    async def unload(self, name: str) -> None:
        """`POST /v1/unload_lora_adapter`: out of the catalog (new requests naming it: 404),
        then off every worker of its base model; requests running with it finish."""
        async with self._lock:
            card = await self.catalog.get(name)
            if card is None:
                raise ModelNotFound(
                    f"The lora adapter '{name}' cannot be found.", param="lora_name"
                )
            await self.catalog.delete(name)
            self.registry.adapters.pop(name, None)
        payload = wire.encode(wire.LoraUnloadRequest(name=name))
        for worker in self._lora_workers(card.base_model):
            try:
                await self._call(worker, wire.UNLOAD_ENDPOINT, payload)
            except ModelNotFound:
                pass  # that worker did not hold it
            except Exception as exc:  # a dead worker drops it anyway; the catalog is the truth
                logger.warning("unloading adapter %s on worker %s: %s", name,
                               worker.instance_id, exc)  # fmt: skip
        logger.info("LoRA adapter %s unloaded", name)

    # ------------------------------------------------------------------ --lora at start
    async def _load_start_adapters(self) -> None:
        pending = list(self.config.adapters)
        while pending:
            pending = [spec for spec in pending if not await self._try_start(spec)]
            if pending:
                await asyncio.sleep(_RETRY_START_S)

    async def _try_start(self, spec: LoraSpec) -> bool:
        """Whether `spec` is done with (loaded, or failed for good: logged)."""
        live = sorted(m.name for m in self.registry.live())
        base = spec.base_model or (live[0] if len(live) == 1 else None)
        try:
            if base is None and len(live) > 1:
                raise InvalidRequest(
                    f"{len(live)} models are served ({', '.join(live)}); give the adapter's "
                    'base model: --lora \'{"name": ..., "path": ..., "base_model_name": ...}\''
                )
            if base is None or base not in live or not self._lora_workers(base):
                return False  # wait for a worker of its base model that serves LoRA
            path = await asyncio.to_thread(os.path.realpath, spec.path)
            await self.load(spec.name, path, base)
        except NoWorkersAvailable:
            return False
        except Exception as exc:
            self.start_errors[spec.name] = str(exc)
            logger.error("--lora %s=%s failed to load: %s", spec.name, spec.path, exc)
        return True
