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
    from a full set of slots)."""

    kind: LoraEventKind
    name: str
    load_s: float = 0.0


class LoraCard(msgspec.Struct, kw_only=True):
    """A loadable adapter: its name, the base model it belongs to and its local directory."""

    name: str
    base_model: str
    path: str
    created_s: float = 0.0
