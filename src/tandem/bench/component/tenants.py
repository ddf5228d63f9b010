"""`tandem bench tenants` (issue 33): many tenants on one mocker fleet driven past its capacity,
each figure beside the FIFO baseline of the same run.

The fleet is in one process: `--workers` mocker engines (the mocker's perf model, real time
divided by `--speedup`) behind tandem's router (least_loaded, `busy_inflight_requests` =
`--slots` per worker, so overload waits in the router queue). Each request goes through the
router's queue and a worker's engine exactly as in a frontend, without HTTP. "FIFO" is the
same fleet with every request of one tenant and one class, no deadline: the queue then serves
arrival order. Capacity is measured first (a closed loop of long prompts), and the offered
loads are multiples of it.

1. noisy: tenant A floods long prompts at `--overload` × capacity, B sends short requests at
   a modest rate; B's TTFT p99 beside B alone, and A's share of what was served.
2. weights: three backlogged tenants with weights 1:1:2; Jain's index over weight-normalised
   served tokens, and how busy the workers stayed (slot occupancy).
3. priority: 10 % of the requests in class high with a TTFT target, the rest normal, at the
   overload; the share of high requests within the target.
4. batch: a `--batch-lines` batch in the batch class (queued at once) under an interactive
   load (`--interactive-load` x the fleet's measured capacity for short requests); interactive
   TTFT p99 with and without the batch.
5. sessions: `--sessions` agents × `--turns` turns over a shared system prompt on the fleet:
   cached prompt fraction against the infinite-cache oracle, and TTFT p99, sessions on / off.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import random
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.errors import ServingError
from tandem.protocols.discovery import Instance
from tandem.protocols.engine import PreprocessedRequest, SamplingParams, StopConditions
from tandem.protocols.tenancy import PRIORITY_CLASSES
from tandem.router.config import RouterConfig
from tandem.router.policy_router import LeastLoadedRouter
from tandem.router.source import StaticInstanceSet

BLOCK = 16
nan = float("nan")
_ids = itertools.count()


@dataclass(slots=True)
class Result:
    tenant: str
    priority: int
    ttft_s: float | None
    num_prompt: int
    num_output: int
    num_cached: int
    ok: bool
    output: list[int] = field(default_factory=list)
    route_s: float | None = None  # of ttft_s: waiting for a worker (the router queue)
    ended_at: float | None = None  # time.perf_counter() when its last token came


@dataclass(slots=True)
class Fleet:
    engines: dict[str, MockerEngine]
    router: LeastLoadedRouter
    fifo: bool
    results: list[Result] = field(default_factory=list)
    busy_samples: list[float] = field(default_factory=list)

    async def send(
        self,
        tokens: list[int],
        max_tokens: int,
        *,
        tenant: str,
        weight: float = 1.0,
        priority: int = 0,
        session: str | None = None,
        keep_output: bool = False,
    ) -> Result:
        request = PreprocessedRequest(
            request_id=f"b{next(_ids)}",
            model="m",
            token_ids=list(tokens),
            sampling=SamplingParams(temperature=0.0),
            stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
            priority=0 if self.fifo else priority,
            tenant=None if self.fifo else tenant,
            tenant_weight=1.0 if self.fifo else weight,
            session_id=session,
        )
        result = Result(tenant, priority, None, len(tokens), 0, 0, False)
        started = time.perf_counter()
        try:
            decision = await self.router.route(request)
            result.route_s = time.perf_counter() - started
        except ServingError:
            self.results.append(result)
            return result
        try:
            async for out in self.engines[decision.instance_id].generate(request):
                if result.ttft_s is None:
                    result.ttft_s = time.perf_counter() - started
                    result.num_cached = out.num_cached_tokens or 0
                    self.router.on_first_token(request.request_id)
                result.num_output += len(out.token_ids)
                if keep_output:
                    result.output.extend(out.token_ids)
            result.ok, result.ended_at = True, time.perf_counter()
        finally:
            self.router.on_finish(request.request_id)
        self.results.append(result)
        return result

    async def sample_busy(self, slots: int, stop: asyncio.Event) -> None:
        while not stop.is_set():
            full = [self.router.inflight(w) >= slots for w in self.engines]
            self.busy_samples.append(sum(full) / len(full))
            await asyncio.sleep(0.02)


async def open_fleet(args: argparse.Namespace, *, fifo: bool, sessions: bool = False) -> Fleet:
    engines = {}
    for i in range(args.workers):
        engine = MockerEngine(
            MockerConfig(
                model_name="m",
                tokenizer=None,
                num_blocks=args.num_blocks,
                block_size=BLOCK,
                max_num_seqs=args.slots,
                max_num_batched_tokens=args.max_batched_tokens,
                speedup_ratio=args.speedup,
            )
        )
        await engine.start()
        engines[f"w{i}"] = engine
    instances = StaticInstanceSet(
        [
            Instance(
                instance_id=w,
                namespace="tandem",
                component="backend",
                endpoint="generate",
                address=f"127.0.0.1:{9000 + i}",
            )
            for i, w in enumerate(engines)
        ]
    )
    router = LeastLoadedRouter(
        RouterConfig(
            busy_inflight_requests=args.slots,
            queue_size=100_000,
            queue_timeout_s=600.0,
            session_ttl_s=600.0 if sessions else 0.0,
            session_slack=args.slots,
        ),
        instances=instances,
    )
    await router.start()
    return Fleet(engines, router, fifo)


async def close_fleet(fleet: Fleet) -> None:
    await fleet.router.close()
    for engine in fleet.engines.values():
        await engine.stop()


_VOCAB = range(100, 40_000)


def prompt(rng: random.Random, n: int) -> list[int]:
    # choices, not n randrange calls: at 1.7x capacity the long prompts' ids alone were a
    # third of the bench's CPU, on the loop every simulated step shares
    return rng.choices(_VOCAB, k=n)


async def poisson(
    rate_per_s: float, duration_s: float, rng: random.Random, fire: Callable[[], Any]
) -> list[asyncio.Task[Any]]:
    tasks: list[asyncio.Task[Any]] = []
    end = time.perf_counter() + duration_s
    while time.perf_counter() < end:
        tasks.append(asyncio.create_task(fire()))
        await asyncio.sleep(rng.expovariate(rate_per_s))
    return tasks


def p99(values: list[float]) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def ttfts(
    results: list[Result], tenant: str | None = None, priority: int | None = None
) -> list[float]:
    return [
        r.ttft_s for r in results
        if r.ttft_s is not None and (tenant is None or r.tenant == tenant)
        and (priority is None or r.priority == priority)
    ]  # fmt: skip


async def capacity(args: argparse.Namespace, num_prompt: int, num_output: int) -> float:
    """Requests of that shape per second the fleet completes with every slot full."""
    fleet = await open_fleet(args, fifo=True)
    rng = random.Random(args.seed)
    stop = time.perf_counter() + args.calibrate_s
    done = 0

    async def loop() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            await fleet.send(prompt(rng, num_prompt), num_output, tenant="a")
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(args.workers * args.slots)))
    rate = done / (time.perf_counter() - started)
    await close_fleet(fleet)
    return rate


async def noisy(args: argparse.Namespace, cap: float, mode: str) -> dict[str, float]:
    fleet = await open_fleet(args, fifo=mode == "fifo")
    rng = random.Random(args.seed + 1)

    async def b() -> None:
        await fleet.send(prompt(rng, args.short_prompt), args.short_output, tenant="b")

    async def a() -> None:
        await fleet.send(prompt(rng, args.long_prompt), args.long_output, tenant="a")

    jobs = [poisson(args.b_rate, args.duration_s, random.Random(args.seed + 2), b)]
    if mode != "alone":
        jobs.append(poisson(cap * args.overload, args.duration_s, random.Random(args.seed + 3), a))
    stop = asyncio.Event()
    lags = asyncio.create_task(loop_lags(stop))
    fired = await asyncio.gather(*jobs)
    window_end = time.perf_counter()  # A was sending all along: the overload's window
    stop.set()
    await drain(fleet, [t for tasks in fired for t in tasks], args.duration_s)
    a_done = [r for r in fleet.results if r.tenant == "a" and r.ok]
    served_a = sum(r.num_prompt + r.num_output for r in a_done)
    # what A got of the fleet while it flooded it (the drain serves all of it in the end)
    in_window = [r for r in a_done if r.ended_at is not None and r.ended_at <= window_end]
    await close_fleet(fleet)
    b_served = [r for r in fleet.results if r.tenant == "b" and r.ttft_s is not None]
    return {
        "b_ttft_p99_s": p99(ttfts(fleet.results, "b")),
        "a_served_tokens": served_a,
        "a_served_in_window_tokens": sum(r.num_prompt + r.num_output for r in in_window),
        # where B's TTFT goes: waiting for a worker, then the engine (its wait and steps)
        "b_route_p99_s": p99([r.route_s or 0.0 for r in b_served]),
        "b_engine_p99_s": p99([(r.ttft_s or 0.0) - (r.route_s or 0.0) for r in b_served]),
        "loop_lag_p99_s": p99(await lags),
    }


async def loop_lags(stop: asyncio.Event, period_s: float = 0.005) -> list[float]:
    """How late this process's event loop wakes a timer: the fleet's own CPU (every engine,
    the router and the clients share one loop), which delays every simulated step."""
    lags: list[float] = []
    while not stop.is_set():
        started = time.perf_counter()
        await asyncio.sleep(period_s)
        lags.append(time.perf_counter() - started - period_s)
    return lags


async def drain(fleet: Fleet, tasks: list[asyncio.Task[Any]], duration_s: float) -> None:
    """Let the run's requests end; what is still queued after the grace time is cancelled."""
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=max(duration_s, 10.0))
    for task in pending:
        task.cancel()
    await asyncio.gather(*pending, return_exceptions=True)


async def weights(args: argparse.Namespace, cap: float, mode: str) -> dict[str, float]:
    fleet = await open_fleet(args, fifo=mode == "fifo")
    rng = random.Random(args.seed + 4)
    tenant_weights = {"t1": 1.0, "t2": 1.0, "t4": 2.0}
    stop = asyncio.Event()
    sampler = asyncio.create_task(fleet.sample_busy(args.slots, stop))
    end = time.perf_counter() + args.duration_s
    served: dict[str, float] = defaultdict(float)

    async def backlog(tenant: str) -> None:  # each tenant keeps 2x the fleet's slots queued
        async def one() -> None:
            while time.perf_counter() < end:
                n = rng.choice((args.short_prompt, args.long_prompt))
                r = await fleet.send(
                    prompt(rng, n), args.long_output, tenant=tenant, weight=tenant_weights[tenant]
                )
                if r.ok and time.perf_counter() < end:
                    served[tenant] += r.num_prompt + 2 * r.num_output

        await asyncio.gather(*(one() for _ in range(2 * args.workers * args.slots)))

    tasks = [asyncio.create_task(backlog(t)) for t in tenant_weights]
    await asyncio.sleep(args.duration_s)
    stop.set()
    await drain(fleet, tasks, args.duration_s)
    await sampler
    norm = [served[t] / w for t, w in tenant_weights.items()]
    jain = sum(norm) ** 2 / (len(norm) * sum(x * x for x in norm)) if any(norm) else 0.0
    samples = fleet.busy_samples[len(fleet.busy_samples) // 10 :]  # after the ramp
    await close_fleet(fleet)
    return {"jain": jain, "busy": sum(samples) / max(len(samples), 1)}


async def priority(args: argparse.Namespace, cap: float, mode: str) -> dict[str, float]:
    fleet = await open_fleet(args, fifo=mode == "fifo")
    rng = random.Random(args.seed + 5)
    high = PRIORITY_CLASSES["high"]

    async def fire() -> None:
        is_high = rng.random() < 0.1
        await fleet.send(
            prompt(rng, args.short_prompt if is_high else args.long_prompt),
            args.short_output if is_high else args.long_output,
            tenant="app",
            priority=high if is_high else 0,
        )

    tasks = await poisson(cap * args.overload, args.duration_s, random.Random(args.seed + 6), fire)
    await drain(fleet, tasks, args.duration_s)
    high_ttfts = [r.ttft_s for r in fleet.results if r.priority == high]
    missed = sum(1 for r in fleet.results if r.priority == high and r.ttft_s is None)
    met = sum(1 for t in high_ttfts if t is not None and t <= args.ttft_target_s)
    await close_fleet(fleet)
    total = len(high_ttfts) + missed
    return {"met": met / total if total else float("nan"), "high_ttft_p99_s": p99(
        [t for t in high_ttfts if t is not None])}  # fmt: skip


async def batch(args: argparse.Namespace, short_cap: float, mode: str) -> dict[str, float]:
    fleet = await open_fleet(args, fifo=mode == "fifo")
    rng = random.Random(args.seed + 7)
    tasks: list[asyncio.Task[Any]] = []
    if mode != "without":
        tasks = [
            asyncio.create_task(
                fleet.send(
                    prompt(rng, args.short_prompt),
                    args.short_output,
                    tenant="batch",
                    priority=PRIORITY_CLASSES["batch"],
                )
            )
            for _ in range(args.batch_lines)
        ]

    async def interactive() -> None:
        await fleet.send(prompt(rng, args.short_prompt), args.short_output, tenant="chat")

    rate = short_cap * args.interactive_load
    stop = asyncio.Event()
    lags = asyncio.create_task(loop_lags(stop))
    fired = await poisson(rate, args.duration_s, random.Random(args.seed + 8), interactive)
    stop.set()
    await drain(fleet, fired, args.duration_s)
    started = time.perf_counter()
    await drain(fleet, tasks, args.batch_timeout_s)
    done = sum(1 for r in fleet.results if r.tenant == "batch" and r.ok)
    await close_fleet(fleet)
    chat = [r for r in fleet.results if r.tenant == "chat" and r.ttft_s is not None]
    return {
        "chat_ttft_p99_s": p99(ttfts(fleet.results, "chat")),
        "batch_done": done,
        "batch_tail_s": time.perf_counter() - started,
        "chat_route_p99_s": p99([r.route_s or 0.0 for r in chat]),
        "chat_engine_p99_s": p99([(r.ttft_s or 0.0) - (r.route_s or 0.0) for r in chat]),
        "loop_lag_p99_s": p99(await lags),
    }


async def sessions(args: argparse.Namespace, mode: str) -> dict[str, float]:
    fleet = await open_fleet(args, fifo=True, sessions=mode == "on")
    rng = random.Random(args.seed + 9)
    system = prompt(rng, args.system_prompt)
    seen: set[tuple[int, ...]] = set()
    oracle = 0
    total = 0

    async def agent(k: int) -> None:
        nonlocal oracle, total
        history = list(system)
        for _ in range(args.turns):
            history += prompt(rng, 64)
            blocks = [tuple(history[: (i + 1) * BLOCK]) for i in range(len(history) // BLOCK)]
            hit = next((i for i, b in enumerate(blocks) if b not in seen), len(blocks))
            oracle += hit * BLOCK
            total += len(history)
            seen.update(blocks)
            r = await fleet.send(history, 32, tenant="agents", session=f"s{k}", keep_output=True)
            history += r.output
            await asyncio.sleep(rng.uniform(0.5, 1.5) * args.think_s)  # the agent's own work

    await asyncio.gather(*(agent(k) for k in range(args.sessions)))
    cached = sum(r.num_cached for r in fleet.results)
    result = {
        "cached_fraction": cached / total,
        "oracle_fraction": oracle / total,
        "ttft_p99_s": p99(ttfts(fleet.results)),
    }
    await close_fleet(fleet)
    return result


async def run(args: argparse.Namespace) -> dict[str, Any]:
    cap = await capacity(args, args.long_prompt, args.long_output)
    out: dict[str, Any] = {
        "capacity_long_rps": cap,
        "args": {**vars(args), "only": sorted(args.only)},
    }
    if "noisy" in args.only:
        out["noisy"] = {m: await noisy(args, cap, m) for m in ("alone", "fifo", "fair")}
    if "weights" in args.only:
        out["weights"] = {m: await weights(args, cap, m) for m in ("fifo", "fair")}
    if "priority" in args.only:
        out["priority"] = {m: await priority(args, cap, m) for m in ("fifo", "fair")}
    if "batch" in args.only:
        # a short request holds a slot for its decode steps: not 1/16 of a long one's cost
        short = await capacity(args, args.short_prompt, args.short_output)
        out["capacity_short_rps"] = short
        out["batch"] = {m: await batch(args, short, m) for m in ("without", "fifo", "fair")}
    if "sessions" in args.only:
        out["sessions"] = {m: await sessions(args, m) for m in ("off", "on")}
    return out


def _ratio(a: float, b: float, form: str) -> str:
    return "-" if a != a or b != b or b == 0 else format(a / b - (1 if "+" in form else 0), form)


def _ms(seconds: float) -> str:
    return "none served" if seconds != seconds else f"{seconds * 1e3:.0f} ms"


def format_result(r: dict[str, Any]) -> str:
    a = r["args"]
    lines = [
        f"tandem bench tenants: {a['workers']} mocker workers x {a['slots']} slots, speedup "
        f"{a['speedup']}, capacity {r['capacity_long_rps']:.2f} long req/s"
        + (f" ({r['capacity_short_rps']:.1f} short)" if "capacity_short_rps" in r else "")
        + f", overload {a['overload']}x, {a['duration_s']} s per run",
    ]
    if n := r.get("noisy"):
        alone, fifo, fair = (n[m]["b_ttft_p99_s"] for m in ("alone", "fifo", "fair"))
        lines.append(
            f"noisy:    B TTFT p99 alone {_ms(alone)} | FIFO {_ms(fifo)} "
            f"({_ratio(fifo, alone, '.2f')}x) | "
            f"fair {_ms(fair)} ({_ratio(fair, alone, '.2f')}x, target <= 1.2x)"
        )
        a_fifo, a_fair = (n[m].get("a_served_in_window_tokens", nan) for m in ("fifo", "fair"))
        lines.append(
            f"          A served while it flooded: FIFO {a_fifo:.0f} tokens, fair {a_fair:.0f} "
            f"({_ratio(a_fair, a_fifo, '.2f')}x FIFO's); in all, drain included: FIFO "
            f"{n['fifo']['a_served_tokens']:.0f}, fair {n['fair']['a_served_tokens']:.0f}"
        )
        split = [
            f"{m} {_ms(n[m].get('b_route_p99_s', nan))} / {_ms(n[m].get('b_engine_p99_s', nan))}"
            for m in ("alone", "fifo", "fair")
        ]
        lines.append("          B's p99 in the router queue / in the engine: " + " | ".join(split))
        lines.append(
            "          event loop lag p99 (the bench's own CPU, in every step): "
            + " | ".join(f"{m} {_ms(n[m].get('loop_lag_p99_s', nan))}" for m in n)
        )
    if w := r.get("weights"):
        lines.append(
            f"weights:  Jain (1:1:2, weight-normalised tokens) FIFO {w['fifo']['jain']:.3f} | "
            f"fair {w['fair']['jain']:.3f} (target >= 0.95); slots busy FIFO "
            f"{w['fifo']['busy']:.1%} | fair {w['fair']['busy']:.1%} (target >= 95 %)"
        )
    if p := r.get("priority"):
        lines.append(
            f"priority: high-class TTFT <= {_ms(a['ttft_target_s'])}: FIFO {p['fifo']['met']:.1%}"
            f" | classes {p['fair']['met']:.1%} (target >= 99 %); p99 FIFO "
            f"{_ms(p['fifo']['high_ttft_p99_s'])} | classes {_ms(p['fair']['high_ttft_p99_s'])}"
        )
    if b := r.get("batch"):
        base, fifo, fair = (b[m]["chat_ttft_p99_s"] for m in ("without", "fifo", "fair"))
        lines.append(
            f"batch:    chat TTFT p99 without batch {_ms(base)} | with, FIFO {_ms(fifo)} "
            f"({_ratio(fifo, base, '+.0%')}) | with, batch class {_ms(fair)} "
            f"({_ratio(fair, base, '+.0%')}, "
            f"target <= +10 %); lines done FIFO {b['fifo']['batch_done']}, batch class "
            f"{b['fair']['batch_done']} of {a['batch_lines']}"
        )
        split = [
            f"{m} {_ms(b[m].get('chat_route_p99_s', nan))} / "
            f"{_ms(b[m].get('chat_engine_p99_s', nan))} / {_ms(b[m].get('loop_lag_p99_s', nan))}"
            for m in b
        ]
        lines.append("          chat p99 router queue / engine / loop lag: " + " | ".join(split))
    if s := r.get("sessions"):
        off, on = s["off"], s["on"]
        lines.append(
            f"sessions: cached prompt fraction off {off['cached_fraction']:.1%} | on "
            f"{on['cached_fraction']:.1%} (oracle {on['oracle_fraction']:.1%}); TTFT p99 "
            f"off {_ms(off['ttft_p99_s'])} | on {_ms(on['ttft_p99_s'])}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="tandem bench tenants", description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--slots", type=int, default=4, help="requests in flight per worker")
    p.add_argument("--speedup", type=float, default=1.0, help="mocker speedup_ratio")
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--max-batched-tokens", type=int, default=2048)
    p.add_argument("--overload", type=float, default=1.7, help="offered load / capacity")
    p.add_argument("--duration-s", type=float, default=20.0)
    p.add_argument("--calibrate-s", type=float, default=8.0)
    p.add_argument("--long-prompt", type=int, default=2048)
    p.add_argument("--long-output", type=int, default=32)
    p.add_argument("--short-prompt", type=int, default=128)
    p.add_argument("--short-output", type=int, default=16)
    p.add_argument("--b-rate", type=float, default=2.0, help="B's requests/s (noisy)")
    p.add_argument("--ttft-target-s", type=float, default=0.25)
    p.add_argument("--batch-lines", type=int, default=2000)
    p.add_argument("--batch-timeout-s", type=float, default=300.0)
    p.add_argument("--interactive-load", type=float, default=0.3,
                   help="interactive load / the fleet's capacity for short requests "
                        "(batch)")  # fmt: skip
    p.add_argument("--sessions", type=int, default=50)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--system-prompt", type=int, default=1024)
    p.add_argument("--think-s", type=float, default=1.0, help="an agent's mean pause per turn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="noisy,weights,priority,batch,sessions")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    args.only = set(args.only.split(","))
    return args


def main(argv: list[str]) -> int:
    from tandem.bench.component.entry import figures_main

    return figures_main(argv, parse_args, lambda a: asyncio.run(run(a)), format_result)
