"""`tandem bench planner`: the planner against static fleets on one time-varying load.

The schedule (Poisson arrivals, rate shaped over `--duration-s`): ramp up from near zero to 60 %
of the peak, plateau, a burst at the peak, fall to near zero and stay there. The SLO (TTFT and
mean ITL per request) is an input (`--ttft-slo-ms`, `--itl-slo-ms`), and the peak rate is what
the engine profile says `--peak-workers` engines serve within it. The same arrivals (one seed)
are replayed against each fleet, live (mocker worker processes replaying the profile, local
connector, file discovery + ZMQ events, the frontend in this process) and in the offline
simulation (`planner_sim` beside it: the same mocker scheduler and `Planner` core, simulated
time):

1. `planner`: load mode, 1..`--max-workers` workers, planning for the SLO ×
   `--planner-target-fraction` (the planner predicts means; the SLO judges every request);
2. `static-avg`: the fleet the profile says the average rate needs;
3. `static-peak`: `--peak-workers`, fixed: the baseline.

Per run, measured: share of requests within both SLOs (attainment), goodput, worker-seconds
(each worker from its spawn, or the load's start for a static one, to its exit or the last
answer, so the planner's startups and drains count), failed requests, seconds the planner spent
at its cap; the planner's worker-seconds over the static peak's from the same source, and the
scaling timeline as a PNG. Verdict: PASS when every planner run answered every request, met
the SLO for `--slo-attainment` of them and used no more worker-seconds than the static peak
(exit 0), else FAIL (exit 1).
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
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from tandem.bench.client import ConnectionPool, RequestResult
from tandem.bench.component.planner_report import (
    BenchConfig,
    Outcome,
    RunResult,
    format_table,
    outcome_of,
    plot,
    summarize_all,
    timeline_gap,
    verdict,
)
from tandem.engines.profile import EngineProfile, load_profile
from tandem.planner import throughput_mode
from tandem.planner.config import PlannerConfig, PoolConfig
from tandem.planner.connector.local import LocalConnector
from tandem.planner.control_loop import PlannerService
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.instances import InstanceSet
from tandem.runtime.runtime import open_runtime

if TYPE_CHECKING:  # imported where used: `--help` and the live runs need neither
    from tandem.engines.mocker.config import MockerConfig
    from tandem.planner.planner import Planner

logger = logging.getLogger(__name__)
_json = msgspec.json.Encoder()

# `tandem profile --engine native` of the default model (SmolLM2-135M, Q4_1) on a 2-core AMD
# EPYC with AVX2 and no AVX-512; how it was made: tandem/planner/profiles/README.md
DEFAULT_PROFILE = (Path(__file__).resolve().parents[2] / "planner" / "profiles"
                   / "smollm2-native-epyc-avx2.json")  # fmt: skip
# The default SLO, for the default profile and ISL/OSL (128/32): TTFT 5 s, ~3× one 128-token
# prefill alone there (1.7 s: room for a prompt or two queued ahead); mean ITL 400 ms, ~1.5×
# the profile's 8-sequence decode step (260 ms) with room for a 128-token prefill step
# (1.7 s) stalling each running answer once. Slow, as this CPU is: the SLO scales with it.
DEFAULT_TTFT_SLO_MS = 5000.0
DEFAULT_ITL_SLO_MS = 400.0


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


def planner_config(cfg: BenchConfig) -> PlannerConfig:
    """The planner of both the live and the simulated run."""
    return PlannerConfig(
        pools=(PoolConfig(min_workers=1, max_workers=cfg.max_workers),),
        ttft_target_ms=cfg.ttft_slo_ms * cfg.planner_fraction,
        itl_target_ms=cfg.itl_slo_ms * cfg.planner_fraction,
        interval_s=1.0, cooldown_up_s=2.0, cooldown_down_s=cfg.cooldown_down_s,
        scale_down_margin=cfg.margin, ready_timeout_s=60.0, stats_window_s=10.0,
    )  # fmt: skip


def fleet_size(name: str, cfg: BenchConfig) -> int:
    return {"planner": 1, "static-avg": cfg.n_avg, "static-peak": cfg.n_peak}[name]


# ---------------------------------------------------------------------------- live runs
async def _fire(pool: ConnectionPool, body: bytes, results: list[RequestResult]) -> None:
    result = RequestResult(start_s=time.perf_counter())
    results.append(await pool.send("/v1/completions", body, result))


def _body(rng: random.Random, cfg: BenchConfig) -> bytes:
    prompt = [rng.randrange(100, 40000) for _ in range(cfg.isl)]
    return _json.encode({"model": "smollm2", "prompt": prompt, "max_tokens": cfg.osl,
                         "stream": True, "stream_options": {"include_usage": True}})  # fmt: skip


async def live_run(name: str, cfg: BenchConfig, times: list[float]) -> RunResult:
    from tandem.frontend.config import FrontendConfig
    from tandem.frontend.serve import serve_frontend

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
            n0 = fleet_size(name, cfg)
            if name == "planner":
                service = PlannerService(planner_rt, connector, planner_config(cfg))
                await service.start()
                planner_task = asyncio.create_task(service.run(stop))
            else:
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
    errors = [f"sent at {r.start_s - t0:.1f} s: status {r.status} {r.error}"
              for r in results if not r.ok][:5]  # fmt: skip
    return RunResult(name, "live", [outcome_of(r) for r in results], t_end - t0, ws, timeline,
                     startup, errors)  # fmt: skip


def _sample(connector: LocalConnector, view: InstanceSet, spawned: dict[str, float],
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


# ---------------------------------------------------------------------------- simulated runs
def mocker_config(cfg: BenchConfig, profile_path: Path) -> MockerConfig:
    from tandem.engines.mocker.config import MockerConfig

    profile = load_profile(profile_path)
    return MockerConfig(tokenizer=None, perf_profile=str(profile_path),
                        speedup_ratio=cfg.speedup, block_size=profile.block_size,
                        num_blocks=profile.num_total_blocks, max_num_seqs=profile.max_num_seqs,
                        max_num_batched_tokens=profile.max_num_batched_tokens)  # fmt: skip


def sim_run(
    name: str, cfg: BenchConfig, times: list[float], mocker: MockerConfig, *, startup_s: float,
    planner_core: Planner | None = None,
) -> RunResult:  # fmt: skip
    """`name`'s fleet in the offline simulation, on the same arrivals as the live run; a
    static fleet is `fleet_size` workers ready at 0, the planner's fleet starts at one.
    `planner_core` replaces the planner (tests: a wrong one must fail the verdict)."""
    from tandem.bench.component.planner_sim import FleetSimulation

    is_planner = name == "planner"
    sim = FleetSimulation(
        mocker, isl=cfg.isl, osl=cfg.osl, startup_s=startup_s,
        planner=planner_config(cfg) if is_planner else None,
        num_static=fleet_size(name, cfg), seed=cfg.seed, planner_core=planner_core,
    ).run(times)  # fmt: skip
    outcomes = []
    for r in sim.requests:
        if r.first_s is None or r.last_s is None:
            outcomes.append(Outcome(False))
            continue
        itl = (r.last_s - r.first_s) / (r.num_tokens - 1) if r.num_tokens > 1 else None
        outcomes.append(Outcome(r.num_tokens >= cfg.osl, r.first_s - r.arrival_s, itl))
    return RunResult(name, "sim", outcomes, sim.end_s, sim.worker_seconds, sim.timeline)


# ---------------------------------------------------------------------------- main
RUN_NAMES = ("planner", "static-avg", "static-peak")


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a number") from None
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number > 0")
    return value


def _fraction(text: str) -> float:
    value = _positive(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a fraction in (0, 1]")
    return value


def _runs(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in RUN_NAMES]
    if bad or "planner" not in names or "static-peak" not in names:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected a comma-separated subset of {', '.join(RUN_NAMES)} that holds "
            f"planner and static-peak (the baseline it is judged against)"
        )
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench planner", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--duration-s", type=_positive, default=150.0, help="length of the schedule")
    p.add_argument(
        "--profile",
        default=str(DEFAULT_PROFILE),
        help="engine profile JSON the mocker workers replay (default: the committed "
        "native SmolLM2-135M profile, measured on a 2-core AMD EPYC, AVX2 only)",
    )
    p.add_argument(
        "--speedup-ratio",
        type=_positive,
        default=1.0,
        help="the workers run the profile this much faster (1: its own times)",
    )
    p.add_argument("--peak-workers", type=int, default=6,
                   help="the static peak fleet; the peak rate is what the profile says this "
                   "many workers serve within the SLO")  # fmt: skip
    p.add_argument(
        "--max-workers",
        type=int,
        help="the planner's cap (default: 2 × --peak-workers, so that the cap does "
        "not bound what the planner chooses; the report gives the time at it)",
    )
    p.add_argument("--isl", type=int, default=128)
    p.add_argument("--osl", type=int, default=32)
    p.add_argument("--ttft-slo-ms", type=_positive, default=DEFAULT_TTFT_SLO_MS,
                   help="TTFT every request is judged by (default %(default)s ms: ~3× the "
                   "default profile's 128-token prefill alone, room for a prompt or two queued "
                   "ahead)")  # fmt: skip
    p.add_argument("--itl-slo-ms", type=_positive, default=DEFAULT_ITL_SLO_MS,
                   help="mean inter-token latency every request is judged by (default "
                   "%(default)s ms: ~1.5× the default profile's 8-sequence decode step, with "
                   "room for one prompt's prefill step stalling each answer)")  # fmt: skip
    p.add_argument(
        "--slo-attainment",
        type=_fraction,
        default=0.9,
        help="share of requests that must meet both SLOs for the planner to pass",
    )
    p.add_argument("--planner-target-fraction", type=_fraction, default=0.6,
                   help="the planner's TTFT/ITL targets are the SLO × this (default "
                   "%(default)s): it predicts and measures means, the SLO counts each request, "
                   "and under Poisson arrivals the tail runs well over the mean")  # fmt: skip
    p.add_argument("--scale-down-margin", type=_fraction, default=0.7,
                   help="the planner's: survivors must stay under target × this")  # fmt: skip
    p.add_argument("--cooldown-down-s", type=float, default=8.0)
    p.add_argument(
        "--startup-s",
        type=_positive,
        default=2.0,
        help="the simulation's worker startup when no live planner run measured it",
    )
    p.add_argument("--runs", type=_runs, default=list(RUN_NAMES))
    p.add_argument(
        "--sim-only",
        action="store_true",
        help="only the offline simulation (seconds; no processes)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-planner", help="directory for the PNG and JSON")
    return p


def _interrupt(_sig: int, _frame: object) -> None:
    raise KeyboardInterrupt  # unwinds asyncio.run: every run's finally drains its workers


def configure(args: argparse.Namespace) -> tuple[BenchConfig, list[float], Path]:
    """The load and the fleets from the flags (the SLO is an input; the peak rate is what the
    profile says `--peak-workers` serve within it)."""
    if args.peak_workers < 1:
        raise SystemExit(f"--peak-workers {args.peak_workers}: expected >= 1")
    cap = args.max_workers if args.max_workers is not None else 2 * args.peak_workers
    if cap < 1:
        raise SystemExit(f"--max-workers {cap}: expected >= 1")
    if args.isl < 1 or args.osl < 1:
        raise SystemExit(f"--isl {args.isl} --osl {args.osl}: expected >= 1 each")
    profile_path = Path(args.profile)
    profile = load_profile(profile_path)
    eff = scaled(profile, 1.0 / args.speedup_ratio)
    ttft, itl = args.ttft_slo_ms, args.itl_slo_ms
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
                      ttft_slo_ms=ttft, itl_slo_ms=itl, slo_attainment=args.slo_attainment,
                      planner_fraction=args.planner_target_fraction, worker_args=worker_args,
                      n_avg=n_avg, n_peak=args.peak_workers, max_workers=cap, seed=args.seed,
                      out_dir=Path(args.out), speedup=args.speedup_ratio,
                      margin=args.scale_down_margin, cooldown_down_s=args.cooldown_down_s,
                      startup_s=args.startup_s)  # fmt: skip
    return cfg, times, profile_path


def main(argv: list[str]) -> int:
    import signal

    signal.signal(signal.SIGTERM, _interrupt)
    args = build_parser().parse_args(argv)
    cfg, times, profile_path = configure(args)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    print(f"schedule: {len(times)} requests over {cfg.duration_s:.0f} s (seed {cfg.seed}), "
          f"peak {cfg.peak_rate:.2f} req/s, mean {len(times) / cfg.duration_s:.2f} req/s; "
          f"ISL {cfg.isl} OSL {cfg.osl}; profile {profile_path} at speedup {cfg.speedup}; "
          f"SLO TTFT {cfg.ttft_slo_ms:.0f} ms, ITL {cfg.itl_slo_ms:.0f} ms for "
          f"{cfg.slo_attainment:.0%} of requests; the planner plans for the SLO × "
          f"{cfg.planner_fraction}, 1..{cfg.max_workers} workers; static fleets: avg "
          f"{cfg.n_avg}, peak {cfg.n_peak}")  # fmt: skip
    runs: list[RunResult] = []
    if not args.sim_only:
        runs += [asyncio.run(live_run(name, cfg, times)) for name in args.runs]
    return report(cfg, times, runs, profile_path, args.runs)


def report(
    cfg: BenchConfig, times: list[float], live: list[RunResult], profile_path: Path,
    names: tuple[str, ...] | list[str] = RUN_NAMES,
) -> int:  # fmt: skip
    """Simulate each of `names` on the same arrivals, print every run (live and simulated)
    side by side with the verdict; 0 when the planner passes, 1 when it fails."""
    live_planner = next((r for r in live if r.name == "planner"), None)
    startup = cfg.startup_s
    if live_planner is not None and live_planner.startup_s:
        startup = statistics.median(live_planner.startup_s)
    mocker = mocker_config(cfg, profile_path)
    sims = [sim_run(name, cfg, times, mocker, startup_s=startup) for name in names]
    runs = [*live, *sims]
    rows = summarize_all(runs, cfg)
    print(format_table(rows))
    for run in live:
        for err in run.errors:  # a failure is named, not just counted
            print(f"failed ({run.name}, {err})")
    sim_planner = next(r for r in sims if r.name == "planner")
    if live_planner is not None:
        lrow = next(r for r in rows if r["run"] == "planner" and r["source"] == "live")
        srow = next(r for r in rows if r["run"] == "planner" and r["source"] == "sim")
        print(
            f"simulation vs live (planner): in SLO {srow['slo_attainment']:.1%} vs "
            f"{lrow['slo_attainment']:.1%}; worker-seconds {srow['worker_seconds']:.0f} vs "
            f"{lrow['worker_seconds']:.0f}; TTFT p50 {srow['ttft_p50_ms']:.0f} vs "
            f"{lrow['ttft_p50_ms']:.0f} ms; mean |Δ workers| over time "
            f"{timeline_gap(live_planner.timeline, sim_planner.timeline):.2f}; median live "
            f"startup {startup:.2f} s"
        )
    passed, lines = verdict(rows, cfg)
    print("\n".join(lines))
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    png = cfg.out_dir / "planner-timeline.png"
    plot(png, cfg, times, runs)
    (cfg.out_dir / "summary.json").write_text(json.dumps(
        {"rows": rows, "passed": passed, "verdict": lines, "peak_rate": cfg.peak_rate,
         "ttft_slo_ms": cfg.ttft_slo_ms, "itl_slo_ms": cfg.itl_slo_ms,
         "slo_attainment": cfg.slo_attainment, "planner_fraction": cfg.planner_fraction,
         "n_avg": cfg.n_avg, "n_peak": cfg.n_peak, "max_workers": cfg.max_workers,
         "timelines": {f"{r.name} ({r.source})": r.timeline for r in runs}},
        indent=1, default=float))  # fmt: skip
    print(f"plot: {png}")
    return 0 if passed else 1
