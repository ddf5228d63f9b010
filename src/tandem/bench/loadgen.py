"""The load generator: sends a workload to an OpenAI endpoint and collects `RequestResult`s.

Modes: closed loop (`concurrency` requests always in flight) or open loop (each request at its
`send_at_s`: a trace's timestamps or a Poisson schedule from `request_rate`; `concurrency`, when
also given, caps requests in flight). `num_requests` and/or `duration_s` bound the run; the
workload is cycled when the run asks for more requests than it has. After the last send, the
run waits for in-flight requests (each bounded by `timeout_s`). Request bodies are encoded
before the clock starts (up to `BODY_CACHE_BYTES`), so the client's JSON encoding (and chat's
detokenization) is neither in the timed window nor on the cores the servers share with it.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
import msgspec

from tandem.bench.client import ConnectionPool, RequestResult
from tandem.bench.cpu import CpuMeter
from tandem.bench.workload import RequestSpec, poisson_send_times, tokens_to_text
from tandem.config_check import check_range

logger = logging.getLogger(__name__)

ENDPOINTS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# bodies encoded ahead of a run, at most (later sends encode theirs when they go)
BODY_CACHE_BYTES = 512 << 20


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadConfig:
    url: str = "http://127.0.0.1:8000"
    model: str | None = None
    endpoint: str = "completions"
    concurrency: int | None = None
    request_rate: float | None = None
    num_requests: int | None = None
    duration_s: float | None = None
    fresh_connections: bool = False
    timeout_s: float = 600.0
    seed: int = 0
    server_pids: tuple[int, ...] = ()
    server_children: bool = False

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(
                f"unknown endpoint '{self.endpoint}'; expected one of: {', '.join(ENDPOINTS)}"
            )
        if urlsplit(self.url).scheme != "http":
            raise ValueError(f"url={self.url!r} must be http://host:port (no TLS)")
        if self.concurrency is not None:
            check_range("concurrency", self.concurrency, low=1)
        if self.request_rate is not None:
            check_range("request_rate", self.request_rate, low=0, low_open=True)
        if self.num_requests is not None:
            check_range("num_requests", self.num_requests, low=1)
        if self.duration_s is not None:
            check_range("duration_s", self.duration_s, low=0, low_open=True)
        check_range("timeout_s", self.timeout_s, low=0, low_open=True)


@dataclass(slots=True, kw_only=True)
class LoadRun:
    """A finished run: results in completion order, wall time, server CPU seconds by pid."""

    config: LoadConfig
    model: str
    results: list[RequestResult]
    wall_s: float
    server_cpu_s: dict[int, float] = field(default_factory=dict)
    client_cpu_s: float = 0.0  # this process: shows whether the client was the bottleneck


def encode_body(spec: RequestSpec, endpoint: str, model: str) -> bytes:
    body: dict[str, object] = {
        "model": model,
        "max_tokens": spec.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": spec.ignore_eos,
    }
    if endpoint == "chat":
        text = spec.text if spec.text is not None else tokens_to_text(spec.prompt_token_ids())
        body["messages"] = [{"role": "user", "content": text}]
    else:
        token_ids = spec.prompt_token_ids()
        body["prompt"] = token_ids if token_ids else (spec.text or "")
    return msgspec.json.encode(body)


async def first_model(url: str, timeout_s: float = 10.0) -> str:
    """The id of the first model of `GET {url}/v1/models`."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(url.rstrip("/") + "/v1/models") as resp,
    ):
        resp.raise_for_status()
        data = await resp.json()
    models = data.get("data") or []
    if not models:
        raise RuntimeError(f"{url}/v1/models lists no model; is a worker up?")
    return str(models[0]["id"])


async def run_load(config: LoadConfig, specs: list[RequestSpec]) -> LoadRun:
    """Send `specs` as `config` says; returns every result, failed ones included."""
    if not specs:
        raise ValueError("the workload has no requests")
    model = config.model or await first_model(config.url)
    parts = urlsplit(config.url)
    pool = ConnectionPool(
        parts.hostname or "127.0.0.1",
        parts.port or 80,
        fresh=config.fresh_connections,
        timeout_s=config.timeout_s,
    )
    path = parts.path.rstrip("/") + ENDPOINTS[config.endpoint]
    sender = _Sender(config, specs, pool, path, model)
    sender.encode_ahead()
    meter = CpuMeter(config.server_pids, children=config.server_children)
    meter.start()
    client_cpu_start = time.process_time()
    try:
        timed = config.request_rate is not None or specs[0].send_at_s is not None
        await (sender.run_timed() if timed else sender.run_closed_loop())
    finally:
        pool.close()
    server_cpu_s = meter.stop()
    return LoadRun(
        client_cpu_s=time.process_time() - client_cpu_start,
        config=config,
        model=model,
        results=sender.results,
        wall_s=sender.wall_s,
        server_cpu_s=server_cpu_s,
    )


def run_load_blocking(config: LoadConfig, specs: list[RequestSpec]) -> LoadRun:
    """`run_load` on a fresh event loop: uvloop when installed (a cheaper client, so less of
    the host's CPU goes to the load generator), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(run_load(config, specs))
    return uvloop.run(run_load(config, specs))


class _Sender:
    def __init__(
        self,
        config: LoadConfig,
        specs: list[RequestSpec],
        pool: ConnectionPool,
        path: str,
        model: str,
    ) -> None:
        self.config = config
        self.specs = specs
        self.pool = pool
        self.path = path
        self.model = model
        self.results: list[RequestResult] = []
        self.wall_s = 0.0
        if config.num_requests is not None:
            self.limit = config.num_requests
        elif config.duration_s is not None:
            self.limit = 1 << 62
        else:
            self.limit = len(specs)
        self.t0 = 0.0
        self.deadline = float("inf")
        self.bodies: list[bytes] = []  # of specs[0], specs[1], ...: encode_ahead

    def encode_ahead(self) -> None:
        """Encode the bodies of the specs the run will send, in order, until BODY_CACHE_BYTES."""
        total = 0
        for spec in self.specs[: min(self.limit, len(self.specs))]:
            if total >= BODY_CACHE_BYTES:
                break
            body = encode_body(spec, self.config.endpoint, self.model)
            self.bodies.append(body)
            total += len(body)

    def _begin(self) -> None:
        self.t0 = time.perf_counter()
        if self.config.duration_s is not None:
            self.deadline = self.t0 + self.config.duration_s

    async def _send(self, index: int) -> None:
        i = index % len(self.specs)
        body = (
            self.bodies[i]
            if i < len(self.bodies)
            else encode_body(self.specs[i], self.config.endpoint, self.model)
        )
        result = RequestResult(start_s=time.perf_counter() - self.t0)
        self.results.append(await self.pool.send(self.path, body, result))

    async def run_closed_loop(self) -> None:
        counter = itertools.count()

        async def loop() -> None:
            while (i := next(counter)) < self.limit and time.perf_counter() < self.deadline:
                await self._send(i)

        self._begin()
        async with asyncio.TaskGroup() as tg:
            for _ in range(self.config.concurrency or 1):
                tg.create_task(loop())
        self.wall_s = time.perf_counter() - self.t0

    async def run_timed(self) -> None:
        rate = self.config.request_rate
        if rate is not None:
            count = self.limit
            if count >= 1 << 62:  # duration-bound: enough arrivals to outlast the deadline
                count = int(rate * (self.config.duration_s or 0.0) * 2) + 16
            times = poisson_send_times(rate, count, self.config.seed)
        else:  # replay: each request once, at its own time
            count = min(self.limit, len(self.specs))
            times = [self.specs[i].send_at_s or 0.0 for i in range(count)]
        cap = asyncio.Semaphore(self.config.concurrency) if self.config.concurrency else None

        async def send_capped(i: int) -> None:
            if cap is None:
                await self._send(i)
                return
            async with cap:
                await self._send(i)

        self._begin()
        async with asyncio.TaskGroup() as tg:
            for i, at in enumerate(times):
                delay = self.t0 + at - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                if time.perf_counter() >= self.deadline:
                    break
                tg.create_task(send_capped(i))
        self.wall_s = time.perf_counter() - self.t0
