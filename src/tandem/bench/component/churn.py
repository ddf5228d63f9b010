"""`tandem bench churn`: the KV router's memory under prefix churn — ever-new prefixes routed
for as long as asked, RSS sampled, integrity checked.

One process: a `KvRouter` (kv policy, the real scoring, active-request tracking and decision
log) over `--workers` simulated workers, each an LRU cache of `--capacity-blocks` blocks. Every
request is a prompt no earlier request shared beyond a family's prefix (`--share` of them
extend one of `--families` live prefixes, which themselves rotate, so the set of prefixes
never stops changing); the router picks a worker, the worker caches the prompt's blocks and
evicts its oldest, and both changes reach the router as KV event batches through its
`EventApplier` (stores with engine block hashes, removals by them, as vLLM reports), then the
request finishes. Once every worker's cache is full, the index and the router's books hold a
bounded set, so RSS must stay flat: the verdict compares RSS at the end with RSS when the caches
first filled (`--max-growth-mb`), and runs the indexer's and active set's integrity checks.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import time
from collections import OrderedDict
from typing import Any

import psutil

from tandem.bench.component.entry import figures_main
from tandem.protocols.discovery import Instance, ModelCard
from tandem.protocols.engine import PreprocessedRequest, StopConditions
from tandem.protocols.kv_events import BlockRemoved, BlockStored, KvEventBatch
from tandem.router.config import RouterConfig
from tandem.router.kv_router import KvRouter
from tandem.router.registry import make_router
from tandem.router.source import StaticInstanceSet
from tandem.tokens.hashing import sequence_hashes

_ENGINE_XOR = 0x5DEECE66D  # engine hashes differ from tandem's, as vLLM's do


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tandem bench churn", description=__doc__)
    p.add_argument("--requests", type=int, default=200_000, help="requests routed in all")
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--capacity-blocks", type=int, default=4096, help="each worker's cache")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt-blocks", type=int, default=32, help="blocks per prompt")
    p.add_argument("--families", type=int, default=64, help="live shared prefixes")
    p.add_argument("--share", type=float, default=0.5, help="fraction extending a family")
    p.add_argument("--samples", type=int, default=20, help="RSS samples over the run")
    p.add_argument("--max-growth-mb", type=float, default=16.0, help="verdict: RSS growth cap")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    for name in ("requests", "workers", "capacity_blocks", "block_size", "prompt_blocks",
                 "families", "samples"):  # fmt: skip
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if not 0.0 <= args.share <= 1.0:
        p.error("--share must be in [0, 1]")
    return args


class _Worker:
    """A worker's LRU block cache; `take` caches a prompt's blocks and returns the batch of
    events that says so."""

    def __init__(self, worker_id: str, capacity: int) -> None:
        self.worker_id = worker_id
        self.capacity = capacity
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.event_id = 0

    @property
    def full(self) -> bool:
        return len(self.cache) >= self.capacity

    def take(self, hashes: list[int], block_size: int) -> KvEventBatch:
        new = []
        for h in hashes:
            if h in self.cache:
                self.cache.move_to_end(h)
            else:
                self.cache[h] = None
                new.append(h)
        evicted = []
        while len(self.cache) > self.capacity:
            evicted.append(self.cache.popitem(last=False)[0])
        events: list[Any] = []
        if new:
            events.append(
                BlockStored(
                    block_hashes=new,
                    block_size=block_size,
                    engine_block_hashes=[h ^ _ENGINE_XOR for h in new],
                )
            )
        if evicted:
            events.append(BlockRemoved(block_hashes=[h ^ _ENGINE_XOR for h in evicted]))
        self.event_id += 1
        return KvEventBatch(
            worker_id=self.worker_id, event_id=self.event_id, timestamp_s=0.0, events=events
        )


def _rss_mb() -> float:
    return float(psutil.Process().memory_info().rss) / 2**20


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    bs = args.block_size
    card = ModelCard(name="m", context_length=1 << 20, block_size=bs, num_total_blocks=1 << 20)
    instances = [
        Instance(instance_id=f"w{i}", namespace="tandem", component="backend",
                 endpoint="generate", address=f"127.0.0.1:{9000 + i}", model=card)
        for i in range(args.workers)
    ]  # fmt: skip
    router = make_router("kv", RouterConfig(seed=args.seed), instances=StaticInstanceSet(instances))
    assert isinstance(router, KvRouter)
    workers = {i.instance_id: _Worker(i.instance_id, args.capacity_blocks) for i in instances}
    router.applier.synced.update(workers)
    rng = random.Random(args.seed)
    fresh = iter(range(1 << 62))  # token ids never repeat: every prompt is new past its family
    families = [[next(fresh) for _ in range(bs * args.prompt_blocks // 2)]
                for _ in range(args.families)]  # fmt: skip
    every = max(args.requests // args.samples, 1)
    samples: list[dict[str, float]] = []
    full_at: dict[str, float] | None = None
    t0 = time.perf_counter()
    for n in range(1, args.requests + 1):
        if rng.random() < args.share:
            f = rng.randrange(args.families)
            head = families[f]
            if rng.random() < 0.01:  # the family's prefix itself moves on
                families[f] = [next(fresh) for _ in head]
        else:
            head = []
        tokens = head + [next(fresh) for _ in range(bs * args.prompt_blocks - len(head))]
        request = PreprocessedRequest(
            request_id=f"r{n}", model="m", token_ids=tokens, stop=StopConditions(max_tokens=1)
        )
        decision = await router.route(request)
        hashes = sequence_hashes(tokens, bs)
        router.applier.apply(workers[decision.instance_id].take(hashes, bs))
        router.on_first_token(request.request_id)
        router.on_finish(request.request_id)
        if full_at is None and all(w.full for w in workers.values()):
            gc.collect()
            full_at = {"requests": float(n), "rss_mb": _rss_mb()}
        if n % every == 0 or n == args.requests:
            samples.append({
                "requests": float(n),
                "rss_mb": _rss_mb(),
                "indexed_blocks": float(sum(router.indexer.num_blocks(k)
                                            for k in router.indexer.workers)),
                "active_requests": float(len(router.active)),
                "elapsed_s": time.perf_counter() - t0,
            })  # fmt: skip
    gc.collect()
    end_rss = _rss_mb()
    problems = []
    try:
        router.indexer.check_integrity()
        router.active.check_integrity()
    except AssertionError as exc:
        problems.append(f"integrity: {exc}")
    held = sum(len(w.cache) for w in workers.values())
    indexed = sum(router.indexer.num_blocks(k) for k in router.indexer.workers)
    if indexed != held:
        problems.append(f"index holds {indexed} blocks, the workers {held}")
    growth = None if full_at is None else end_rss - full_at["rss_mb"]
    if full_at is None:
        problems.append("the workers' caches never filled: raise --requests")
    elif growth is not None and growth > args.max_growth_mb:
        problems.append(f"RSS grew {growth:.1f} MB after the caches filled")
    await router.close()
    return {
        "args": vars(args),
        "samples": samples,
        "full_at": full_at,
        "end_rss_mb": end_rss,
        "growth_mb": growth,
        "indexed_blocks": indexed,
        "worker_blocks": held,
        "requests_per_s": args.requests / (time.perf_counter() - t0),
        "problems": problems,
        "verdict": "PASS" if not problems else "FAIL",
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    return asyncio.run(_run(args))


def format_result(result: dict[str, Any]) -> str:
    a = result["args"]
    lines = [
        f"churn: {a['requests']} requests, {a['workers']} workers x {a['capacity_blocks']} "
        f"blocks, {a['prompt_blocks']}-block prompts, {a['share']:.0%} extend one of "
        f"{a['families']} rotating prefixes; {result['requests_per_s']:.0f} routed/s",
        f"{'requests':>10}{'RSS MB':>9}{'indexed blocks':>16}{'active':>8}",
    ]
    for s in result["samples"]:
        lines.append(
            f"{s['requests']:>10.0f}{s['rss_mb']:>9.1f}{s['indexed_blocks']:>16.0f}"
            f"{s['active_requests']:>8.0f}"
        )
    full = result["full_at"]
    if full is not None:
        lines.append(
            f"caches full after {full['requests']:.0f} requests at {full['rss_mb']:.1f} MB; "
            f"end {result['end_rss_mb']:.1f} MB (growth {result['growth_mb']:+.1f} MB)"
        )
    lines.append(
        f"index {result['indexed_blocks']} blocks = workers {result['worker_blocks']}; "
        f"verdict {result['verdict']}" + "".join(f"\n  {p}" for p in result["problems"])
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """0 on PASS, 1 on FAIL (the table says why)."""
    verdicts: list[str] = []

    def run_and_keep(args: argparse.Namespace) -> dict[str, Any]:
        result = run(args)
        verdicts.append(result["verdict"])
        return result

    figures_main(argv, parse_args, run_and_keep, format_result)
    return 0 if verdicts == ["PASS"] else 1
