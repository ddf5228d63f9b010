"""`VllmEngine`: vLLM's `AsyncLLM` in the worker process, behind tandem's `Engine` protocol.

Token-in/token-out: tandem's frontend tokenizes; vLLM gets `TokensPrompt`s and returns token
ids (no detokenization). `AsyncLLM` runs its EngineCore (and that its Worker) as child
processes; a reaper child kills them if this process dies without shutting down
(`reaper.py`). KV events come over vLLM's ZMQ publisher into `kv_events.py`; load from a vLLM
stat logger (`metrics.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import TYPE_CHECKING, Any

import msgspec

from tandem.engines.base import EngineCapabilities, EngineDefaults, EngineInfo, EngineLoad
from tandem.engines.kv_event_queue import KvEventQueue
from tandem.engines.output_stream import DirectSink
from tandem.engines.vllm import lora_ops
from tandem.engines.vllm.config import VllmWorkerConfig
from tandem.engines.vllm.kv_events import KvEventTranslator, VllmEventSubscriber
from tandem.engines.vllm.metrics import (
    PrometheusServer,
    SchedulerSnapshot,
    start_metrics_server,
    stat_logger_factory,
)
from tandem.engines.vllm.model_dir import ensure_hf_dir
from tandem.engines.vllm.peer_fetch import VllmPeerFetch, exported, is_export
from tandem.engines.vllm.reaper import Reaper
from tandem.engines.vllm.sampling import (
    engine_output,
    handoff_args,
    prefill_result,
    sampling_params,
    tokens_prompt,
)
from tandem.errors import ContextLengthExceeded, EngineError, InvalidRequest, ModelNotFound
from tandem.protocols.engine import FETCH_METADATA_KEY, EngineOutput, PreprocessedRequest
from tandem.protocols.kv_events import KvEvent
from tandem.protocols.lora import LoraLoaded
from tandem.protocols.scaling import StepSample

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

logger = logging.getLogger(__name__)

# vLLM on these CPUs (issue 16): no reserved core for the frontend thread, a small KV space
WATCH_PERIOD_S = 0.5
CPU_ENV_DEFAULTS = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmEngine(EngineDefaults):
    """Text only, no embeddings: the optional parts it has are its steps and metadata."""

    def __init__(self, config: VllmWorkerConfig) -> None:
        self.config = config
        self.llm: Any = None
        self.model_path: str | None = None
        self.snapshot = SchedulerSnapshot()
        self._events = KvEventQueue()
        self._subscriber: VllmEventSubscriber | None = None
        self._metrics: PrometheusServer | None = None
        self._reaper: Reaper | None = None
        self._info: EngineInfo | None = None
        self._running: set[str] = set()
        self._stopping = False
        self._max_logprobs = 20
        self._failed: asyncio.Future[str] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        # LoRA adapters through vLLM's own LoRA (`--enable-lora`; its CPU build has it:
        # PunicaWrapperCPU): name -> vLLM's LoRARequest, which carries the path, so vLLM
        # reloads an adapter its LRU cache (--max-cpu-loras) dropped
        self._loras: dict[str, Any] = {}
        self._next_lora_id = 1
        self.fetch: VllmPeerFetch | None = None  # with config.kv_fetch, once started

    @property
    def capabilities(self) -> EngineCapabilities:
        return _LORA if _lora_enabled(self.config) else _PLAIN

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> EngineInfo:
        if self._info is not None:
            return self._info
        self.model_path = await asyncio.to_thread(ensure_hf_dir, self.config.model)
        self._reaper = Reaper()  # before vLLM edits this process's environment
        for key, value in CPU_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        if self.config.cpus is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = self.config.cpus
        if _lora_enabled(self.config):  # vLLM's processes load lora_ops.register as a plugin
            os.environ[lora_ops.ENV] = "1"
        try:
            # on this loop's thread, blocking it: AsyncLLM binds its sockets to the running
            # loop (built in another thread it would never see an output). The worker has
            # not registered yet, so nothing waits on this loop meanwhile.
            self.llm = self._build_llm()
        except BaseException:
            await self._close_resources()
            raise
        vc = self.llm.vllm_config
        self._max_logprobs = int(vc.model_config.max_logprobs)
        if self._subscriber is not None:
            kv_cfg = vc.kv_events_config
            self._subscriber.start(kv_cfg.replay_endpoint if kv_cfg else None)
        if self.config.metrics_port is not None:
            self._metrics = start_metrics_server(self.config.metrics_host, self.config.metrics_port)
        self._info = self._make_info(vc)
        if self.config.kv_fetch:
            self.fetch = VllmPeerFetch(
                block_size=self._info.block_size, bytes_per_token=_bytes_per_token(vc),
                timeout_s=self.config.kv_fetch_timeout_s, lease_s=self.config.kv_lease_s,
                external_tokens=lambda: self.snapshot.num_external_kv_tokens,
            )  # fmt: skip
        self.snapshot.kv_capacity_tokens = self._info.num_total_blocks * self._info.block_size
        self._failed = asyncio.get_running_loop().create_future()
        self._watchdog = asyncio.create_task(self._watch(), name="vllm-watchdog")
        policy = str(vc.scheduler_config.policy)
        logger.info(
            "vLLM engine started: model=%s blocks=%d block_size=%d disagg=%s metrics=%s "
            "scheduling=%s kv_fetch=%s",
            self._info.model_name,
            self._info.num_total_blocks,
            self._info.block_size,
            self.config.disagg_mode,
            self._metrics.url if self._metrics else None,
            policy,
            self.fetch is not None,
        )
        if policy != "priority":
            logger.warning(
                "vLLM runs the %s scheduling policy: each request's priority class reaches it "
                "but its scheduler ignores it (arrival order; tandem's router queue still "
                "orders by class); start the worker with --scheduling-policy priority to have "
                "vLLM admit and preempt by class",
                policy,
            )
        return self._info

    def _build_llm(self) -> Any:
        from vllm.config import KVEventsConfig
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        kwargs = dict(self.config.engine_args)
        kwargs["model"] = self.model_path
        kwargs.setdefault("tokenizer", self.model_path)
        if self.config.served_model_name:
            kwargs["served_model_name"] = [self.config.served_model_name]
        if self.config.kv_events:
            self._subscriber = VllmEventSubscriber(
                KvEventTranslator(block_size=0), self._events.push
            )
            kwargs["enable_prefix_caching"] = kwargs.get("enable_prefix_caching") is not False
            kwargs["kv_events_config"] = KVEventsConfig(
                enable_kv_cache_events=True,
                publisher="zmq",
                endpoint=self._subscriber.endpoint,
                replay_endpoint=f"tcp://127.0.0.1:{_free_port()}",
                buffer_steps=self.config.kv_event_buffer_steps,
                topic="",
            )
        if self.config.disagg_mode != "none" or self.config.kv_fetch:
            from vllm.config import KVTransferConfig

            # each worker its own NIXL handshake port, on loopback
            os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(_free_port())
            os.environ.setdefault("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
            roles = {"prefill": "kv_producer", "decode": "kv_consumer"}
            # peer fetch: each worker exports (producer) and pulls (consumer)
            role = roles.get(self.config.disagg_mode, "kv_both")
            extra = {"kv_lease_duration": self.config.kv_lease_s} if self.config.kv_fetch else {}
            kwargs["kv_transfer_config"] = KVTransferConfig(
                kv_connector="NixlConnector",
                # vLLM's connector, its NIXL agent without a spinning progress thread
                kv_connector_module_path="tandem.engines.vllm.nixl_connector",
                kv_role=role,
                kv_buffer_device="cpu",
                kv_connector_extra_config=extra,
            )
        args = AsyncEngineArgs(**kwargs)
        return AsyncLLM.from_engine_args(args, stat_loggers=[stat_logger_factory(self.snapshot)])

    def _make_info(self, vc: Any) -> EngineInfo:
        block_size = int(vc.cache_config.block_size)
        if self._subscriber is not None:
            self._subscriber.translator.block_size = block_size
        name = self.config.served_model_name or os.path.basename(str(self.model_path).rstrip("/"))
        eos = vc.model_config.hf_config.eos_token_id
        eos_ids = eos if isinstance(eos, list) else ([] if eos is None else [int(eos)])
        return EngineInfo(
            model_name=name,
            context_length=int(vc.model_config.max_model_len),
            block_size=block_size,
            num_total_blocks=int(vc.cache_config.num_gpu_blocks or 0),
            max_num_seqs=int(vc.scheduler_config.max_num_seqs),
            max_num_batched_tokens=int(vc.scheduler_config.max_num_batched_tokens),
            eos_token_ids=[int(t) for t in eos_ids],
            tokenizer=f"hf:{self.model_path}",
            engine="vllm",
            max_loras=int(vc.lora_config.max_cpu_loras or 0) if vc.lora_config else 0,
        )

    async def _watch(self) -> None:
        """vLLM's EngineCore dying (killed, crashed) ends this engine for good."""
        while self.llm is not None and not self._stopping:
            if self.llm.errored:
                if self._failed is not None and not self._failed.done():
                    self._failed.set_result("vLLM's EngineCore died")
                return
            await asyncio.sleep(WATCH_PERIOD_S)

    async def wait_failed(self) -> str:
        """The reason once vLLM's engine has died; never returns while it works."""
        assert self._failed is not None, "wait_failed before start()"
        return await asyncio.shield(self._failed)

    async def stop(self) -> None:
        """Abort what runs (streams end with 'cancelled'), shut vLLM's processes down."""
        self._stopping = True
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        if self.llm is not None and self._running:
            with contextlib.suppress(Exception):
                await self.llm.abort(list(self._running))
        await self._close_resources()
        self._events.close()

    async def _close_resources(self) -> None:
        if self._subscriber is not None:
            await self._subscriber.close()
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None
        llm, self.llm = self.llm, None
        if llm is not None:
            # vLLM's own shutdown stops EngineCore before its output handler, which then
            # logs the dead engine as a failure: stop the handler first
            handler = getattr(llm, "output_handler", None)
            if handler is not None:
                handler.cancel()
                await asyncio.gather(handler, return_exceptions=True)
                llm.output_handler = None
            try:
                await asyncio.to_thread(llm.shutdown, self.config.shutdown_timeout_s)
            except Exception:
                logger.warning("vLLM shutdown failed", exc_info=True)
        reaper, self._reaper = self._reaper, None
        if reaper is not None:
            await asyncio.to_thread(reaper.done)

    # ---------------------------------------------------------------- requests
    async def generate(
        self, request: PreprocessedRequest, *, direct: DirectSink | None = None
    ) -> AsyncGenerator[EngineOutput, None]:
        """Stream the request's outputs. Raises InvalidRequest / ContextLengthExceeded on the
        first iteration when vLLM refuses it, EngineError when the engine is not running.
        Closing early aborts it in vLLM (its blocks are freed). `direct` is never given (its
        capabilities take no direct sink). With peer fetch, a request carrying a `kv_fetch`
        hint first pulls the prefix (`VllmPeerFetch.pull`), and a request whose
        disagg_params ask for an export computes one token and returns vLLM's
        kv_transfer_params (`peer_fetch.py`)."""
        if self.llm is None or self._info is None or self._stopping:
            raise EngineError("vLLM engine is not running; call start() first")
        self._check(request)
        if request.mm_items:
            raise InvalidRequest(
                f"request_id={request.request_id} carries {len(request.mm_items)} image(s); "
                "the vLLM worker serves text only (expected no images)"
            )
        if request.request_id in self._running:
            raise InvalidRequest(
                f"request_id={request.request_id} is already running on this engine"
            )
        export = is_export(request)
        if export and self.fetch is None:
            raise InvalidRequest(
                f"request_id={request.request_id} asks for a KV export; this vLLM worker was "
                "started without --kv-fetch"
            )
        if request.kv_fetch is not None:  # a hint this worker cannot take is ignored
            if self.fetch is not None:
                await self.fetch.pull(request, self._pull_stream)
            request = msgspec.structs.replace(request, kv_fetch=None)
        one_token = self.config.disagg_mode == "prefill" or export
        # an export keeps its blocks for a peer's pull as a prefill worker's do for a decode
        extra = handoff_args(request, "prefill" if export else self.config.disagg_mode)
        async for out in self._outputs(request, extra, one_token=one_token):
            if export and self.fetch is not None and out.finish_reason is not None:
                out = exported(out, self.config.kv_lease_s)
                self.fetch.stats.num_exported += 1
                self.fetch.stats.num_export_blocks += (len(request.token_ids) - 1) // (
                    self._info.block_size
                )
            yield out

    def _pull_stream(
        self, request: PreprocessedRequest, extra_args: dict[str, Any]
    ) -> AsyncIterator[EngineOutput]:
        """A peer fetch's pull (step 2): one token, pulling the prefix with `extra_args`."""
        return self._outputs(request, extra_args, one_token=True, handoff=False)

    async def _outputs(
        self,
        request: PreprocessedRequest,
        extra_args: dict[str, Any] | None,
        *,
        one_token: bool,
        handoff: bool = True,
    ) -> AsyncGenerator[EngineOutput, None]:
        """vLLM's outputs of `request` as EngineOutputs; `one_token`: a single greedy pass
        (a prefill or an export: its last output carries vLLM's kv_transfer_params when
        `handoff`, and no token)."""
        assert self.llm is not None
        request_id = request.request_id
        params = sampling_params(request, max_logprobs=self._max_logprobs, constrain=not one_token)
        params.extra_args = extra_args
        if one_token:
            params.max_tokens, params.min_tokens = 1, 0
        num_top = request.sampling.logprobs
        self._running.add(request_id)
        finished = False
        first = True
        try:
            lora = self._lora_request(request.lora_name)
            # priority: vLLM's own convention, as tandem's classes (lower = served earlier);
            # its scheduler honours it under --scheduling-policy priority (tandem's default)
            stream = self.llm.generate(
                tokens_prompt(request), params, request_id, lora_request=lora,
                priority=request.priority,
            )  # fmt: skip
            async for out in self._guarded(stream, request_id):
                result = engine_output(out, first=first, num_top_logprobs=num_top)
                if one_token and handoff and result.finish_reason is not None:
                    result = prefill_result(result, out, request_id)
                first = False
                finished = result.finish_reason is not None
                if result.token_ids or finished or result.num_cached_tokens:
                    yield result
                if finished:
                    return
            if not finished:  # vLLM's stream ended without a finish (engine shut down)
                finished = True
                yield EngineOutput(finish_reason="cancelled")
        finally:
            self._running.discard(request_id)
            if not finished and self.llm is not None:
                with contextlib.suppress(Exception):
                    await self.llm.abort(request_id)

    async def _guarded(self, stream: Any, request_id: str) -> AsyncIterator[Any]:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        try:
            async for out in stream:
                yield out
        except (ValueError, VLLMClientError) as exc:  # vLLM's request validation
            raise InvalidRequest(f"vLLM refused request_id={request_id}: {exc}") from exc
        except (EngineDeadError, EngineGenerateError) as exc:
            if self._stopping:
                return
            raise EngineError(f"vLLM engine failed on request_id={request_id}: {exc}") from exc
        finally:
            await stream.aclose()

    # ---------------------------------------------------------------- LoRA
    async def load_lora(self, name: str, path: str) -> LoraLoaded:
        """vLLM's `add_lora` (it reads and checks the PEFT files itself; what it refuses is
        an InvalidRequest with its message). Idempotent for the same path."""
        if not self.capabilities.lora or self.llm is None:
            return await super().load_lora(name, path)  # the clear refusal
        from vllm.lora.request import LoRARequest

        held = self._loras.get(name)
        if held is not None:
            if held.lora_path != path:
                raise InvalidRequest(
                    f"LoRA adapter '{name}' is loaded from {held.lora_path}; unload it before "
                    f"loading {path} under that name"
                )
            return LoraLoaded(name=name, rank=0, load_s=0.0)
        request = LoRARequest(lora_name=name, lora_int_id=self._next_lora_id, lora_path=path)
        started = time.monotonic()
        try:
            await self.llm.add_lora(request)
        except Exception as exc:  # vLLM's message names what is wrong with the adapter
            raise InvalidRequest(f"vLLM refused LoRA adapter '{name}' ({path}): {exc}") from exc
        self._next_lora_id += 1
        self._loras[name] = request
        return LoraLoaded(name=name, rank=_rank(path), load_s=time.monotonic() - started)

    async def unload_lora(self, name: str) -> None:
        """New requests naming it are refused at once; vLLM keeps its weights until its LRU
        cache needs the slot, so requests running with it finish (as vLLM's own server
        unloads)."""
        if self._loras.pop(name, None) is None:
            raise ModelNotFound(f"LoRA adapter '{name}' is not loaded on this worker")

    def loras(self) -> list[str]:
        return sorted(self._loras)

    def _lora_request(self, name: str | None) -> Any:
        if name is None:
            return None
        request = self._loras.get(name)
        if request is None:
            if not self.capabilities.lora:
                raise InvalidRequest(
                    f"lora_name={name!r}: this vLLM worker serves no LoRA adapters (start it "
                    "with vLLM's --enable-lora)"
                )
            raise ModelNotFound(f"LoRA adapter '{name}' is not loaded on this worker")
        return request

    def _check(self, request: PreprocessedRequest) -> None:
        assert self._info is not None
        num_prompt = len(request.token_ids)
        if num_prompt == 0:
            raise InvalidRequest("token_ids is empty; expected at least one prompt token")
        total = num_prompt + request.stop.max_tokens
        if total > self._info.context_length:
            raise ContextLengthExceeded(
                f"prompt {num_prompt} + max_tokens {request.stop.max_tokens} = {total} exceeds "
                f"max_model_len {self._info.context_length}; lower max_tokens or shorten the prompt"
            )

    async def abort(self, request_id: str) -> None:
        if self.llm is not None and request_id in self._running:
            await self.llm.abort(request_id)

    # ---------------------------------------------------------------- state
    def kv_events(self) -> AsyncIterator[list[KvEvent]]:
        return self._events.stream()

    def kv_snapshot(self) -> list[KvEvent]:
        return [] if self._subscriber is None else self._subscriber.translator.snapshot()

    def load(self) -> EngineLoad:
        """With the bandwidth and setup time its peer fetches measured, once there are some."""
        total = self._info.num_total_blocks if self._info else 0
        snap = self.snapshot
        stats = self.fetch.stats if self.fetch is not None else None
        measured = stats is not None and stats.num_succeeded > 0
        return EngineLoad(
            num_active_blocks=round(snap.kv_cache_usage * total),
            num_total_blocks=total,
            num_waiting=snap.num_waiting,
            num_running=snap.num_running,
            kv_fetch_bytes_per_s=stats.bandwidth_bytes_per_s if stats and measured else None,
            kv_fetch_setup_s=stats.setup_s if stats and measured else None,
        )

    def metric_families(self) -> list[Metric]:
        """``tandem_kv_fetch_*`` with peer fetch (vLLM's own metrics are on its server)."""
        return self.fetch.stats.families() if self.fetch is not None else []

    def take_step_samples(self) -> list[StepSample]:
        """The vLLM iterations since the last call, for the planner (see
        `SchedulerSnapshot.record_step` for which vLLM stats each field comes from)."""
        return self.snapshot.take_steps()

    def instance_metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {"metrics_url": self._metrics.url} if self._metrics else {}
        if self.config.disagg_mode != "none":
            meta["disagg_mode"] = self.config.disagg_mode
            meta["kv_connector"] = "NixlConnector"
        if self.fetch is not None and self.llm is not None:
            host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
            port = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "0"))
            engine_id = str(self.llm.vllm_config.kv_transfer_config.engine_id)
            meta["kv_connector"] = "NixlConnector"
            meta[FETCH_METADATA_KEY] = self.fetch.metadata(address=(host, port), agent_id=engine_id)
        return meta


_PLAIN, _LORA = EngineCapabilities(), EngineCapabilities(lora=True)


def _lora_enabled(config: VllmWorkerConfig) -> bool:
    return bool(config.engine_args.get("enable_lora"))


def _bytes_per_token(vc: Any) -> int:
    """KV bytes of one token over all layers (keys and values) in vLLM's cache."""
    import torch

    mc, pc = vc.model_config, vc.parallel_config
    cache_dtype = vc.cache_config.cache_dtype
    dtype = (
        mc.dtype if cache_dtype in (None, "auto") else getattr(torch, str(cache_dtype), mc.dtype)
    )
    itemsize = torch.empty((), dtype=dtype).element_size()
    return int(2 * mc.get_num_layers(pc) * mc.get_num_kv_heads(pc) * mc.get_head_size() * itemsize)


def _rank(path: str) -> int:
    """The adapter's rank from its adapter_config.json (vLLM checked the files already)."""
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            return int(json.load(f).get("r", 0))
    except (OSError, ValueError, TypeError):
        return 0
