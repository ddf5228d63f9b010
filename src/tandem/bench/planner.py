"""`tandem bench planner`: the planner against static fleets on one time-varying load.

The schedule (Poisson arrivals, rate shaped over `--duration-s`): ramp up from near zero to 60 %
of the peak, plateau, a burst at the peak, fall to near zero and stay there. The same schedule
is replayed, in one run, against live fleets of mocker worker processes (local connector,
profile-driven perf model, file discovery + ZMQ events, the frontend in this process):

1. `planner`: load mode, min 1 worker, max the peak fleet, planning for the SLO targets ×
   `--planner-target-fraction` (the planner predicts means; the SLO judges every request);
2. `static-avg`: the fleet the engine profile says the average rate needs;
3. `static-peak`: the fleet it says the peak rate needs;

and once more in an offline simulation of the planner run (tandem.bench.planner_sim).
Per run: share of requests within the TTFT and ITL targets, goodput (within-target requests
per second), worker-seconds over the load (from spawn to exit for the planner's workers, so
startup and drain count), failed requests, and the scaling timeline as a PNG; then how far
simulation and live disagree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from tandem.bench.client import ConnectionPool, RequestResult
from tandem.engines.profile import EngineProfile, ProfileFile, load_profile
from tandem.planner import throughput_mode
from tandem.planner.config import PlannerConfig, PoolConfig
from tandem.planner.connector.local import LocalConnector
from tandem.planner.service import PlannerService
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.runtime import open_runtime

logger = logging.getLogger(__name__)
_json = msgspec.json.Encoder()


# ---------------------------------------------------------------------------- schedule
def rate_at(frac: float, peak: float) -> float:
    """Requests per second at fraction `frac` of the run."""
    low = 0.04 * peak
    if frac < 0.25:
        return low + (0.6 * peak - low) * frac / 0.25
    if frac < 0.45:
        return 0.6 * peak
    if frac < 0.55:
        return peak
    if frac < 0.65:
        return peak - (peak - low) * (frac - 0.55) / 0.10
    return low


def send_times(duration_s: float, peak: float, seed: int) -> list[float]:
    """A non-homogeneous Poisson process (thinning) following `rate_at`."""
    rng = random.Random(seed)
    t, out = 0.0, list[float]()
    while True:
        t += rng.expovariate(peak)
        if t >= duration_s:
            return out
        if rng.random() < rate_at(t / duration_s, peak) / peak:
            out.append(t)


# ---------------------------------------------------------------------------- live runs
@dataclass(slots=True)
class RunResult:
    name: str
    results: list[RequestResult]
    duration_s: float
    worker_seconds: float
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (t, live workers)
    startup_s: list[float] = field(default_factory=list)


def within_target(r: RequestResult, ttft_ms: float, itl_ms: float) -> bool:
    if not r.ok or r.ttft_s is None:
        return False
    mean_itl = statistics.fmean(r.itl_s) if r.itl_s else 0.0
    return r.ttft_s * 1000 <= ttft_ms and mean_itl * 1000 <= itl_ms


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    duration_s: float
    peak_rate: float
    isl: int
    osl: int
    ttft_target_ms: float
    itl_target_ms: float
    worker_args: list[str]
    n_avg: int
    n_peak: int
    seed: int
    out_dir: Path
    speedup: float
    margin: float
    cooldown_down_s: float
    planner_fraction: float  # the planner plans for the SLO × this (its mean vs their tail)


async def _fire(pool: ConnectionPool, body: bytes, results: list[RequestResult]) -> None:
    result = RequestResult(start_s=time.perf_counter())
    results.append(await pool.send("/v1/completions", body, result))


def _body(rng: random.Random, cfg: BenchConfig) -> bytes:
    prompt = [rng.randrange(100, 40000) for _ in range(cfg.isl)]
    return _json.encode({"model": "smollm2", "prompt": prompt, "max_tokens": cfg.osl,
                         "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip


async def live_run(name: str, cfg: BenchConfig, times: list[float]) -> RunResult:
    from tandem.frontend.config import FrontendConfig
    from tandem.frontend.main import serve_frontend

    run_dir = Path(tempfile.mkdtemp(prefix=f"tandem-bench-planner-{name}-"))
    rc = RuntimeConfig(namespace=f"bp{name.replace('-', '')}", discovery="file",
                       discovery_dir=str(run_dir / "discovery"), events="zmq")  # fmt: skip
    connector = LocalConnector(rc, {"backend": cfg.worker_args}, drain_grace_s=60.0,
                               log_dir=str(run_dir / "logs"))  # fmt: skip
    spawned: dict[str, float] = {}
    exited: dict[str, float] = {}
    ready_at: dict[str, float] = {}
    stop = asyncio.Event()
    async with open_runtime(rc) as frontend_rt, open_runtime(rc) as planner_rt:
        ready, bound = asyncio.Event(), list[tuple[str, int]]()
        fcfg = FrontendConfig(port=0, migration_limit=3, request_stats_interval_s=0.5,
                              max_inflight_requests=4096)  # fmt: skip
        frontend = asyncio.create_task(
            serve_frontend(fcfg, frontend_rt, ready=ready, stop=stop, bound=bound)
        )
        await asyncio.wait_for(ready.wait(), 30)
        host, port = bound[0]
        view = planner_rt.instance_set("backend", "generate")
        await view.start()
        service: PlannerService | None = None
        planner_task = None
        original_add = connector.add_worker

        async def tracked_add(component: str) -> str:
            wid = await original_add(component)
            spawned[wid] = time.perf_counter()
            return wid

        connector.add_worker = tracked_add  # type: ignore[method-assign]
        try:
            if name == "planner":
                pcfg = PlannerConfig(
                    pools=(PoolConfig(min_workers=1, max_workers=cfg.n_peak),),
                    ttft_target_ms=cfg.ttft_target_ms * cfg.planner_fraction,
                    itl_target_ms=cfg.itl_target_ms * cfg.planner_fraction,
                    interval_s=1.0, cooldown_up_s=2.0, cooldown_down_s=cfg.cooldown_down_s,
                    scale_down_margin=cfg.margin,
                    ready_timeout_s=60.0, stats_window_s=10.0,
                )  # fmt: skip
                service = PlannerService(planner_rt, connector, pcfg)
                await service.start()
                planner_task = asyncio.create_task(service.run(stop))
                n0 = 1
            else:
                n0 = cfg.n_avg if name == "static-avg" else cfg.n_peak
                for _ in range(n0):
                    await connector.add_worker("backend")
            deadline = time.monotonic() + 120
            while len(view.instances) < n0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name}: {n0} workers not ready in 120 s")
                await asyncio.sleep(0.05)
            logger.info("bench planner: %s fleet ready (%d workers); replaying %d requests",
                        name, n0, len(times))  # fmt: skip
            rng = random.Random(cfg.seed)
            pool = ConnectionPool(host, port, fresh=False, timeout_s=600.0)
            results: list[RequestResult] = []
            tasks = []
            timeline: list[tuple[float, int]] = []
            t0 = time.perf_counter()
            start = {w: t0 for w in spawned}  # static workers count from the load's start
            next_sample = 0.0
            for at in times:
                while True:
                    now = time.perf_counter() - t0
                    if now >= next_sample:
                        _sample(connector, view, spawned, exited, ready_at, timeline, now, t0)
                        next_sample += 0.5
                    if now >= at:
                        break
                    await asyncio.sleep(min(at - now, next_sample - now))
                tasks.append(asyncio.create_task(_fire(pool, _body(rng, cfg), results)))
            while not all(t.done() for t in tasks):
                now = time.perf_counter() - t0
                _sample(connector, view, spawned, exited, ready_at, timeline, now, t0)
                await asyncio.sleep(0.5)
            t_end = time.perf_counter()
            for wid in connector.procs:
                exited.setdefault(wid, t_end)
            pool.close()
        finally:
            stop.set()
            if planner_task is not None:
                await planner_task
            if service is not None:
                await service.close()
            await view.close()
            await connector.close()
            await frontend
    ws = sum(max(min(exited.get(w, t_end), t_end) - max(start.get(w, s), t0), 0.0)
             for w, s in spawned.items())  # fmt: skip
    startup = [ready_at[w] - spawned[w] for w in ready_at if w not in start]
    return RunResult(name, results, t_end - t0, ws, timeline, startup)


def _sample(connector: LocalConnector, view: Any, spawned: dict[str, float],
            exited: dict[str, float], ready_at: dict[str, float],
            timeline: list[tuple[float, int]], now: float, t0: float) -> None:  # fmt: skip
    t = time.perf_counter()
    for wid in spawned:
        if wid not in connector.procs and wid not in exited:
            exited[wid] = t
        if wid in view.instances and wid not in ready_at:
            ready_at[wid] = t
    timeline.append((now, sum(1 for w in spawned if w not in exited)))


# ---------------------------------------------------------------------------- sizing
def scaled(profile: EngineProfile, factor: float) -> EngineProfile:
    """The profile with every time multiplied by `factor` (a mocker at speedup s: 1/s)."""
    p = msgspec.structs.replace(profile)
    p.prefill = msgspec.structs.replace(
        profile.prefill, ttft_ms=[v * factor for v in profile.prefill.ttft_ms]
    )
    p.decode = msgspec.structs.replace(
        profile.decode, itl_ms=[[v * factor for v in row] for row in profile.decode.itl_ms]
    )
    return p


def fleet_for(
    rate: float, profile: EngineProfile, isl: int, osl: int, ttft: float, itl: float
) -> int:
    f = throughput_mode.Forecast(request_rate=rate, isl=isl, osl=osl)
    return max(throughput_mode.replicas("aggregated", f, profile, ttft, itl), 1)


def peak_rate_for(workers: int, profile: EngineProfile, isl: int, osl: int, ttft: float,
                  itl: float) -> float:  # fmt: skip
    """The highest rate the profile says `workers` engines serve within the targets."""
    lo, hi = 0.01, 10_000.0
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        if fleet_for(mid, profile, isl, osl, ttft, itl) <= workers:
            lo = mid
        else:
            hi = mid
    return lo


# ---------------------------------------------------------------------------- report
def summarize(run: RunResult, ttft_ms: float, itl_ms: float, peak_ws: float) -> dict[str, Any]:
    rs = run.results
    ok = [r for r in rs if r.ok]
    good = [r for r in rs if within_target(r, ttft_ms, itl_ms)]
    ttfts = sorted(r.ttft_s * 1000 for r in ok if r.ttft_s is not None)
    itls = sorted(statistics.fmean(r.itl_s) * 1000 for r in ok if r.itl_s)
    return {
        "run": run.name,
        "requests": len(rs),
        "failed": len(rs) - len(ok),
        "within_target": len(good) / len(rs) if rs else 0.0,
        "goodput_rps": len(good) / run.duration_s if run.duration_s else 0.0,
        "worker_seconds": run.worker_seconds,
        "share_of_peak_ws": run.worker_seconds / peak_ws if peak_ws else float("nan"),
        "ttft_p50_ms": _pct(ttfts, 0.5),
        "ttft_p90_ms": _pct(ttfts, 0.9),
        "itl_mean_p50_ms": _pct(itls, 0.5),
        "mean_workers": run.worker_seconds / run.duration_s if run.duration_s else 0.0,
    }


def _pct(values: list[float], q: float) -> float:
    return values[min(int(q * len(values)), len(values) - 1)] if values else float("nan")


def sim_summary(sim: Any, ttft_ms: float, itl_ms: float, duration_s: float,
                peak_ws: float) -> dict[str, Any]:  # fmt: skip
    reqs = sim.requests
    done = [r for r in reqs if r.first_s is not None]

    def ok(r: Any) -> bool:
        if r.first_s is None or (r.first_s - r.arrival_s) * 1000 > ttft_ms:
            return False
        itl = ((r.last_s - r.first_s) / (r.num_tokens - 1) * 1000) if r.num_tokens > 1 else 0.0
        return itl <= itl_ms

    ws = sum(min(w.exited_s if w.exited_s is not None else duration_s, duration_s) - w.spawned_s
             for w in sim.workers)  # fmt: skip
    ttfts = sorted((r.first_s - r.arrival_s) * 1000 for r in done)
    itls = sorted((r.last_s - r.first_s) / (r.num_tokens - 1) * 1000
                  for r in done if r.num_tokens > 1)  # fmt: skip
    good = sum(1 for r in reqs if ok(r))
    return {
        "run": "planner (simulated)",
        "requests": len(reqs),
        "failed": 0,
        "within_target": good / len(reqs) if reqs else 0.0,
        "goodput_rps": good / duration_s,
        "worker_seconds": ws,
        "share_of_peak_ws": ws / peak_ws if peak_ws else float("nan"),
        "ttft_p50_ms": _pct(ttfts, 0.5),
        "ttft_p90_ms": _pct(ttfts, 0.9),
        "itl_mean_p50_ms": _pct(itls, 0.5),
        "mean_workers": ws / duration_s,
    }


def timeline_gap(live: list[tuple[float, int]], sim: list[tuple[float, int]]) -> float:
    """Mean |live workers − simulated workers| over the live samples."""
    if not live or not sim:
        return float("nan")
    gaps = []
    j = 0
    for t, n in live:
        while j + 1 < len(sim) and sim[j + 1][0] <= t:
            j += 1
        gaps.append(abs(n - sim[j][1]))
    return statistics.fmean(gaps)


def plot(path: Path, cfg: BenchConfig, times: list[float], runs: list[RunResult],
         sim_timeline: list[tuple[float, int]]) -> None:  # fmt: skip
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_rate, ax_workers) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    bins = max(int(cfg.duration_s / 2), 1)
    ax_rate.hist(times, bins=bins, weights=[bins / cfg.duration_s] * len(times), color="grey")
    ax_rate.set_ylabel("requests / s")
    ax_rate.set_title("tandem bench planner: load and fleet size")
    for run in runs:
        if run.timeline:
            ts, ns = zip(*run.timeline, strict=True)
            ax_workers.step(ts, ns, where="post", label=f"{run.name} (live)")
    if sim_timeline:
        ts, ns = zip(*sim_timeline, strict=True)
        ax_workers.step(ts, ns, where="post", linestyle="--", label="planner (simulated)")
    ax_workers.set_xlabel("seconds")
    ax_workers.set_ylabel("live workers")
    ax_workers.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'run':<22}{'requests':>9}{'failed':>7}{'in target':>10}{'goodput/s':>10}"
            f"{'worker-s':>10}{'% peak ws':>10}{'mean wkrs':>10}{'TTFT p50':>9}{'TTFT p90':>9}"
            f"{'ITL p50':>8}")  # fmt: skip
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['run']:<22}{r['requests']:>9}{r['failed']:>7}{r['within_target']:>9.1%} "
            f"{r['goodput_rps']:>9.2f}{r['worker_seconds']:>10.0f}{r['share_of_peak_ws']:>9.0%} "
            f"{r['mean_workers']:>10.2f}{r['ttft_p50_ms']:>9.0f}{r['ttft_p90_ms']:>9.0f}"
            f"{r['itl_mean_p50_ms']:>8.1f}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------- main
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench planner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--duration-s", type=float, default=150.0)
    p.add_argument("--profile", help="engine profile JSON (default: profile the mocker first)")
    p.add_argument("--speedup-ratio", type=float, default=0.25,
                   help="the workers run the profile this much faster")  # fmt: skip
    p.add_argument("--peak-workers", type=int, default=6,
                   help="size the peak rate so the profile needs this many workers")  # fmt: skip
    p.add_argument("--isl", type=int, default=1500)
    p.add_argument("--osl", type=int, default=40)
    p.add_argument("--ttft-target-ms", type=float, help="default: 6 × the profiled TTFT at ISL")
    p.add_argument("--itl-target-ms", type=float, help="default: 4 × the profiled ITL at batch 1")
    p.add_argument("--planner-target-fraction", type=float, default=0.6,
                   help="the planner's TTFT/ITL targets are the SLO's × this: it predicts means, "
                   "the SLO counts each request")  # fmt: skip
    p.add_argument("--scale-down-margin", type=float, default=0.7,
                   help="the planner's: survivors must stay under target × this")  # fmt: skip
    p.add_argument("--cooldown-down-s", type=float, default=8.0)
    p.add_argument("--runs", default="planner,static-avg,static-peak")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-planner", help="directory for the PNG and JSON")
    return p


def _interrupt(_sig: int, _frame: object) -> None:
    raise KeyboardInterrupt  # unwinds asyncio.run: every run's finally drains its workers


def main(argv: list[str]) -> int:
    import signal

    signal.signal(signal.SIGTERM, _interrupt)
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile_path = Path(args.profile) if args.profile else out / "mocker-profile.json"
    if not args.profile:
        asyncio.run(_profile_mocker(profile_path))
    profile = load_profile(profile_path)
    eff = scaled(profile, 1.0 / args.speedup_ratio)
    ttft = args.ttft_target_ms or 6 * eff.ttft_ms(args.isl)
    itl = args.itl_target_ms or 4 * eff.itl_ms(1, args.isl + args.osl / 2)
    peak = peak_rate_for(args.peak_workers, eff, args.isl, args.osl, ttft, itl)
    times = send_times(args.duration_s, peak, args.seed)
    mean_rate = len(times) / args.duration_s
    n_avg = fleet_for(mean_rate, eff, args.isl, args.osl, ttft, itl)
    worker_args = ["--engine", "mocker", "--perf-profile", str(profile_path.resolve()),
                   "--speedup-ratio", str(args.speedup_ratio),
                   "--block-size", str(profile.block_size),
                   "--num-blocks", str(profile.num_total_blocks),
                   "--max-num-seqs", str(profile.max_num_seqs),
                   "--max-num-batched-tokens", str(profile.max_num_batched_tokens),
                   "--log-level", "WARNING"]  # fmt: skip
    cfg = BenchConfig(duration_s=args.duration_s, peak_rate=peak, isl=args.isl, osl=args.osl,
                      ttft_target_ms=ttft, itl_target_ms=itl, worker_args=worker_args,
                      n_avg=n_avg, n_peak=args.peak_workers, seed=args.seed, out_dir=out,
                      speedup=args.speedup_ratio, margin=args.scale_down_margin,
                      cooldown_down_s=args.cooldown_down_s,
                      planner_fraction=args.planner_target_fraction)  # fmt: skip
    print(f"schedule: {len(times)} requests over {args.duration_s:.0f} s, peak {peak:.1f} req/s, "
          f"mean {mean_rate:.2f} req/s; ISL {args.isl} OSL {args.osl}; targets TTFT "
          f"{ttft:.0f} ms ITL {itl:.1f} ms (planner plans for × {args.planner_target_fraction}); "
          f"static fleets: avg {n_avg}, peak {args.peak_workers}")  # fmt: skip
    runs = [asyncio.run(live_run(name, cfg, times)) for name in args.runs.split(",")]
    return report(cfg, times, runs, profile_path)


def report(cfg: BenchConfig, times: list[float], runs: list[RunResult], profile_path: Path) -> int:
    from tandem.bench.planner_sim import FleetSimulation
    from tandem.engines.mocker.config import MockerConfig

    peak_ws = cfg.n_peak * max((r.duration_s for r in runs), default=cfg.duration_s)
    rows = [summarize(r, cfg.ttft_target_ms, cfg.itl_target_ms, peak_ws) for r in runs]
    live = next((r for r in runs if r.name == "planner"), None)
    sim_timeline: list[tuple[float, int]] = []
    if live is not None:
        profile = load_profile(profile_path)
        startup = statistics.median(live.startup_s) if live.startup_s else 2.0
        mocker = MockerConfig(tokenizer=None, perf_profile=str(profile_path),
                              speedup_ratio=cfg.speedup, block_size=profile.block_size,
                              num_blocks=profile.num_total_blocks,
                              max_num_seqs=profile.max_num_seqs,
                              max_num_batched_tokens=profile.max_num_batched_tokens)  # fmt: skip
        pcfg = PlannerConfig(
            pools=(PoolConfig(min_workers=1, max_workers=cfg.n_peak),),
            ttft_target_ms=cfg.ttft_target_ms * cfg.planner_fraction,
            itl_target_ms=cfg.itl_target_ms * cfg.planner_fraction, interval_s=1.0,
            cooldown_up_s=2.0, cooldown_down_s=cfg.cooldown_down_s, scale_down_margin=cfg.margin,
            ready_timeout_s=60.0, stats_window_s=10.0,
        )  # fmt: skip
        sim = FleetSimulation(mocker, isl=cfg.isl, osl=cfg.osl, startup_s=startup, planner=pcfg,
                              seed=cfg.seed).run(times, live.duration_s)  # fmt: skip
        sim_timeline = sim.timeline
        srow = sim_summary(sim, cfg.ttft_target_ms, cfg.itl_target_ms, live.duration_s, peak_ws)
        rows.append(srow)
    print(format_table(rows))
    for run in runs:
        failed = [r for r in run.results if not r.ok]
        for r in failed[:5]:  # a failure is named, not just counted
            at = r.start_s - min(x.start_s for x in run.results)
            print(f"failed ({run.name}, sent at {at:.1f} s): status {r.status} {r.error}")
    if live is not None:
        lrow = rows[[r.name for r in runs].index("planner")]
        gap = timeline_gap(live.timeline, sim_timeline)
        d_share = (srow["within_target"] - lrow["within_target"]) * 100
        print(
            f"simulation vs live (planner): within-target {srow['within_target']:.1%} vs "
            f"{lrow['within_target']:.1%} ({d_share:+.1f} pts); "
            f"worker-seconds {srow['worker_seconds']:.0f} vs {lrow['worker_seconds']:.0f} "
            f"({(srow['worker_seconds'] / lrow['worker_seconds'] - 1) * 100:+.0f} %); "
            f"TTFT p50 {srow['ttft_p50_ms']:.0f} vs {lrow['ttft_p50_ms']:.0f} ms; "
            f"mean |Δ workers| over time {gap:.2f}; median live startup "
            f"{statistics.median(live.startup_s) if live.startup_s else float('nan'):.2f} s"
        )  # fmt: skip
    png = cfg.out_dir / "planner-timeline.png"
    plot(png, cfg, times, runs, sim_timeline)
    (cfg.out_dir / "summary.json").write_text(json.dumps(
        {"rows": rows, "peak_rate": cfg.peak_rate, "ttft_target_ms": cfg.ttft_target_ms,
         "itl_target_ms": cfg.itl_target_ms, "n_avg": cfg.n_avg, "n_peak": cfg.n_peak,
         "timelines": {r.name: r.timeline for r in runs}, "sim_timeline": sim_timeline},
        indent=1, default=float))  # fmt: skip
    print(f"plot: {png}")
    failed = sum(r["failed"] for r in rows)
    return 0 if failed == 0 else 1


async def _profile_mocker(path: Path) -> None:
    from tandem.engines.mocker.config import MockerConfig
    from tandem.engines.mocker.engine import MockerEngine
    from tandem.planner.profiler import profile_engine

    engine = MockerEngine(MockerConfig(tokenizer=None))
    profile = await profile_engine(engine, engine_name="mocker", isls=[128, 512, 1024, 2048, 4096],
                                   batches=[1, 8, 32, 128], contexts=[128, 1024, 2048],
                                   decode_steps=6, repeats=2)  # fmt: skip
    ProfileFile(path).write(profile)
