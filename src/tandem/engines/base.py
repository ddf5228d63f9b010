"""The `Engine` protocol (DESIGN.md §8), what an engine declares it can do
(`EngineCapabilities`) and the registry of engines by name.

An engine is token-in/token-out. The `Worker` (tandem.engines.worker) hosts one engine:
registers it in discovery, serves its endpoints, assigns event ids to its KV events and
publishes them with its load metrics, watches cancellation and drains on SIGTERM. It reads
`Engine.capabilities` instead of probing the engine for attributes; an engine without an
optional part inherits `EngineDefaults`, which says "none" for each.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tandem.engines.output_stream import DirectSink
from tandem.engines.vision import EmbeddingProvider
from tandem.errors import InvalidRequest, ModelNotFound
from tandem.protocols.engine import EngineOutput, PreprocessedRequest
from tandem.protocols.kv_events import KvEvent
from tandem.protocols.scaling import StepSample

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray
    from prometheus_client.metrics_core import Metric

    from tandem.protocols.lora import LoraLoaded


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineInfo:
    """What `start()` reports; the Worker turns it into the instance's ModelCard."""

    model_name: str
    context_length: int
    block_size: int
    num_total_blocks: int
    max_num_seqs: int
    max_num_batched_tokens: int
    eos_token_ids: list[int] = field(default_factory=list)
    tokenizer: str | None = None  # "gguf:<path>" | "hf:<dir>" | None
    engine: str = "mocker"
    # images (DESIGN.md §10): embedding rows per image (0 = text only) and the placeholder token
    mm_num_tokens_per_image: int = 0
    mm_placeholder_token_id: int | None = None
    # embeddings (an engine with `embed`): vector width and Matryoshka training (see ModelCard)
    embedding_dim: int = 0
    embedding_matryoshka: bool = False
    # LoRA adapters resident at once (`--max-loras`; 0: serves none); the Worker announces it
    max_loras: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineLoad:
    """A cheap snapshot of the scheduler's state."""

    num_active_blocks: int
    num_total_blocks: int
    num_waiting: int
    num_running: int
    num_cached_blocks: int = 0  # prefix-cache blocks held (what a scale-down victim loses)
    kv_fetch_bytes_per_s: float | None = None  # measured peer KV fetch bandwidth, if any
    kv_fetch_setup_s: float | None = None  # and the measured fixed part of a fetch


@dataclass(frozen=True, slots=True, kw_only=True)
class ImageInput:
    """How an engine that takes images wants its embeddings (`Engine.attach_embedding_provider`)."""

    local_encoder: str | None = None  # the in-process vision encoder it can run (EPD), if any
    model: str | None = None  # the model that encoder belongs to
    embeddings_as_arrays: bool = False  # numpy rows, not torch tensors (an engine without torch)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineCapabilities:
    """What an engine does beyond the required part of `Engine`; declared, never probed."""

    # the prompt may arrive as the wire's u32 buffer (empty token_ids): the engine reads it
    # with prompt_array / num_prompt_tokens (tandem.protocols.engine), never one int per token
    reads_token_bytes: bool = False
    # `generate(request, direct=sink)` offers mid-stream outputs to the sink from the step
    # (OutputStream), so the request's task is not woken per token
    accepts_direct_sink: bool = False
    # `embed` computes embeddings (served when EngineInfo.embedding_dim > 0 too)
    embeds: bool = False
    # takes requests with images; None: text only (`attach_embedding_provider` refuses)
    images: ImageInput | None = None
    # serves LoRA adapters (issue 32): `load_lora` / `unload_lora` / `loras` work, and a
    # request's `lora_name` must name a resident adapter (else ModelNotFound naming it)
    lora: bool = False


class Engine(Protocol):
    @property
    def capabilities(self) -> EngineCapabilities: ...

    async def start(self) -> EngineInfo:
        """Load weights / allocate the KV pool and start the step loop."""
        ...

    def generate(
        self, request: PreprocessedRequest, *, direct: DirectSink | None = None
    ) -> AsyncGenerator[EngineOutput, None]:
        """Schedule `request` and stream its outputs; the last has finish_reason set.
        Closing the generator early (`aclose`) aborts the request and frees its blocks.
        May be called concurrently for many requests. `direct` is given only to an engine
        whose capabilities say `accepts_direct_sink`; outputs it takes are not yielded."""
        ...

    async def abort(self, request_id: str) -> None:
        """Remove the request at the next step and free its blocks (idempotent)."""
        ...

    async def wait_failed(self) -> str:
        """Return the reason once the engine has died for good (its step loop failed; it
        serves nothing more); never returns while it works. The Worker then leaves
        discovery and its process exits non-zero. Safe to await from several tasks."""
        ...

    def kv_events(self) -> AsyncIterator[list[KvEvent]]:
        """KV events in the order they happened, one list per scheduler step that produced
        any. Only one consumer (the Worker)."""
        ...

    def kv_snapshot(self) -> list[KvEvent]:
        """BlockStored events describing every block currently cached (for a router that
        meets this worker, or lost track)."""
        ...

    def load(self) -> EngineLoad: ...

    async def stop(self) -> None:
        """Stop the step loop; in-flight generate() streams end with finish_reason 'cancelled'
        (so do they when the engine dies, with `error` saying why)."""
        ...

    # ---- optional parts: `EngineDefaults` has the "none" answer of each
    def take_step_samples(self) -> list[StepSample]:
        """The steps run since the last call; the Worker publishes them for the planner."""
        ...

    def instance_metadata(self) -> dict[str, Any]:
        """Extra discovery metadata of the instance (a disaggregated role, its agent...)."""
        ...

    async def embed(self, inputs: list[list[int]]) -> NDArray[np.float32]:
        """With `capabilities.embeds`: one unit vector per input ([len(inputs),
        EngineInfo.embedding_dim] float32), KV retained for none of them; raises
        InvalidRequest for inputs it cannot take. The Worker serves it on `embed`."""
        ...

    def metric_families(self) -> list[Metric]:
        """Prometheus families the engine adds to its worker's at scrape time (the KV block
        manager's tiers, a transfer agent's counters)."""
        ...

    def attach_embedding_provider(self, provider: EmbeddingProvider) -> None:
        """With `capabilities.images`: where the engine gets image embeddings from (set by
        the worker's wiring before `start`, tandem.multimodal.provider_args)."""
        ...

    async def load_lora(self, name: str, path: str) -> LoraLoaded:
        """With `capabilities.lora`: make the PEFT adapter in directory `path` resident as
        `name` (evicting the least recently used idle one when every slot is taken; all
        busy -> Overloaded). Idempotent for the same name and path; the same name with
        another path -> InvalidRequest. A bad adapter -> InvalidRequest naming the problem
        (tandem.engines.lora.read_peft_adapter)."""
        ...

    async def unload_lora(self, name: str) -> None:
        """With `capabilities.lora`: drop adapter `name` (unknown -> ModelNotFound). Requests
        already running with it finish first; new ones naming it are refused."""
        ...

    def loras(self) -> list[str]:
        """The adapters resident now (empty for an engine without LoRA)."""
        ...


class EngineDefaults:
    """The optional parts of `Engine` for an engine that has none of them: no capabilities,
    no steps reported, no extra metadata or metrics, no embeddings, no images."""

    @property
    def capabilities(self) -> EngineCapabilities:
        return EngineCapabilities()

    def take_step_samples(self) -> list[StepSample]:
        return []

    def instance_metadata(self) -> dict[str, Any]:
        return {}

    async def embed(self, inputs: list[list[int]]) -> NDArray[np.float32]:
        raise InvalidRequest("this worker's engine does not compute embeddings")

    def metric_families(self) -> list[Metric]:
        return []

    def attach_embedding_provider(self, provider: EmbeddingProvider) -> None:
        raise ValueError(f"{type(self).__name__} takes no images")

    async def load_lora(self, name: str, path: str) -> LoraLoaded:
        raise InvalidRequest(f"this worker's engine ({_engine_name(self)}) serves no LoRA adapters")

    async def unload_lora(self, name: str) -> None:
        raise ModelNotFound(
            f"LoRA adapter '{name}' is not loaded: this worker's engine ({_engine_name(self)}) "
            "serves no LoRA adapters"
        )

    def loras(self) -> list[str]:
        return []


def _engine_name(engine: object) -> str:
    return type(engine).__name__.removesuffix("Engine").lower() or type(engine).__name__


@dataclass(frozen=True, slots=True)
class _Registered:
    engine: str  # "module:Class" of the engine, built as Class(config)
    config: str  # "module:Class" of its frozen config
    args: str  # module with add_args(parser) and config_from_args(ns) -> config


_ENGINES: dict[str, _Registered] = {
    "mocker": _Registered(
        "tandem.engines.mocker.engine:MockerEngine",
        "tandem.engines.mocker.config:MockerConfig",
        "tandem.engines.mocker.args",
    ),
    "native": _Registered(
        "tandem.engines.native.engine:NativeEngine",
        "tandem.engines.native.config:NativeConfig",
        "tandem.engines.native.args",
    ),
    # the encode worker of multimodal disaggregation (component `encoder`, endpoint `encode`)
    "encoder": _Registered(
        "tandem.multimodal.encode_engine:EncoderEngine",
        "tandem.multimodal.encode_engine:EncodeWorkerConfig",
        "tandem.multimodal.encode_args",
    ),
    "vllm": _Registered(
        "tandem.engines.vllm.engine:VllmEngine",
        "tandem.engines.vllm.config:VllmWorkerConfig",
        "tandem.engines.vllm.args",
    ),
}


def engine_names() -> list[str]:
    return sorted(_ENGINES)


def _lookup(name: str) -> _Registered:
    try:
        return _ENGINES[name]
    except KeyError:
        raise ValueError(
            f"unknown engine '{name}'; expected one of: {', '.join(engine_names())}"
        ) from None


def _load(target: str) -> Any:
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def add_engine_args(name: str, parser: argparse.ArgumentParser) -> None:
    """Let engine `name` declare its flags (each engine's `args.add_args(parser)`)."""
    importlib.import_module(_lookup(name).args).add_args(parser)


def engine_config_from_args(name: str, args: argparse.Namespace) -> object:
    """Engine `name`'s frozen config from its parsed flags (its `args.config_from_args`);
    raises ValueError for a bad flag value."""
    config: object = importlib.import_module(_lookup(name).args).config_from_args(args)
    return config


def make_engine(name: str, config: object) -> Engine:
    """Build engine `name` from its frozen config (`engine_config_from_args`, or one made in
    code); TypeError for another engine's config."""
    registered = _lookup(name)
    config_cls: type = _load(registered.config)
    if not isinstance(config, config_cls):
        raise TypeError(
            f"engine '{name}' is built from a {config_cls.__name__}, not a {type(config).__name__}"
        )
    cls: Callable[[object], Engine] = _load(registered.engine)
    return cls(config)
