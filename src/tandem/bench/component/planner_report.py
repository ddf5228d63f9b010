"""`tandem bench planner`'s results and report: each request as the SLO judges it, each run
(live or simulated) as a row, the verdict, the table and the scaling-timeline plot."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench.client import RequestResult


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request as the SLO judges it: answered in full, its TTFT and its mean ITL."""

    ok: bool
    ttft_s: float | None = None
    itl_s: float | None = None  # mean gap between its tokens (None: one token)


def outcome_of(r: RequestResult) -> Outcome:
    return Outcome(r.ok, r.ttft_s, statistics.fmean(r.itl_s) if r.itl_s else None)


def meets_slo(o: Outcome, ttft_ms: float, itl_ms: float) -> bool:
    """Answered, TTFT within `ttft_ms` and the mean ITL within `itl_ms`."""
    if not o.ok or o.ttft_s is None:
        return False
    return o.ttft_s * 1000 <= ttft_ms and (o.itl_s or 0.0) * 1000 <= itl_ms


@dataclass(slots=True)
class RunResult:
    name: str  # planner, static-avg, static-peak
    source: str  # live or sim
    outcomes: list[Outcome]
    duration_s: float  # from the first arrival's time 0 to the last answer
    worker_seconds: float  # measured: each worker from spawn (or the load's start) to exit
    timeline: list[tuple[float, int]] = field(default_factory=list)  # (t, live workers)
    startup_s: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # the first failures, named


@dataclass(frozen=True, slots=True, kw_only=True)
class BenchConfig:
    duration_s: float
    peak_rate: float
    isl: int
    osl: int
    ttft_slo_ms: float  # the SLO every request is judged by (an input, never derived)
    itl_slo_ms: float
    slo_attainment: float  # share of requests that must meet the SLO for a pass
    planner_fraction: float  # the planner plans for the SLO × this (its mean vs their tail)
    worker_args: list[str]
    n_avg: int
    n_peak: int
    max_workers: int  # the planner's cap
    seed: int
    out_dir: Path
    speedup: float
    margin: float
    cooldown_down_s: float
    startup_s: float = 2.0  # the simulation's worker startup when no live run measured it


def time_at_cap(timeline: list[tuple[float, int]], cap: int, end_s: float) -> float:
    """Seconds the fleet held `cap` or more workers (the timeline steps hold until the next
    sample; the last until `end_s`)."""
    total = 0.0
    for i, (t, n) in enumerate(timeline):
        t_next = timeline[i + 1][0] if i + 1 < len(timeline) else end_s
        if n >= cap:
            total += max(min(t_next, end_s) - t, 0.0)
    return total


def summarize(run: RunResult, cfg: BenchConfig, peak_ws: float | None) -> dict[str, Any]:
    """`peak_ws`: the static-peak fleet's measured worker-seconds from the same source."""
    os_ = run.outcomes
    ok = [o for o in os_ if o.ok]
    good = sum(1 for o in os_ if meets_slo(o, cfg.ttft_slo_ms, cfg.itl_slo_ms))
    ttfts = sorted(o.ttft_s * 1000 for o in ok if o.ttft_s is not None)
    itls = sorted(o.itl_s * 1000 for o in ok if o.itl_s is not None)
    at_cap = time_at_cap(run.timeline, cfg.max_workers, run.duration_s)
    return {
        "run": run.name,
        "source": run.source,
        "requests": len(os_),
        "failed": len(os_) - len(ok),
        "slo_attainment": good / len(os_) if os_ else 0.0,
        "goodput_rps": good / run.duration_s if run.duration_s else 0.0,
        "duration_s": run.duration_s,
        "worker_seconds": run.worker_seconds,
        "ws_vs_static_peak": run.worker_seconds / peak_ws if peak_ws else float("nan"),
        "mean_workers": run.worker_seconds / run.duration_s if run.duration_s else 0.0,
        "max_workers_seen": max((n for _, n in run.timeline), default=0),
        "s_at_cap": at_cap if run.name == "planner" else float("nan"),
        "ttft_p50_ms": _pct(ttfts, 0.5),
        "ttft_p90_ms": _pct(ttfts, 0.9),
        "itl_mean_p50_ms": _pct(itls, 0.5),
    }


def _pct(values: list[float], q: float) -> float:
    return values[min(int(q * len(values)), len(values) - 1)] if values else float("nan")


def summarize_all(runs: list[RunResult], cfg: BenchConfig) -> list[dict[str, Any]]:
    peak = {r.source: r.worker_seconds for r in runs if r.name == "static-peak"}
    return [summarize(r, cfg, peak.get(r.source)) for r in runs]


def verdict(rows: list[dict[str, Any]], cfg: BenchConfig) -> tuple[bool, list[str]]:
    """Pass when every planner run (simulated and live) answered every request, met the SLO
    for at least `slo_attainment` of them and used no more worker-seconds than the static
    peak fleet on the same arrivals (the point of a planner); the lines say why."""
    lines, passed = [], True
    by = {(r["run"], r["source"]): r for r in rows}
    for (name, source), r in sorted(by.items()):
        if name != "planner":
            continue
        peak = by.get(("static-peak", source))
        ok = r["failed"] == 0 and r["slo_attainment"] >= cfg.slo_attainment
        costlier = peak is not None and r["worker_seconds"] > peak["worker_seconds"]
        ok &= not costlier
        passed &= ok
        vs = (f"; static peak ({cfg.n_peak} workers): {peak['slo_attainment']:.1%} in SLO, "
              f"{peak['worker_seconds']:.0f} worker-s; planner / static peak worker-s "
              f"{r['ws_vs_static_peak']:.2f}") if peak else ""  # fmt: skip
        lines.append(
            f"{'PASS' if ok else 'FAIL'} ({source}): planner {r['slo_attainment']:.1%} of "
            f"{r['requests']} requests in SLO (need {cfg.slo_attainment:.0%}), {r['failed']} "
            f"failed, {r['worker_seconds']:.0f} worker-s{vs}"
        )
        if costlier:
            lines.append(f"  the planner used more worker-seconds than the static peak ({source})")
        if r["s_at_cap"] > 0:
            lines.append(
                f"  at its cap ({cfg.max_workers} workers) for {r['s_at_cap']:.0f} s of "
                f"{r['duration_s']:.0f} s ({source}): the cap bounded the planner; raise "
                f"--max-workers to see what it would choose"
            )
    for r in rows:
        if r["run"] == "static-peak" and r["slo_attainment"] < cfg.slo_attainment:
            lines.append(
                f"  note ({r['source']}): the static peak fleet itself meets the SLO for only "
                f"{r['slo_attainment']:.1%}: the SLO is tight for this profile and load"
            )
    return passed, lines


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


def plot(path: Path, cfg: BenchConfig, times: list[float], runs: list[RunResult]) -> None:
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
            style = "--" if run.source == "sim" else "-"
            ax_workers.step(ts, ns, where="post", linestyle=style,
                            label=f"{run.name} ({run.source})")  # fmt: skip
    ax_workers.axhline(cfg.max_workers, color="red", linewidth=0.8, label="planner cap")
    ax_workers.set_xlabel("seconds")
    ax_workers.set_ylabel("live workers")
    ax_workers.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'run':<13}{'source':<7}{'requests':>9}{'failed':>7}{'in SLO':>8}{'goodput/s':>10}"
            f"{'worker-s':>9}{'vs peak':>8}{'mean wkrs':>10}{'s at cap':>9}{'TTFT p50':>9}"
            f"{'TTFT p90':>9}{'ITL p50':>8}")  # fmt: skip
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['run']:<13}{r['source']:<7}{r['requests']:>9}{r['failed']:>7}"
            f"{r['slo_attainment']:>7.1%} {r['goodput_rps']:>9.2f} {r['worker_seconds']:>8.0f}"
            f"{r['ws_vs_static_peak']:>8.2f}{r['mean_workers']:>10.2f}{r['s_at_cap']:>9.0f}"
            f"{r['ttft_p50_ms']:>9.0f}{r['ttft_p90_ms']:>9.0f}{r['itl_mean_p50_ms']:>8.1f}"
        )
    return "\n".join(lines)
