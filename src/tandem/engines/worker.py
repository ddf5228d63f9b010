"""`Worker`: hosts one `Engine` on the runtime (DESIGN.md §1, §8).

It serves `{ns}.{component}.generate` (PreprocessedRequest in, EngineOutput stream out) and
`{ns}.{component}.kv_state` (KvStateRequest → replayed or full KvEventBatches), when the engine
can embed `{ns}.{component}.embed` (EmbedRequest → one EmbedResponse), registers one
`Instance` (with a ModelCard from the engine's EngineInfo) in discovery, publishes the
engine's KV events on `{ns}.{component}.kv_events` and its load on
`{ns}.{component}.load_metrics`, and drains on `stop`.

If the engine dies (`Engine.wait_failed` returns), the worker leaves discovery at once and
sets `failed`; `tandem worker` then exits non-zero so whoever supervises it restarts it.

An embedding-only worker (`embedding_only`) still registers its instance at the generate
path (the frontend follows the workers of a component there) but its card lists only the
"embed" task, and its `generate` endpoint refuses every request with PeerGone, so a router
that picked it anyway routes the request again to a worker that generates.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tandem.config_check import check_range
from tandem.engines.base import Engine, EngineInfo, EngineLoad
from tandem.engines.output_stream import DirectSink
from tandem.engines.worker_events import KvEventPublisher
from tandem.engines.worker_lora import WorkerLoras, refuse_lora
from tandem.engines.worker_metrics import WorkerMetrics
from tandem.engines.worker_trace import WorkerSpans
from tandem.errors import DeadlineExceeded, InvalidRequest, PeerGone
from tandem.protocols import kv_events as kv
from tandem.protocols import scaling
from tandem.protocols.discovery import (
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    Instance,
    ModelCard,
    ModelFile,
)
from tandem.protocols.embedding import (
    EMBED_ENDPOINT,
    EmbedResponse,
    decode_embed_request,
)
from tandem.protocols.engine import EngineOutput, decode_request, encode, encode_output
from tandem.runtime import log_format, tracing
from tandem.runtime.base import RequestContext
from tandem.runtime.blobs.base import BlobError
from tandem.runtime.log_format import request_scope
from tandem.runtime.runtime import Runtime
from tandem.tokens.model_files import tokenizer_files
from tandem.tokens.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

_state_request = msgspec.msgpack.Decoder(kv.KvStateRequest)


def new_instance_id() -> str:
    return uuid.uuid4().hex[:16]


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerConfig:
    component: str = "backend"
    endpoint: str = "generate"
    instance_id: str = field(default_factory=new_instance_id)
    drain_grace_s: float = 10.0
    event_buffer_size: int = 4096  # KV event batches kept for replay
    metrics_period_s: float = 1.0  # load metrics at least this often
    metrics_min_interval_s: float = 0.05  # and at most once per this while busy
    stats_period_s: float = 0.5  # WorkerStats (lifecycle + engine steps) for the planner
    embedding_only: bool = False  # serve only `embed` (the engine must be able to embed)
    # extra instance metadata, e.g. {"needs_encoder": True} for a worker that only encodes
    # images remotely (the frontend's /health then wants an encode worker)
    metadata: dict[str, Any] = field(default_factory=dict)
    # the frontend's parsers of this model's output, carried by its ModelCard (None: the
    # frontend decides from the chat template)
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        for name in ("component", "endpoint", "instance_id"):
            value = getattr(self, name)
            if not value or "." in value:
                raise ValueError(f"{name}={value!r} must be non-empty without '.'")
        for name, known in (
            ("tool_call_parser", TOOL_CALL_PARSERS),
            ("reasoning_parser", REASONING_PARSERS),
        ):
            value = getattr(self, name)
            if value is not None and value not in known:
                raise ValueError(f"{name}={value!r}; expected one of: {', '.join(known)}")
        check_range("drain_grace_s", self.drain_grace_s, low=0, high=3600)
        check_range("event_buffer_size", self.event_buffer_size, low=1, high=1 << 24)
        check_range("metrics_period_s", self.metrics_period_s, low=0.001, high=3600)
        check_range(
            "metrics_min_interval_s", self.metrics_min_interval_s, low=0, high=self.metrics_period_s
        )
        check_range("stats_period_s", self.stats_period_s, low=0.01, high=3600)


def model_card(
    info: EngineInfo, tasks: list[str] | None = None, config: WorkerConfig | None = None
) -> ModelCard:
    return ModelCard(
        name=info.model_name,
        context_length=info.context_length,
        block_size=info.block_size,
        num_total_blocks=info.num_total_blocks,
        tokenizer=info.tokenizer,
        eos_token_ids=list(info.eos_token_ids),
        max_num_seqs=info.max_num_seqs,
        max_num_batched_tokens=info.max_num_batched_tokens,
        engine=info.engine,
        mm_num_tokens_per_image=info.mm_num_tokens_per_image,
        mm_placeholder_token_id=info.mm_placeholder_token_id,
        tasks=list(tasks or ["generate"]),
        embedding_dim=info.embedding_dim,
        embedding_matryoshka=info.embedding_matryoshka,
        tool_call_parser=config.tool_call_parser if config is not None else None,
        reasoning_parser=config.reasoning_parser if config is not None else None,
    )


class _PromptTally:
    """Counts one request's prompt (and its cached part) in the worker metrics, once: on the
    first output that carries the cached count, whichever path sends it."""

    __slots__ = ("_metrics", "_num_tokens", "counted")

    def __init__(self, metrics: WorkerMetrics, num_tokens: int) -> None:
        self._metrics, self._num_tokens = metrics, num_tokens
        self.counted = False

    def observe(self, num_cached: int) -> None:
        if not self.counted:
            self.counted = True
            self._metrics.observe_prompt(self._num_tokens, num_cached)


class Worker:
    """Not reusable: `start` once, `stop` once. All methods run on the runtime's loop."""

    def __init__(self, engine: Engine, runtime: Runtime, config: WorkerConfig | None = None):
        self.engine = engine
        self.capabilities = engine.capabilities
        self.runtime = runtime
        self.config = config or WorkerConfig()
        self.instance_id = self.config.instance_id
        self.instance: Instance | None = None
        self.info: EngineInfo | None = None
        ns, comp = runtime.namespace, self.config.component
        self.kv_events = KvEventPublisher(
            runtime.events,
            f"{ns}.{comp}.kv_events",
            self.instance_id,
            buffer_size=self.config.event_buffer_size,
        )
        self.load_subject = f"{ns}.{comp}.load_metrics"
        self.stats_subject = scaling.worker_stats_subject(ns, comp)
        self.state: scaling.WorkerState = "starting"
        self.num_inflight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._load_changed = asyncio.Event()
        self._accepting = False
        self._stopped = False
        self._tasks: list[asyncio.Task[None]] = []
        # set once the engine died and the instance left discovery; `failure` says why
        self.failed = asyncio.Event()
        self.failure: str | None = None
        self.metrics = WorkerMetrics(self)
        # set by the caller before `start` when it serves /metrics, /health and /live over HTTP
        # (`--system-port`); the discovery record then carries it
        self.system_port: int | None = None
        # its LoRA adapters: endpoints, on-demand loads, events (an engine with LoRA only)
        self.loras: WorkerLoras | None = None

    async def _with_model_files(self, card: ModelCard) -> ModelCard:
        """`card` naming the tokenizer's files put in the cluster's blob store, so a frontend
        on a host without the model's files loads them from there (issue 30). A tokenizer this
        host cannot load registers the card as it is (a frontend with the path still works)."""
        if card.tokenizer is None:
            return card
        try:
            tok = await asyncio.to_thread(load_tokenizer, card.tokenizer)
            files = await asyncio.to_thread(tokenizer_files, tok)
            blobs = self.runtime.blobs
            named = {name: ModelFile(sha256=await blobs.put(data), size=len(data))
                     for name, data in files.items()}  # fmt: skip
        except (OSError, ValueError, BlobError) as exc:
            logger.warning(
                "model %s: its tokenizer files do not travel with the registration (%s); "
                "frontends need %s on their own host",
                card.name,
                exc,
                card.tokenizer,
            )
            return card
        logger.info(
            "model %s: tokenizer files in %s (%d bytes)",
            card.name,
            self.runtime.blobs.where,
            sum(f.size for f in named.values()),
        )
        return msgspec.structs.replace(card, files=named)

    async def start(self) -> Instance:
        """Start the engine, the publishers and the endpoints, then register the instance.
        Raises ValueError when `embedding_only` is set and the engine cannot embed."""
        await self._send_stats()  # "starting": the planner sees a slow engine load begin
        self.info = await self.engine.start()
        tasks = self._tasks_of(self.info)
        self._load_changed.set()  # announce capacity right away
        events = self.engine.kv_events()
        self._tasks = [
            asyncio.create_task(self._publish_kv_events(events), name="worker-kv-events"),
            asyncio.create_task(self._publish_load(), name="worker-load-metrics"),
            asyncio.create_task(self._watch_engine(), name="worker-engine-watch"),
            asyncio.create_task(self._publish_stats(), name="worker-stats"),
        ]
        comp = self.config.component
        self.runtime.server.register(self.runtime.endpoint_path(comp, "kv_state"), self._kv_state)
        self.runtime.server.register(self.runtime.endpoint_path(comp, "metrics"), self._metrics)
        system = {"system_port": self.system_port} if self.system_port else {}
        metadata: dict[str, Any] = {
            "kv_state_endpoint": "kv_state",
            "metrics_endpoint": "metrics",
            **system,
        }
        if self.capabilities.lora:
            self.loras = WorkerLoras(
                self.engine,
                self.runtime,
                worker_id=self.instance_id,
                component=comp,
                max_loras=self.info.max_loras,
                registry=self.metrics.registry,  # tandem_worker_lora_* on its /metrics
            )
            self.loras.register()
            metadata.update(self.loras.metadata())
        if "embed" in tasks:
            path = self.runtime.endpoint_path(comp, EMBED_ENDPOINT)
            self.runtime.server.register(path, self._embed)
            metadata["embed_endpoint"] = EMBED_ENDPOINT
        self._accepting = True
        self.instance = await self.runtime.serve_endpoint(
            comp,
            self.config.endpoint,
            self._generate if "generate" in tasks else self._refuse_generate,
            model=await self._with_model_files(model_card(self.info, tasks, self.config)),
            # a disaggregated engine adds its role and transfer agent (tandem.disagg)
            metadata={**metadata, **self._engine_metadata(), **self.config.metadata},
            instance_id=self.instance_id,
        )
        self.state = "ready"
        await self._send_stats()
        return self.instance

    @property
    def role(self) -> str:
        """aggregated, prefill, decode or encode (discovery metadata and the component)."""
        if self.config.component == "encoder":
            return "encode"
        mode = self._engine_metadata().get("disagg_mode") if self.info is not None else None
        return str(mode) if mode else "aggregated"

    def _tasks_of(self, info: EngineInfo) -> list[str]:
        can_embed = self.capabilities.embeds and info.embedding_dim > 0
        if self.config.embedding_only:
            if not can_embed:
                raise ValueError(
                    f"embedding_only=True but engine '{info.engine}' cannot embed; expected "
                    "an engine with embeddings (native, mocker)"
                )
            return ["embed"]
        return ["generate", "embed"] if can_embed else ["generate"]

    def _engine_metadata(self) -> dict[str, Any]:
        return dict(self.engine.instance_metadata())

    async def stop(self, grace_s: float | None = None) -> None:
        """Unregister, refuse new requests (PeerGone, so clients go elsewhere), let in-flight
        ones finish within `grace_s`, then stop the engine (the rest end with PeerGone)."""
        if self._stopped or self.info is None:
            return
        self._stopped = True
        grace = self.config.drain_grace_s if grace_s is None else grace_s
        self.state = "draining"
        await self._send_stats()
        await self._leave()
        try:
            async with asyncio.timeout(grace):
                await self._idle.wait()
        except TimeoutError:
            logger.warning(
                "instance_id=%s: %d requests still running after %.1fs grace; stopping engine",
                self.instance_id,
                self.num_inflight,
                grace,
            )
        await self.engine.stop()
        # the engine's kv_events() ends once drained: let the last batches go out
        await asyncio.wait(self._tasks[:1], timeout=1.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.state = "stopped"
        await self._send_stats()
        logger.info("worker instance_id=%s stopped", self.instance_id)

    async def _leave(self) -> None:
        """Refuse new requests and unregister (idempotent)."""
        if not self._accepting:
            return
        self._accepting = False
        await self.runtime.discovery.unregister(self.instance_id)
        if self.instance_id in self.runtime.instance_ids:
            self.runtime.instance_ids.remove(self.instance_id)

    async def _watch_engine(self) -> None:
        """A dead engine must not stay registered: leave discovery, then set `failed`."""
        reason = await self.engine.wait_failed()
        logger.error("instance_id=%s: %s; leaving discovery", self.instance_id, reason)
        self.failure = reason
        try:
            await self._leave()
        except Exception:  # the process exits anyway, which ends its lease
            logger.exception("instance_id=%s: unregister after engine failure", self.instance_id)
        finally:
            self.failed.set()

    # ------------------------------------------------------------------ endpoints
    async def _generate(self, payload: bytes, ctx: RequestContext) -> AsyncGenerator[bytes, None]:
        if not self._accepting:
            raise PeerGone(f"worker {self.instance_id} is draining; retry on another instance")
        try:
            # an engine that reads the prompt with prompt_array gets the wire's u32 buffer
            materialize = not self.capabilities.reads_token_bytes
            request = decode_request(payload, materialize=materialize)
        except msgspec.MsgspecError as exc:
            raise InvalidRequest(f"bad PreprocessedRequest: {exc}") from exc
        deadline = request.deadline_s  # the request plane enforces its own deadline too
        if deadline is not None and time.time() >= deadline:
            raise DeadlineExceeded(f"request_id={request.request_id} arrived after its deadline")
        if request.lora_name:
            if self.loras is None:
                raise refuse_lora(self.info.engine if self.info else "?", request.lora_name)
            await self.loras.ensure(request.lora_name)  # a cataloged adapter loads on demand
        self._request_started()
        log_scope = request_scope(request.request_id) if log_format.request_ids_logged else None
        if log_scope is not None:  # this request's own task (the request plane's) until it ends
            log_scope.__enter__()
        spans = None
        if tracing.enabled:
            spans = WorkerSpans(request, ctx.traceparent, self.instance_id, self.role)
        logger.debug("request_id=%s started (%d prompt tokens)", request.request_id,
                     request.num_prompt_tokens)  # fmt: skip
        prompt = _PromptTally(self.metrics, request.num_prompt_tokens)
        direct = self._direct_sink(ctx, deadline, spans, prompt)
        stream = self.engine.generate(request, direct=direct)
        error: BaseException | None = None
        status = "error"
        try:
            async for out in stream:
                if spans is not None:
                    spans.output(out)
                if out.num_cached_tokens is not None:
                    prompt.observe(out.num_cached_tokens)
                if out.finish_reason == "cancelled" and not ctx.cancelled.is_set():
                    why = f": {out.error}" if out.error else ""
                    raise PeerGone(
                        f"worker {self.instance_id} stopped during "
                        f"request_id={request.request_id}{why}"
                    )
                yield encode_output(out)
                if ctx.cancelled.is_set():
                    status = "cancelled"
                    break
                if deadline is not None and out.finish_reason is None and time.time() > deadline:
                    raise DeadlineExceeded(
                        f"request_id={request.request_id} passed its deadline on "
                        f"worker {self.instance_id}"
                    )
            else:
                status = "success"
        except BaseException as exc:
            error = exc
            if isinstance(exc, asyncio.CancelledError | GeneratorExit):
                status = "cancelled"
            raise
        finally:
            self.metrics.requests.labels(status).inc()
            await stream.aclose()  # aborts the request if it is still running
            self._request_finished()
            if spans is not None:
                spans.finish(error)
            logger.debug("request_id=%s ended%s", request.request_id,
                         f" ({type(error).__name__})" if error is not None else "")  # fmt: skip
            if log_scope is not None:
                log_scope.__exit__(None, None, None)

    def _direct_sink(
        self,
        ctx: RequestContext,
        deadline: float | None,
        spans: WorkerSpans | None,
        prompt: _PromptTally,
    ) -> DirectSink | None:
        """For an engine that takes one (`capabilities.accepts_direct_sink`): a sink that puts
        an output straight on the request plane from the engine's step, so the request's task
        is not woken per token. It takes only what `_generate` would just encode and send (counting
        the prompt on the output that carries its cached count, as `_generate` does): never
        the last output (the stream's end is `_generate`'s), an error, anything past the
        deadline or anything traced; the request plane refuses it when the stream is gone
        (cancelled) or must wait (no credit, full write buffer), and then `_generate` takes
        it. None where it does not apply."""
        if not self.capabilities.accepts_direct_sink or spans is not None:
            return None
        try_send = ctx.try_send

        def sink(out: EngineOutput) -> bool:
            if (
                out.finish_reason is not None
                or out.error is not None
                or (deadline is not None and time.time() > deadline)
                or not try_send(encode_output(out))
            ):
                return False
            if out.num_cached_tokens is not None:
                prompt.observe(out.num_cached_tokens)
            return True

        return sink

    async def _refuse_generate(
        self, payload: bytes, ctx: RequestContext
    ) -> AsyncGenerator[bytes, None]:
        raise PeerGone(
            f"worker {self.instance_id} serves embeddings only (embedding_only); "
            "route generation to another instance"
        )
        yield b""  # pragma: no cover - makes this an async generator like the others

    async def _embed(self, payload: bytes, ctx: RequestContext) -> AsyncGenerator[bytes, None]:
        """One EmbedRequest in, one EmbedResponse out (the engine batches the inputs)."""
        if not self._accepting:
            raise PeerGone(f"worker {self.instance_id} is draining; retry on another instance")
        try:
            request = decode_embed_request(payload)
        except msgspec.MsgspecError as exc:
            raise InvalidRequest(f"bad EmbedRequest: {exc}") from exc
        if request.deadline_s is not None and time.time() >= request.deadline_s:
            raise DeadlineExceeded(f"request_id={request.request_id} arrived after its deadline")
        assert self.info is not None
        self._request_started()
        try:
            vectors = await self.engine.embed(request.inputs)
        finally:
            self._request_finished()
        yield encode(
            EmbedResponse(
                dim=int(vectors.shape[1]),
                data=vectors.astype("<f4", copy=False).tobytes(),
                num_tokens=sum(len(ids) for ids in request.inputs),
            )
        )

    async def _kv_state(self, payload: bytes, ctx: RequestContext) -> AsyncGenerator[bytes, None]:
        try:
            request = _state_request.decode(payload)
        except msgspec.MsgspecError as exc:
            raise InvalidRequest(f"bad KvStateRequest: {exc}") from exc
        for payload in self.kv_events.state_reply(request.after_event_id, self.engine.kv_snapshot):
            yield payload

    async def _metrics(self, payload: bytes, ctx: RequestContext) -> AsyncGenerator[bytes, None]:
        """This worker's Prometheus text (what /metrics on its system port answers)."""
        yield self.metrics.render()

    def health(self) -> tuple[bool, dict[str, Any]]:
        """(ready to serve, body) for the system port's /health: ready once registered,
        until draining or an engine failure."""
        ready = self.state == "ready" and self._accepting and self.failure is None
        body: dict[str, Any] = {"status": "ready" if ready else self.state}
        body.update(instance_id=self.instance_id, component=self.config.component)
        if self.failure is not None:
            body.update(status="failed", error=self.failure)
        return ready, body

    def _request_started(self) -> None:
        self.num_inflight += 1
        self._idle.clear()
        self._load_changed.set()

    def _request_finished(self) -> None:
        self.num_inflight -= 1
        if not self.num_inflight:
            self._idle.set()
        self._load_changed.set()

    # ------------------------------------------------------------------ publishers
    async def _publish_kv_events(self, events: AsyncIterator[list[kv.KvEvent]]) -> None:
        try:
            async for batch in events:
                await self.kv_events.publish(batch)
        except Exception:
            logger.exception("instance_id=%s: kv event publishing failed", self.instance_id)

    async def _publish_load(self) -> None:
        """On a change (throttled to one per metrics_min_interval_s while busy) and at least
        every metrics_period_s."""
        cfg = self.config
        last: EngineLoad | None = None
        last_sent = 0.0
        while True:
            if not self.num_inflight:
                try:
                    async with asyncio.timeout(cfg.metrics_period_s):
                        await self._load_changed.wait()
                except TimeoutError:
                    pass
            self._load_changed.clear()
            load = self.engine.load()
            now = time.monotonic()
            if load != last or now - last_sent >= cfg.metrics_period_s:
                last, last_sent = load, now
                await self._send_load(load)
            await asyncio.sleep(cfg.metrics_min_interval_s)

    async def _publish_stats(self) -> None:
        while True:
            await asyncio.sleep(self.config.stats_period_s)
            await self._send_stats()

    async def _send_stats(self) -> None:
        """One WorkerStats: lifecycle state, in-flight count, KV use and the engine's steps
        since the last one (an engine without them reports none)."""
        load = self.engine.load() if self.info is not None else None
        msg = scaling.WorkerStats(
            worker_id=self.instance_id,
            component=self.config.component,
            state=self.state,
            timestamp_s=time.time(),
            num_inflight=self.num_inflight,
            num_active_blocks=load.num_active_blocks if load else 0,
            num_total_blocks=load.num_total_blocks if load else 0,
            num_cached_blocks=load.num_cached_blocks if load else 0,
            steps=self.engine.take_step_samples() if self.info is not None else [],
        )
        self.metrics.observe_steps(msg.steps)
        try:
            await self.runtime.events.publish(self.stats_subject, scaling.encode(msg))
        except Exception:
            logger.warning("instance_id=%s: worker stats publish failed", self.instance_id)

    async def _send_load(self, load: EngineLoad) -> None:
        msg = kv.LoadMetrics(
            worker_id=self.instance_id,
            num_active_blocks=load.num_active_blocks,
            num_total_blocks=load.num_total_blocks,
            num_waiting=load.num_waiting,
            num_running=load.num_running,
            timestamp_s=time.time(),
            kv_event_id=self.kv_events.event_id,
            kv_fetch_bytes_per_s=load.kv_fetch_bytes_per_s,
            kv_fetch_setup_s=load.kv_fetch_setup_s,
        )
        try:
            await self.runtime.events.publish(self.load_subject, kv.encode(msg))
        except Exception:
            logger.warning("instance_id=%s: load metrics publish failed", self.instance_id)
