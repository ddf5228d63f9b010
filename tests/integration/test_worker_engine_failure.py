"""A Worker whose engine dies (memory discovery/events, TCP request plane): the instance
leaves discovery at once, `failed` is set with the reason, the request in flight and new
ones get PeerGone (the frontend routes or migrates them elsewhere, as for a worker that died);
`tandem worker` then exits non-zero."""

from __future__ import annotations

import argparse
import asyncio
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from tests.support.eventually import eventually
from tests.support.frontend_stack import COMPLETIONS, FrontendStack

from tandem.cli import worker as worker_cli
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.mocker.scheduler import Scheduler
from tandem.engines.worker import Worker, WorkerConfig
from tandem.errors import PeerGone
from tandem.protocols.engine import PreprocessedRequest, StopConditions, decode_output, encode
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.file import FileDiscovery
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.runtime import open_runtime
from tandem.runtime.tcp import TcpRequestClient

pytestmark = pytest.mark.timeout(20)


def _req(rid: str, max_tokens: int = 4) -> bytes:
    return encode(
        PreprocessedRequest(
            request_id=rid,
            model="m",
            token_ids=[1, 2, 3],
            stop=StopConditions(max_tokens=max_tokens),
        )
    )


def _break_scheduler_after(monkeypatch: pytest.MonkeyPatch, num_steps: int) -> None:
    real_step = Scheduler.step
    calls = {"n": 0}

    def step(self: Scheduler):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] > num_steps:
            raise RuntimeError("scheduler state is broken")
        return real_step(self)

    monkeypatch.setattr(Scheduler, "step", step)


async def test_a_dead_engine_takes_its_worker_out_of_discovery(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    disc, bus = MemoryDiscovery(), MemoryEventBus()
    cfg = RuntimeConfig(namespace="t")
    engine = MockerEngine(
        MockerConfig(num_blocks=64, block_size=4, speedup_ratio=0, tokenizer=None)
    )
    async with (
        open_runtime(cfg, discovery=disc, events=bus) as worker_rt,
        open_runtime(cfg, discovery=disc, events=bus) as client_rt,
    ):
        worker = Worker(engine, worker_rt, WorkerConfig())
        instance = await worker.start()
        assert len(await disc.list_instances("t.backend.generate")) == 1
        _break_scheduler_after(monkeypatch, 2)
        outs = []
        with pytest.raises(PeerGone, match="during request_id=doomed: mocker engine failed"):
            async for p in client_rt.stream(instance, _req("doomed", 10), request_id="doomed"):
                outs.append(decode_output(p))
        assert outs and not any(o.finish_reason for o in outs)  # two steps made tokens
        await asyncio.wait_for(worker.failed.wait(), 5)
        assert worker.failure == "mocker engine failed: RuntimeError: scheduler state is broken"
        assert await disc.list_instances("t.backend.generate") == []
        with pytest.raises(PeerGone, match="draining"):
            async for _ in client_rt.stream(instance, _req("late"), request_id="late"):
                pass
        await worker.stop(grace_s=0)


async def test_tandem_worker_exits_non_zero_when_its_engine_dies(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    parser = argparse.ArgumentParser()
    argv = [
        *("--discovery", "file", "--discovery-dir", str(tmp_path), "--namespace", "cli"),
        *("--speedup-ratio", "0", "--tokenizer", "none", "--drain-grace-s", "1"),
    ]
    worker_cli.add_arguments(parser, argv)
    args = parser.parse_args(argv)
    _break_scheduler_after(monkeypatch, 0)
    stop = asyncio.Event()  # never set: the engine's death alone ends serve()
    serving = asyncio.create_task(worker_cli.serve(args, stop))
    disc = FileDiscovery(str(tmp_path), ttl_s=2.0, poll_interval_s=0.05)
    client = None
    try:
        event = await asyncio.wait_for(anext(disc.watch("cli.backend.generate")), 10)
        inst = event.instance
        client = TcpRequestClient()
        with pytest.raises(PeerGone, match="scheduler state is broken"):
            async for _ in client.stream(inst.address, inst.path, _req("r"), request_id="r"):
                pass
        assert await asyncio.wait_for(serving, 10) == worker_cli.EXIT_ENGINE_FAILED
        assert await disc.list_instances("cli.") == []
    finally:
        stop.set()
        if client is not None:
            await client.close()
        await disc.close()
        if not serving.done():
            serving.cancel()


async def test_requests_of_a_dead_engine_migrate_to_another_worker() -> None:
    async with AsyncExitStack() as exit_stack:
        s = FrontendStack(exit_stack)
        engines = []
        for _ in range(2):
            config = MockerConfig(num_blocks=256, block_size=16, speedup_ratio=1.0)
            engines.append(MockerEngine(config))
            await s.add_worker(engines[-1])
        ready = {"model": "smollm2", "prompt": [5, 6], "max_tokens": 1}
        await s.start_frontend(ready, ready_path=COMPLETIONS, migration_limit=1)
        body = {"model": "smollm2", "prompt": [5, 6, 7], "max_tokens": 300, "ignore_eos": True}
        reply = asyncio.create_task(s.post(COMPLETIONS, body))
        await eventually(lambda: any(e.scheduler.num_running for e in engines))
        doomed = next(e for e in engines if e.scheduler.num_running)

        def broken() -> None:
            raise RuntimeError("scheduler state is broken")

        doomed.scheduler.step = broken  # type: ignore[method-assign]
        status, answer, _ = await asyncio.wait_for(reply, 20)
        assert status == 200, answer
        assert answer["usage"]["completion_tokens"] == 300
        assert answer["choices"][0]["finish_reason"] == "length"
        await eventually(lambda: sum(w.failed.is_set() for w in s.workers) == 1)
