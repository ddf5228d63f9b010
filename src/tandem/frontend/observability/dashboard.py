"""`/dashboard`: a live page of the frontend's view of its workers, and its JSON source.

`GET /dashboard` is a static page shipped in the package (`static/dashboard.html`, vanilla
JS, nothing fetched from elsewhere) that polls `GET /dashboard/state` once a second (one
request in flight at a time). The state is built from the frontend's live objects — the
model registry and each model's router (`worker_loads`, its queue, its `DecisionLog`), the
prefill pool, the health monitor's liveness, admission's in-flight count, discovery for
the encode workers, the tenants' counters (`TenantStats`) and the batch lane's progress —
never by parsing `/metrics`. Access: `tandem.frontend.auth`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from importlib import resources
from typing import TYPE_CHECKING, Any

import msgspec

from tandem.frontend.http.message import HttpRequest, HttpResponse
from tandem.frontend.models import ModelRegistry
from tandem.frontend.observability.health import HealthMonitor
from tandem.frontend.tenancy import Tenancy
from tandem.protocols.discovery import Instance
from tandem.protocols.tenancy import class_name
from tandem.router.base import Router
from tandem.router.metrics import RouterMetrics
from tandem.runtime.base import Discovery

if TYPE_CHECKING:
    from tandem.disagg.pool import PrefillPool

logger = logging.getLogger(__name__)
_json = msgspec.json.Encoder()
NUM_DECISIONS = 20  # routing decisions per model in one state
ENCODER_LIST_TIMEOUT_S = 2.0


class Dashboard:
    """Serves the page and its state; reads live objects, mutates nothing. One loop."""

    def __init__(
        self,
        *,
        registry: ModelRegistry,
        num_inflight: Callable[[], int],
        max_inflight: int,
        health: HealthMonitor | None = None,
        prefill_pool: PrefillPool | None = None,
        discovery: Discovery | None = None,
        namespace: str = "tandem",
        encoder_component: str = "encoder",
        batches: Callable[[], dict[str, Any]] | None = None,
        tenancy: Tenancy | None = None,
    ) -> None:
        self._registry, self._num_inflight, self._max_inflight = (
            registry,
            num_inflight,
            max_inflight,
        )
        self._health, self._prefill, self._discovery = health, prefill_pool, discovery
        self._encoder_prefix = f"{namespace}.{encoder_component}."
        self._batches = batches  # the batch lane's progress (frontend/batch/lane.py)
        self._tenancy = tenancy  # its table and TenantStats; None without a tenants file
        self._page = resources.files("tandem.frontend").joinpath("static/dashboard.html")

    async def page(self, request: HttpRequest, response: HttpResponse) -> None:
        await response.send(200, self._page.read_bytes(), content_type=b"text/html; charset=utf-8")

    async def state_endpoint(self, request: HttpRequest, response: HttpResponse) -> None:
        await response.send(200, _json.encode(await self.state()))

    async def state(self) -> dict[str, Any]:
        """Everything the page shows, JSON-ready."""
        healthy, report = self._health.health() if self._health else (True, {"missing": []})
        models = [self._model(name) for name in sorted(self._model_names())]
        encoders = await self._encoders()
        if encoders:
            models.append({"name": "(encoders)", "router": None, "workers": encoders,
                           "decisions": []})  # fmt: skip
        return {
            "time_s": round(time.time(), 3),
            "frontend": {
                "healthy": healthy,
                "missing": report.get("missing", []),
                "inflight": self._num_inflight(),
                "max_inflight": self._max_inflight,
                "loop_lag_ms": round(self._health.loop_lag_s * 1000, 1) if self._health else 0.0,
                "queued": sum(m["router"]["queued"] for m in models if m["router"]),
            },
            "models": models,
            "tenants": None if self._tenancy is None else _tenant_usage(self._tenancy),
            "batches": None if self._batches is None else await asyncio.to_thread(self._batches),
        }

    def _model_names(self) -> set[str]:
        names = set(self._registry.models)
        if self._prefill is not None:
            names.update(self._prefill.views)
        return names

    def _model(self, name: str) -> dict[str, Any]:
        workers: list[dict[str, Any]] = []
        decisions: list[dict[str, Any]] = []
        routers: list[dict[str, Any]] = []
        model = self._registry.models.get(name)
        if model is not None:
            role = "decode" if self._prefill is not None else "aggregated"
            workers += self._workers(model.instances.instances, model.router, role)
            routers.append(_router_summary(model.router, role))
            decisions += _decisions(model.router, role)
        if self._prefill is not None and name in self._prefill.views:
            prefill = self._prefill.started_router(name)
            workers += self._workers(self._prefill.views[name].instances, prefill, "prefill")
            if prefill is not None:
                routers.append(_router_summary(prefill, "prefill"))
                decisions += _decisions(prefill, "prefill")
        decisions.sort(key=lambda d: d["time_s"], reverse=True)
        router = {
            "policy": routers[0]["policy"] if routers else None,
            "queued": sum(r["queued"] for r in routers),
            "hit_rate": _combined_hit_rate(routers),
            "num_decisions": sum(r["num_decisions"] for r in routers),
            "kv_fetches": sum(r["kv_fetches"] or 0 for r in routers),
            "pools": routers,
        }
        return {"name": name, "router": router, "workers": workers,
                "decisions": decisions[:NUM_DECISIONS]}  # fmt: skip

    def _workers(
        self, instances: dict[str, Instance], router: Router | None, default_role: str
    ) -> list[dict[str, Any]]:
        loads = router.worker_loads() if router is not None else {}
        log = router.decisions if router is not None else None
        rows = []
        for worker_id, inst in sorted(instances.items()):
            load = loads.get(worker_id, {})
            total = load.get("total_blocks") or (inst.model.num_total_blocks if inst.model else 0)
            active = load.get("active_blocks")
            rows.append({
                "instance_id": worker_id,
                "role": str(inst.metadata.get("disagg_mode") or default_role),
                "address": inst.address,
                "health": self._worker_health(worker_id),
                "inflight": int(load.get("inflight", 0)),
                "running": _int_or_none(load.get("running")),
                "waiting": _int_or_none(load.get("waiting")),
                "active_blocks": _int_or_none(active),
                "total_blocks": int(total) if total else None,
                "kv_usage": round(active / total, 4) if active is not None and total else None,
                "cached_blocks": _int_or_none(load.get("cached_blocks")),
                "routed": log.num_routed(worker_id) if log is not None else 0,
                "hit_rate": _round(log.hit_rate(worker_id)) if log is not None else None,
                "loras": _loras(router, worker_id),
            })  # fmt: skip
        return rows

    def _worker_health(self, worker_id: str) -> dict[str, Any]:
        if self._health is None:
            return {"status": "unknown", "last_seen_s": None}
        age = self._health.last_seen_age_s(worker_id)
        if age is None:
            return {"status": "unknown", "last_seen_s": None}
        status = "alive" if age <= self._health.stale_s else "stale"
        return {"status": status, "last_seen_s": round(age, 1)}

    async def _encoders(self) -> list[dict[str, Any]]:
        if self._discovery is None:
            return []
        try:
            async with asyncio.timeout(ENCODER_LIST_TIMEOUT_S):
                instances = await self._discovery.list_instances(self._encoder_prefix)
        except Exception as exc:  # the page still shows everything else
            logger.warning("dashboard: listing encode workers failed: %s", exc)
            return []
        return [
            {"instance_id": i.instance_id, "role": "encode", "address": i.address,
             "health": {"status": "registered", "last_seen_s": None}, "inflight": None,
             "running": None, "waiting": None, "active_blocks": None, "total_blocks": None,
             "kv_usage": None, "cached_blocks": None, "routed": None, "hit_rate": None}
            for i in sorted(instances, key=lambda i: i.instance_id)
        ]  # fmt: skip


def _loras(router: Router | None, worker_id: str) -> dict[str, Any] | None:
    """The LoRA adapters resident on a worker and its slots, as its router knows them
    (router/lora.py); None for a worker that announces no slots."""
    metrics = router.metrics if router is not None else None
    if metrics is None or worker_id not in metrics.lora.max_loras:
        return None
    lora = metrics.lora
    return {"resident": lora.names.get(worker_id, []), "slots": lora.max_loras[worker_id]}


def _router_summary(router: Router, pool: str) -> dict[str, Any]:
    log = router.decisions
    return {
        "pool": pool,
        "policy": router.policy,
        "queued": int(router.num_queued),
        "num_decisions": log.num_decisions,
        "hit_rate": _round(log.hit_rate()),
        "_blocks": log.blocks(),
        # peer KV fetch hints sent (router/fetch.py); None for a router without counters here
        "kv_fetches": router.metrics.kv_fetches if router.metrics is not None else None,
        **_tenancy(router.metrics),
    }


def _tenant_usage(tenancy: Tenancy) -> list[dict[str, Any]]:
    """Issue 33, per tenant as this frontend counted it (`TenantStats`, the same counters as
    `tandem_frontend_tenant_tokens_total` and `tandem_frontend_tenant_rate_limited_total`):
    tokens served (counted when a request ends; one refused or timed out before it ran counts
    none) and the requests answered 429 by its requests/min and tokens/min limits, beside its weight
    and limits. Every configured tenant has a row, and any other one that was counted."""
    table, stats = tenancy.table, tenancy.stats
    names = set(table.tenants) | {t for t, _ in stats.tokens} | {t for t, _ in stats.limited}
    rows = []
    for name in sorted(names):
        config = table.get(name)
        rows.append({
            "tenant": name,
            "weight": config.weight,
            "prompt_tokens": stats.tokens[(name, "prompt")],
            "completion_tokens": stats.tokens[(name, "output")],
            "limit_hits": {"requests": stats.limited[(name, "requests")],
                           "tokens": stats.limited[(name, "tokens")]},
            "limits": {"requests_per_minute": config.requests_per_minute,
                       "tokens_per_minute": config.tokens_per_minute},
        })  # fmt: skip
    return rows


def _tenancy(metrics: RouterMetrics | None) -> dict[str, Any]:
    """Issue 33: per (class, tenant) what waits in the router queue, how many waited and how
    long on average, deadline misses; session bindings; and `tenant_tokens`, the router's
    fair-share count per tenant (prompt + 2 x output tokens, the output expected until the
    request ends): what the queue weighs, not tokens served (`_tenant_usage` has those)."""
    if metrics is None:
        return {"tenants": [], "tenant_tokens": {}, "sessions": None}
    rows: dict[tuple[str, str], dict[str, Any]] = {}

    def row(key: tuple[str, str]) -> dict[str, Any]:
        blank = {"queued": 0, "waited": 0, "mean_wait_s": None, "deadline_misses": 0}
        return rows.setdefault(key, {"priority_class": key[0], "tenant": key[1], **blank})

    if metrics.tenants is not None:
        for (klass, tenant), n in metrics.tenants.depth().items():
            row((class_name(klass), tenant))["queued"] = n
    for key, n in metrics.queue_waits.items():
        row(key).update(waited=n, mean_wait_s=_round(metrics.queue_wait_sum_s[key] / n))
    for key, n in metrics.deadline_misses.items():
        row(key)["deadline_misses"] = n
    served = metrics.tenants.served_tokens if metrics.tenants is not None else {}
    sessions = metrics.sessions
    return {
        "tenants": [rows[k] for k in sorted(rows)],
        "tenant_tokens": {t: round(v) for t, v in sorted(served.items())},
        "sessions": None
        if sessions is None
        else {"bound": len(sessions), "hits": sessions.num_hits, "rebinds": sessions.num_rebinds},
    }


def _combined_hit_rate(routers: list[dict[str, Any]]) -> float | None:
    """Over every pool of the model; takes the pools' block counts out of their rows."""
    counts = [r.pop("_blocks") for r in routers]
    blocks = sum(n for _, n in counts)
    return round(sum(o for o, _ in counts) / blocks, 4) if blocks else None


def _decisions(router: Router, pool: str) -> list[dict[str, Any]]:
    return [{**d, "pool": pool} for d in router.decisions.snapshot(NUM_DECISIONS)]


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
