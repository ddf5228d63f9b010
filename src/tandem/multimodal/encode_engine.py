"""`EncoderEngine`: the encode worker (`tandem worker --engine encoder`, component `encoder`,
endpoint `encode`), DESIGN.md §10 step 2.

A request is a `PreprocessedRequest` whose `mm_items` carry image bytes. The engine decodes them
(checking each mm_hash), queues them for the batcher, which runs the vision encoder over up to
`max_batch_images` images from any number of requests at once (on a thread), and hands each
request's embeddings to the `EmbeddingSender`: one readable transfer op per request, held until
the requester pulls it or its TTL passes. The single `EngineOutput` answers
`disagg_params={"mm_embeddings": [EmbeddingHandle, ...]}`, one per image, in order.
A request annotated `mm_stats` answers the engine's counters instead.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np

from tandem.config_check import check_range
from tandem.engines.base import EngineDefaults, EngineInfo, EngineLoad
from tandem.engines.kv_event_queue import KvEventQueue
from tandem.engines.output_stream import DirectSink
from tandem.errors import EngineError, InvalidRequest, Overloaded
from tandem.multimodal.base import VisionEncoder
from tandem.multimodal.embedding_transfer import EmbeddingSender
from tandem.multimodal.image import DecodedImage
from tandem.multimodal.sim_encoder import SimEncoderConfig, SimVisionEncoder
from tandem.protocols.engine import EngineOutput, PreprocessedRequest
from tandem.protocols.kv_events import KvEvent
from tandem.runtime.tls import TlsFiles
from tandem.transfer import TransferAgent, TransferAgentConfig
from tandem.transfer.base import BACKEND_NAMES, LAZY_BACKENDS

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

logger = logging.getLogger(__name__)

STATS_ANNOTATION = "mm_stats"
EMBEDDINGS_KEY = "mm_embeddings"


@dataclass(frozen=True, slots=True, kw_only=True)
class EncodeWorkerConfig:
    """`encoder`: a name of `tandem.multimodal.registry` ("bridge") or "sim" (the simulated
    encoder of `sim`). `model`: the LM whose embedding space the encoder targets."""

    encoder: str = "bridge"
    model: str | None = None
    model_name: str = "smollm2"
    max_batch_images: int = 16
    batch_wait_ms: float = 2.0
    max_queued_images: int = 512
    num_slots: int = 512
    embedding_ttl_s: float = 30.0
    transfer_backends: tuple[str, ...] = BACKEND_NAMES
    # those of transfer_backends started only for a peer on another host (NIXL's progress
    # thread, Mooncake's engine: a one-host stack never uses them)
    transfer_lazy_backends: tuple[str, ...] = LAZY_BACKENDS
    # where the embedding transfer agent listens and what peers dial
    transfer_host: str = "127.0.0.1"
    transfer_port: int = 0  # 0: any free port
    # torch intra-op threads: 1 by default — bit-identical rows whatever the batch, and no
    # OpenMP barrier stalls beside other busy processes (13 ms/image on one core here)
    num_threads: int = 1
    sim: SimEncoderConfig = field(default_factory=SimEncoderConfig)

    def __post_init__(self) -> None:
        check_range("max_batch_images", self.max_batch_images, low=1, high=1024)
        check_range("transfer_port", self.transfer_port, low=0, high=65535)
        check_range("batch_wait_ms", self.batch_wait_ms, low=0, high=10_000)
        check_range("num_threads", self.num_threads, low=1, high=1024)
        check_range("max_queued_images", self.max_queued_images, low=1)
        check_range("num_slots", self.num_slots, low=1)
        check_range("embedding_ttl_s", self.embedding_ttl_s, low=0, high=3600, low_open=True)


@dataclass(slots=True)
class _Job:
    images: list[DecodedImage]
    done: asyncio.Future[list[np.ndarray]]


@dataclass(slots=True)
class EncodeStats:
    num_requests: int = 0
    num_images: int = 0
    num_batches: int = 0
    encode_seconds: float = 0.0


class EncoderEngine(EngineDefaults):
    """Implements the `Engine` protocol for the encode worker; runs on the worker's loop.
    None of the optional capabilities: it encodes images it is sent, it takes none itself."""

    def __init__(self, config: EncodeWorkerConfig, *, cluster_secret: str | None = None) -> None:
        self.config = config
        # authenticates the transfer agent's peers (decode workers pulling embeddings)
        self.cluster_secret = cluster_secret
        self.tls: TlsFiles | None = None  # the transfer agent's TLS (the worker sets it)
        self.encoder: VisionEncoder | SimVisionEncoder | None = None
        self.agent: TransferAgent | None = None
        self.sender: EmbeddingSender | None = None
        self.stats = EncodeStats()
        self._queue: asyncio.Queue[_Job] = asyncio.Queue()
        self._num_queued_images = 0
        self._num_running_images = 0
        self._events = KvEventQueue()
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> EngineInfo:
        self.encoder = await asyncio.to_thread(self._load_encoder)
        slot_bytes = self.encoder.num_tokens_per_image * self.encoder.hidden_size * 4
        self.agent = TransferAgent(
            TransferAgentConfig(
                host=self.config.transfer_host,
                port=self.config.transfer_port,
                backends=self.config.transfer_backends,
                lazy_backends=self.config.transfer_lazy_backends,
                cluster_secret=self.cluster_secret,
                tls=self.tls,
            )
        )
        self.sender = EmbeddingSender(
            self.agent,
            slot_bytes=slot_bytes,
            num_slots=self.config.num_slots,
            ttl_s=self.config.embedding_ttl_s,
        )
        self._task = asyncio.create_task(self._batch_loop(), name="encoder-batches")
        logger.info(
            "encoder %s ready: %d rows x %d per image, batches of up to %d images",
            self.config.encoder,
            self.encoder.num_tokens_per_image,
            self.encoder.hidden_size,
            self.config.max_batch_images,
        )
        return EngineInfo(
            model_name=self.config.model_name,
            context_length=1,
            block_size=1,
            num_total_blocks=self.config.num_slots,
            max_num_seqs=self.config.max_queued_images,
            max_num_batched_tokens=self.config.max_batch_images,
            engine="encoder",
            mm_num_tokens_per_image=self.encoder.num_tokens_per_image,
        )

    def _load_encoder(self) -> VisionEncoder | SimVisionEncoder:
        if self.config.encoder == "sim":
            return SimVisionEncoder(self.config.sim)
        import torch

        from tandem.multimodal.registry import load_encoder

        torch.set_num_threads(self.config.num_threads)
        return load_encoder(self.config.encoder, model=self.config.model)

    def instance_metadata(self) -> dict[str, Any]:
        assert self.agent is not None
        return {"role": "encoder", "transfer_agent": list(self.agent.address)}

    def metric_families(self) -> list[Metric]:
        """Its transfer agent's counters (the embeddings decode workers pulled)."""
        return self.agent.families() if self.agent is not None else []

    async def wait_failed(self) -> str:
        """Never returns: a failed batch fails its requests, the batch loop goes on."""
        never: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        return await never

    async def generate(
        self, request: PreprocessedRequest, *, direct: DirectSink | None = None
    ) -> AsyncGenerator[EngineOutput, None]:
        if self._task is None or self.sender is None:
            raise EngineError("encoder engine is not running; call start() first")
        if STATS_ANNOTATION in request.annotations:
            yield EngineOutput(finish_reason="stop", disagg_params=self.stats_dict())
            return
        if not request.mm_items:
            raise InvalidRequest(f"request_id={request.request_id} has no images to encode")
        n = len(request.mm_items)
        if self._num_queued_images + n > self.config.max_queued_images:
            raise Overloaded(
                f"encoder queue holds {self._num_queued_images} images (max "
                f"{self.config.max_queued_images}); retry shortly or add encode workers",
                retry_after_s=1,
            )
        from tandem.multimodal.provider import _decode_items

        images = await asyncio.to_thread(_decode_items, request.mm_items)
        job = _Job(images, asyncio.get_running_loop().create_future())
        self._num_queued_images += n
        self._queue.put_nowait(job)
        try:
            embeddings = await job.done
        finally:
            if not job.done.done():
                job.done.cancel()
        handles = self.sender.offer(embeddings, [img.mm_hash for img in images])
        self.stats.num_requests += 1
        yield EngineOutput(
            finish_reason="stop",
            disagg_params={EMBEDDINGS_KEY: [msgspec.to_builtins(h) for h in handles]},
        )

    async def _batch_loop(self) -> None:
        wait_s = self.config.batch_wait_ms / 1000.0
        while True:
            jobs = [await self._queue.get()]
            num_images = len(jobs[0].images)
            deadline = asyncio.get_running_loop().time() + wait_s
            while num_images < self.config.max_batch_images:
                try:
                    async with asyncio.timeout_at(deadline):
                        job = await self._queue.get()
                except TimeoutError:
                    break
                jobs.append(job)
                num_images += len(job.images)
            await self._run_batch(jobs, num_images)

    async def _run_batch(self, jobs: list[_Job], num_images: int) -> None:
        self._num_queued_images -= num_images
        live = [j for j in jobs if not j.done.done()]  # a cancelled request costs no encode
        images = [img for j in live for img in j.images]
        self._num_running_images = len(images)
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            rows = await asyncio.to_thread(self._encode, images) if images else []
        except Exception as exc:  # batch boundary: these requests fail, the loop goes on
            logger.exception("vision encoder failed on a batch of %d images", len(images))
            for j in live:
                if not j.done.done():
                    j.done.set_exception(EngineError(f"vision encoder failed: {exc}"))
            return
        finally:
            self._num_running_images = 0
        self.stats.num_batches += 1
        self.stats.num_images += len(images)
        self.stats.encode_seconds += loop.time() - started
        at = 0
        for j in live:
            part, at = rows[at : at + len(j.images)], at + len(j.images)
            if not j.done.done():
                j.done.set_result(part)

    def _encode(self, images: Sequence[DecodedImage]) -> list[np.ndarray]:
        assert self.encoder is not None, "encode before start()"
        out = self.encoder.encode(images)
        return [o if isinstance(o, np.ndarray) else o.numpy() for o in out]

    def stats_dict(self) -> dict[str, Any]:
        held = self.sender.num_held if self.sender is not None else 0
        return {
            "num_requests": self.stats.num_requests,
            "num_images": self.stats.num_images,
            "num_batches": self.stats.num_batches,
            "encode_seconds": self.stats.encode_seconds,
            "num_held_embeddings": held,
            "num_queued_images": self._num_queued_images,
        }

    async def abort(self, request_id: str) -> None:
        pass  # a request's encode is cancelled by closing its generate() stream

    def kv_events(self) -> AsyncIterator[list[KvEvent]]:
        return self._events.stream()

    def kv_snapshot(self) -> list[KvEvent]:
        return []

    def load(self) -> EngineLoad:
        return EngineLoad(
            num_active_blocks=self.sender.num_held if self.sender is not None else 0,
            num_total_blocks=self.config.num_slots,
            num_waiting=self._num_queued_images,
            num_running=self._num_running_images,
        )

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        while not self._queue.empty():
            job = self._queue.get_nowait()
            if not job.done.done():
                job.done.set_exception(EngineError("encode worker stopped"))
        self._events.close()
        if self.agent is not None:
            await asyncio.to_thread(self.agent.close)
