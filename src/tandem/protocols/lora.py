"""LoRA adapter wire types (issue 32): what a worker answers when it loads one, the residency
events it publishes on the event plane, and the catalog entry kept in discovery.

msgspec msgpack; unknown fields are ignored on decode.
"""

from __future__ import annotations

from typing import Literal

import msgspec

LoraEventKind = Literal["loaded", "unloaded", "evicted"]


class LoraLoaded(msgspec.Struct, kw_only=True):
    """A worker's answer to a load: the adapter's rank and how long the load took (0.0 when
    it was already resident)."""

    name: str
    rank: int
    load_s: float = 0.0


class LoraEvent(msgspec.Struct, kw_only=True, omit_defaults=True):
    """An adapter became resident on a worker, or left it (unloaded on request, or evicted
    from a full set of slots). Published by the worker on `lora_events_subject`; `resident`
    is its whole resident set after the change, so a reader that missed an event is right
    again at the next one."""

    kind: LoraEventKind
    name: str
    load_s: float = 0.0
    worker_id: str = ""
    resident: list[str] = msgspec.field(default_factory=list)
    max_loras: int = 0  # the worker's slot limit (0: unknown)


class LoraCard(msgspec.Struct, kw_only=True):
    """A loadable adapter: its name, the base model it belongs to and its local directory."""

    name: str
    base_model: str
    path: str
    created_s: float = 0.0


class LoraLoadRequest(msgspec.Struct, kw_only=True):
    """A worker's `load_lora` request: make the adapter in directory `path` resident as `name`
    (answer: one LoraLoaded)."""

    name: str
    path: str


class LoraUnloadRequest(msgspec.Struct, kw_only=True):
    """A worker's `unload_lora` request (answer: one empty payload; unknown -> ModelNotFound)."""

    name: str


class LoraState(msgspec.Struct, kw_only=True):
    """A worker's `lora_state` answer: the adapters resident on it and its slot limit."""

    worker_id: str
    resident: list[str] = msgspec.field(default_factory=list)
    max_loras: int = 0


# request-plane endpoints of a worker whose engine serves LoRA (`<ns>.<component>.<endpoint>`)
LOAD_ENDPOINT, UNLOAD_ENDPOINT, STATE_ENDPOINT = "load_lora", "unload_lora", "lora_state"


def lora_events_subject(namespace: str, component: str) -> str:
    """Where a worker publishes its LoraEvents."""
    return f"{namespace}.{component}.lora_events"


_encoder = msgspec.msgpack.Encoder()


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


class LoadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/load_lora_adapter`'s body (vLLM's shape; `base_model_name` as in vLLM's
    `--lora-modules` JSON, needed only when several models are served)."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False
    is_3d_lora_weight: bool = False
    base_model_name: str | None = None


class UnloadLoraAdapterRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/unload_lora_adapter`'s body (vLLM's shape)."""

    lora_name: str
