"""Embeddings for a prefill / aggregated worker: cache first, then an encode worker, then the
worker's own encoder (DESIGN.md §10 steps 2–3).

`CachingEmbeddingProvider` implements `EmbeddingProvider`: it looks each image's mm_hash up in the
`EmbeddingCache`; the misses go, as one request, to an encode worker through `RemoteEncoderClient`
(E/PD, E/P/D) or to the in-process provider (EPD). A remote attempt that fails — no encode worker,
the worker died, its embeddings could not be pulled — encodes locally when this worker has an
encoder, and otherwise fails the request with a clear error (503 when no encoder answered within
the timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from tandem.errors import EngineError, InvalidRequest, NoWorkersAvailable, ServingError
from tandem.multimodal.base import EmbeddingProvider
from tandem.multimodal.embedding_cache import EmbeddingCache
from tandem.multimodal.embedding_transfer import EmbeddingHandle, EmbeddingReceiver
from tandem.multimodal.encode_engine import EMBEDDINGS_KEY
from tandem.protocols.discovery import Instance
from tandem.protocols.engine import (
    MmItem,
    PreprocessedRequest,
    StopConditions,
    decode_output,
    encode,
)
from tandem.runtime.runtime import Runtime

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

ENCODER_COMPONENT = "encoder"
ENCODER_ENDPOINT = "encode"


class RemoteEncoderClient:
    """Sends images to the encode workers (`{ns}.encoder.encode`) and pulls their embeddings.

    Picks the instance with the fewest requests in flight from this client (ties: round robin);
    a worker that fails or refuses is skipped and the next one tried, all within `timeout_s`.
    One event loop; `encode` may be awaited concurrently."""

    def __init__(self, runtime: Runtime, receiver: EmbeddingReceiver, *, timeout_s: float) -> None:
        self.runtime = runtime
        self.receiver = receiver
        self.timeout_s = timeout_s
        self.instances = runtime.instance_set(ENCODER_COMPONENT, ENCODER_ENDPOINT)
        self._inflight: dict[str, int] = {}
        self._turn = itertools.count()
        self.num_failovers = 0

    async def start(self) -> None:
        await self.instances.start()

    async def close(self) -> None:
        await self.instances.close()

    def _candidates(self, tried: set[str]) -> list[Instance]:
        live = [i for i in self.instances.instances.values() if i.instance_id not in tried]
        turn = next(self._turn)
        live.sort(key=lambda i: (self._inflight.get(i.instance_id, 0), hash((i.instance_id, turn))))
        return live

    async def encode(self, request_id: str, model: str, items: list[MmItem]) -> list[np.ndarray]:
        """Embeddings of `items` (which carry image bytes), in order. Raises `NoWorkersAvailable`
        when no encode worker answered within the timeout, `InvalidRequest` for a bad image,
        `ServingError` for a transfer that failed."""
        deadline = time.monotonic() + self.timeout_s
        tried: set[str] = set()
        errors: list[str] = []
        waited = False
        while True:
            candidates = self._candidates(tried)
            if not candidates:
                if tried or waited or time.monotonic() >= deadline:
                    break
                waited = True  # none registered: give one a moment to appear, then 503
                await self._wait_for_instances(deadline)
                continue
            instance = candidates[0]
            tried.add(instance.instance_id)
            try:
                handles = await self._ask(instance, request_id, model, items, deadline)
            except InvalidRequest:
                raise
            except (ServingError, OSError, TimeoutError) as exc:
                if isinstance(exc, TimeoutError):
                    exc = TimeoutError(f"no answer within the {self.timeout_s:g}s encode timeout")
                errors.append(f"{instance.instance_id}: {exc}")
                self.num_failovers += 1
                logger.warning("request_id=%s: encode worker %s failed (%s); trying another",
                               request_id, instance.instance_id, exc)  # fmt: skip
                continue
            remaining = max(0.05, deadline - time.monotonic())
            return await asyncio.to_thread(self.receiver.pull, handles, timeout_s=remaining)
        raise NoWorkersAvailable(
            f"no encode worker (component '{ENCODER_COMPONENT}') encoded request_id={request_id}"
            f" within {self.timeout_s:g}s"
            + (f": {'; '.join(errors)}" if errors else "; none is running")
            + " (start `tandem worker --engine encoder`)"
        )

    async def _wait_for_instances(self, deadline: float) -> None:
        with_timeout = max(0.0, deadline - time.monotonic())
        with contextlib.suppress(TimeoutError):
            await self.instances.wait_for(1, timeout_s=min(with_timeout, 1.0))

    async def _ask(
        self, instance: Instance, request_id: str, model: str, items: list[MmItem], deadline: float
    ) -> list[EmbeddingHandle]:
        ask = PreprocessedRequest(
            request_id=f"{request_id}:encode",
            model=model,
            token_ids=[],
            stop=StopConditions(max_tokens=1),
            mm_items=[msgspec.structs.replace(i, embedding_handle=None) for i in items],
        )
        key = instance.instance_id
        self._inflight[key] = self._inflight.get(key, 0) + 1
        try:
            remaining = deadline - time.monotonic()
            async with asyncio.timeout(remaining):
                stream = self.runtime.stream(
                    instance,
                    encode(ask),
                    request_id=ask.request_id,
                    deadline_s=time.time() + remaining,
                )
                async with stream:
                    payload = await anext(stream)
        finally:
            self._inflight[key] -= 1
        out = decode_output(payload)
        if out.error or not out.disagg_params or EMBEDDINGS_KEY not in out.disagg_params:
            raise EngineError(f"encode worker {key} answered no embeddings: {out.error}")
        handles = [msgspec.convert(h, EmbeddingHandle) for h in out.disagg_params[EMBEDDINGS_KEY]]
        if len(handles) != len(items):
            raise EngineError(f"encode worker {key} answered {len(handles)} of {len(items)} images")
        return handles


class CachingEmbeddingProvider:
    """Implements `EmbeddingProvider`: embedding cache → remote encoder → local encoder.
    `remote` and `local` may each be None (not both). Concurrent `embeddings` calls are fine."""

    def __init__(
        self,
        cache: EmbeddingCache,
        *,
        remote: RemoteEncoderClient | None = None,
        local: EmbeddingProvider | None = None,
        to_tensor: Callable[[np.ndarray], Any] | None = None,
    ) -> None:
        """`to_tensor` turns a pulled array into what the engine takes (default: a torch
        tensor sharing its memory; the mocker keeps arrays and never imports torch)."""
        if remote is None and local is None:
            raise ValueError("an embedding provider needs a remote or a local encoder")
        self.cache = cache
        self.remote = remote
        self.local = local
        self.to_tensor = to_tensor or _torch_tensor
        self.num_remote_images = 0
        self.num_local_images = 0
        self.num_local_fallbacks = 0

    async def embeddings(self, request: PreprocessedRequest) -> list[torch.Tensor]:
        items = request.mm_items
        out: list[torch.Tensor | None] = [self.cache.get(i.mm_hash) for i in items]
        missing = [k for k, emb in enumerate(out) if emb is None]
        if missing:
            fresh = await self._encode(request, [items[k] for k in missing])
            for k, new in zip(missing, fresh, strict=True):
                self.cache.put(items[k].mm_hash, new)
                out[k] = new
        for k, (item, emb) in enumerate(zip(items, out, strict=True)):
            if emb is None or emb.shape[0] != item.num_tokens:
                raise EngineError(
                    f"mm_items[{k}] spans {item.num_tokens} rows; its embedding has "
                    f"{None if emb is None else tuple(emb.shape)}"
                )
        return [e for e in out if e is not None]

    async def _encode(
        self, request: PreprocessedRequest, items: list[MmItem]
    ) -> list[torch.Tensor]:
        if self.remote is not None:
            try:
                arrays = await self.remote.encode(request.request_id, request.model, items)
                self.num_remote_images += len(items)
                return [self.to_tensor(a) for a in arrays]
            except InvalidRequest:
                raise
            except ServingError as exc:
                if self.local is None:
                    raise
                self.num_local_fallbacks += 1
                logger.warning("request_id=%s: remote encode failed (%s); encoding locally",
                               request.request_id, exc)  # fmt: skip
        assert self.local is not None
        sub = msgspec.structs.replace(request, mm_items=items)
        rows = await self.local.embeddings(sub)
        self.num_local_images += len(items)
        return list(rows)

    def families(self) -> list[Metric]:
        """Prometheus families: the cache's and where images were encoded."""
        p = "tandem_mm"
        return [
            *self.cache.families(),
            CounterMetricFamily(
                f"{p}_remote_encoded_images", "images encoded by an encode worker",
                self.num_remote_images,
            ),
            CounterMetricFamily(
                f"{p}_local_encoded_images", "images encoded in this worker",
                self.num_local_images,
            ),
            CounterMetricFamily(
                f"{p}_local_encode_fallbacks", "remote encodes that failed and ran locally",
                self.num_local_fallbacks,
            ),
        ]  # fmt: skip


def _torch_tensor(array: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(array)
