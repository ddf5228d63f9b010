"""Which pool serves a request: per-request targets (or the grids' middles), priority rules,
then the aggregated grid or the prefill-first pair. Pure functions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.errors import InvalidRequest
from tandem.planner.global_router.config import DISAGGREGATED, GlobalRouterConfig

EXTENSION = "tandem"  # request field: {"ttft_target_ms": float, "itl_target_ms": float}


@dataclass(frozen=True, slots=True)
class Targets:
    ttft_ms: float | None = None
    itl_ms: float | None = None
    priority: int | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    pool: str  # the aggregated pool, or "prefill+decode"
    url: str
    reason: str
    retry_from: str  # the pools listed before this one are the retry path (a pair: its prefill)


def targets_from(body: dict[str, Any]) -> Targets:
    """Read and remove the request's extension field and `priority` (vLLM's field name)."""
    ext = body.pop(EXTENSION, None)
    priority = body.pop("priority", None)
    if ext is not None and not isinstance(ext, dict):
        raise InvalidRequest(f"'{EXTENSION}' must be an object with ttft_target_ms/itl_target_ms")
    ext = ext or {}
    unknown = set(ext) - {"ttft_target_ms", "itl_target_ms"}
    if unknown:
        raise InvalidRequest(f"unknown '{EXTENSION}' field(s) {sorted(unknown)}; expected "
                             "ttft_target_ms, itl_target_ms")  # fmt: skip
    out = {}
    for key in ("ttft_target_ms", "itl_target_ms"):
        value = ext.get(key)
        if value is not None and (not isinstance(value, int | float) or value <= 0):
            raise InvalidRequest(f"{EXTENSION}.{key}={value!r}; expected a number > 0")
        out[key] = value
    if priority is not None and not isinstance(priority, int):
        raise InvalidRequest(f"priority={priority!r}; expected an integer")
    return Targets(out["ttft_target_ms"], out["itl_target_ms"], priority)


def decide(cfg: GlobalRouterConfig, targets: Targets, isl: int, max_tokens: int) -> Decision:
    if targets.priority is not None:
        for rule in cfg.raw.priority:
            if rule.min <= targets.priority <= rule.max:
                url = cfg.pools[rule.pool].url
                reason = f"priority {targets.priority} → {rule.pool}"
                return Decision(rule.pool, url, reason, rule.pool)
    if cfg.aggregated is not None:
        g = cfg.aggregated
        ttft = targets.ttft_ms if targets.ttft_ms is not None else g.middle(g.rows)
        itl = targets.itl_ms if targets.itl_ms is not None else g.middle(g.cols)
        pool = g.lookup(ttft, itl)
        if pool != DISAGGREGATED:
            reason = f"TTFT {ttft:g} ms, ITL {itl:g} ms → {pool}"
            return Decision(pool, cfg.pools[pool].url, reason, pool)
        targets = Targets(ttft, itl, targets.priority)  # the cell hands over to the pair grids
    assert cfg.prefill is not None and cfg.decode is not None
    p, d = cfg.prefill, cfg.decode
    ttft = targets.ttft_ms if targets.ttft_ms is not None else p.middle(p.cols)
    itl = targets.itl_ms if targets.itl_ms is not None else d.middle(d.cols)
    prefill = p.lookup(isl, ttft)
    decode = d.lookup(isl + max_tokens, itl)
    return Decision(f"{prefill}+{decode}", cfg.pairs[(prefill, decode)],
                    f"ISL {isl}, TTFT {ttft:g} ms → {prefill}; context {isl + max_tokens}, "
                    f"ITL {itl:g} ms → {decode}", prefill)  # fmt: skip
