"""The `Engine` protocol (DESIGN.md §8) and the registry of engines by name.

An engine is token-in/token-out. The `Worker` (tandem.engines.worker) hosts one engine:
registers it in discovery, serves its endpoints, assigns event ids to its KV events and
publishes them with its load metrics, watches cancellation and drains on SIGTERM.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.protocols.engine import EngineOutput, PreprocessedRequest
from tandem.protocols.kv_events import KvEvent


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


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineLoad:
    """A cheap snapshot of the scheduler's state."""

    num_active_blocks: int
    num_total_blocks: int
    num_waiting: int
    num_running: int
    num_cached_blocks: int = 0  # prefix-cache blocks held (what a scale-down victim loses)


class Engine(Protocol):
    async def start(self) -> EngineInfo:
        """Load weights / allocate the KV pool and start the step loop."""
        ...

    def generate(self, request: PreprocessedRequest) -> AsyncIterator[EngineOutput]:
        """Schedule `request` and stream its outputs; the last has finish_reason set.
        Closing the iterator early aborts the request and frees its blocks.
        May be called concurrently for many requests."""
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

    # Optional: `take_step_samples() -> list[StepSample]` (tandem.protocols.scaling), the
    # steps run since the last call; the Worker publishes them for the planner.
    # Optional: `async embed(inputs: list[list[int]]) -> numpy.ndarray`, one unit vector per
    # input ([len(inputs), EngineInfo.embedding_dim] float32), KV retained for none of them;
    # raises InvalidRequest for inputs it cannot take. The Worker serves it on `embed`.

    async def stop(self) -> None:
        """Stop the step loop; in-flight generate() streams end with finish_reason 'cancelled'
        (so do they when the engine dies, with `error` saying why)."""
        ...


# name -> (module with the engine class, class name, module with add_args/config_from_args)
_ENGINES: dict[str, tuple[str, str, str]] = {
    "mocker": ("tandem.engines.mocker.engine", "MockerEngine", "tandem.engines.mocker.args"),
    "native": ("tandem.engines.native.engine", "NativeEngine", "tandem.engines.native.args"),
    # the encode worker of multimodal disaggregation (component `encoder`, endpoint `encode`)
    "encoder": (
        "tandem.multimodal.encode_engine",
        "EncoderEngine",
        "tandem.multimodal.encode_args",
    ),
    "vllm": ("tandem.engines.vllm.engine", "VllmEngine", "tandem.engines.vllm.args"),
}


def engine_names() -> list[str]:
    return sorted(_ENGINES)


def _lookup(name: str) -> tuple[str, str, str]:
    try:
        return _ENGINES[name]
    except KeyError:
        raise ValueError(
            f"unknown engine '{name}'; expected one of: {', '.join(engine_names())}"
        ) from None


def add_engine_args(name: str, parser: argparse.ArgumentParser) -> None:
    """Let engine `name` declare its flags (each engine's `args.add_args(parser)`)."""
    importlib.import_module(_lookup(name)[2]).add_args(parser)


def make_engine(name: str, args: argparse.Namespace) -> Engine:
    """Build engine `name` from parsed flags (`args.config_from_args(ns)` → `Cls(config)`)."""
    module_name, cls_name, args_module = _lookup(name)
    config: Any = importlib.import_module(args_module).config_from_args(args)
    cls: Callable[[Any], Engine] = getattr(importlib.import_module(module_name), cls_name)
    return cls(config)
