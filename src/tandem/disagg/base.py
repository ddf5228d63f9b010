"""Compatibility re-export: the engine-side handoff contract (`KvHandoff`, `KvCacheSpec`)
lives in `tandem.engines.handoff`, where engines may import it (DESIGN.md §2)."""

from __future__ import annotations

from tandem.engines.handoff import KvCacheSpec, KvHandoff

__all__ = ["KvCacheSpec", "KvHandoff"]
