"""`LoraPlacement`: which workers a request for a LoRA adapter may go to (issue 32).

Residency comes from the workers: each announces its slot limit and resident adapters in its
discovery metadata (`max_loras`, `loras`) and publishes a `LoraEvent` with its whole resident
set after every load, unload and eviction (`<ns>.<component>.lora_events`). A request naming an
adapter goes to the workers that hold it, and the policy (KV-aware under `kv`) chooses among
them. When none holds it, the adapter is placed by rendezvous hashing: the worker with the
highest hash of (adapter, worker id) among those with a free slot; the worker loads it on
demand. Every router replica and frontend computes the same ranking from the same residency, so
they agree without talking. When every slot is taken, the worker is the one whose next LRU
victim (its least recently routed adapter no request of this router runs with) has the lowest
measured rate, rendezvous order on ties, so the fleet's slots keep what is asked for most
(there routers agree as far as their rates do); when no worker has an idle adapter, the
highest-ranked (its load waits for a slot). Until the worker's event confirms it, a placement
counts as held (`pending_s`), so the requests that follow go there too instead of placing it
again.

Hot adapters get replicas: each adapter's request rate is an exponentially decayed count
(`rate_half_life_s`), and an adapter with share s of the requests wants
ceil(s × workers / replica_load) holders (at most `max_replicas`); the count rises at once and
falls only when 1.5 times the share would fit in fewer (hysteresis). Surplus holders (the
lowest-ranked) get no more requests, so the worker's LRU evicts them when it needs the slot.

Cold adapters are unloaded: when an adapter's last request of this router on a worker ends
and the adapter ranks, by measured rate, below what the fleet's slots hold (every slot less
the hot adapters' extra replicas), the router asks that worker to unload it (`unload_lora`,
with a request client: the `kv` policy), so the slot goes to the next miss instead of the
worker's LRU evicting an adapter asked for more often. Nothing is cold while every adapter
asked for fits (`--no-lora-unload-cold` turns it off).
"""

from __future__ import annotations

import argparse
import hashlib
import math
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from tandem.config_check import check_range
from tandem.protocols.discovery import Instance
from tandem.protocols.lora import LoraEvent

MAX_LABELLED_ADAPTERS = 1000  # per-adapter metric series; later names count as "other"
MIN_RATE_EVIDENCE = 20.0  # decayed requests seen before rates may add replicas


@dataclass(frozen=True, slots=True, kw_only=True)
class LoraPlacementConfig:
    """`enabled` False: requests with an adapter go wherever the policy sends them (the
    baselines of `tandem bench lora-placement`)."""

    enabled: bool = True
    max_replicas: int = 4
    # share of one worker's traffic an adapter may take per replica; 1.0, not 0.5: at 0.5 the
    # replica loads stalled workers more than the spread helped (`tandem bench
    # lora-placement`, 8 workers, 100 adapters Zipf(1.0): 458 vs 405 loads, TTFT p99 634 vs
    # 518 ms; 2.0: 395 loads, p99 589 ms)
    replica_load: float = 1.0
    rate_half_life_s: float = 60.0
    pending_s: float = 30.0  # a placement counts as held this long without the worker's event
    unload_cold: bool = True  # ask a worker to unload an idle adapter ranked below the slots

    def __post_init__(self) -> None:
        check_range("lora_max_replicas", self.max_replicas, low=1, high=1024)
        check_range("lora_replica_load", self.replica_load, low=0.01, high=64.0)
        check_range("lora_rate_half_life_s", self.rate_half_life_s, low=0.1, high=86400.0)
        check_range("lora_pending_s", self.pending_s, low=0.1, high=3600.0)


def rendezvous(name: str, worker_id: str) -> int:
    """The highest-random-weight score of `worker_id` for adapter `name` (stable everywhere)."""
    digest = hashlib.blake2b(f"{name}\0{worker_id}".encode(), digest_size=8).digest()
    # big-endian: the digests' order as bytes, as the frontend's load picks (frontend/adapters.py)
    return int.from_bytes(digest, "big")


@dataclass(slots=True)
class _Worker:
    max_loras: int = 0
    resident: set[str] = field(default_factory=set)
    pending: dict[str, float] = field(default_factory=dict)  # adapter -> expiry (clock)


@dataclass(slots=True)
class LoraCounters:
    """Per-adapter counters and residency for /metrics. Plain ints; the owner updates them."""

    requests: Counter[str] = field(default_factory=Counter)
    prompt_tokens: Counter[str] = field(default_factory=Counter)
    placements: Counter[tuple[str, str]] = field(default_factory=Counter)  # (adapter, reason)
    loads: Counter[str] = field(default_factory=Counter)
    unloads: Counter[str] = field(default_factory=Counter)  # unloaded on request
    evictions: Counter[str] = field(default_factory=Counter)
    load_seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    resident: dict[str, int] = field(default_factory=dict)  # worker_id -> adapters resident
    max_loras: dict[str, int] = field(default_factory=dict)  # worker_id -> slot limit
    names: dict[str, list[str]] = field(default_factory=dict)  # worker_id -> resident adapters

    def label(self, name: str) -> str:
        if name in self.requests or len(self.requests) < MAX_LABELLED_ADAPTERS:
            return name
        return "other"


@dataclass(frozen=True, slots=True)
class Plan:
    """Where a request for `adapter` may go: `allowed` (the policy chooses among them) and why."""

    adapter: str
    allowed: list[Instance]
    reason: str  # holder | placed | replica | no_lora_workers
    holders: list[str]
    wanted: int

    def summary(self) -> dict[str, Any]:
        return {
            "adapter": self.adapter,
            "reason": self.reason,
            "holders": self.holders,
            "wanted_replicas": self.wanted,
            "allowed": [i.instance_id for i in self.allowed],
        }


class LoraPlacement:
    """Residency, rates and placement of one router. Synchronous; one event loop."""

    def __init__(
        self, config: LoraPlacementConfig, clock: Callable[[], float], counters: LoraCounters
    ) -> None:
        self.config = config
        self._clock = clock
        self.counters = counters
        self._workers: dict[str, _Worker] = {}
        self._rates: dict[str, tuple[float, float]] = {}  # adapter -> (decayed count, at)
        self._replicas: dict[str, int] = {}
        self._inflight: Counter[tuple[str, str]] = Counter()  # (worker, adapter) -> requests
        self._requests: dict[str, tuple[str, str]] = {}  # request_id -> (worker, adapter)
        self._last_used: dict[tuple[str, str], float] = {}  # (worker, adapter) -> last routed
        self._num_routed = 0

    # ------------------------------------------------------------ residency
    def apply_instance(self, instance: Instance) -> None:
        """A worker registered: its slot limit and the adapters it held then."""
        meta = instance.metadata
        if "max_loras" not in meta:
            return  # an engine without LoRA: it never holds one
        w = self._workers.setdefault(instance.instance_id, _Worker())
        w.max_loras = int(meta.get("max_loras") or 0)
        w.resident = {str(n) for n in meta.get("loras") or ()}
        self._publish(instance.instance_id, w)

    def apply_event(self, event: LoraEvent) -> None:
        """A worker's residency changed; `event.resident` is its whole set now."""
        if not event.worker_id:
            return
        w = self._workers.setdefault(event.worker_id, _Worker())
        if event.max_loras:
            w.max_loras = event.max_loras
        for gone in w.resident - set(event.resident):
            self._last_used.pop((event.worker_id, gone), None)
        w.resident = set(event.resident)
        for name in w.resident:
            w.pending.pop(name, None)
        if event.kind == "loaded":
            label = self.counters.label(event.name)
            self.counters.loads[label] += 1
            self.counters.load_seconds[label] += event.load_s
        elif event.kind == "unloaded":
            self.counters.unloads[self.counters.label(event.name)] += 1
            w.pending.pop(event.name, None)
        else:
            self.counters.evictions[self.counters.label(event.name)] += 1
            w.pending.pop(event.name, None)
        self._publish(event.worker_id, w)

    def forget(self, worker_id: str) -> None:
        self._workers.pop(worker_id, None)
        self._last_used = {k: t for k, t in self._last_used.items() if k[0] != worker_id}
        self.counters.resident.pop(worker_id, None)
        self.counters.max_loras.pop(worker_id, None)
        self.counters.names.pop(worker_id, None)

    def _publish(self, worker_id: str, w: _Worker) -> None:
        self.counters.resident[worker_id] = len(w.resident)
        self.counters.max_loras[worker_id] = w.max_loras
        self.counters.names[worker_id] = sorted(w.resident)

    def serves_lora(self, worker_id: str) -> bool:
        w = self._workers.get(worker_id)
        return w is not None and w.max_loras > 0

    def holds(self, worker_id: str, name: str) -> bool:
        """Resident on the worker, or placed there by this router and not yet confirmed."""
        w = self._workers.get(worker_id)
        if w is None:
            return False
        if name in w.resident:
            return True
        expiry = w.pending.get(name)
        if expiry is None:
            return False
        if expiry < self._clock():
            del w.pending[name]
            return False
        return True

    def _num_used(self, worker_id: str) -> int:
        w = self._workers[worker_id]
        return len(w.resident | {n for n in w.pending if self.holds(worker_id, n)})

    def _victim_rate(self, worker_id: str, now: float) -> float | None:
        """The measured rate of the adapter the worker's LRU would evict for a new one: its
        least recently routed adapter that none of this router's requests runs with (None
        when there is none)."""
        w = self._workers[worker_id]
        idle = [n for n in w.resident if self._inflight[(worker_id, n)] == 0]
        if not idle:
            return None
        victim = min(idle, key=lambda n: (self._last_used.get((worker_id, n), -math.inf), n))
        return self._decayed(victim, now)

    def residency(self) -> dict[str, dict[str, Any]]:
        """Per worker: slot limit, resident and pending adapters (explain, dashboard)."""
        return {
            wid: {
                "max_loras": w.max_loras,
                "resident": sorted(w.resident),
                "pending": sorted(n for n in w.pending if self.holds(wid, n)),
            }
            for wid, w in sorted(self._workers.items())
        }

    # ------------------------------------------------------------ rates and replicas
    def _decayed(self, name: str, now: float) -> float:
        count, at = self._rates.get(name, (0.0, now))
        return float(count * 0.5 ** ((now - at) / self.config.rate_half_life_s))

    def wanted_replicas(self, name: str, num_workers: int) -> int:
        """Holders adapter `name` should have, from its share of the measured request rate."""
        now = self._clock()
        total = sum(self._decayed(n, now) for n in self._rates)
        current = self._replicas.get(name, 1)
        if total < MIN_RATE_EVIDENCE or num_workers <= 1:
            want = current
        else:
            x = self._decayed(name, now) / total * num_workers / self.config.replica_load
            want = current
            if math.ceil(x) > current:
                want = math.ceil(x)
            elif max(math.ceil(1.5 * x), 1) < current:
                want = max(math.ceil(1.5 * x), 1)
        want = max(1, min(want, self.config.max_replicas, max(num_workers, 1)))
        if want == 1:
            self._replicas.pop(name, None)
        else:
            self._replicas[name] = want
        return want

    # ------------------------------------------------------------ placement
    def plan(self, name: str, candidates: Sequence[Instance]) -> Plan:
        """The candidates a request for adapter `name` may go to. Mutates only the replica
        counts (hysteresis); call `routed` with the choice."""
        lora = [c for c in candidates if self.serves_lora(c.instance_id)]
        if not lora:  # no worker announces slots: the chosen worker answers (a clear error)
            return Plan(name, list(candidates), "no_lora_workers", [], 0)
        ranked = sorted(lora, key=lambda c: rendezvous(name, c.instance_id), reverse=True)
        holders = [c for c in ranked if self.holds(c.instance_id, name)]
        wanted = self.wanted_replicas(name, len(lora))
        held = [c.instance_id for c in holders]
        if len(holders) >= wanted:
            return Plan(name, holders[:wanted], "holder", held, wanted)
        others = [c for c in ranked if c not in holders]
        target = self._place(others)
        return Plan(name, [target], "replica" if holders else "placed", held, wanted)

    def _place(self, ranked: list[Instance]) -> Instance:
        """The first worker in rendezvous order with a free slot; when every slot is taken,
        the one whose next LRU victim is the coldest adapter (rendezvous order on ties), so
        the fleet's slots keep the adapters asked for most; when none has an idle adapter,
        the first (its load waits for a slot)."""
        for c in ranked:
            w = self._workers[c.instance_id]
            if self._num_used(c.instance_id) < w.max_loras:
                return c
        now = self._clock()
        victims = [(rate, i) for i, c in enumerate(ranked)
                   if (rate := self._victim_rate(c.instance_id, now)) is not None]  # fmt: skip
        return ranked[min(victims)[1]] if victims else ranked[0]

    def routed(self, request_id: str, worker_id: str, plan: Plan, num_tokens: int) -> None:
        """A request planned by `plan` went to `worker_id`: count it, and hold the adapter
        there as pending until the worker's event says what happened."""
        name = plan.adapter
        self.counters.placements[(self.counters.label(name), plan.reason)] += 1
        now = self._clock()
        self._rates[name] = (self._decayed(name, now) + 1.0, now)
        self._num_routed += 1
        if self._num_routed % 1024 == 0:  # forget adapters nobody asked for in a long while
            self._rates = {n: v for n, v in self._rates.items() if self._decayed(n, now) > 1e-3}
        label = self.counters.label(name)
        self.counters.requests[label] += 1
        self.counters.prompt_tokens[label] += num_tokens
        w = self._workers.get(worker_id)
        if w is not None and name not in w.resident:
            w.pending[name] = now + self.config.pending_s
        self.finished(request_id)
        self._requests[request_id] = (worker_id, name)
        self._last_used[(worker_id, name)] = now
        self._inflight[(worker_id, name)] += 1

    def finished(self, request_id: str) -> tuple[str, str] | None:
        """The request ended. Returns (worker_id, adapter) when that adapter is now idle there
        and cold (`is_cold`): the router asks the worker to unload it, so the slot goes to
        the next miss instead of an adapter asked for more often (the worker's own LRU
        would evict by recency, not by rate)."""
        key = self._requests.pop(request_id, None)
        if key is None:
            return None
        left = self._inflight[key] - 1
        if left > 0:
            self._inflight[key] = left
            return None
        del self._inflight[key]
        worker_id, name = key
        w = self._workers.get(worker_id)
        if not self.config.unload_cold or w is None or name not in w.resident:
            return None
        return key if self.is_cold(name) else None

    def is_cold(self, name: str) -> bool:
        """Whether adapter `name` ranks, by measured rate, below what the fleet's slots hold
        (every worker's slots less the hot adapters' extra replicas): keeping it resident
        would cost an adapter asked for more often. False until rates are measured, and
        whenever every adapter asked for fits."""
        now = self._clock()
        rates = {n: self._decayed(n, now) for n in self._rates}
        slots = sum(w.max_loras for w in self._workers.values())
        slots -= sum(k - 1 for k in self._replicas.values())
        if sum(rates.values()) < MIN_RATE_EVIDENCE or len(rates) <= slots:
            return False
        mine = rates.get(name, 0.0)
        return sum(r > mine for r in rates.values()) >= slots


def lora_families(
    prefix: str, rows: Sequence[tuple[Mapping[str, str], LoraCounters]]
) -> list[Metric]:
    """Prometheus families of the routers' LoRA counters (`rows`: each router's labels, e.g.
    model, and its counters; every row with the same label names)."""
    names = tuple(rows[0][0]) if rows else ()
    p = f"{prefix}_lora"

    def fam(kind: Callable[..., Any], name: str, doc: str, *extra: str) -> Any:
        return kind(f"{p}_{name}", doc, labels=(*extra, *names))

    per_adapter: list[tuple[Any, Callable[[LoraCounters], Mapping[str, float]]]] = [
        (fam(CounterMetricFamily, "requests", "requests routed, per adapter", "adapter"),
         lambda c: c.requests),
        (fam(CounterMetricFamily, "prompt_tokens", "prompt tokens routed, per adapter",
             "adapter"), lambda c: c.prompt_tokens),
        (fam(CounterMetricFamily, "loads", "adapter loads the workers announced", "adapter"),
         lambda c: c.loads),
        (fam(CounterMetricFamily, "load_seconds", "seconds the announced loads took",
             "adapter"), lambda c: c.load_seconds),
        (fam(CounterMetricFamily, "unloads", "adapters unloaded on request", "adapter"),
         lambda c: c.unloads),
        (fam(CounterMetricFamily, "evictions", "adapters evicted from a full set of slots",
             "adapter"), lambda c: c.evictions),
    ]  # fmt: skip
    placements = fam(
        CounterMetricFamily, "placements",
        "requests by why their worker was allowed: holder, placed (a miss), replica (a hot "
        "adapter's new holder), no_lora_workers", "adapter", "reason",
    )  # fmt: skip
    resident = fam(GaugeMetricFamily, "resident_adapters", "adapters resident", "worker_id")
    slots = fam(GaugeMetricFamily, "slots", "adapter slots (--max-loras)", "worker_id")
    for labels, c in rows:
        values = tuple(labels[n] for n in names)
        for family, counter in per_adapter:
            for adapter, n in sorted(counter(c).items()):
                family.add_metric((adapter, *values), n)
        for (adapter, reason), n in sorted(c.placements.items()):
            placements.add_metric((adapter, reason, *values), n)
        for worker_id, n in sorted(c.resident.items()):
            resident.add_metric((worker_id, *values), n)
            slots.add_metric((worker_id, *values), c.max_loras.get(worker_id, 0))
    return [*(f for f, _ in per_adapter), placements, resident, slots]


def add_lora_args(group: argparse._ArgumentGroup) -> None:
    """The router's LoRA placement flags (defaults from `LoraPlacementConfig`)."""
    d = LoraPlacementConfig()
    group.add_argument(
        "--lora-placement",
        action=argparse.BooleanOptionalAction,
        default=d.enabled,
        help="send a request naming a LoRA adapter to the workers holding it, place a miss by "
        "rendezvous hashing, give hot adapters replicas (off: the policy alone decides)",
    )
    group.add_argument(
        "--lora-max-replicas",
        type=int,
        default=d.max_replicas,
        help="most workers one hot adapter is kept on",
    )
    group.add_argument(
        "--lora-replica-load",
        type=float,
        default=d.replica_load,
        help="share of one worker's requests an adapter may take per replica before it gets "
        "another (replicas = ceil(share x workers / this))",
    )
    group.add_argument(
        "--lora-unload-cold",
        action=argparse.BooleanOptionalAction,
        default=d.unload_cold,
        help="kv policy: ask a worker to unload an idle adapter whose request rate ranks below "
        "what the fleet's adapter slots hold (nothing is cold while every adapter fits)",
    )
    group.add_argument(
        "--lora-rate-half-life-s",
        type=float,
        default=d.rate_half_life_s,
        help="half-life of the per-adapter request rate the replicas follow",
    )


def lora_config_from_args(ns: argparse.Namespace) -> LoraPlacementConfig:
    d = LoraPlacementConfig()
    return LoraPlacementConfig(
        enabled=getattr(ns, "lora_placement", d.enabled),
        max_replicas=getattr(ns, "lora_max_replicas", d.max_replicas),
        replica_load=getattr(ns, "lora_replica_load", d.replica_load),
        rate_half_life_s=getattr(ns, "lora_rate_half_life_s", d.rate_half_life_s),
        unload_cold=getattr(ns, "lora_unload_cold", d.unload_cold),
    )
