"""Offline simulation of `tandem bench planner`'s schedule: the mocker's synchronous scheduler
per worker, round-robin routing (the frontend's default), the same `Planner` core on the same
observations, simulated time only (no sleeps, no processes).

Event-driven: arrivals, step ends and planner ticks in time order. A step starts when a
worker is idle and has work and ends `duration_ms / speedup` later, when its tokens are
delivered. An added worker is ready `startup_s` after the planner asks (measured live); a
removed one takes no new requests and exits when its last request finishes. A static fleet
(`num_static`, no planner) is simulated the same way, so the planner's fleet and the static
one are measured on the same arrivals by the same code: the run ends when the last request
has its last token, and a worker's seconds run from its spawn (0 for a static worker) to its
exit or that end.
"""

from __future__ import annotations

import heapq
import itertools
import random
from dataclasses import dataclass, field

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.scheduler import Scheduler
from tandem.planner.config import PlannerConfig
from tandem.planner.observation import PoolObservation, PoolTraffic, WorkerView
from tandem.planner.planner import Planner
from tandem.protocols.engine import PreprocessedRequest, StopConditions
from tandem.protocols.scaling import StepSample


@dataclass(slots=True)
class SimRequest:
    arrival_s: float
    first_s: float | None = None
    last_s: float | None = None
    num_tokens: int = 0


@dataclass(slots=True)
class SimWorker:
    worker_id: str
    scheduler: Scheduler
    spawned_s: float
    ready_s: float
    draining: bool = False
    exited_s: float | None = None
    busy_until: float | None = None  # end of the running step
    steps: list[tuple[float, StepSample]] = field(default_factory=list)
    num_fed: int = 0  # steps already given to the planner's regression
    requests: dict[str, SimRequest] = field(default_factory=dict)


@dataclass(slots=True)
class SimResult:
    requests: list[SimRequest]
    workers: list[SimWorker]
    timeline: list[tuple[float, int]]  # (t, live workers)
    end_s: float = 0.0  # the last request's last token (or the last arrival)

    @property
    def worker_seconds(self) -> float:
        """Each worker from its spawn to its exit (or `end_s`), within [0, end_s]."""
        return sum(
            max(min(w.exited_s if w.exited_s is not None else self.end_s, self.end_s)
                - w.spawned_s, 0.0)
            for w in self.workers
        )  # fmt: skip


class FleetSimulation:
    def __init__(
        self,
        mocker: MockerConfig,
        *,
        isl: int,
        osl: int,
        startup_s: float,
        planner: PlannerConfig | None,
        num_static: int = 0,
        seed: int = 0,
        planner_core: Planner | None = None,
    ) -> None:
        """`planner_core` replaces `Planner(planner)` (tests hand in a deliberately wrong one);
        `planner` still gives the interval and the stats window."""
        if planner is None and num_static < 1:
            raise ValueError(f"num_static={num_static} without a planner; expected >= 1")
        self.mocker, self.isl, self.osl, self.startup_s = mocker, isl, osl, startup_s
        self.speedup = mocker.speedup_ratio or 1.0
        self.planner = planner_core or (Planner(planner) if planner is not None else None)
        self.planner_config = planner
        self.workers: dict[str, SimWorker] = {}
        self._ids = itertools.count()
        self._rr = itertools.count()
        self._rng = random.Random(seed)
        self._events: list[tuple[float, int, str, str]] = []  # (t, seq, kind, worker_id)
        self._seq = itertools.count()
        self.finished: list[tuple[float, SimRequest, int]] = []  # (t, request, isl)
        self.arrivals: list[float] = []
        for _ in range(num_static):
            self._spawn(0.0, ready_at=0.0)

    def _spawn(self, now: float, ready_at: float) -> str:
        wid = f"sim{next(self._ids)}"
        self.workers[wid] = SimWorker(wid, Scheduler(self.mocker), now, ready_at)
        return wid

    def _push(self, t: float, kind: str, worker_id: str = "") -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, worker_id))

    def _ready(self, now: float) -> list[SimWorker]:
        return [w for w in self.workers.values()
                if w.ready_s <= now and not w.draining and w.exited_s is None]  # fmt: skip

    def _arrive(self, now: float, n: int) -> None:
        self.arrivals.append(now)
        ready = self._ready(now)
        if not ready:  # the frontend would wait for a worker: queue on the first to come
            ready = [w for w in self.workers.values() if w.exited_s is None and not w.draining]
        w = ready[next(self._rr) % len(ready)]
        rid = f"r{n}"
        tokens = [self._rng.randrange(100, 40000) for _ in range(self.isl)]
        w.scheduler.add_request(PreprocessedRequest(
            request_id=rid, model="sim", token_ids=tokens,
            stop=StopConditions(max_tokens=self.osl, ignore_eos=True)))  # fmt: skip
        w.requests[rid] = SimRequest(arrival_s=now)
        self._kick(w, max(now, w.ready_s))

    def _kick(self, w: SimWorker, now: float) -> None:
        if w.busy_until is None and w.scheduler.has_work:
            result = w.scheduler.step()
            end = now + result.duration_ms / 1000.0 / self.speedup
            w.busy_until = end
            s = w.scheduler
            w.steps.append((end, StepSample(
                wall_ms=(end - now) * 1000.0, num_prefill_tokens=result.num_prefill_tokens,
                num_decode_kv_tokens=result.num_decode_kv_tokens,
                num_running=s.num_running, num_waiting=s.num_waiting)))  # fmt: skip
            for seq, out in result.outputs:
                req = w.requests.get(seq.request_id)
                if req is None or not out.token_ids:
                    continue
                req.first_s = end if req.first_s is None else req.first_s
                req.last_s = end
                req.num_tokens += len(out.token_ids)
                if out.finish_reason is not None:
                    self.finished.append((end, req, self.isl))
                    del w.requests[seq.request_id]
            self._push(end, "step_end", w.worker_id)

    def _step_end(self, w: SimWorker, now: float) -> None:
        w.busy_until = None
        self._kick(w, now)
        if w.draining and not w.requests and w.busy_until is None:
            w.exited_s = now

    def run(self, send_times: list[float]) -> SimResult:
        """Replay `send_times` (seconds from 0) until every request has finished; the planner
        ticks every interval from 0 while requests arrive or run (as live, where it runs
        until the last request is answered)."""
        for n, t in enumerate(send_times):
            self._push(t, "arrive", str(n))
        if self.planner_config is not None:
            self._push(0.0, "tick")
        last_arrival = max(send_times, default=0.0)
        timeline: list[tuple[float, int]] = [(0.0, self._num_live())]
        end = 0.0
        while self._events:
            now, _, kind, arg = heapq.heappop(self._events)
            if kind == "arrive":
                self._arrive(now, int(arg))
            elif kind == "step_end":
                self._step_end(self.workers[arg], now)
            else:
                self._tick(now)
                timeline.append((now, self._num_live()))
                busy = any(w.requests for w in self.workers.values())
                if now < last_arrival or busy:
                    self._push(now + self.planner_config.interval_s, "tick")  # type: ignore[union-attr]
                continue
            end = max(end, now)
        timeline.append((end, self._num_live(end)))
        requests = [r for w in self.workers.values() for r in w.requests.values()]
        requests += [r for _, r, _ in self.finished]
        return SimResult(requests, list(self.workers.values()), timeline, end_s=end)

    def _num_live(self, at: float | None = None) -> int:
        return sum(1 for w in self.workers.values()
                   if w.exited_s is None or (at is not None and w.exited_s >= at))  # fmt: skip

    def _tick(self, now: float) -> None:
        assert self.planner is not None and self.planner_config is not None
        window = max(self.planner_config.interval_s, 1.0)
        views = []
        for w in self._ready(now):
            recent = [s for t, s in w.steps if now - window < t <= now]
            n = len(recent)
            pool = w.scheduler.pool
            views.append(WorkerView(
                worker_id=w.worker_id, num_inflight=len(w.requests),
                num_running=recent[-1].num_running if recent else 0,
                num_waiting=recent[-1].num_waiting if recent else 0,
                num_active_blocks=pool.num_active_blocks, num_total_blocks=pool.num_blocks,
                num_cached_blocks=pool.num_cached_blocks, block_size=self.mocker.block_size,
                max_num_batched_tokens=self.mocker.max_num_batched_tokens,
                prefill_tokens_per_step=sum(s.num_prefill_tokens for s in recent) / n if n else 0.0,
                prefill_tokens_per_s=sum(s.num_prefill_tokens for s in recent) / window,
                decode_kv_tokens=sum(s.num_decode_kv_tokens for s in recent) / n if n else 0.0,
            ))  # fmt: skip
            fresh = [s for t, s in w.steps[w.num_fed :] if t <= now]
            w.num_fed += len(fresh)
            self.planner.observe_steps("backend", fresh)
        done = [(t, r) for t, r, _ in self.finished if now - window < t <= now]
        ttfts = [(r.first_s - r.arrival_s) * 1000 for _, r in done if r.first_s is not None]
        itls = [((r.last_s or 0) - (r.first_s or 0)) * 1000 / (r.num_tokens - 1)
                for _, r in done if r.num_tokens > 1]  # fmt: skip
        traffic = PoolTraffic(
            interval_s=window,
            num_arrivals=sum(1 for t in self.arrivals if now - window < t <= now),
            num_finished=len(done), mean_isl=float(self.isl) if done else 0.0,
            mean_osl=float(self.osl) if done else 0.0,
            mean_ttft_ms=sum(ttfts) / len(ttfts) if ttfts else None,
            mean_itl_ms=sum(itls) / len(itls) if itls else None,
        )  # fmt: skip
        self.planner.observe_traffic(traffic)
        starting = [w.worker_id for w in self.workers.values() if w.ready_s > now]
        draining = [w.worker_id for w in self.workers.values() if w.draining and w.exited_s is None]
        obs = {"backend": PoolObservation(component="backend", ready=views, starting=starting,
                                          draining=draining, traffic=traffic)}  # fmt: skip
        for action in self.planner.tick(now, obs):
            if action.kind == "add":
                wid = self._spawn(now, ready_at=now + self.startup_s)
                self.planner.on_added("backend", wid, now)
            elif action.kind == "remove" and action.worker_id in self.workers:
                w = self.workers[action.worker_id]
                w.draining = True
                if not w.requests and w.busy_until is None:
                    w.exited_s = now
            elif action.kind == "abandon" and action.worker_id in self.workers:
                self.workers[action.worker_id].exited_s = now
