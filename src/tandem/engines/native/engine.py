"""`NativeEngine`: the `Engine` protocol around `EngineCore`, stepping in its own thread.

The step thread owns the core: it applies queued adds/aborts, runs `step()` and hands each
step's outputs and KV events back to the event loop with one `call_soon_threadsafe`, so
the worker's networking stays responsive while the model computes. `kv_snapshot`,
`export_blocks` and `import_blocks` take the step lock (they wait for a running step).

A step that raises fails only its batch's requests (`EngineCore.step`). Anything else that
escapes the step loop kills the engine for good: every open stream ends as on `stop`
(finish_reason 'cancelled', `error` saying why: the Worker answers PeerGone, so the frontend
routes or migrates it elsewhere, as for a worker that died), `generate` refuses new requests
and `wait_failed()` returns the reason, so the hosting Worker leaves discovery and its
process exits non-zero.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np
import torch

from tandem.cbuild import select_isa
from tandem.engines.base import (
    EngineCapabilities,
    EngineDefaults,
    EngineInfo,
    EngineLoad,
    ImageInput,
)
from tandem.engines.kv_event_queue import KvEventQueue
from tandem.engines.lora import read_peft_adapter
from tandem.engines.native.adapters import NativeAdapter, lora_shape, prepare
from tandem.engines.native.config import NativeConfig
from tandem.engines.native.embedding import pooled_embeddings, token_groups
from tandem.engines.native.engine_core import EngineCore
from tandem.engines.native.loader import load_model_weights, load_quant_weights
from tandem.engines.native.model import LlamaModel
from tandem.engines.native.quant_model import QuantLlamaModel
from tandem.engines.output_stream import DirectSink, OutputStream
from tandem.engines.vision import EmbeddingProvider, encoder_rows
from tandem.engines.worker_metrics import text_families
from tandem.errors import ContextLengthExceeded, EngineError, InvalidRequest
from tandem.protocols.engine import EngineOutput, PreprocessedRequest
from tandem.protocols.kv_events import KvEvent
from tandem.protocols.lora import LoraLoaded
from tandem.protocols.scaling import StepSample

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

T = TypeVar("T")


def build_core(config: NativeConfig) -> tuple[EngineCore, str]:
    """Load the model named by `config` and build the core; returns (core, model path)."""
    torch.set_num_threads(config.num_threads)
    model, path = build_model(config)
    core = EngineCore(config, model)
    core.grammars.tokenizer_spec = tokenizer_spec(path)
    return core, path


def tokenizer_spec(model_path: str | None) -> str | None:
    """The tokenizer spec (tandem.tokens) of a model file or directory."""
    if not model_path:
        return None
    return f"hf:{model_path}" if os.path.isdir(model_path) else f"gguf:{model_path}"


def build_model(config: NativeConfig) -> tuple[LlamaModel, str]:
    """The model in `config.weights` format on `config.device` (loaded on the host, then
    moved); returns (model, resolved model path)."""
    device = torch.device(config.device)
    if config.weights != "fp32":
        path, model_config, qweights = load_quant_weights(config.model, config.weights)
        max_len = _max_len(config, model_config.context_length)
        quant = QuantLlamaModel(
            model_config,
            qweights,
            weights_format=config.weights,
            max_positions=max_len,
            device=device,
            kv_dtype=getattr(torch, config.resolved_kv_dtype()),
        )
        return quant, path
    path, model_config, weights = load_model_weights(config.model)
    max_len = _max_len(config, model_config.context_length)
    model = LlamaModel(
        model_config,
        weights,
        dtype=getattr(torch, config.dtype),
        max_positions=max_len,
        device=device,
        kv_dtype=getattr(torch, config.resolved_kv_dtype()),
    )
    return model, path


def _max_len(config: NativeConfig, context_length: int) -> int:
    return min(config.max_model_len or context_length, context_length)


class NativeEngine(EngineDefaults):
    def __init__(
        self,
        config: NativeConfig,
        *,
        core: EngineCore | None = None,
        embedding_provider: EmbeddingProvider | None = None,
    ) -> None:
        """`embedding_provider` gives requests with images their embedding rows; a worker's
        wiring (`tandem.multimodal.provider_args`) attaches one before `start`: the in-process
        encoder `config.mm_encoder` (EPD), encode workers, or both behind a cache."""
        self.config = config
        self.core = core
        self.embedding_provider = embedding_provider
        self.model_path: str | None = None
        self._lock = threading.Lock()  # held while a step runs
        self._steps: deque[StepSample] = deque(maxlen=4096)  # for the planner; oldest dropped
        self._cv = threading.Condition()
        self._inbox: deque[tuple[str, Any]] = deque()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, OutputStream] = {}
        self._events = KvEventQueue()
        self._info: EngineInfo | None = None
        self._failure: str | None = None  # why the step loop died; set once
        self._failed: asyncio.Future[str] | None = None

    async def start(self) -> EngineInfo:
        if self._info is not None:
            return self._info
        self._loop = asyncio.get_running_loop()
        self._failed = self._loop.create_future()
        if self.core is None:
            self.core, self.model_path = await asyncio.to_thread(build_core, self.config)
        assert self.core is not None
        self._info = self._make_info(self.core)
        self.core.kvbm_event_sink = self._post_tier_events
        self._thread = threading.Thread(target=self._run, name="native-engine-step", daemon=True)
        self._thread.start()
        logger.info(
            "native engine started: model=%s device=%s kernels=%s weights=%s kv_cache=%s "
            "blocks=%d block_size=%d",
            self._info.model_name,
            self.core.model.device,
            select_isa()[0] if self.core.model.device.type == "cpu" else "torch",
            self.config.weights,
            str(self.core.model.kv_dtype).removeprefix("torch."),
            self._info.num_total_blocks,
            self._info.block_size,
        )
        return self._info

    def _make_info(self, core: EngineCore) -> EngineInfo:
        path = self.model_path
        default_name = "smollm2" if self.config.model is None else None
        if default_name is None and path:
            default_name = os.path.splitext(os.path.basename(path.rstrip("/")))[0]
        return EngineInfo(
            model_name=self.config.served_model_name or default_name or core.model.config.name,
            context_length=core.max_model_len,
            block_size=self.config.block_size,
            num_total_blocks=core.num_blocks,
            max_num_seqs=self.config.max_num_seqs,
            max_num_batched_tokens=self.config.max_num_batched_tokens,
            eos_token_ids=list(core.model.config.eos_token_ids),
            tokenizer=tokenizer_spec(path),
            engine="native",
            embedding_dim=core.model.config.hidden_size,
            **mm_card_fields(self.config, core.model.config.vocab_size),
        )

    @property
    def capabilities(self) -> EngineCapabilities:
        """Embeds; takes images (its own encoder `config.mm_encoder` loaded on the first one
        when it has one); serves LoRA adapters unless --max-loras is 0."""
        images = ImageInput(local_encoder=self.config.mm_encoder, model=self.config.model)
        return EngineCapabilities(embeds=True, images=images, lora=self.config.max_loras > 0)

    # ---------------------------------------------------------------- LoRA adapters
    async def load_lora(self, name: str, path: str) -> LoraLoaded:
        """Read and check the PEFT adapter at `path` off the event loop, lay it out for the
        model, then make it resident between two steps (evicting the least recently used
        idle adapter when --max-loras are resident). load_s: the whole load, 0.0 when it
        was already resident from the same path."""
        core, info = self._running("load_lora")
        if self.config.max_loras == 0:
            raise InvalidRequest(
                "this worker serves no LoRA adapters (--max-loras 0); start it with "
                "--max-loras N to load some"
            )
        if not name or len(name) > 256 or name != name.strip():
            raise InvalidRequest(f"LoRA adapter name {name!r}; expected 1-256 characters")
        if (loaded := _already_loaded(core.loras.peek(name), name, path)) is not None:
            return loaded
        started = time.perf_counter()
        shape = lora_shape(core.model.config, info.model_name)

        def read() -> NativeAdapter:
            with torch.inference_mode():
                return prepare(read_peft_adapter(path, shape, name=name), core.model)

        adapter = await asyncio.to_thread(read)

        def install(core: EngineCore) -> LoraLoaded | list[str]:
            if (loaded := _already_loaded(core.loras.peek(name), name, path)) is not None:
                return loaded  # a concurrent load of the same adapter won
            return core.add_lora(adapter)

        result = await asyncio.to_thread(self.run_locked, install)
        if isinstance(result, LoraLoaded):
            return result
        load_s = time.perf_counter() - started
        logger.info(
            "LoRA adapter %s loaded from %s: rank %d, %.1f MiB, %.3f s%s",
            name, path, adapter.rank, adapter.num_bytes / (1 << 20), load_s,
            f"; evicted {', '.join(result)}" if result else "",
        )  # fmt: skip
        return LoraLoaded(name=name, rank=adapter.rank, load_s=load_s)

    async def unload_lora(self, name: str) -> None:
        """Drop adapter `name` (ModelNotFound when it is not resident): new requests naming
        it are refused at once; running ones finish on the weights they started with."""
        self._running("unload_lora")
        await asyncio.to_thread(self.run_locked, lambda core: core.loras.remove(name))
        logger.info("LoRA adapter %s unloaded", name)

    def loras(self) -> list[str]:
        """Resident adapters, least recently used first."""
        return [] if self.core is None else self.core.loras.names()

    def _running(self, what: str) -> tuple[EngineCore, EngineInfo]:
        if self._failure is not None:
            raise EngineError(f"{self._failure}; this engine serves nothing more")
        if self.core is None or self._info is None or self._stopping:
            raise EngineError(f"native engine is not running; {what} needs start() first")
        return self.core, self._info

    def attach_embedding_provider(self, provider: EmbeddingProvider) -> None:
        self.embedding_provider = provider

    async def generate(
        self,
        request: PreprocessedRequest,
        *,
        install: Callable[[EngineCore], None] | None = None,
        direct: DirectSink | None = None,
    ) -> AsyncGenerator[EngineOutput, None]:
        """Stream the request's outputs. Raises InvalidRequest/ContextLengthExceeded on the
        first iteration if it can never run, EngineError if the engine is not running.
        Closing early aborts it. `install`, when given, replaces admission: it runs on the
        step thread and puts the request's sequence into the core itself (a disaggregated
        decode resuming with imported KV, tandem.engines.native.kv_transfer). `direct` is
        never given (its capabilities take no direct sink)."""
        if self._failure is not None:
            raise EngineError(f"{self._failure}; this engine serves nothing more")
        if self.core is None or self._thread is None or self._stopping:
            raise EngineError("native engine is not running; call start() first")
        self.core.check(request)
        mm_embeddings = None
        if request.mm_items and install is None:  # a KV handoff (install) needs no images
            mm_embeddings = await self._mm_embeddings(request)
            if self._stopping:  # stop() ran while the images were encoded
                raise EngineError("native engine stopped while the request's images were encoded")
        grammar = None
        if request.sampling.structured is not None:  # compiled here, off the step thread
            core = self.core
            grammar = await asyncio.to_thread(
                core.grammars.matcher,
                request.sampling.structured,
                request.token_ids,
                request.num_generated_tokens,
            )
        request_id = request.request_id
        if request_id in self._streams:
            raise InvalidRequest(f"request_id={request_id} is already running on this engine")
        stream = self._streams[request_id] = OutputStream()
        self._submit("add", (request, install, mm_embeddings, grammar))
        try:
            async for out in stream.until_finished():
                yield out
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not stream.finished:
                self._submit("abort", request_id)

    async def embed(self, inputs: list[list[int]]) -> np.ndarray:
        """Mean-pooled, normalised embeddings [len(inputs), hidden] (`native.embedding`).
        Inputs are batched into forwards of at most max_num_batched_tokens tokens (a longer
        input alone), each run between generation steps; no KV block is used. Raises
        InvalidRequest / ContextLengthExceeded for inputs it cannot take."""
        if self._failure is not None:
            raise EngineError(f"{self._failure}; this engine serves nothing more")
        if self.core is None or self._thread is None or self._stopping:
            raise EngineError("native engine is not running; call start() first")
        vocab, limit = self.core.model.config.vocab_size, self.core.max_model_len
        for i, ids in enumerate(inputs):
            if not ids:
                raise InvalidRequest(f"input[{i}] is empty; expected at least one token")
            if len(ids) > limit:
                raise ContextLengthExceeded(
                    f"input[{i}] has {len(ids)} tokens; max_model_len is {limit}"
                )
            if any(not 0 <= t < vocab for t in ids):
                raise InvalidRequest(f"input[{i}] has token ids outside [0, {vocab})")
        parts = []
        for group in token_groups(inputs, self.config.max_num_batched_tokens):
            part = await asyncio.to_thread(self.run_locked, lambda core, g=group: self._embed(g))
            parts.append(part)
        return torch.cat(parts).numpy()

    def _embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """One pooled forward, recorded as a prefill-only step for the planner (step lock held)."""
        assert self.core is not None
        started = time.perf_counter()
        vectors = pooled_embeddings(self.core.model, inputs)
        scheduler = self.core.scheduler
        self._steps.append(StepSample(
            wall_ms=(time.perf_counter() - started) * 1000.0,
            num_prefill_tokens=sum(map(len, inputs)), num_decode_kv_tokens=0,
            num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        ))  # fmt: skip
        return vectors

    async def _mm_embeddings(self, request: PreprocessedRequest) -> list[torch.Tensor]:
        if self.embedding_provider is None:
            why = (
                "no embedding provider was attached to this engine"
                if self.config.mm_encoder
                else "this worker runs no vision encoder (start it with --mm-encoder)"
            )
            raise InvalidRequest(f"request_id={request.request_id} has images; {why}")
        return await self.embedding_provider.embeddings(request)

    async def abort(self, request_id: str) -> None:
        self._submit("abort", request_id)

    async def wait_failed(self) -> str:
        """Return why the step loop died, once it has; never returns while it runs."""
        assert self._failed is not None, "wait_failed before start()"
        return await asyncio.shield(self._failed)

    def run_locked(self, fn: Callable[[EngineCore], T]) -> T:
        """Run `fn(core)` between steps (waits for a running step), then wake the step
        thread so work `fn` added is scheduled. Blocking: call it off the event loop."""
        assert self.core is not None, "run_locked before start()"
        with self._lock:
            result = fn(self.core)
            self.core.flush_evicted()  # `fn` may have allocated over cached blocks
        with self._cv:
            self._cv.notify()
        return result

    def _submit(self, op: str, arg: Any) -> None:
        with self._cv:
            self._inbox.append((op, arg))
            self._cv.notify()

    def kv_events(self) -> AsyncIterator[list[KvEvent]]:
        return self._events.stream()

    def kv_snapshot(self) -> list[KvEvent]:
        assert self.core is not None, "kv_snapshot before start()"
        with self._lock:
            return self.core.kv_snapshot()

    def metric_families(self) -> list[Metric]:
        return text_families(self.prometheus_lines())

    def prometheus_lines(self) -> list[str]:
        """Tier metrics of the KV block manager (empty without --kvbm-* tiers)."""
        return [] if self.core is None else self.core.prometheus_lines()

    def load(self) -> EngineLoad:
        core = self.core
        if core is None:
            return EngineLoad(num_active_blocks=0, num_total_blocks=0, num_waiting=0, num_running=0)
        return EngineLoad(
            num_active_blocks=core.block_manager.num_active_blocks,
            num_total_blocks=core.num_blocks,
            num_waiting=len(core.scheduler.waiting),
            num_running=len(core.scheduler.running),
        )

    def _record_step(self, core: EngineCore, wall_ms: float) -> None:
        prefill, decode_kv = core.last_step_tokens
        self._steps.append(StepSample(
            wall_ms=wall_ms, num_prefill_tokens=prefill, num_decode_kv_tokens=decode_kv,
            num_running=len(core.scheduler.running), num_waiting=len(core.scheduler.waiting),
        ))  # fmt: skip

    def take_step_samples(self) -> list[StepSample]:
        """The steps run since the last call (appended by the step thread; deque ops are
        atomic, so the loop drains it without the step lock)."""
        out: list[StepSample] = []
        while self._steps:
            out.append(self._steps.popleft())
        return out

    async def stop(self) -> None:
        """Stop the step thread; every open stream ends with finish_reason 'cancelled'."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        thread, self._thread = self._thread, None
        if thread is not None:
            await asyncio.to_thread(thread.join)
        if self.core is not None:
            await asyncio.to_thread(self.core.close)
        for stream in self._streams.values():
            stream.push(EngineOutput(finish_reason="cancelled"))
        self._events.close()

    # ---------------------------------------------------------------- KV data plane
    @property
    def kv_cache(self) -> torch.Tensor:
        """The raw KV tensor [layers, 2, blocks, block_size, kv_heads, head_dim] (for
        zero-copy registration with a transfer backend)."""
        assert self.core is not None, "kv_cache before start()"
        return self.core.runner.kv_cache

    @property
    def bytes_per_block(self) -> int:
        assert self.core is not None, "bytes_per_block before start()"
        return self.core.runner.bytes_per_block

    def export_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Per layer, a contiguous copy [2, n, block_size, kv_heads, head_dim]."""
        assert self.core is not None, "export_blocks before start()"
        with self._lock:
            return self.core.runner.export_blocks(block_ids)

    def import_blocks(self, block_ids: list[int], data: list[torch.Tensor]) -> None:
        """Write per-layer data (as `export_blocks` returns) into the given blocks."""
        assert self.core is not None, "import_blocks before start()"
        with self._lock:
            self.core.flush_evicted()
            self.core.runner.import_blocks(block_ids, data)

    # ---------------------------------------------------------------- step thread
    def _run(self) -> None:
        core = self.core
        assert core is not None and self._loop is not None
        try:
            while True:
                with self._cv:
                    while not self._inbox and not core.has_work() and not self._stopping:
                        self._cv.wait()
                    if self._stopping:
                        return
                    ops = list(self._inbox)
                    self._inbox.clear()
                with self._lock:
                    outputs = self._apply(core, ops)
                    if core.has_work():
                        started = time.perf_counter()
                        outputs += core.step()
                        self._record_step(core, (time.perf_counter() - started) * 1000.0)
                    events = core.take_events()
                self._loop.call_soon_threadsafe(self._dispatch, outputs, events)
        except Exception as exc:  # task boundary: the engine is dead, say so everywhere
            logger.exception("native engine step loop failed")
            self._failure = f"native engine failed: {type(exc).__name__}: {exc}"
            self._stopping = True  # generate() now refuses new requests
            self._loop.call_soon_threadsafe(self._die, self._failure)

    @staticmethod
    def _apply(core: EngineCore, ops: list[tuple[str, Any]]) -> list[tuple[str, EngineOutput]]:
        outputs: list[tuple[str, EngineOutput]] = []
        for op, arg in ops:
            if op == "abort":
                core.abort(arg)
                continue
            request, install, mm_embeddings, grammar = arg
            try:
                if install is None:
                    core.add(request, mm_embeddings, grammar)
                else:
                    install(core)
                    core.seqs[request.request_id].grammar = grammar
            except Exception as exc:  # request boundary: fail this request only
                logger.warning("rejecting request_id=%s: %s", request.request_id, exc)
                outputs.append(
                    (request.request_id, EngineOutput(finish_reason="error", error=str(exc)))
                )
        return outputs

    def _dispatch(self, outputs: list[tuple[str, EngineOutput]], events: list[KvEvent]) -> None:
        for request_id, out in outputs:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.push(out)
        self._events.push(events)

    def _post_tier_events(self, events: list[KvEvent]) -> None:
        """Host/disk KV events from kvbm's threads, queued like a step's (thread-safe)."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._dispatch, [], events)

    def _die(self, reason: str) -> None:
        failed = EngineOutput(finish_reason="cancelled", error=reason)
        for stream in self._streams.values():
            stream.push(failed)
        self._events.close()  # kv_events() ends once drained
        if self._failed is not None and not self._failed.done():
            self._failed.set_result(reason)


def _already_loaded(adapter: NativeAdapter | None, name: str, path: str) -> LoraLoaded | None:
    """The answer to loading `name` from `path` when `adapter` (resident as `name`) is it;
    None when nothing is resident under that name; InvalidRequest for another path."""
    if adapter is None:
        return None
    if os.path.realpath(adapter.path) != os.path.realpath(path):
        raise InvalidRequest(
            f"LoRA adapter '{name}' is already loaded from {adapter.path}; unload it before "
            f"loading {path} under that name"
        )
    return LoraLoaded(name=name, rank=adapter.rank, load_s=0.0)


def mm_card_fields(config: NativeConfig, vocab_size: int) -> dict[str, Any]:
    """The model card's image geometry: rows per image from the encoder's spec, placeholder id."""
    if config.mm_encoder is None:
        return {}
    if not 0 <= config.mm_placeholder_token_id < vocab_size:
        raise ValueError(
            f"mm_placeholder_token_id={config.mm_placeholder_token_id} out of range; expected "
            f"a token id in [0, {vocab_size}) of this model"
        )
    return {
        "mm_num_tokens_per_image": encoder_rows(config.mm_encoder),
        "mm_placeholder_token_id": config.mm_placeholder_token_id,
    }
