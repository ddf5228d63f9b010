"""`tandem bench lora-placement` (issue 32): where LoRA adapters are loaded, measured at scale
on mocker workers: tandem's placement against random and least-loaded routing.

The fleet is in one process and on simulated time (`virtual_time.py`: the figures do not depend
on how busy this machine is): `--workers` mocker engines with `--max-loras` adapter slots and
a `--lora-load-ms` load that holds the worker's step loop (`engines/mocker/lora.py`), each
behind a small worker front that loads a request's adapter on demand and publishes the
`LoraEvent`s the Worker publishes (`engines/worker_lora.py`), and tandem's router. Requests
arrive as a Poisson process at `--rate`; each names one of `--adapters` adapters drawn from
Zipf(`--zipf`), with a system prompt of its adapter and a prompt of its own.

- tandem: the `kv` policy (approximate mode: the router's own routing as the cache view) with
  LoRA placement (`router/lora.py`: holders first, misses placed by rendezvous hashing,
  replicas for hot adapters).
- random, least_loaded: those policies with `--no-lora-placement`: the adapter plays no part.

Each run reports adapter loads (in all, per simulated minute, and per minute after the first
`--warmup` of the requests, when every placement has filled its slots), evictions, the
requests that waited for their adapter's load, TTFT p50/p99 (simulated ms, from arrival) and
the requests that failed. The verdict: tandem's loads at least `--target-ratio` times fewer
than random's, at equal or better TTFT p99.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import itertools
import os
import random
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import msgspec

from tandem.bench.component.entry import figures_main
from tandem.bench.component.virtual_time import run_virtual
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.errors import EngineError, ServingError
from tandem.protocols import lora as wire
from tandem.protocols.discovery import Instance, ModelCard
from tandem.protocols.engine import PreprocessedRequest, StopConditions
from tandem.protocols.lora import LoraEvent, LoraEventKind
from tandem.router.base import Router
from tandem.router.config import RouterConfig
from tandem.router.lora import LoraPlacementConfig
from tandem.router.registry import make_router
from tandem.router.source import StaticInstanceSet
from tandem.runtime.base import RequestClient
from tandem.runtime.events.memory import MemoryEventBus

POLICIES = ("tandem", "random", "least_loaded")
BLOCK_SIZE = 16


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="tandem bench lora-placement",
        description="LoRA adapter placement on mocker workers: tandem vs random vs least-loaded",
    )
    p.add_argument("--workers", type=int, default=8)
    p.add_argument("--adapters", type=int, default=100)
    p.add_argument("--zipf", type=float, default=1.0, help="popularity exponent of adapters")
    p.add_argument("--max-loras", type=int, default=8, help="adapter slots per worker")
    p.add_argument("--lora-load-ms", type=float, default=100.0)
    p.add_argument("--lora-replica-load", type=float, default=LoraPlacementConfig().replica_load)
    p.add_argument("--lora-max-replicas", type=int, default=LoraPlacementConfig().max_replicas)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--rate", type=float, default=60.0, help="arrivals per simulated second")
    p.add_argument("--isl", type=int, default=512, help="prompt tokens")
    p.add_argument("--system-tokens", type=int, default=256, help="per-adapter system prompt")
    p.add_argument("--osl", type=int, default=32, help="output tokens")
    p.add_argument("--warmup", type=float, default=0.2, help="fraction of requests")
    p.add_argument("--target-ratio", type=float, default=5.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    for name in ("workers", "adapters", "max_loras", "requests", "isl", "osl"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')}={getattr(args, name)}; expected >= 1")
    if not 0 < args.rate <= 1e5 or args.zipf < 0 or not 0 <= args.warmup < 1:
        p.error("--rate in (0, 1e5], --zipf >= 0 and --warmup in [0, 1) expected")
    if not 0 <= args.system_tokens < args.isl:
        p.error(f"--system-tokens={args.system_tokens}; expected in [0, --isl)")
    bad = set(args.policies.split(",")) - set(POLICIES)
    if bad:
        p.error(f"unknown policies {sorted(bad)}; expected some of: {', '.join(POLICIES)}")
    return args


@dataclass(frozen=True, slots=True)
class Spec:
    arrival_s: float
    adapter: str
    token_ids: list[int]


def workload(args: argparse.Namespace) -> list[Spec]:
    """Poisson arrivals; adapters by Zipf popularity; per-adapter system prompt + own tokens."""
    rng = random.Random(args.seed)
    weights = [1.0 / (k + 1) ** args.zipf for k in range(args.adapters)]
    cumulative = list(itertools.accumulate(weights))
    systems = [
        [rng.randrange(17, 49152) for _ in range(args.system_tokens)] for _ in range(args.adapters)
    ]
    specs, t = [], 0.0
    for _ in range(args.requests):
        t += rng.expovariate(args.rate)
        k = bisect.bisect_left(cumulative, rng.random() * cumulative[-1])
        own = [rng.randrange(17, 49152) for _ in range(args.isl - args.system_tokens)]
        specs.append(Spec(t, f"adapter-{k:03d}", systems[k] + own))
    return specs


class SimWorker:
    """What the Worker does around its engine for adapters: the on-demand load of a request's
    adapter (one load per name at a time) and a LoraEvent with the resident set after it."""

    def __init__(self, worker_id: str, engine: MockerEngine, bus: MemoryEventBus, root: Path):
        self.worker_id, self.engine, self.bus, self.root = worker_id, engine, bus, root
        self._locks: dict[str, asyncio.Lock] = {}
        self.load_times: list[float] = []  # when each load began (loop time)

    async def ensure(self, name: str) -> bool:
        """Make `name` resident; True when the request had to wait for a load."""
        if name in self.engine.loras():
            return False
        async with self._locks.setdefault(name, asyncio.Lock()):
            if name in self.engine.loras():
                return True  # it waited for another request's load of it
            before = set(self.engine.loras())
            self.load_times.append(asyncio.get_running_loop().time())
            loaded = await self.engine.load_lora(name, str(self.root / name))
            for evicted in sorted(before - set(self.engine.loras())):
                await self._publish("evicted", evicted)
            await self._publish("loaded", name, loaded.load_s)
        return True

    async def unload(self, name: str) -> None:
        """The `unload_lora` endpoint: drop `name` (a router found it cold) and say so."""
        async with self._locks.setdefault(name, asyncio.Lock()):
            await self.engine.unload_lora(name)
            await self._publish("unloaded", name)

    async def _publish(self, kind: LoraEventKind, name: str, load_s: float = 0.0) -> None:
        event = LoraEvent(kind=kind, name=name, load_s=load_s, worker_id=self.worker_id,
                          resident=sorted(self.engine.loras()),
                          max_loras=self.engine.config.max_loras)  # fmt: skip
        await self.bus.publish(wire.lora_events_subject("tandem", "backend"), wire.encode(event))


class LocalClient:
    """The request plane as the router uses it here: `unload_lora` calls to the workers."""

    def __init__(self, workers: dict[str, SimWorker]) -> None:
        self.by_address = {f"127.0.0.1:{9000 + i}": w for i, w in enumerate(workers.values())}

    async def stream(
        self,
        address: str,
        endpoint_path: str,
        payload: bytes,
        *,
        request_id: str,
        deadline_s: float | None = None,
        connect_timeout_s: float = 5.0,
    ) -> AsyncIterator[bytes]:
        if not endpoint_path.endswith(wire.UNLOAD_ENDPOINT):
            raise EngineError(f"the bench's workers serve no {endpoint_path}")
        name = msgspec.msgpack.decode(payload, type=wire.LoraUnloadRequest).name
        await self.by_address[address].unload(name)
        yield b""

    def peer_silent_s(self, address: str) -> float | None:
        return None

    async def answers(self, address: str, within_s: float) -> bool:
        return True

    def drop(self, address: str, reason: str) -> None:
        """Nothing to drop: no connections."""


@dataclass
class Outcome:
    ttft_s: list[float] = field(default_factory=list)
    waited: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)


async def _one(
    spec: Spec, index: int, osl: int, router: Router, workers: dict[str, SimWorker], out: Outcome
) -> None:
    loop = asyncio.get_running_loop()
    request = PreprocessedRequest(
        request_id=f"r{index}",
        model="base",
        token_ids=spec.token_ids,
        stop=StopConditions(max_tokens=osl),
        lora_name=spec.adapter,
    )
    try:
        decision = await router.route(request)
        worker = workers[decision.instance_id]
        try:
            if await worker.ensure(spec.adapter):
                out.waited += 1
            first = True
            async for piece in worker.engine.generate(request):
                if first and piece.token_ids:
                    out.ttft_s.append(loop.time() - spec.arrival_s)
                    router.on_first_token(request.request_id)
                    first = False
        finally:
            router.on_finish(request.request_id)
    except ServingError as exc:
        out.failed += 1
        out.errors[type(exc).__name__] = out.errors.get(type(exc).__name__, 0) + 1


async def run_policy(policy: str, specs: list[Spec], args: argparse.Namespace) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    bus = MemoryEventBus(buffer_size=1 << 16)
    card = ModelCard(name="base", context_length=8192, block_size=BLOCK_SIZE,
                     num_total_blocks=16384)  # fmt: skip
    root = Path(tempfile.mkdtemp(prefix="tandem-lora-bench-"))
    for k in range(args.adapters):
        (root / f"adapter-{k:03d}").mkdir()
        (root / f"adapter-{k:03d}" / "adapter_config.json").write_text('{"r": 16}')
    workers: dict[str, SimWorker] = {}
    instances = []
    for i in range(args.workers):
        mocker = MockerConfig(
            model_name="base", tokenizer=None, block_size=BLOCK_SIZE, num_blocks=16384,
            speedup_ratio=1.0, max_loras=args.max_loras, lora_load_ms=args.lora_load_ms,
        )  # fmt: skip
        engine = MockerEngine(mocker, clock=loop.time)
        await engine.start()
        wid = f"w{i}"
        workers[wid] = SimWorker(wid, engine, bus, root)
        meta = {"lora_state_endpoint": wire.STATE_ENDPOINT, "max_loras": args.max_loras,
                "loras": []}  # fmt: skip
        instances.append(Instance(instance_id=wid, namespace="tandem", component="backend",
                                  endpoint="generate", address=f"127.0.0.1:{9000 + i}",
                                  model=card, metadata=meta))  # fmt: skip
    config = RouterConfig(
        seed=args.seed,
        use_kv_events=False,
        lora=LoraPlacementConfig(
            enabled=policy == "tandem",
            replica_load=args.lora_replica_load,
            max_replicas=args.lora_max_replicas,
        ),
    )
    router = make_router(
        "kv" if policy == "tandem" else policy,
        config,
        instances=StaticInstanceSet(instances),
        events=bus,
        client=cast(RequestClient, LocalClient(workers)),  # stream() is an async generator
        clock=loop.time,
        rng=random.Random(args.seed),
    )
    await router.start()
    out = Outcome()
    started = loop.time()
    tasks = []
    for i, spec in enumerate(specs):
        await asyncio.sleep(max(spec.arrival_s - (loop.time() - started), 0.0))
        tasks.append(asyncio.create_task(_one(spec, i, args.osl, router, workers, out)))
    await asyncio.gather(*tasks)
    duration_s = loop.time() - started
    loads = sum(w.engine.adapters.num_loads for w in workers.values())
    cut = int(args.warmup * len(specs))
    steady_from = specs[cut].arrival_s if cut < len(specs) else duration_s
    steady = sum(t >= started + steady_from for w in workers.values() for t in w.load_times)
    evictions = sum(w.engine.adapters.num_evictions for w in workers.values())
    placements: dict[str, int] = {}
    if router.metrics is not None:
        for (_, reason), n in router.metrics.lora.placements.items():
            placements[reason] = placements.get(reason, 0) + n
    await router.close()
    for w in workers.values():
        await w.engine.stop()
    shutil.rmtree(root, ignore_errors=True)
    row = _summary(policy, out, loads, evictions, duration_s, specs)
    row["steady_loads_per_min"] = steady / max(duration_s - steady_from, 1e-9) * 60.0
    row["placements"] = placements
    return row


def _summary(
    policy: str,
    out: Outcome,
    loads: int,
    evictions: int,
    duration_s: float,
    specs: list[Spec],
) -> dict[str, Any]:
    ttft = sorted(out.ttft_s)

    def pct(q: float) -> float:
        return ttft[min(int(q * len(ttft)), len(ttft) - 1)] * 1e3 if ttft else float("nan")

    return {
        "policy": policy,
        "requests": len(specs),
        "adapter_loads": loads,
        "loads_per_min": loads / duration_s * 60.0,
        "evictions": evictions,
        "waited_for_load": out.waited,
        "ttft_p50_ms": pct(0.50),
        "ttft_p99_ms": pct(0.99),
        "failed": out.failed,
        "errors": out.errors,
        "duration_s": duration_s,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    specs = workload(args)
    wall = time.perf_counter()
    rows = [run_virtual(run_policy(policy, specs, args)) for policy in args.policies.split(",")]
    by = {r["policy"]: r for r in rows}
    verdict: dict[str, Any] = {}
    if "tandem" in by and "random" in by:
        t, r = by["tandem"], by["random"]
        ratio = r["adapter_loads"] / max(t["adapter_loads"], 1)
        verdict = {
            "loads_ratio_random_over_tandem": ratio,
            "ttft_p99_ratio_tandem_over_random": t["ttft_p99_ms"] / r["ttft_p99_ms"],
            "met": ratio >= args.target_ratio and t["ttft_p99_ms"] <= r["ttft_p99_ms"],
        }
    return {
        "config": {k: v for k, v in vars(args).items() if k != "json"},
        "rows": rows,
        "verdict": verdict,
        "wall_s": time.perf_counter() - wall,
        "load_average": os.getloadavg(),
    }


def format_result(result: dict[str, Any]) -> str:
    c = result["config"]
    lines = [
        f"LoRA placement: {c['workers']} mocker workers x {c['max_loras']} slots, "
        f"{c['adapters']} adapters Zipf({c['zipf']}), {c['requests']} requests at "
        f"{c['rate']}/s (simulated), ISL {c['isl']} OSL {c['osl']}, load {c['lora_load_ms']} ms",
        f"{'policy':<14}{'loads':>7}{'loads/min':>11}{'steady/min':>12}{'evicted':>9}"
        f"{'waited':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'failed':>8}",
    ]
    for r in result["rows"]:
        steady = r["steady_loads_per_min"]
        lines.append(
            f"{r['policy']:<14}{r['adapter_loads']:>7}{r['loads_per_min']:>11.1f}{steady:>12.1f}"
            f"{r['evictions']:>9}{r['waited_for_load']:>8}{r['ttft_p50_ms']:>9.0f}ms"
            f"{r['ttft_p99_ms']:>8.0f}ms{r['failed']:>8}"
        )
    v = result["verdict"]
    if v:
        lines.append(
            f"random/tandem loads {v['loads_ratio_random_over_tandem']:.1f}x (target >= "
            f"{c['target_ratio']}x), tandem/random TTFT p99 "
            f"{v['ttft_p99_ratio_tandem_over_random']:.2f}: {'MET' if v['met'] else 'MISSED'}"
        )
    la = result["load_average"]
    lines.append(
        f"simulated time (figures independent of machine load); wall {result['wall_s']:.0f} s, "
        f"load average {la[0]:.1f} {la[1]:.1f} {la[2]:.1f}"
    )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    return figures_main(argv, parse_args, run, format_result)
