"""`KvRouter`: routes each request to the worker with the lowest KV-aware cost (DESIGN.md §7),
fed by KV events (or, with `use_kv_events=False`, by its own decisions) and its own
active-request tracking (shared with replicas when `replica_sync` is on)."""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Unpack

import msgspec

from tandem.protocols.discovery import Instance
from tandem.protocols.engine import KvFetchHint, PreprocessedRequest, prompt_array
from tandem.protocols.kv_events import LoadMetrics
from tandem.protocols.scaling import decode_worker_stats
from tandem.router.active_sequences import ActiveSequences
from tandem.router.approx import ApproxCache
from tandem.router.base import RouteDecision
from tandem.router.config import RouterConfig
from tandem.router.cost import CandidateCost, candidate_cost, choose, tiered_overlap
from tandem.router.event_applier import EventApplier
from tandem.router.fetch import FetchPlan, FetchSource, best_holder, plan_fetch
from tandem.router.indexer import MEDIA, KvIndexer, WorkerKey
from tandem.router.kv_follower import KvEventFollower
from tandem.router.policy_router import AllBusy, PolicyRouter, PolicyRouterWiring
from tandem.router.step_speed import PrefillSpeed
from tandem.router.sync import ReplicaSync
from tandem.router.zmq_source import ZmqEndpoint, ZmqEngineSource
from tandem.runtime.base import RequestClient, Subscription
from tandem.tokens.hashing import sequence_hashes

logger = logging.getLogger(__name__)

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True, slots=True)
class Scored:
    block_hashes: list[int]
    num_tokens: int
    costs: list[CandidateCost]
    overlap_weight: float
    temperature: float


class KvRouter(PolicyRouter):
    """See module doc. Synchronous core; `start` adds the event-plane followers."""

    policy = "kv"

    def __init__(
        self,
        config: RouterConfig,
        *,
        client: RequestClient | None = None,
        **wiring: Unpack[PolicyRouterWiring],
    ) -> None:
        super().__init__(config, **wiring)
        self._client = client
        self.lora_client = client  # unloads cold LoRA adapters (router/lora.py)
        self.indexer = KvIndexer()
        self.active = ActiveSequences(ttl_s=config.active_ttl_s, clock=self._clock)
        self._last_sweep_s = self._clock()
        self._pending: Scored | None = None
        self._recorded_costs: Sequence[CandidateCost] | None = None
        self.applier = EventApplier(self.indexer, self.metrics)
        self.speed = PrefillSpeed()  # workers' measured prefill ms per token (WorkerStats)
        self._fetch_bandwidth: dict[str, float] = {}  # measured by the workers' peer fetches
        self._fetch_setup: dict[str, float] = {}  # and their fixed part (round trips), seconds
        self.follower: KvEventFollower | None = None
        self.approx: ApproxCache | None = None
        if not config.use_kv_events:
            self.approx = ApproxCache(
                self.indexer,
                ttl_s=config.approx_ttl_s,
                max_blocks=config.approx_max_blocks,
                clock=self._clock,
            )
        self.sync: ReplicaSync | None = None
        self.engine_sources = [
            ZmqEngineSource(ZmqEndpoint.parse(spec), self.applier) for spec in config.zmq_endpoints
        ]

    async def _start_extra(self) -> None:
        if self._events is not None:
            stats = await self._events.subscribe(self.subject("worker_stats"))
            self._spawn(self._follow_stats(stats), "worker_stats")
        if self.config.replica_sync and self._events is not None:
            subject = f"{self.namespace}.router.sync"
            self.sync = ReplicaSync(self.active, self._events, subject, on_change=self._wake.set)
            await self.sync.start()
        if self.config.use_kv_events and self._events is not None and self._client is None:
            logger.warning("KV router has no request client: cannot ask workers for KV state")
        if self.config.use_kv_events and self._events is not None:
            self.follower = KvEventFollower(
                self.applier,
                events=self._events,
                client=self._client,
                instances=self._instances,
                subject_prefix=f"{self.namespace}.{self.config.worker_component}",
                timeout_s=self.config.kv_state_timeout_s,
                clock=self._clock,
            )
            await self.follower.start()
        for source in self.engine_sources:
            await source.start()

    async def _follow_stats(self, sub: Subscription) -> None:
        try:
            async for _subject, payload in sub:
                try:
                    msg = decode_worker_stats(payload)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    logger.warning("dropping malformed worker stats: %s", exc)
                    continue
                if msg.worker_id in self._instances.instances:
                    self.speed.observe(msg.worker_id, msg.steps)
        finally:
            await sub.close()

    def _on_worker_added(self, worker_id: str) -> None:
        if any(s.spec.worker_id == worker_id for s in self.engine_sources):
            self.applier.synced.add(worker_id)  # engines send no full state: next batch counts
        elif self.follower is not None:
            self.follower.request_sync(worker_id, None)

    def _on_load(self, metrics: LoadMetrics) -> None:
        if metrics.kv_fetch_bytes_per_s is not None:
            self._fetch_bandwidth[metrics.worker_id] = metrics.kv_fetch_bytes_per_s
        if metrics.kv_fetch_setup_s is not None:
            self._fetch_setup[metrics.worker_id] = metrics.kv_fetch_setup_s
        if self.follower is not None and metrics.kv_event_id is not None:
            self.follower.check_event_id(metrics.worker_id, metrics.dp_rank, metrics.kv_event_id)

    async def close(self) -> None:
        for source in self.engine_sources:
            await source.close()
        if self.sync is not None:
            await self.sync.close()
        if self.follower is not None:
            await self.follower.close()
        await super().close()

    @property
    def block_size(self) -> int:
        if self.config.block_size is not None:
            return int(self.config.block_size)
        for inst in self._instances.instances.values():
            if inst.model is not None:
                return inst.model.block_size
        return DEFAULT_BLOCK_SIZE

    def _forget_worker(self, worker_id: str) -> None:
        super()._forget_worker(worker_id)
        if self.follower is not None:
            self.follower.forget_worker(worker_id)
        self.applier.forget_worker(worker_id)
        self.speed.forget(worker_id)
        self._fetch_bandwidth.pop(worker_id, None)
        self._fetch_setup.pop(worker_id, None)
        if self.approx is not None:
            self.approx.forget_worker(worker_id)
        self.active.remove_worker(worker_id)

    # ------------------------------------------------------------ scoring
    def request_hashes(self, request: PreprocessedRequest) -> list[int]:
        return sequence_hashes(
            prompt_array(request),  # its cached u32 bytes when preprocessing made them
            self.block_size,
            lora_name=request.lora_name,
            cache_salt=request.cache_salt,
            mm_items=request.mm_items,
        )

    def _overlaps(self, hashes: list[int]) -> dict[str, float]:
        def per_worker(matches: dict[WorkerKey, int]) -> dict[str, int]:
            out: dict[str, int] = {}
            for key, depth in matches.items():
                out[key.worker_id] = max(out.get(key.worker_id, 0), depth)
            return out

        device = per_worker(self.indexer.find_matches(hashes))
        if not self.indexer.has_tiers():
            return {w: float(d) for w, d in device.items()}
        host = per_worker(self.indexer.find_matches(hashes, ("device", "host")))
        anyt = per_worker(self.indexer.find_matches(hashes, MEDIA))
        return {
            w: tiered_overlap(
                device.get(w, 0),
                host.get(w, 0),
                d,
                host_credit=self.config.host_overlap_credit,
                disk_credit=self.config.disk_overlap_credit,
            )
            for w, d in anyt.items()
        }

    def _is_busy(self, worker: Instance) -> bool:
        cfg = self.config
        wid = worker.instance_id
        prefill_limit = cfg.busy_prefill_tokens
        if prefill_limit is not None and self.active.num_prefill_tokens(wid) > prefill_limit:
            return True
        if cfg.busy_active_blocks_fraction is not None:
            load = self.loads.get(wid)
            if load is not None and load.num_total_blocks:
                fraction = load.active_fraction
            elif worker.model is not None and worker.model.num_total_blocks:
                fraction = self.active.num_active_blocks(wid) / worker.model.num_total_blocks
            else:
                fraction = 0.0
            if fraction > cfg.busy_active_blocks_fraction:
                return True
        return False

    def score(self, request: PreprocessedRequest, candidates: Sequence[Instance]) -> Scored:
        """Every candidate's cost for `request`; mutates nothing."""
        hashes = self.request_hashes(request)
        block_size = self.block_size
        num_tokens = len(request.token_ids)
        partial = 1 if num_tokens % block_size else 0
        overlaps = self._overlaps(hashes)
        fetches = self._fetch_plans(hashes, overlaps, candidates)
        cached = self._cached_counts()
        slowness = self.speed.slowness([c.instance_id for c in candidates])
        routing = request.routing
        weight = self.config.overlap_weight
        temperature = self.config.temperature
        if routing is not None and routing.overlap_weight is not None:
            weight = routing.overlap_weight
        if routing is not None and routing.temperature is not None:
            temperature = routing.temperature
        costs = [
            candidate_cost(
                worker_id=c.instance_id,
                num_tokens=num_tokens,
                block_size=block_size,
                # blocks in flight there count as cached-to-be: a request queued behind the
                # prefill computing them finds them cached (same-prefix bursts stay together)
                overlap_blocks=max(
                    overlaps.get(c.instance_id, 0.0),
                    float(self.active.prefix_depth(c.instance_id, hashes)),
                ),
                active_prefill_tokens=self.active.num_prefill_tokens(c.instance_id),
                active_blocks=self.active.num_active_blocks(c.instance_id),
                num_new_blocks=self.active.num_new_blocks(c.instance_id, hashes) + partial,
                overlap_weight=weight,
                prefill_slowness=slowness[c.instance_id],
                cached_blocks=cached.get(c.instance_id, 0),
                is_busy=self._is_busy(c),
                fetch=fetches.get(c.instance_id),
            )
            for c in candidates
        ]
        return Scored(hashes, num_tokens, costs, weight, temperature)

    def _fetch_plans(
        self, hashes: list[int], overlaps: dict[str, float], candidates: Sequence[Instance]
    ) -> dict[str, FetchPlan]:
        """Per candidate offering peer fetch, its fetch from the worker of its protocol
        caching the longest device prefix (router/fetch.py); empty when fetch is off or
        nobody offers it."""
        if not self.config.kv_fetch:
            return {}
        sources = {c.instance_id: s for c in candidates
                   if (s := FetchSource.from_metadata(c.metadata)) is not None}  # fmt: skip
        if len(sources) < 2:
            return {}
        if self.indexer.has_tiers():  # only device blocks are exported
            overlaps = {k.worker_id: float(d) for k, d in self.indexer.find_matches(hashes).items()}
        by_protocol: dict[str | None, dict[str, FetchSource]] = {}
        for worker_id, source in sources.items():  # KV moves only between workers of one kind
            by_protocol.setdefault(source.protocol, {})[worker_id] = source
        plans: dict[str, FetchPlan] = {}
        for group in by_protocol.values():
            plans.update(self._fetch_plans_among(hashes, overlaps, group))
        return plans

    def _fetch_plans_among(
        self, hashes: list[int], overlaps: dict[str, float], sources: dict[str, FetchSource]
    ) -> dict[str, FetchPlan]:
        """`_fetch_plans` among `sources`, workers whose KV moves one way (one protocol)."""
        holder = best_holder(overlaps, sources)
        if holder is None:
            return {}
        size, src, cfg = self.block_size, sources[holder], self.config
        usable = min(int(overlaps[holder]), len(hashes))
        plans: dict[str, FetchPlan] = {}
        for worker_id, mine in sources.items():
            if worker_id == holder:
                continue
            # blocks it holds or is computing now (in flight) need no fetch
            local = max(
                int(overlaps.get(worker_id, 0.0)), self.active.prefix_depth(worker_id, hashes)
            )
            # the fetcher's measured bandwidth and setup time (published with its load) else
            # the declared ones; its measured prefill speed (WorkerStats) else its declared,
            # else the default
            bandwidth = self._fetch_bandwidth.get(worker_id) or min(
                src.bandwidth_bytes_per_s, mine.bandwidth_bytes_per_s
            )
            measured_ms = self.speed.ms_per_token(worker_id)
            prefill_s = (
                (measured_ms / 1e3 if measured_ms else None)
                or mine.prefill_s_per_token
                or cfg.kv_fetch_prefill_s_per_token
            )
            plan = plan_fetch(
                source_id=holder, local_blocks=local,
                holder_blocks=usable, block_size=size, bytes_per_token=src.bytes_per_token,
                bandwidth_bytes_per_s=bandwidth, prefill_s_per_token=prefill_s,
                setup_s=self._fetch_setup.get(worker_id, cfg.kv_fetch_setup_s),
            )  # fmt: skip
            if plan is not None and plan.pays:
                plans[worker_id] = plan
        return plans

    def _fetch_hint(self, plan: FetchPlan, scored: Scored) -> KvFetchHint | None:
        """The hint for the chosen worker's fetch (None if its holder left meanwhile)."""
        holder = self._instances.instances.get(plan.source_id)
        source = FetchSource.from_metadata(holder.metadata) if holder is not None else None
        if holder is None or source is None:
            return None
        return KvFetchHint(
            source_instance_id=plan.source_id,
            address=source.address,
            agent_id=source.agent_id,
            # the whole prefix: the fetcher keeps what it caches and pulls the rest
            block_hashes=scored.block_hashes[: plan.first_block + plan.num_blocks],
            block_size=self.block_size,
            protocol=source.protocol,
            # where the frontend asks the holder to export (protocols other than tandem's)
            source_address=None if source.protocol is None else holder.address,
        )

    def _cached_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for key in self.indexer.workers:
            out[key.worker_id] = out.get(key.worker_id, 0) + self.indexer.num_blocks(key)
        return out

    def _eligible(self, request: PreprocessedRequest, scored: Scored) -> list[CandidateCost]:
        pinned = request.routing is not None and request.routing.worker_id is not None
        return [c for c in scored.costs if pinned or not c.is_busy]

    # ------------------------------------------------------------ routing
    def _choose(
        self, request: PreprocessedRequest, candidates: Sequence[Instance]
    ) -> tuple[Instance, dict[str, Any]]:
        self._maybe_sweep()
        if self.approx is not None:
            self.approx.expire()
        scored = self.score(request, candidates)
        eligible = self._eligible(request, scored)
        if not eligible:
            raise AllBusy
        best = choose(eligible, scored.temperature, self._rng)
        self._pending = scored
        chosen = next(c for c in candidates if c.instance_id == best.worker_id)
        return chosen, {"policy": self.policy, "cost": best.cost}

    def _record(
        self, request: PreprocessedRequest, chosen: Instance, details: dict[str, Any]
    ) -> RouteDecision:
        scored, self._pending = self._pending, None
        assert scored is not None, "_record without a preceding _choose"
        self._recorded_costs = scored.costs
        best = next(c for c in scored.costs if c.worker_id == chosen.instance_id)
        overlap = int(best.overlap_blocks)
        prefill_tokens = max(scored.num_tokens - overlap * self.block_size, 0)
        self.active.add(request.request_id, chosen.instance_id, scored.block_hashes, prefill_tokens)
        self._after_add(request.request_id, chosen.instance_id, scored, prefill_tokens)
        hint = self._fetch_hint(best.fetch, scored) if best.fetch is not None else None
        if hint is not None and best.fetch is not None:
            self.metrics.observe_fetch(best.fetch.num_blocks, best.fetch.num_bytes)
            details["kv_fetch"] = {"source": hint.source_instance_id,
                                   "blocks": best.fetch.num_blocks}  # fmt: skip
        return RouteDecision(
            instance_id=chosen.instance_id,
            address=chosen.address,
            overlap_blocks=overlap,
            request_blocks=len(scored.block_hashes),
            details=details,
            block_hashes=scored.block_hashes,
            block_size=self.block_size,
            kv_fetch=hint,
        )

    def _decision_costs(self) -> Sequence[CandidateCost] | None:
        costs, self._recorded_costs = self._recorded_costs, None
        return costs

    def _after_add(
        self, request_id: str, worker_id: str, scored: Scored, prefill_tokens: int
    ) -> None:
        """Approximate mode and replica sync record the choice further."""
        if self.approx is not None:
            self.approx.record(worker_id, scored.block_hashes)
        if self.sync is not None:
            self.sync.publish(
                "add",
                request_id,
                worker_id=worker_id,
                block_hashes=scored.block_hashes,
                num_prefill_tokens=prefill_tokens,
            )

    def _maybe_sweep(self) -> None:
        now = self._clock()
        if now - self._last_sweep_s >= self.config.active_ttl_s / 10:
            self._last_sweep_s = now
            self.active.sweep()

    def on_first_token(self, request_id: str) -> None:
        if self.sync is not None and request_id in self.active:
            self.sync.publish("prefilled", request_id)
        self.active.mark_prefilled(request_id)
        self._wake.set()

    def on_finish(self, request_id: str, output_tokens: int | None = None) -> None:
        if self.active.free(request_id) is not None and self.sync is not None:
            self.sync.publish("free", request_id)
        super().on_finish(request_id, output_tokens)

    # ------------------------------------------------------------ introspection
    def explain(self, request: PreprocessedRequest) -> dict[str, Any]:
        """Every candidate's overlap, prefill/decode blocks, cost, busy flag, and the worker
        `route` would pick now (sampled with a copy of the RNG, so nothing changes)."""
        candidates = self.candidates(request)
        lora = self.explain_lora(request)  # its adapter's holders and why (router/lora.py)
        scored = self.score(request, candidates)
        eligible = self._eligible(request, scored)
        choice = choose(eligible, scored.temperature, copy.copy(self._rng)) if eligible else None
        return {
            **lora,
            "policy": self.policy,
            "block_size": self.block_size,
            "request_tokens": scored.num_tokens,
            "request_blocks": len(scored.block_hashes),
            "overlap_weight": scored.overlap_weight,
            "temperature": scored.temperature,
            "candidates": [asdict(c) for c in scored.costs],
            "choice": None if choice is None else choice.worker_id,
            "all_busy": choice is None,
            # the chosen worker's peer KV fetch: holder, blocks, bytes, fetch vs recompute ms
            "kv_fetch": None if choice is None or choice.fetch is None else asdict(choice.fetch),
        }

    def _load_row(self, worker_id: str) -> dict[str, float]:
        row = super()._load_row(worker_id)
        row["router_active_blocks"] = float(self.active.num_active_blocks(worker_id))
        row["router_prefill_tokens"] = float(self.active.num_prefill_tokens(worker_id))
        row["cached_blocks"] = float(self._cached_counts().get(worker_id, 0))
        speed = self.speed.ms_per_token(worker_id)
        if speed is not None:  # measured prefill speed: what the cost's slowness reads
            row["prefill_ms_per_token"] = speed
        return row
