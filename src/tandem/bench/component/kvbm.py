"""`tandem bench kvbm`: multi-turn chats on the native engine with G1 only, G1+G2, G1+G2+G3.

Each conversation's turn adds --user-tokens new tokens to its history (previous prompt +
answer) and generates --output-tokens; the next turn goes to a conversation drawn at random
(seeded), one request at a time. The G1 pool is sized so the final working set (every
conversation's whole history) is --working-set-ratio (4) times the pool, so histories are
evicted between turns. Prints TTFT p50/p99, prefill tokens recomputed (prompt − cached),
and the blocks onboarded per tier for each configuration, all on the same model and
workload in one run; each turn runs on the three engines back to back and the workload is
repeated --repeats times on fresh engines, each turn's best TTFT kept (fair and robust on a
shared host). The G2→G3 reuse filter is off (every block offloaded to host is written to disk).
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.bench.component.entry import figures_main
from tandem.engines.native.config import NativeConfig
from tandem.engines.native.engine import build_core
from tandem.engines.native.engine_core import EngineCore
from tandem.engines.native.model import LlamaModel
from tandem.kvbm.base import KvbmConfig
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tandem bench kvbm", description=__doc__)
    p.add_argument("--model", default=None, help="a .gguf or HF dir (default: SmolLM2 GGUF)")
    p.add_argument("--num-threads", type=int, default=2)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=3, help="turns per conversation")
    p.add_argument("--user-tokens", type=int, default=128, help="new tokens per turn")
    p.add_argument("--output-tokens", type=int, default=4, help="tokens generated per turn")
    p.add_argument("--working-set-ratio", type=float, default=4.0, help="working set / G1")
    p.add_argument("--host-ratio", type=float, default=0.25, help="G2 blocks / working set")
    p.add_argument("--disk-ratio", type=float, default=2.0, help="G3 blocks / working set")
    p.add_argument("--disk-dir", default=None, help="G3 directory (default: a temp dir)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats", type=int, default=2, help="runs of the workload; per turn the best TTFT"
    )
    p.add_argument("--json", default=None, help="also write the figures to this file")
    return p.parse_args(argv)


@dataclass(slots=True)
class Workload:
    turns: list[tuple[int, list[int]]]  # (conversation, new user tokens) in arrival order
    working_set_blocks: int
    max_request_blocks: int


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    remaining = {c: args.turns for c in range(args.conversations)}
    turns: list[tuple[int, list[int]]] = []
    while remaining:
        conv = rng.choice(sorted(remaining))
        remaining[conv] -= 1
        if not remaining[conv]:
            del remaining[conv]
        turns.append(
            (conv, [rng.randrange(100, vocab_size - 100) for _ in range(args.user_tokens)])
        )
    final = args.turns * (args.user_tokens + args.output_tokens)
    bs = args.block_size
    return Workload(turns, args.conversations * final // bs, -(-final // bs))


@dataclass(slots=True)
class RunResult:
    name: str
    ttft_s: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    recomputed_tokens: int = 0
    onboarded: dict[str, int] = field(default_factory=dict)
    dropped: int = 0
    wall_s: float = 0.0


def run_turn(
    core: EngineCore, rid: str, prompt: list[int], max_tokens: int
) -> tuple[float, int, list[int]]:
    """(TTFT, cached tokens, output) of one request run alone to the end."""
    start = time.perf_counter()
    core.add(
        PreprocessedRequest(
            request_id=rid,
            model="bench",
            token_ids=prompt,
            sampling=SamplingParams(temperature=0.0),
            stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
        )
    )
    ttft, cached, out = 0.0, 0, list[int]()
    while core.has_work():
        for request_id, o in core.step():
            if request_id != rid:
                continue
            if not out:
                ttft = time.perf_counter() - start
                cached = o.num_cached_tokens or 0
            out += o.token_ids
    return ttft, cached, out


class ConfigRun:
    """One configuration's engine, conversation histories and figures."""

    def __init__(self, name: str, core: EngineCore, args: argparse.Namespace) -> None:
        self.core = core
        self.args = args
        self.result = RunResult(name)
        self.history: dict[int, list[int]] = {}
        run_turn(core, f"{name}-warmup", [100 + i for i in range(args.user_tokens)], 2)

    def turn(self, i: int, conv: int, user: list[int]) -> None:
        prompt = self.history.get(conv, []) + user
        start = time.perf_counter()
        ttft, cached, out = run_turn(self.core, f"{self.result.name}-{i}", prompt,
                                     self.args.output_tokens)  # fmt: skip
        self.result.wall_s += time.perf_counter() - start
        self.history[conv] = prompt + out
        # the user's pause before the next turn: the copies this turn queued land in the
        # tiers (untimed), so which blocks a later turn onboards does not depend on how
        # busy the host was, and the token counts repeat exactly (merge_repeats)
        if self.core.tiering is not None and not self.core.tiering.kvbm.flush():
            raise RuntimeError(
                f"{self.result.name}: copies to the KV tiers still queued after 10 s"
            )
        self.result.ttft_s.append(ttft)
        self.result.prompt_tokens += len(prompt)
        self.result.recomputed_tokens += len(prompt) - cached

    def finish(self) -> RunResult:
        tiering = self.core.tiering
        if tiering is not None:
            metrics = tiering.kvbm.metrics
            self.result.onboarded = {
                "host": metrics.transfers["host_to_device"].num_blocks,
                "disk": metrics.transfers["disk_to_device"].num_blocks,
            }
            self.result.dropped = sum(metrics.dropped.values())
        self.core.close()
        return self.result


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def configs(
    args: argparse.Namespace, work: Workload, disk_dir: str
) -> list[tuple[str, KvbmConfig | None]]:
    host = max(1, int(args.host_ratio * work.working_set_blocks))
    disk = max(1, int(args.disk_ratio * work.working_set_blocks))
    common: dict[str, Any] = {"log_interval_s": 0.0, "disk_min_reuse": 0}
    return [
        ("G1", None),
        ("G1+G2", KvbmConfig(host_blocks=host, **common)),
        ("G1+G2+G3", KvbmConfig(host_blocks=host, disk_dir=disk_dir, disk_blocks=disk, **common)),
    ]


def run_once(
    args: argparse.Namespace,
    model: LlamaModel,
    work: Workload,
    plan: list[tuple[str, KvbmConfig | None]],
    g1_blocks: int,
) -> list[RunResult]:
    """The whole workload on fresh engines, one per configuration; each turn runs on every
    configuration back to back, so load from other processes falls on all of them alike."""
    runs = []
    for name, tiers in plan:
        config = NativeConfig(
            model=args.model, block_size=args.block_size, num_threads=args.num_threads,
            num_blocks=g1_blocks, kvbm=tiers,
        )  # fmt: skip
        runs.append(ConfigRun(name, EngineCore(config, model), args))
    for i, (conv, user) in enumerate(work.turns):
        for config_run in runs:
            config_run.turn(i, conv, user)
    return [r.finish() for r in runs]


def merge_repeats(repeats: list[RunResult]) -> RunResult:
    """Per turn, the fastest TTFT over the repeats (noise from a shared host only adds
    time); token counts are deterministic, so they come from the first repeat."""
    first = repeats[0]
    assert all(r.recomputed_tokens == first.recomputed_tokens for r in repeats), "not greedy?"
    first.ttft_s = [min(ts) for ts in zip(*(r.ttft_s for r in repeats), strict=True)]
    first.wall_s = min(r.wall_s for r in repeats)
    return first


def run(args: argparse.Namespace) -> dict[str, Any]:
    base = NativeConfig(
        model=args.model,
        block_size=args.block_size,
        num_threads=args.num_threads,
        num_blocks=-(-300 // args.block_size),  # room for the warm-up requests
    )
    first, _ = build_core(base)
    model = first.model
    # first calls of each GEMM shape are slow (weight prepacking, allocator): not a turn's TTFT
    for n in (256, 64, 16):
        run_turn(first, f"warmup-{n}", [100 + i for i in range(n)], 4)
    first.close()
    work = make_workload(args, model.config.vocab_size)
    g1_blocks = max(
        work.max_request_blocks + 1, int(work.working_set_blocks / args.working_set_ratio)
    )
    repeats = []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="tandem-kvbm-", dir=args.disk_dir) as disk_dir:
            plan = configs(args, work, disk_dir)
            repeats.append(run_once(args, model, work, plan, g1_blocks))
    results = [merge_repeats(list(rs)) for rs in zip(*repeats, strict=True)]
    return {
        "model": model.config.name,
        "block_size": args.block_size,
        "g1_blocks": g1_blocks,
        "working_set_blocks": work.working_set_blocks,
        "num_requests": len(work.turns),
        "repeats": args.repeats,
        "configs": [tiers_summary(r) for r in results],
        "tiers": {name: tier_sizes(t) for name, t in plan},
    }


def tier_sizes(tiers: KvbmConfig | None) -> dict[str, int] | None:
    return None if tiers is None else {"host": tiers.host_blocks, "disk": tiers.disk_blocks}


def tiers_summary(r: RunResult) -> dict[str, Any]:
    return {
        "name": r.name,
        "ttft_p50_ms": percentile(r.ttft_s, 0.5) * 1000,
        "ttft_p99_ms": percentile(r.ttft_s, 0.99) * 1000,
        "ttft_mean_ms": statistics.fmean(r.ttft_s) * 1000,
        "prompt_tokens": r.prompt_tokens,
        "recomputed_tokens": r.recomputed_tokens,
        "onboarded_host_blocks": r.onboarded.get("host", 0),
        "onboarded_disk_blocks": r.onboarded.get("disk", 0),
        "dropped": r.dropped,
        "wall_s": r.wall_s,
    }


def format_result(result: dict[str, Any]) -> str:
    lines = [
        f"model={result['model']} block_size={result['block_size']} "
        f"G1={result['g1_blocks']} blocks, working set={result['working_set_blocks']} blocks, "
        f"{result['num_requests']} requests, TTFT best of {result['repeats']} per turn",
        f"{'config':<10} {'tiers (blocks)':<16} {'TTFT p50':>9} {'p99':>9} {'recomputed':>11} "
        f"{'of prompt':>10} {'from G2':>8} {'from G3':>8} {'wall s':>7}",
    ]
    for c in result["configs"]:
        t = result["tiers"][c["name"]]
        tiers = "-" if t is None else f"G2={t['host']}" + (f" G3={t['disk']}" if t["disk"] else "")
        lines.append(
            f"{c['name']:<10} {tiers:<16} {c['ttft_p50_ms']:>7.1f}ms {c['ttft_p99_ms']:>7.1f}ms "
            f"{c['recomputed_tokens']:>11} {c['prompt_tokens']:>10} "
            f"{c['onboarded_host_blocks']:>8} {c['onboarded_disk_blocks']:>8} {c['wall_s']:>7.1f}"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    return figures_main(argv, parse_args, run, format_result)
