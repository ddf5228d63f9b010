"""`Planner`: the synchronous, deterministic decision core (DESIGN.md §11).

Each `tick(now, observations)` settles earlier actions, notices changes it did not make, and
returns at most one kind of action per pool:

- settling: an added worker counts as settled once it is registered (ready); one still not
  ready after `ready_timeout_s` is given up on (an `abandon` action, counted in
  `num_never_ready`), never waited on forever. A removed worker settles once it is gone; one
  still listed after `drain_timeout_s` is counted in `num_stuck_drains` and no longer waited on.
  While anything in a pool settles, that pool gets no new action.
- replicas changed by someone else (a ready worker appearing or vanishing without an action
  of ours) are re-read: counted in `num_external_changes`, taken as the new state, and
  answered with a cooldown, never reverted.
- bounds: below `min_workers` → add up to the floor at once; above `max_workers` → no more
  adds (nothing is removed for it: the extra workers were someone's decision); the total
  budget caps adds over all pools.
- otherwise the mode decides (load: ±1; throughput: toward the profiled replica count, adds
  at once, removes one at a time), after the cooldown of that direction; a remove also needs
  every verdict of the last `scale_down_stable_s` to have asked for it (one quiet interval
  of Poisson arrivals is not a trend: draining on it re-adds the worker seconds later).
Scale-down picks the victim with the fewest in-flight requests, then the least cached KV.
Not thread-safe.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from tandem.engines.profile import EngineProfile
from tandem.planner import load_mode, throughput_mode
from tandem.planner.config import PlannerConfig, PoolConfig
from tandem.planner.observation import PoolObservation, PoolTraffic, WorkerView
from tandem.planner.regression import StepCoefficients, StepTimeModel
from tandem.planner.throughput_mode import TrafficForecaster
from tandem.protocols.scaling import StepSample

logger = logging.getLogger(__name__)

ActionKind = Literal["add", "remove", "abandon"]
MAX_CALIBRATION = 4.0  # a measured/predicted ratio beyond this is noise, not a bias


@dataclass(frozen=True, slots=True)
class ScaleAction:
    kind: ActionKind
    component: str
    worker_id: str | None  # remove/abandon: which; add: None (the connector names it)
    reason: str


@dataclass(slots=True)
class PoolState:
    config: PoolConfig
    last_action_s: float = -math.inf
    adding: dict[str, float] = field(default_factory=dict)  # worker_id -> asked at
    removing: dict[str, float] = field(default_factory=dict)
    num_requested_adds: int = 0  # asked of the connector, not yet named by it
    known_ready: set[str] = field(default_factory=set)
    has_seen: bool = False  # the first tick's workers are the starting state, not a change
    num_never_ready: int = 0
    num_stuck_drains: int = 0
    num_external_changes: int = 0
    last_reason: str = ""
    calibration: load_mode.Calibration = field(default_factory=load_mode.Calibration)
    down_since: float | None = None  # since when every verdict has said "remove one"

    @property
    def is_settling(self) -> bool:
        return bool(self.adding or self.removing or self.num_requested_adds)


def choose_victim(workers: list[WorkerView]) -> WorkerView | None:
    """Of the workers the connector can drain: fewest in-flight requests, then least cached
    KV, then the smallest id (stable). None when it manages none of them."""
    managed = [w for w in workers if w.is_managed]
    if not managed:
        return None
    return min(managed, key=lambda w: (w.num_inflight, w.num_cached_blocks, w.worker_id))


class Planner:
    def __init__(
        self,
        config: PlannerConfig,
        *,
        profile: EngineProfile | None = None,
        is_alive: Callable[[str], bool] | None = None,
    ) -> None:
        """`is_alive(worker_id)`: whether the connector still runs a worker it started (a
        process that exited or a Ray actor whose node was lost is not); one that ends before it
        is ready is given up on at once instead of after `ready_timeout_s`."""
        if config.mode == "throughput" and profile is None:
            raise ValueError("throughput mode needs an engine profile")
        self.config = config
        self._is_alive = is_alive
        self.profile = profile
        self.pools = {p.component: PoolState(p) for p in config.pools}
        self.models = {p.component: StepTimeModel() for p in config.pools}
        self.forecaster = TrafficForecaster(config.predictor)

    # ------------------------------------------------------------------ inputs
    def observe_steps(self, component: str, samples: list[StepSample]) -> None:
        model = self.models.get(component)
        if model is not None:
            for s in samples:
                model.observe(s)

    def observe_traffic(self, traffic: PoolTraffic) -> None:
        """The whole system's requests of one interval (throughput mode's forecast input)."""
        finished = traffic.num_finished > 0
        self.forecaster.observe(
            traffic.request_rate,
            traffic.mean_isl if finished else None,
            traffic.mean_osl if finished else None,
            traffic.cached_fraction,
        )

    def on_added(self, component: str, worker_id: str | None, now: float) -> None:
        """The connector started (or failed to start, `worker_id` None) one requested add."""
        pool = self.pools[component]
        pool.num_requested_adds = max(pool.num_requested_adds - 1, 0)
        if worker_id is not None:
            pool.adding[worker_id] = now
        else:
            pool.num_never_ready += 1

    def on_remove_requested(self, component: str, worker_id: str, now: float) -> None:
        self.pools[component].removing[worker_id] = now

    # ------------------------------------------------------------------ decision
    def tick(self, now: float, observations: dict[str, PoolObservation]) -> list[ScaleAction]:
        actions: list[ScaleAction] = []
        for component, pool in self.pools.items():
            obs = observations.get(component) or PoolObservation(component=component)
            actions += self._settle(pool, obs, now)
            self._reread(pool, obs, now)
        for component, pool in self.pools.items():
            obs = observations.get(component) or PoolObservation(component=component)
            if not pool.is_settling:
                actions += self._decide(pool, obs, now, observations)
        return actions

    def _settle(self, pool: PoolState, obs: PoolObservation, now: float) -> list[ScaleAction]:
        ready = {w.worker_id for w in obs.ready}
        out: list[ScaleAction] = []
        for wid, asked in list(pool.adding.items()):
            if wid in ready:
                del pool.adding[wid]
                pool.known_ready.add(wid)
            elif (ended := self._is_alive is not None and not self._is_alive(wid)) or (
                now - asked > self.config.ready_timeout_s
            ):
                del pool.adding[wid]
                pool.num_never_ready += 1
                reason = (
                    "ended before it was ready (its process or actor is gone)"
                    if ended
                    else f"not ready {now - asked:.0f}s after start; given up"
                )
                logger.warning("pool %s: worker %s %s", pool.config.component, wid, reason)
                out.append(ScaleAction("abandon", pool.config.component, wid, reason))
        listed = ready | set(obs.draining)
        for wid, asked in list(pool.removing.items()):
            pool.known_ready.discard(wid)
            if wid not in listed:
                del pool.removing[wid]
            elif now - asked > self.config.drain_timeout_s:
                del pool.removing[wid]
                pool.num_stuck_drains += 1
                logger.warning("pool %s: worker %s still draining after %.0fs",
                               pool.config.component, wid, now - asked)  # fmt: skip
        return out

    def _reread(self, pool: PoolState, obs: PoolObservation, now: float) -> None:
        ready = {w.worker_id for w in obs.ready}
        appeared = ready - pool.known_ready - set(pool.adding)
        vanished = pool.known_ready - ready - set(pool.removing)
        if (appeared or vanished) and pool.has_seen:
            pool.num_external_changes += 1
            pool.last_action_s = now  # let it settle; the new count is the state now
            logger.info("pool %s: replicas changed outside the planner (+%s −%s); re-read",
                        pool.config.component, sorted(appeared), sorted(vanished))  # fmt: skip
        pool.known_ready = ready - set(pool.removing)
        pool.has_seen = True

    def _decide(
        self,
        pool: PoolState,
        obs: PoolObservation,
        now: float,
        observations: dict[str, PoolObservation],
    ) -> list[ScaleAction]:
        cfg, pc = self.config, pool.config
        n = len(obs.ready)
        headroom = cfg.budget - self._num_workers(observations)
        if n + len(obs.starting) < pc.min_workers:
            count = min(pc.min_workers - n - len(obs.starting), max(headroom, 0))
            return self._adds(pool, now, count, f"below the floor of {pc.min_workers}")
        delta, reason = self._wanted_delta(pool, obs)
        pool.last_reason = reason
        if delta >= 0:
            pool.down_since = None
        elif pool.down_since is None:
            pool.down_since = now
        if delta > 0:
            if now - pool.last_action_s < cfg.cooldown_up_s:
                return []
            count = min(delta, pc.max_workers - n - len(obs.starting), headroom)
            return self._adds(pool, now, count, reason)
        if delta < 0 and n > pc.min_workers and obs.ready:
            if now - pool.last_action_s < cfg.cooldown_down_s:
                return []
            assert pool.down_since is not None
            if now - pool.down_since < cfg.scale_down_stable_s:
                return []
            victim = choose_victim(obs.ready)
            if victim is None:
                return []
            pool.last_action_s = now
            pool.down_since = None
            pool.removing[victim.worker_id] = now
            pool.known_ready.discard(victim.worker_id)
            return [ScaleAction("remove", pc.component, victim.worker_id, reason)]
        return []

    def _adds(self, pool: PoolState, now: float, count: int, reason: str) -> list[ScaleAction]:
        if count <= 0:
            return []
        pool.last_action_s = now
        pool.down_since = None
        pool.num_requested_adds += count
        return [ScaleAction("add", pool.config.component, None, reason) for _ in range(count)]

    def _wanted_delta(self, pool: PoolState, obs: PoolObservation) -> tuple[int, str]:
        cfg, kind = self.config, pool.config.kind
        if cfg.mode == "load":
            model = self.models[pool.config.component].fit()
            self._calibrate(pool, obs, model)
            verdict = load_mode.decide(obs, model, cfg, kind, self._growth(obs), pool.calibration)
            return verdict.delta, verdict.reason
        assert self.profile is not None
        forecast = self.forecaster.forecast()
        wanted = throughput_mode.replicas(
            kind, forecast, self.profile, cfg.ttft_target_ms, cfg.itl_target_ms
        )
        wanted = min(max(wanted, pool.config.min_workers), pool.config.max_workers)
        reason = (
            f"forecast {forecast.request_rate:.2f} req/s ISL {forecast.isl:.0f} "
            f"OSL {forecast.osl:.0f} hit {forecast.kv_hit_rate:.2f} → {wanted} replicas"
        )
        return wanted - len(obs.ready) - len(obs.starting), reason

    def _calibrate(self, pool: PoolState, obs: PoolObservation, model: StepCoefficients) -> None:
        """Fold this interval's measured / predicted fleet means into the pool's calibration
        (an exponential average over about `stats_window_s`, each ratio within
        [1, MAX_CALIBRATION]). Only the latency the pool answers for is calibrated: the
        frontends measure whole requests, which a prefill pool's TTFT and a decode pool's
        ITL stand for. An interval with nothing to compare (no request measured, or no busy
        worker) moves the calibration back toward 1 at the same rate: it describes the load
        that was measured, and a stale factor from a burst kept an idle pool from ever
        draining (survivors' idle ITL × 2 over target × margin, seen live on a decode pool)."""
        t, kind = obs.traffic, pool.config.kind
        if t is None:
            return
        ttft_pred, itl_pred = load_mode.fleet_means(obs, model)
        alpha = min(self.config.interval_s / self.config.stats_window_s, 1.0)
        c = pool.calibration

        def fold(old: float, measured: float | None, predicted: float | None) -> float:
            if measured is None or not predicted:
                return old + alpha * (1.0 - old)
            ratio = min(max(measured / predicted, 1.0), MAX_CALIBRATION)
            return old + alpha * (ratio - old)

        pool.calibration = load_mode.Calibration(
            ttft=fold(c.ttft, t.mean_ttft_ms, ttft_pred) if kind != "decode" else 1.0,
            itl=fold(c.itl, t.mean_itl_ms, itl_pred) if kind != "prefill" else 1.0,
        )

    def _growth(self, obs: PoolObservation) -> float:
        """Forecast rate over the current one, within [1, 2] (1 without traffic)."""
        now = obs.traffic.request_rate if obs.traffic is not None else 0.0
        if now <= 0 or self.forecaster.num_observed < 3:
            return 1.0
        return min(max(self.forecaster.forecast().request_rate / now, 1.0), 2.0)

    def _num_workers(self, observations: dict[str, PoolObservation]) -> int:
        total = 0
        for component, pool in self.pools.items():
            obs = observations.get(component)
            seen = set(pool.adding)
            if obs is not None:
                seen |= {w.worker_id for w in obs.ready} | set(obs.starting)
            total += len(seen) + pool.num_requested_adds
        return total
