"""`tandem bench soak`: mixed load against a `tandem serve --engine mocker` stack for a given
time, sampling the RSS of every process of the stack; reports each process's RSS slope.

Load: `--concurrency` client loops, each request picked at random: chat or completions,
streamed or not, a share cancelled after the first chunk (the client closes the connection),
prompt length and max_tokens drawn from ranges. Every `--sample-period-s` the RSS of the serve
process and each of its children (the workers) is read with psutil. The slope (MB/min) is a
least-squares fit over the samples after the warm-up share of the run, when caches, pools and
allocator arenas have reached their working size; growth after that is a leak. Target: every
process's slope below 0.2 MB/min over 30 minutes.

    tandem bench soak --duration-s 1800 --workers 2 --json soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from tandem.config_check import check_range

logger = logging.getLogger(__name__)

SLOPE_TARGET_MB_PER_MIN = 0.2
WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "seven",
    "tired",
    "owls",
    "watch",
]


@dataclass(frozen=True, slots=True, kw_only=True)
class SoakConfig:
    duration_s: float = 1800.0
    num_workers: int = 2
    concurrency: int = 8
    speedup_ratio: float = 1.0
    sample_period_s: float = 5.0
    warmup_share: float = 0.25
    cancel_share: float = 0.1
    stream_share: float = 0.5
    chat_share: float = 0.5
    prompt_words: tuple[int, int] = (1, 400)
    max_tokens: tuple[int, int] = (1, 200)
    seed: int = 0

    def __post_init__(self) -> None:
        check_range("duration_s", self.duration_s, low=0, low_open=True)
        check_range("sample_period_s", self.sample_period_s, low=0, low_open=True)
        check_range("warmup_share", self.warmup_share, low=0, high=1, high_open=True)
        check_range("cancel_share", self.cancel_share, low=0, high=1)
        check_range("stream_share", self.stream_share, low=0, high=1)
        check_range("chat_share", self.chat_share, low=0, high=1)
        check_range("concurrency", self.concurrency, low=1)
        check_range("num_workers", self.num_workers, low=1)


@dataclass(slots=True)
class SoakRun:
    samples: dict[str, list[tuple[float, float]]] = field(default_factory=dict)  # name -> (s, MB)
    num_ok: Counter[str] = field(default_factory=Counter)
    num_cancelled: int = 0
    failures: Counter[str] = field(default_factory=Counter)  # "kind: error" -> count
    duration_s: float = 0.0


def slope_mb_per_min(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) points in MB per minute; None under 3 points."""
    if len(points) < 3:
        return None
    n = len(points)
    mean_t = sum(t for t, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    var = sum((t - mean_t) ** 2 for t, _ in points)
    if var == 0:
        return None
    cov = sum((t - mean_t) * (y - mean_y) for t, y in points)
    return cov / var * 60.0


def summarize(run: SoakRun, config: SoakConfig) -> dict[str, Any]:
    warm = config.warmup_share * run.duration_s
    procs = {}
    for name, points in sorted(run.samples.items()):
        after = [p for p in points if p[0] >= warm]
        slope = slope_mb_per_min(after)
        procs[name] = {
            "rss_first_mb": points[0][1],
            "rss_warm_mb": after[0][1] if after else None,
            "rss_last_mb": points[-1][1],
            "rss_max_mb": max(y for _, y in points),
            "num_samples": len(after),
            "slope_mb_per_min": slope,
            "meets_target": slope is not None and slope < SLOPE_TARGET_MB_PER_MIN,
        }
    return {
        "duration_s": run.duration_s,
        "warmup_s": warm,
        "num_ok": dict(run.num_ok),
        "num_cancelled": run.num_cancelled,
        "num_failed": sum(run.failures.values()),
        "failures": dict(run.failures),
        "processes": procs,
    }


def format_table(summary: dict[str, Any]) -> str:
    def f(v: float | None, digits: int = 1) -> str:
        return "-" if v is None else f"{v:.{digits}f}"

    lines = [
        f"soak: {summary['duration_s']:.0f} s, slope after {summary['warmup_s']:.0f} s warm-up; "
        f"ok {sum(summary['num_ok'].values())} {summary['num_ok']}, cancelled "
        f"{summary['num_cancelled']}, failed {summary['num_failed']}",
        f"{'process':<12}{'rss start':>10}{'rss warm':>10}{'rss end':>10}{'rss max':>10}"
        f"{'MB/min':>10}{'samples':>9}  target<{SLOPE_TARGET_MB_PER_MIN}",
    ]
    for name, p in summary["processes"].items():
        lines.append(
            f"{name:<12}{f(p['rss_first_mb']):>10}{f(p['rss_warm_mb']):>10}"
            f"{f(p['rss_last_mb']):>10}{f(p['rss_max_mb']):>10}"
            f"{f(p['slope_mb_per_min'], 3):>10}{p['num_samples']:>9}  "
            f"{'ok' if p['meets_target'] else 'MISSED'}"
        )
    for what, n in summary["failures"].items():
        lines.append(f"failure x{n}: {what}")
    return "\n".join(lines)


# ------------------------------------------------------------------ the stack's processes
def stack_processes(serve_pid: int) -> dict[str, psutil.Process]:
    """`serve` (frontend) and its children as `worker0..`, in pid order."""
    serve = psutil.Process(serve_pid)
    children = sorted(serve.children(recursive=True), key=lambda p: p.pid)
    return {"serve": serve, **{f"worker{i}": p for i, p in enumerate(children)}}


async def sample_rss(
    serve_pid: int, run: SoakRun, started: float, period_s: float, stop: asyncio.Event
) -> None:
    while not stop.is_set():
        now = time.monotonic() - started
        for name, proc in stack_processes(serve_pid).items():
            try:
                rss_mb = proc.memory_info().rss / 1e6
            except psutil.Error:
                continue
            run.samples.setdefault(name, []).append((now, rss_mb))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), period_s)


# ------------------------------------------------------------------ load
def _request(
    rng: random.Random, config: SoakConfig, model: str, i: int
) -> tuple[str, dict[str, Any]]:
    words = rng.randint(*config.prompt_words)
    text = f"request {i}: " + " ".join(rng.choice(WORDS) for _ in range(words))
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": rng.randint(*config.max_tokens),
        "stream": rng.random() < config.stream_share,
    }
    if rng.random() < config.chat_share:
        body["messages"] = [{"role": "user", "content": text}]
        return "/v1/chat/completions", body
    body["prompt"] = text
    return "/v1/completions", body


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    path: str,
    body: dict[str, Any],
    cancel: bool,
    run: SoakRun,
) -> None:
    kind = ("chat" if "chat" in path else "completions") + ("-stream" if body["stream"] else "")
    try:
        async with session.post(url + path, json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                run.failures[f"{kind}: HTTP {resp.status} {text}"] += 1
                return
            if cancel and body["stream"]:
                await resp.content.readany()
                resp.close()  # the client goes away mid-stream
                run.num_cancelled += 1
                return
            data = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        run.failures[f"{kind}: {type(exc).__name__} {exc}"] += 1
        return
    if body["stream"] and not data.rstrip().endswith(b"data: [DONE]"):
        run.failures[f"{kind}: stream did not end with [DONE]"] += 1
    elif body["stream"] and b'data: {"error"' in data:  # a mid-stream error event
        run.failures[f"{kind}: error event {data[-200:]!r}"] += 1
    else:
        run.num_ok[kind] += 1


async def drive_load(url: str, model: str, config: SoakConfig, run: SoakRun, end: float) -> None:
    timeout = aiohttp.ClientTimeout(total=120.0)
    connector = aiohttp.TCPConnector(limit=config.concurrency * 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def loop(worker: int) -> None:
            rng = random.Random(config.seed * 1000 + worker)
            i = 0
            while time.monotonic() < end:
                path, body = _request(rng, config, model, i)
                await _one(session, url, path, body, rng.random() < config.cancel_share, run)
                i += 1

        await asyncio.gather(*(loop(w) for w in range(config.concurrency)))


async def soak(url: str, model: str, serve_pid: int, config: SoakConfig) -> SoakRun:
    run = SoakRun()
    started = time.monotonic()
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(serve_pid, run, started, config.sample_period_s, stop))
    try:
        await drive_load(url, model, config, run, started + config.duration_s)
    finally:
        run.duration_s = time.monotonic() - started
        stop.set()
        await sampler
    return run


# ------------------------------------------------------------------ command
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem bench soak", description=__doc__)
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--duration-s", type=float, default=1800.0)
    p.add_argument("--workers", type=int, default=2, help="mocker worker processes")
    p.add_argument("--concurrency", type=int, default=8, help="client loops")
    p.add_argument("--speedup-ratio", type=float, default=1.0, help="mocker speed (1 = real)")
    p.add_argument("--sample-period-s", type=float, default=5.0)
    p.add_argument("--warmup-share", type=float, default=0.25, help="share left out of slopes")
    p.add_argument("--cancel-share", type=float, default=0.1, help="streams dropped early")
    p.add_argument("--prompt-words", type=int, nargs=2, default=(1, 400), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, nargs=2, default=(1, 200), metavar=("MIN", "MAX"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="extra flags for tandem serve")
    p.add_argument("--work-dir", default=None, help="logs (default: a temporary directory)")
    p.add_argument("--json", default=None, help="write summary and samples here")
    return p


def main(argv: list[str]) -> int:
    from tandem.bench.tandem_stack import tandem_mocker_stack

    args = build_parser().parse_args(argv)
    config = SoakConfig(
        duration_s=args.duration_s,
        num_workers=args.workers,
        concurrency=args.concurrency,
        speedup_ratio=args.speedup_ratio,
        sample_period_s=args.sample_period_s,
        warmup_share=args.warmup_share,
        cancel_share=args.cancel_share,
        prompt_words=tuple(args.prompt_words),
        max_tokens=tuple(args.max_tokens),
        seed=args.seed,
    )
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="tandem-soak-"))
    with tandem_mocker_stack(
        work_dir,
        layout="serve",
        num_workers=config.num_workers,
        speedup_ratio=config.speedup_ratio,
        extra_args=args.serve_args,
    ) as stack:
        logger.info(
            "soak for %.0f s against %s (logs in %s)", config.duration_s, stack.url, work_dir
        )
        run = asyncio.run(soak(stack.url, stack.model, stack.frontend_pid, config))
    summary = summarize(run, config)
    print(format_table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "samples": run.samples}))
    ok = summary["num_failed"] == 0 and all(
        p["meets_target"] for p in summary["processes"].values()
    )
    return 0 if ok else 1
