"""`tandem bench disagg`: disaggregated 1 prefill + 1 decode vs 2 aggregated mocker workers.

A mixed workload — short chats with long prompts arriving among them (Poisson arrivals,
fixed seed) — runs against each stack in one process (memory discovery and events, the real
TCP request plane, real transfer agents; the mocker simulates compute and the KV transfer
time). Reported per stack: TTFT and ITL p50/p99 in simulated milliseconds (wall time ×
speedup ratio) and the makespan. The point: a long prefill stalls every decode batched with
it on an aggregated worker (ITL p99), while a decode worker never prefills.

    tandem bench disagg --num-requests 300 --rate 6 --speedup-ratio 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from contextlib import AsyncExitStack
from dataclasses import dataclass, field

from tandem.disagg.config import DisaggRouteConfig, DisaggWorkerConfig
from tandem.disagg.orchestrator import DisaggStreamer
from tandem.disagg.worker_engine import DisaggEngine
from tandem.engines.base import Engine
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.frontend.config import FrontendConfig
from tandem.frontend.disagg_wiring import disagg_streamer
from tandem.frontend.migration import EngineStreamer
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions
from tandem.router.base import Router
from tandem.router.registry import make_router
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.runtime import open_runtime


@dataclass(frozen=True, slots=True)
class Arrival:
    at_s: float
    token_ids: list[int]
    max_tokens: int
    is_long: bool


@dataclass
class Timing:
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    makespan_s: float = 0.0
    num_failed: int = 0


def workload(args: argparse.Namespace) -> list[Arrival]:
    rng = random.Random(args.seed)
    t, out = 0.0, []
    for _ in range(args.num_requests):
        t += rng.expovariate(args.rate)
        is_long = rng.random() < args.long_fraction
        isl, osl = (args.long_isl, args.long_osl) if is_long else (args.short_isl, args.short_osl)
        out.append(Arrival(t, [rng.randrange(17, 49152) for _ in range(isl)], osl, is_long))
    return out


async def build(
    stack: AsyncExitStack, kind: str, args: argparse.Namespace
) -> tuple[EngineStreamer | DisaggStreamer, Router]:
    """(streamer, decode router) of a '1p1d' or '2agg' stack."""
    discovery, events = MemoryDiscovery(), MemoryEventBus()
    cfg = RuntimeConfig(namespace="bench")
    mocker = MockerConfig(speedup_ratio=args.speedup_ratio, tokenizer=None,
                          kv_transfer_bandwidth_gbps=args.bandwidth_gbps)  # fmt: skip
    roles = [("prefill", "prefill"), ("decode", "backend")] if kind == "1p1d" else [
        ("none", "backend"), ("none", "backend")]  # fmt: skip
    for mode, component in roles:
        rt = await stack.enter_async_context(open_runtime(cfg, discovery=discovery, events=events))
        engine: Engine = MockerEngine(mocker)
        if mode != "none":
            engine = DisaggEngine(engine, DisaggWorkerConfig(mode=mode, backends=("shm", "tcp")))
        worker = Worker(engine, rt, WorkerConfig(component=component))
        await worker.start()
        stack.push_async_callback(worker.stop, 0.0)
    front = await stack.enter_async_context(open_runtime(cfg, discovery=discovery, events=events))
    fcfg = FrontendConfig(router_policy=args.router, disagg=DisaggRouteConfig(enabled=True))
    decode_set = front.instance_set("backend", "generate")
    router = make_router(args.router, fcfg.router, instances=decode_set, events=front.events,
                         client=front.client, namespace=front.namespace)  # fmt: skip
    aggregated = EngineStreamer(front.client, front.endpoint_path("backend", "generate"))
    streamer: EngineStreamer | DisaggStreamer = aggregated
    await router.start()
    await decode_set.start()
    await decode_set.wait_for(1 if kind == "1p1d" else 2)
    stack.push_async_callback(router.close)
    stack.push_async_callback(decode_set.close)
    if kind == "1p1d":
        streamer, pool = disagg_streamer(fcfg, front, aggregated, decode_set)
        await pool.start()
        stack.push_async_callback(pool.close)
        while await pool.router_for(MockerConfig().model_name) is None:  # noqa: ASYNC110
            await asyncio.sleep(0.01)  # discovery delivers the prefill instance
    return streamer, router


async def one(
    streamer: EngineStreamer | DisaggStreamer,
    router: Router,
    i: int,
    a: Arrival,
    t0: float,
    out: Timing,
) -> None:
    await asyncio.sleep(max(t0 + a.at_s - time.perf_counter(), 0))
    req = PreprocessedRequest(
        request_id=f"b{i}", model=MockerConfig().model_name, token_ids=a.token_ids,
        sampling=SamplingParams(temperature=0.0),
        stop=StopConditions(max_tokens=a.max_tokens, ignore_eos=True),
    )  # fmt: skip
    start = last = time.perf_counter()
    first = True
    try:
        async for o in streamer.stream(req, router):
            now = time.perf_counter()
            if o.token_ids:
                if first:
                    out.ttft_ms.append((now - start) * 1e3)
                    first = False
                else:
                    out.itl_ms += [(now - last) * 1e3 / len(o.token_ids)] * len(o.token_ids)
                last = now
            if o.finish_reason is not None:
                break
    except Exception:
        out.num_failed += 1


async def run_stack(kind: str, args: argparse.Namespace, arrivals: list[Arrival]) -> Timing:
    timing = Timing()
    async with AsyncExitStack() as stack:
        streamer, router = await build(stack, kind, args)
        t0 = time.perf_counter()
        await asyncio.gather(*(one(streamer, router, i, a, t0, timing)
                               for i, a in enumerate(arrivals)))  # fmt: skip
        timing.makespan_s = time.perf_counter() - t0
    scale = args.speedup_ratio  # report simulated time
    timing.ttft_ms = [x * scale for x in timing.ttft_ms]
    timing.itl_ms = [x * scale for x in timing.itl_ms]
    timing.makespan_s *= scale
    return timing


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="tandem bench disagg", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--num-requests", type=int, default=300)
    p.add_argument("--rate", type=float, default=6.0, help="arrivals per simulated second")
    p.add_argument("--long-fraction", type=float, default=0.1)
    p.add_argument("--short-isl", type=int, default=300)
    p.add_argument("--short-osl", type=int, default=150)
    p.add_argument("--long-isl", type=int, default=7000)
    p.add_argument("--long-osl", type=int, default=50)
    p.add_argument("--speedup-ratio", type=float, default=4.0)
    p.add_argument("--bandwidth-gbps", type=float, default=64.0)
    p.add_argument("--router", default="round_robin")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args(argv)
    args.rate *= args.speedup_ratio  # arrival times are wall time
    arrivals = workload(args)
    rows = {}
    for kind in ("2agg", "1p1d"):
        t = asyncio.run(run_stack(kind, args, arrivals))
        rows[kind] = {
            "ttft_p50_ms": pct(t.ttft_ms, 0.5), "ttft_p99_ms": pct(t.ttft_ms, 0.99),
            "itl_p50_ms": pct(t.itl_ms, 0.5), "itl_p99_ms": pct(t.itl_ms, 0.99),
            "makespan_s": t.makespan_s, "failed": t.num_failed,
        }  # fmt: skip
    print(f"{'stack':<6} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
          f"{'makespan':>9} {'failed':>6}   (simulated ms / s)")  # fmt: skip
    for kind, r in rows.items():
        print(f"{kind:<6} {r['ttft_p50_ms']:9.1f} {r['ttft_p99_ms']:9.1f} {r['itl_p50_ms']:8.2f} "
              f"{r['itl_p99_ms']:8.2f} {r['makespan_s']:9.1f} {r['failed']:6d}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": rows}, f, indent=2)
    return 0 if all(r["failed"] == 0 for r in rows.values()) else 1
