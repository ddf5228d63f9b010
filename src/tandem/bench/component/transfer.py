"""`tandem bench transfer`: KV transfer GB/s between two processes, per backend.

The bench process pulls from a spawned owner process through a `TransferAgent`
restricted to one backend at a time (the control handshake is included in every
figure), beside an in-process ``memcpy`` of the same size. Each transfer moves
``--blocks`` blocks of one region, like a KV export.

    tandem bench transfer [--sizes-mib 1,4,16,64,256] [--iters 5] [--blocks 64] [--json F]
    tandem bench transfer --fetch 200 [--fetch-blocks 16] [--backends shm,tcp]

``--fetch N`` times N peer KV fetches instead (issue 31), each as `PeerFetch` makes it:
``Export`` of the hashes to the holder process (it opens a readable op over its blocks),
then the pull of those blocks; it prints the export round trip (the fetch's setup), the
pull, their sum and the connections dialled, per backend (p50 / p90 ms).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time
from multiprocessing.connection import Connection

import numpy as np

from tandem.transfer import OpRef, RegionLayout, TransferAgent, TransferAgentConfig

MIB = 1 << 20


def _layout(size: int, num_blocks: int) -> RegionLayout:
    return RegionLayout.contiguous(num_blocks=num_blocks, block_bytes=size // num_blocks)


def _owner(conn: Connection, backend: str, sizes: list[int], num_blocks: int) -> None:
    """The exporting process: one shm region per size; answers op requests until closed.

    It enables only the measured backend: NIXL's progress thread busy-polls a core,
    which would slow every other backend's figure on a small machine.
    """
    config = TransferAgentConfig(agent_id="bench-owner", backends=(backend,))
    with TransferAgent(config) as agent:
        for size in sizes:
            region = agent.create_region(f"r{size}", _layout(size, num_blocks))
            region.data[:] = np.random.default_rng(size).integers(0, 256, size, np.uint8)
        conn.send(agent.backend_names)
        while (size := conn.recv()) is not None:
            op = agent.create_readable(f"r{size}", list(range(num_blocks)), ttl_s=60)
            conn.send(op.meta)


def _fetch_owner(conn: Connection, num_blocks: int, block_bytes: int) -> None:
    """The holder process of ``--fetch``: exports the first blocks of one region."""
    config = TransferAgentConfig(agent_id="bench-holder", backends=("shm", "tcp"))
    with TransferAgent(config) as agent:
        agent.create_region("kv", _layout(num_blocks * block_bytes, num_blocks))

        def export(op_id: str, hashes: list[int], ttl_s: float) -> int:
            agent.create_readable("kv", list(range(len(hashes))), ttl_s=ttl_s, op_id=op_id)
            return len(hashes)

        agent.exporter = export
        conn.send((agent.address, agent.agent_id))
        conn.recv()  # None: done


def _fetch_ms(backend: str, args: argparse.Namespace) -> dict[str, float]:
    """p50/p90 ms of a peer fetch's export round trip, its pull and the two together."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    block_bytes = args.fetch_block_kib * 1024
    owner = ctx.Process(target=_fetch_owner, args=(child, args.fetch_blocks, block_bytes),
                        daemon=True)  # fmt: skip
    owner.start()
    config = TransferAgentConfig(agent_id=f"bench-fetch-{backend}", backends=(backend,))
    try:
        address, agent_id = parent.recv()
        with TransferAgent(config) as agent:
            if backend not in agent.backend_names:
                return {}
            n = args.fetch_blocks
            agent.register_region(
                "kv", np.zeros(n * block_bytes, np.uint8), _layout(n * block_bytes, n)
            )
            setup, pull, total = [], [], []
            for i in range(args.fetch + 1):  # the first warms up mappings (and a connection)
                target = OpRef(address=address, agent_id=agent_id, op_id=f"fetch-{i}")
                started = time.perf_counter()
                got = agent.request_export(target, list(range(n)), ttl_s=30, timeout_s=30)
                exported = time.perf_counter()
                result = agent.pull(target, "kv", list(range(got)), timeout_s=30)
                assert result.backend == backend, result
                done = time.perf_counter()
                if i:
                    setup.append(exported - started)
                    pull.append(done - exported)
                    total.append(done - started)
            pool = getattr(agent, "pool", None)  # absent before connection reuse
            opened = pool.num_opened if pool is not None else 2 * (args.fetch + 1)
    finally:
        parent.send(None)
        owner.join(30)
    figures = {"connections": float(opened)}
    for name, xs in (("export", setup), ("pull", pull), ("fetch", total)):
        figures[f"{name}_p50_ms"] = _pct(xs, 0.5) * 1e3
        figures[f"{name}_p90_ms"] = _pct(xs, 0.9) * 1e3
    return figures


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def _memcpy_gbps(size: int, iters: int) -> float:
    src = np.random.default_rng(0).integers(0, 256, size, np.uint8)
    dst = np.empty_like(src)
    times = []
    for _ in range(iters + 1):
        start = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - start)
    return size / statistics.median(times[1:]) / 1e9


def _backend_gbps(
    conn: Connection, backend: str, sizes: list[int], args: argparse.Namespace
) -> dict[int, float]:
    figures = {}
    config = TransferAgentConfig(agent_id=f"bench-{backend}", backends=(backend,))
    with TransferAgent(config) as agent:
        if backend not in agent.backend_names:
            return {}
        for size in sizes:
            agent.register_region(f"r{size}", np.zeros(size, np.uint8), _layout(size, args.blocks))
            times = []
            for _ in range(args.iters + 1):  # the first run warms up mappings and connections
                conn.send(size)
                meta = conn.recv()
                result = agent.pull(meta, f"r{size}", list(range(args.blocks)), timeout_s=120)
                assert result.backend == backend, result
                times.append(result.seconds)
            figures[size] = size / statistics.median(times[1:]) / 1e9
            agent.unregister_region(f"r{size}")
    return figures


def _measure(backend: str, sizes: list[int], args: argparse.Namespace) -> dict[int, float]:
    """GB/s per size pulling from a fresh owner process; {} when the backend is missing."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(child, backend, sizes, args.blocks), daemon=True)
    owner.start()
    try:
        offered = parent.recv()
        return _backend_gbps(parent, backend, sizes, args) if backend in offered else {}
    finally:
        parent.send(None)
        owner.join(30)


def _table(sizes: list[int], rows: dict[str, dict[int, float]]) -> str:
    lines = ["size_MiB  " + "".join(f"{name:>10}" for name in rows) + "   shm/nixl"]
    for size in sizes:
        cells = "".join(
            f"{rows[name][size]:>10.2f}" if size in rows[name] else f"{'-':>10}" for name in rows
        )
        shm, nixl = rows.get("shm", {}).get(size), rows.get("nixl", {}).get(size)
        ratio = f"{shm / nixl:>10.2f}x" if shm and nixl else f"{'-':>11}"
        lines.append(f"{size // MIB:>8}  {cells}{ratio}")
    return "\n".join(lines) + "\n(GB/s, median of --iters pulls; 1 GB = 1e9 bytes)"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="tandem bench transfer", description=__doc__)
    parser.add_argument("--sizes-mib", default="1,4,16,64,256", help="transfer sizes in MiB")
    parser.add_argument(
        "--iters", type=int, default=5, help="timed pulls per size (after 1 warm-up)"
    )
    parser.add_argument("--blocks", type=int, default=64, help="blocks per transfer")
    parser.add_argument("--backends", default="shm,nixl,mooncake,tcp", help="backends to measure")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--fetch", type=int, default=0,
                        help="time this many peer KV fetches (export + pull) instead")  # fmt: skip
    parser.add_argument("--fetch-blocks", type=int, default=16, help="blocks per fetch")
    parser.add_argument("--fetch-block-kib", type=int, default=64, help="KiB per block")
    args = parser.parse_args(argv)
    if args.fetch:
        return _fetch_main(parser, args)
    sizes = [int(float(s) * MIB) for s in args.sizes_mib.split(",")]
    if args.iters < 1 or args.blocks < 1 or any(s % args.blocks for s in sizes):
        parser.error(
            "--iters and --blocks must be >= 1 and every size a multiple of --blocks bytes"
        )
    rows = {"memcpy": {s: _memcpy_gbps(s, args.iters) for s in sizes}}
    for backend in args.backends.split(","):
        if figures := _measure(backend, sizes, args):
            rows[backend] = figures
    print(_table(sizes, rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {name: {str(s): v for s, v in r.items()} for name, r in rows.items()}, f, indent=1
            )
    return 0


def _fetch_main(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    if args.fetch < 1 or args.fetch_blocks < 1 or args.fetch_block_kib < 1:
        parser.error("--fetch, --fetch-blocks and --fetch-block-kib must be >= 1")
    rows = {}
    for backend in args.backends.split(","):
        if figures := _fetch_ms(backend, args):
            rows[backend] = figures
    size = args.fetch_blocks * args.fetch_block_kib
    print(f"peer KV fetch of {args.fetch_blocks} blocks ({size} KiB), {args.fetch} fetches "
          "(ms p50/p90; connections: dialled in all)")  # fmt: skip
    print(f"{'backend':>8} {'export':>13} {'pull':>13} {'fetch':>13} {'connections':>12}")
    for name, f in rows.items():
        cells = " ".join(f"{f[k + '_p50_ms']:>6.2f}/{f[k + '_p90_ms']:<6.2f}"
                         for k in ("export", "pull", "fetch"))  # fmt: skip
        print(f"{name:>8} {cells} {int(f['connections']):>12}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)
    return 0
