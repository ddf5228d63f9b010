"""`tandem bench indexer`: replay a Mooncake trace's block events into `KvIndexer`.

Each request's `hash_ids` become a chain of block hashes (optionally each trace block split
into `--sub-blocks` smaller blocks); request i is served by worker i mod W, whose cache
holds `--capacity-blocks` blocks with LRU eviction (BlockRemoved). Events are generated
first, then timed: block-ops/s (stored + removed blocks per second, one core) and
find_matches latency over every request's chain at the end state.

find_matches time grows with the matched depth, so the p99 is the latency of the trace's
longest chains (the header prints chain lengths). Latencies include one perf_counter_ns
pair (the header prints its cost). `--gc frozen` collects and freezes the heap and turns
the collector off for the timed sections; the default leaves it on, as the router runs."""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import time
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path

from tandem.bench.shared_dir import MOONCAKE_TRACE
from tandem.router.indexer import KvIndexer, WorkerKey

DEFAULT_TRACE = MOONCAKE_TRACE
_MASK = (1 << 64) - 1

Op = tuple[bool, WorkerKey, list[int]]  # (is_store, worker, block hashes)


def load_chains(path: Path, sub_blocks: int, limit: int | None) -> list[list[int]]:
    """Chained 64-bit hashes per request: equal prefixes of hash_ids give equal chains."""
    chains = []
    with path.open() as f:
        for n, line in enumerate(f):
            if limit is not None and n >= limit:
                break
            prev = 0
            chain = []
            for hid in json.loads(line)["hash_ids"]:
                for part in range(sub_blocks):
                    prev = ((prev ^ (hid * sub_blocks + part + 1)) * 0x9E3779B97F4A7C15) & _MASK
                    chain.append(prev)
            chains.append(chain)
    return chains


def build_ops(chains: list[list[int]], num_workers: int, capacity: int) -> list[Op]:
    keys = [WorkerKey(f"w{i}") for i in range(num_workers)]
    caches: list[OrderedDict[int, None]] = [OrderedDict() for _ in keys]
    ops: list[Op] = []
    for i, chain in enumerate(chains):
        w = i % num_workers
        cache = caches[w]
        new = [h for h in chain if h not in cache]
        for h in chain:
            cache[h] = None
            cache.move_to_end(h)
        if new:
            ops.append((True, keys[w], new))
        excess = len(cache) - capacity
        if excess > 0:
            ops.append((False, keys[w], [cache.popitem(last=False)[0] for _ in range(excess)]))
    return ops


@contextlib.contextmanager
def gc_mode(mode: str) -> Iterator[None]:
    """`frozen`: no collector pauses inside (heap collected and frozen first)."""
    if mode != "frozen":
        yield
        return
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
        gc.unfreeze()


def timer_overhead_ns(samples: int = 20_000) -> float:
    """Median cost of the empty `perf_counter_ns` pair that wraps each timed call."""
    clock = time.perf_counter_ns
    costs = []
    for _ in range(samples):
        t0 = clock()
        costs.append(clock() - t0)
    return statistics.median(costs)


def run_one(
    chains: list[list[int]], num_workers: int, capacity: int, gc_setting: str = "on"
) -> dict[str, float]:
    ops = build_ops(chains, num_workers, capacity)
    idx = KvIndexer()
    num_block_ops = sum(len(hashes) for _, _, hashes in ops)
    with gc_mode(gc_setting):
        start = time.perf_counter()
        for is_store, key, hashes in ops:
            if is_store:
                idx.store(key, hashes)
            else:
                idx.remove(key, hashes)
        elapsed = time.perf_counter() - start
    clock = time.perf_counter_ns
    latencies_us = []
    with gc_mode(gc_setting):
        for chain in chains:
            t0 = clock()
            idx.find_matches(chain)
            latencies_us.append((clock() - t0) / 1000)
    q = statistics.quantiles(latencies_us, n=100)
    return {
        "workers": num_workers,
        "block_ops": num_block_ops,
        "block_ops_per_s": num_block_ops / elapsed,
        "find_p50_us": q[49],
        "find_p99_us": q[98],
        "mean_chain_blocks": statistics.fmean(len(c) for c in chains),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="tandem bench indexer", description=__doc__)
    p.add_argument("--trace", default=os.environ.get("TANDEM_TRACE", DEFAULT_TRACE))
    p.add_argument("--workers", default="1,64,1024", help="comma-separated worker counts")
    p.add_argument(
        "--sub-blocks",
        type=int,
        default=4,
        help="split each 512-token trace block into N blocks (4 -> 128 tokens)",
    )
    p.add_argument("--capacity-blocks", type=int, default=8192, help="per-worker cache size")
    p.add_argument("--limit", type=int, default=None, help="use the first N requests only")
    p.add_argument(
        "--gc",
        choices=("on", "frozen"),
        default="on",
        help="collector during timed sections: on (as the router runs) or frozen",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object per run")
    args = p.parse_args(argv)
    path = Path(args.trace)
    if not path.exists():
        raise SystemExit(f"trace {path} not found; pass --trace FILE.jsonl (Mooncake format)")
    chains = load_chains(path, args.sub_blocks, args.limit)
    lengths = statistics.quantiles([len(c) for c in chains], n=100) if len(chains) > 1 else [0] * 99
    print(
        f"trace {path}: {len(chains)} requests, sub-blocks {args.sub_blocks}, "
        f"capacity {args.capacity_blocks} blocks/worker; chain blocks p50 {lengths[49]:.0f} "
        f"p99 {lengths[98]:.0f} max {max(map(len, chains), default=0)}"
    )
    print(f"gc {args.gc}; timer overhead {timer_overhead_ns():.0f} ns per call (included)")
    print(
        f"{'workers':>8} {'block-ops':>10} {'block-ops/s':>12} {'find p50 µs':>12} "
        f"{'find p99 µs':>12}"
    )
    for n in (int(x) for x in args.workers.split(",")):
        r = run_one(chains, n, args.capacity_blocks, args.gc)
        if args.json:
            print(json.dumps(r))
        else:
            print(
                f"{n:>8} {r['block_ops']:>10.0f} {r['block_ops_per_s']:>12,.0f} "
                f"{r['find_p50_us']:>12.1f} {r['find_p99_us']:>12.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
