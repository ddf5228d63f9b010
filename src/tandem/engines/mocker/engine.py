"""`MockerEngine`: the `Engine` protocol around the synchronous mocker `Scheduler`.

One step-loop task runs `Scheduler.step()` whenever there is work, sleeps the simulated pass
time divided by `speedup_ratio` (never with speedup 0, where it only yields to the loop), then
hands each request its output of that step and queues the step's KV events. Everything runs
on one event loop; `generate`, `abort`, `load` and `kv_snapshot` may be called at any time
from it (never while a step runs, since a step does not await).

A step that raises kills the engine (the scheduler's state is no longer trustworthy): every
open stream ends as on `stop` (finish_reason 'cancelled', `error` saying why), `generate`
refuses new requests and `wait_failed()` returns the reason, so the hosting Worker leaves
discovery and its process exits non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, NamedTuple

from tandem.engines.base import (
    EngineCapabilities,
    EngineDefaults,
    EngineInfo,
    EngineLoad,
    ImageInput,
)
from tandem.engines.kv_event_queue import KvEventQueue
from tandem.engines.mocker import perf_model
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.embedding import hashed_embedding
from tandem.engines.mocker.lora import MockerLoras
from tandem.engines.mocker.scheduler import Scheduler, StepResult
from tandem.engines.output_stream import DirectSink, OutputStream
from tandem.engines.vision import EmbeddingProvider
from tandem.engines.worker_metrics import text_families
from tandem.errors import ContextLengthExceeded, EngineError, InvalidRequest
from tandem.protocols.engine import (
    EngineOutput,
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
    prompt_array,
)
from tandem.protocols.kv_events import KvEvent
from tandem.protocols.lora import LoraLoaded
from tandem.protocols.scaling import StepSample

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

logger = logging.getLogger(__name__)


class ReceivedSampling(NamedTuple):
    request_id: str
    sampling: SamplingParams
    stop: StopConditions


class MockerEngine(EngineDefaults):
    # admission reads a prompt still in the wire's u32 buffer with prompt_array; the step
    # loop offers outputs to a direct sink (OutputStream); remote image embeddings stay numpy
    # (the mocker never imports torch) and it runs no encoder of its own (EPD is simulated)
    capabilities = EngineCapabilities(
        reads_token_bytes=True,
        accepts_direct_sink=True,
        embeds=True,
        images=ImageInput(embeddings_as_arrays=True),
    )

    def __init__(
        self,
        config: MockerConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.config = config
        self.scheduler = Scheduler(config)
        self._clock = clock
        self._sleep = sleep
        self._streams: dict[str, OutputStream] = {}
        self._wake = asyncio.Event()
        self._events = KvEventQueue()
        self._task: asyncio.Task[None] | None = None
        self._failure: str | None = None  # why the step loop died; set once
        self._failed: asyncio.Future[str] | None = None
        # images: set by the worker (tandem.multimodal.provider_args) for E/PD; without one,
        # an image request's simulated encode stalls the step loop (EPD)
        self.embedding_provider: EmbeddingProvider | None = None
        self._encode_debt_s = 0.0
        self._steps: deque[StepSample] = deque(maxlen=4096)  # oldest dropped if nobody reads
        # the mocker's tokens are synthetic, so sampling fields cannot change them; it
        # records what arrived (of the last 1024 requests) so tests can see every field travel
        self.received: deque[ReceivedSampling] = deque(maxlen=1024)
        # LoRA adapters (mocker/lora.py): a load holds the step loop for its simulated time
        self.capabilities = replace(MockerEngine.capabilities, lora=config.max_loras > 0)
        self._stalls: list[tuple[float, asyncio.Future[None]]] = []
        speedup = config.speedup_ratio
        load_s = config.lora_load_ms / 1000.0 / speedup if speedup > 0 else 0.0
        self.adapters = MockerLoras(config.max_loras, load_s, self._stall, clock)

    @property
    def info(self) -> EngineInfo:
        c = self.config
        return EngineInfo(
            model_name=c.model_name,
            context_length=c.context_length,
            block_size=c.block_size,
            num_total_blocks=c.num_blocks,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens,
            eos_token_ids=list(c.eos_token_ids),
            tokenizer=c.tokenizer,
            engine="mocker",
            mm_num_tokens_per_image=c.mm_num_tokens_per_image,
            mm_placeholder_token_id=c.mm_placeholder_token_id
            if c.mm_num_tokens_per_image
            else None,
            embedding_dim=c.embedding_dim,
            embedding_matryoshka=True,  # see tandem.engines.mocker.embedding
            max_loras=c.max_loras,
        )

    async def start(self) -> EngineInfo:
        if self._task is None:
            self._failed = asyncio.get_running_loop().create_future()
            self._task = asyncio.create_task(self._run(), name="mocker-step-loop")
        return self.info

    async def generate(
        self,
        request: PreprocessedRequest,
        *,
        install: Callable[[Scheduler], object] | None = None,
        direct: DirectSink | None = None,
    ) -> AsyncGenerator[EngineOutput, None]:
        """Stream the request's outputs (merged when the consumer lags behind the steps).
        Raises InvalidRequest/ContextLengthExceeded on the first iteration if it can never
        run, EngineError if the engine is not running. Closing early aborts it.
        `install`, when given, replaces `add_request`: it puts the request's sequence into
        the scheduler itself (a disaggregated decode resuming, tandem.engines.mocker.disagg).
        `direct`, when given, is offered each output while this generator waits for one
        (`OutputStream`); outputs it takes are not yielded here."""
        if self._failure is not None:
            raise EngineError(f"{self._failure}; this engine serves nothing more")
        if self._task is None:
            raise EngineError("mocker engine is not running; call start() first")
        request_id = request.request_id
        self.received.append(ReceivedSampling(request_id, request.sampling, request.stop))
        if request.sampling.structured is not None:  # never a 200 that ignores the schema
            raise InvalidRequest(
                f"request_id={request_id} asks for structured output "
                f"({request.sampling.structured.kind}); the mocker engine writes pseudo-tokens "
                "and cannot enforce it; serve with --engine native"
            )
        if request.mm_items and install is None:
            if not request.token_ids:  # an embedding provider reads the ids
                request.token_ids = prompt_array(request).tolist()
            await self._encode_images(request)
        lora = request.lora_name
        if lora:
            await self.adapters.acquire(lora)  # waits while it loads; ModelNotFound if absent
        try:
            if install is None:
                self.scheduler.add_request(request)
            else:
                install(self.scheduler)
        except BaseException:
            if lora:
                self.adapters.release(lora)
            raise
        stream = self._streams[request_id] = OutputStream(direct)
        self._wake.set()
        try:
            async for out in stream.until_finished():
                yield out
        finally:
            self._streams.pop(request_id, None)
            if lora:
                self.adapters.release(lora)
            if not stream.finished:
                self.scheduler.abort(request_id)

    async def load_lora(self, name: str, path: str) -> LoraLoaded:
        """Make adapter `name` resident (simulated: `mocker/lora.py`); the load stalls the
        step loop `--lora-load-ms` / speedup. InvalidRequest for a directory without a PEFT
        config or a name loaded from another path; Overloaded when no slot went idle."""
        if self._task is None or self._failure is not None:
            raise EngineError("mocker engine is not running; it loads no LoRA adapter")
        return await self.adapters.load(name, path)

    async def unload_lora(self, name: str) -> None:
        """Drop adapter `name` (ModelNotFound when not resident); running requests finish."""
        self.adapters.unload(name)

    def loras(self) -> list[str]:
        return self.adapters.resident()

    async def _stall(self, seconds: float) -> None:
        """Hold the step loop for `seconds` (a LoRA load between two steps)."""
        done = asyncio.get_running_loop().create_future()
        self._stalls.append((seconds, done))
        self._wake.set()
        await done

    async def embed(self, inputs: list[list[int]]) -> Any:
        """[len(inputs), embedding_dim] hash-seeded unit vectors (`mocker.embedding`), after
        the simulated prefill time of all their tokens (divided by the speedup ratio); no
        block is used. Raises InvalidRequest / ContextLengthExceeded like the native engine."""
        import numpy as np

        c = self.config
        if self._failure is not None:
            raise EngineError(f"{self._failure}; this engine serves nothing more")
        if self._task is None or c.embedding_dim == 0:
            raise EngineError("mocker engine is not running or has --embedding-dim 0")
        for i, ids in enumerate(inputs):
            if not ids:
                raise InvalidRequest(f"input[{i}] is empty; expected at least one token")
            if len(ids) > c.context_length:
                raise ContextLengthExceeded(
                    f"input[{i}] has {len(ids)} tokens; context_length is {c.context_length}"
                )
            if any(not 0 <= t < c.vocab_size for t in ids):
                raise InvalidRequest(f"input[{i}] has token ids outside [0, {c.vocab_size})")
        if c.speedup_ratio > 0:
            ms = perf_model.prefill_ms(sum(map(len, inputs)))
            await self._sleep(ms / 1000.0 / c.speedup_ratio)
        return np.stack([hashed_embedding(ids, c.embedding_dim) for ids in inputs])

    async def _encode_images(self, request: PreprocessedRequest) -> None:
        if self.config.mm_num_tokens_per_image == 0:
            raise InvalidRequest(
                f"request_id={request.request_id} has images; this mocker is text only "
                "(start it with --mm-num-tokens-per-image N)"
            )
        if self.embedding_provider is not None:
            await self.embedding_provider.embeddings(request)  # E/PD: rows are not used
        elif self.config.speedup_ratio > 0:
            ms = self.config.mm_encode_ms_per_image * len(request.mm_items)
            self._encode_debt_s += ms / 1000.0 / self.config.speedup_ratio

    async def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) is not None:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.push(EngineOutput(finish_reason="cancelled"))

    async def wait_failed(self) -> str:
        """Return why the step loop died, once it has; never returns while it runs."""
        assert self._failed is not None, "wait_failed before start()"
        return await asyncio.shield(self._failed)

    def kv_events(self) -> AsyncIterator[list[KvEvent]]:
        return self._events.stream()

    def kv_snapshot(self) -> list[KvEvent]:
        """Every cached device block, then the simulated host/disk tiers' blocks."""
        events = self.scheduler.pool.snapshot()
        if self.scheduler.kvbm is not None:
            events += self.scheduler.kvbm.kv_snapshot()
        return events

    def attach_embedding_provider(self, provider: EmbeddingProvider) -> None:
        self.embedding_provider = provider

    def metric_families(self) -> list[Metric]:
        return text_families(self.prometheus_lines())

    def prometheus_lines(self) -> list[str]:
        """Simulated tier metrics (tandem.kvbm); empty without --kvbm-* tiers."""
        kvbm = self.scheduler.kvbm
        return [] if kvbm is None else kvbm.prometheus_lines()

    def load(self) -> EngineLoad:
        s = self.scheduler
        return EngineLoad(
            num_active_blocks=s.pool.num_active_blocks,
            num_total_blocks=s.pool.num_blocks,
            num_waiting=s.num_waiting,
            num_running=s.num_running,
            num_cached_blocks=s.pool.num_cached_blocks,
        )

    def take_step_samples(self) -> list[StepSample]:
        """The steps run since the last call (wall time as the step loop lived it)."""
        steps = list(self._steps)
        self._steps.clear()
        return steps

    async def stop(self) -> None:
        """Stop stepping; every open stream ends with finish_reason 'cancelled'."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._end_all(EngineOutput(finish_reason="cancelled"))
        self._fail_stalls("mocker engine stopped")
        self._events.close()  # ends kv_events() once drained

    # ------------------------------------------------------------------ step loop
    async def _run(self) -> None:
        speedup = self.config.speedup_ratio
        target = self._clock()
        try:
            while True:
                if not self.scheduler.has_work and not self._stalls:
                    self._wake.clear()
                    await self._wake.wait()
                    target = self._clock()
                if self._stalls:  # LoRA loads: the engine does nothing else meanwhile
                    stalls, self._stalls = self._stalls, []
                    target = max(target, self._clock()) + sum(s for s, _ in stalls)
                    await self._sleep(target - self._clock())
                    for _, done in stalls:
                        if not done.done():
                            done.set_result(None)
                    if not self.scheduler.has_work:
                        continue
                if self._encode_debt_s > 0:  # EPD: the encoder holds the engine meanwhile
                    debt, self._encode_debt_s = self._encode_debt_s, 0.0
                    target = max(target, self._clock()) + debt
                    await self._sleep(target - self._clock())
                started = self._clock()
                result = self.scheduler.step()
                if speedup > 0:
                    # absorb our own overhead: the pass ends duration after the last one did
                    target = max(target + result.duration_ms / 1000.0 / speedup, self._clock())
                    await self._sleep(target - self._clock())
                self._record(result, (self._clock() - started) * 1000.0)
                self._dispatch(result)
                if speedup == 0:
                    await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # task boundary: the engine is dead, say so everywhere
            logger.exception("mocker step loop failed")
            self._failure = f"mocker engine failed: {type(exc).__name__}: {exc}"
            self._end_all(EngineOutput(finish_reason="cancelled", error=self._failure))
            self._fail_stalls(self._failure)
            self._events.close()  # kv_events() ends once drained
            if self._failed is not None and not self._failed.done():
                self._failed.set_result(self._failure)

    def _record(self, result: StepResult, wall_ms: float) -> None:
        s = self.scheduler
        self._steps.append(
            StepSample(
                wall_ms=wall_ms,
                num_prefill_tokens=result.num_prefill_tokens,
                num_decode_kv_tokens=result.num_decode_kv_tokens,
                num_running=s.num_running,
                num_waiting=s.num_waiting,
            )
        )

    def _dispatch(self, result: StepResult) -> None:
        for seq, out in result.outputs:
            stream = self._streams.get(seq.request_id)
            if stream is not None:
                stream.push(out)
        self._events.push(result.events)

    def _fail_stalls(self, why: str) -> None:
        stalls, self._stalls = self._stalls, []
        for _, done in stalls:
            if not done.done():
                done.set_exception(EngineError(f"{why}; the LoRA load did not finish"))

    def _end_all(self, final: EngineOutput) -> None:
        for request_id, stream in list(self._streams.items()):
            stream.push(final)
            try:
                self.scheduler.abort(request_id)
            except Exception:  # a failed step may have left the scheduler inconsistent
                logger.warning("request_id=%s: abort after failure raised", request_id)
