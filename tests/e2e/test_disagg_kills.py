"""Real-process faults: a `tandem worker --disagg-mode prefill` SIGKILLed while it holds pinned
KV blocks, a `--disagg-mode decode` worker SIGKILLed while its rendezvous is open, and one
SIGKILLed mid-pull (prefill-first, while the bytes move). The surviving (in-process) side
ends its request within the bound — completed by a local prefill / another decode worker
with the aggregated tokens, or a clear error — and its block accounting returns to zero."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import msgspec
import pytest
from tests.support.tandem_procs import TandemProcess, start_tandem

from tandem.disagg.config import DisaggRouteConfig, DisaggWorkerConfig
from tandem.disagg.params import DisaggParams
from tandem.disagg.worker_engine import DisaggEngine
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.errors import NoWorkersAvailable, TransferError
from tandem.frontend.config import FrontendConfig
from tandem.frontend.disagg_wiring import disagg_streamer
from tandem.frontend.migration import EngineStreamer
from tandem.protocols.engine import (
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
    decode_output,
    encode,
)
from tandem.router.registry import make_router
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.runtime import open_runtime
from tandem.transfer import OpStatus

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]
MOCKER = MockerConfig(num_blocks=256, block_size=4, speedup_ratio=0, tokenizer=None)
FAST = ("shm", "tcp")


def request(rid: str, **kw: object) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model=MOCKER.model_name, token_ids=list(range(100, 130)),
        sampling=SamplingParams(temperature=0.0),
        stop=StopConditions(max_tokens=8, ignore_eos=True), **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def worker(tmp: Path, mode: str, backends: str = "shm,tcp") -> TandemProcess:
    flags = ["--engine", "mocker", "--speedup-ratio", "0", "--block-size", "4"]
    flags += ["--num-blocks", "256", "--disagg-mode", mode, "--disagg-transfer-backends", backends]
    flags += ["--namespace", "t", "--discovery", "file", "--discovery-dir", str(tmp / "disc")]
    proc = start_tandem(f"{mode}-worker", ["worker", *flags], tmp)
    proc.wait_log(r"worker ready: instance_id=", timeout_s=30)
    return proc


async def zero_blocks(engine: DisaggEngine) -> None:
    deadline = time.monotonic() + 5
    while engine.load().num_active_blocks and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    assert engine.load().num_active_blocks == 0
    engine.engine.scheduler.check_integrity()  # type: ignore[attr-defined]


async def aggregated() -> list[int]:
    engine = MockerEngine(MOCKER)
    await engine.start()
    tokens = [t async for o in engine.generate(request("agg")) for t in o.token_ids]
    await engine.stop()
    return tokens


@pytest.mark.parametrize("policy", ["local", "fail"])
async def test_prefill_killed_while_holding_pins(tmp_path: Path, policy: str) -> None:
    proc = worker(tmp_path, "prefill")
    cfg = DisaggWorkerConfig(
        mode="decode", backends=FAST, transfer_timeout_s=5, on_transfer_failure=policy
    )
    decode = DisaggEngine(MockerEngine(MOCKER), cfg)
    await decode.start()
    rc = RuntimeConfig(namespace="t", discovery="file", discovery_dir=str(tmp_path / "disc"))
    try:
        async with open_runtime(rc) as rt:
            view = rt.instance_set("prefill", "generate")
            await view.start()
            inst = next(iter((await view.wait_for(1)).values()))
            out = None
            async for payload in rt.client.stream(
                inst.address, inst.path, encode(request("k")), request_id="k"
            ):
                out = decode_output(payload)
            await view.close()
        assert out is not None and out.disagg_params is not None  # blocks are pinned there
        proc.signal(signal.SIGKILL)
        proc.proc.wait(10)
        req = request("k")
        leg = msgspec.structs.replace(
            req, token_ids=req.token_ids + out.token_ids, disagg_params=out.disagg_params,
            stop=msgspec.structs.replace(req.stop, max_tokens=7),
        )  # fmt: skip
        started = time.monotonic()
        if policy == "local":
            tokens = [t async for o in decode.generate(leg) for t in o.token_ids]
            assert out.token_ids + tokens == await aggregated()
        else:
            with pytest.raises(TransferError, match="peer unreachable or gone"):
                async for _ in decode.generate(leg):
                    pass
        assert time.monotonic() - started < 5  # far inside the transfer timeout
        await zero_blocks(decode)
    finally:
        proc.stop(grace_s=1)
        await decode.stop()


async def test_decode_killed_with_rendezvous_open(tmp_path: Path) -> None:
    proc = worker(tmp_path, "decode")
    prefill = DisaggEngine(MockerEngine(MOCKER), DisaggWorkerConfig(
        mode="prefill", backends=FAST, transfer_timeout_s=5))  # fmt: skip
    await prefill.start()
    rc = RuntimeConfig(namespace="t", discovery="file", discovery_dir=str(tmp_path / "disc"))
    try:
        async with open_runtime(rc) as rt:
            view = rt.instance_set("backend", "generate")
            await view.start()
            inst = next(iter((await view.wait_for(1)).values()))
            await view.close()
            address = tuple(inst.metadata["kv_transfer_address"])
            room = DisaggParams(mode="rendezvous", op_id="room-k", num_tokens=30)
            stream = rt.client.stream(inst.address, inst.path,
                                      encode(request("d", disagg_params=room.to_dict())),
                                      request_id="d")  # fmt: skip
            waiting = asyncio.ensure_future(anext(stream))
            await asyncio.sleep(0.3)  # the decode allocated and published its rendezvous
            proc.signal(signal.SIGKILL)
            proc.proc.wait(10)
            await asyncio.gather(waiting, return_exceptions=True)
        push = DisaggParams(mode="push", op_id="room-k", address=address)  # type: ignore[arg-type]
        started = time.monotonic()
        with pytest.raises(TransferError):
            async for _ in prefill.generate(request("d", disagg_params=push.to_dict())):
                pass
        assert time.monotonic() - started < 5
        await zero_blocks(prefill)
    finally:
        proc.stop(grace_s=1)
        await prefill.stop()


class FirstTo:
    """Router wrapper: the first route goes to ``worker_id`` (the doomed process); later
    ones (the re-route after it died) are the inner router's own choice."""

    def __init__(self, inner: Any, worker_id: str) -> None:
        self.inner, self.worker_id, self.is_first = inner, worker_id, True

    async def route(self, request: PreprocessedRequest, *, exclude: frozenset[str] = frozenset()):
        if self.is_first:
            self.is_first = False
            others = set(self.inner._instances.instances) - {self.worker_id}
            exclude = exclude | others
        return await self.inner.route(request, exclude=exclude)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


async def host(stack: AsyncExitStack, rc: RuntimeConfig, engine: DisaggEngine, comp: str) -> None:
    rt = await stack.enter_async_context(open_runtime(rc))
    w = Worker(engine, rt, WorkerConfig(component=comp, metrics_period_s=0.2))
    await w.start()
    stack.push_async_callback(w.stop, 0.0)


@pytest.mark.parametrize("survivor", [True, False], ids=["migrates", "clear-error"])
async def test_decode_killed_mid_pull(tmp_path: Path, survivor: bool) -> None:
    """Prefill-first over tcp: the prefill's agent SIGKILLs the pulling decode process at
    the moment it starts sending the bytes (op in_progress, the decode blocked reading them).
    The dropped connection errors the op, so the pins go at once (not at the 60 s TTL); the
    decode leg is routed again without its handoff and completes on the surviving decode
    worker with the aggregated tokens, or, with none left, fails with a clear 503."""
    proc = worker(tmp_path, "decode", backends="tcp")
    rc = RuntimeConfig(namespace="t", discovery="file", discovery_dir=str(tmp_path / "disc"))
    cfg = DisaggWorkerConfig(mode="prefill", backends=("tcp",), pin_ttl_s=60,
                             transfer_timeout_s=10)  # fmt: skip
    prefill = DisaggEngine(MockerEngine(MOCKER), cfg)
    decode = DisaggEngine(MockerEngine(MOCKER), dataclasses.replace(cfg, mode="decode"))
    seen: dict[str, Any] = {}
    try:
        async with AsyncExitStack() as stack:
            await host(stack, rc, prefill, "prefill")
            if survivor:
                await host(stack, rc, decode, "backend")
            front = await stack.enter_async_context(open_runtime(rc))
            fcfg = FrontendConfig(port=0, migration_limit=1,
                                  disagg=DisaggRouteConfig(enabled=True))  # fmt: skip
            decode_set = front.instance_set("backend", "generate")
            await decode_set.start()
            stack.push_async_callback(decode_set.close)
            live = await decode_set.wait_for(2 if survivor else 1, timeout_s=20)
            mine = decode.agent.agent_id if decode.agent is not None else None
            doomed = next(i for i in live.values()
                          if i.metadata.get("kv_transfer_agent_id") != mine)  # fmt: skip
            inner = make_router("round_robin", fcfg.router, instances=decode_set,
                                events=front.events, client=front.client,
                                namespace=front.namespace)  # fmt: skip
            await inner.start()
            stack.push_async_callback(inner.close)
            aggregated_streamer = EngineStreamer(
                front.client, front.endpoint_path("backend", "generate"), migration_limit=1
            )
            streamer, pool = disagg_streamer(fcfg, front, aggregated_streamer, decode_set)
            await pool.start()
            stack.push_async_callback(pool.close)
            await _wait_prefill_pool(pool)
            _kill_when_pulled(prefill, proc, doomed.metadata["kv_transfer_agent_id"], seen)
            started = time.monotonic()
            tokens: list[int] = []
            try:
                async for out in streamer.stream(request("m"), FirstTo(inner, doomed.instance_id)):
                    tokens += out.token_ids
                assert survivor, "no decode worker was left to finish it"
                # the prefill's first token, then the survivor's continuation of prompt + it
                # (a mocker continuation seeds its pseudo-tokens anew, so only the count and
                # the first token can be compared with the aggregated run)
                assert len(tokens) == 8 and tokens[0] == (await aggregated())[0]
            except NoWorkersAvailable as exc:
                assert not survivor
                assert "excluded" in str(exc)  # says the only decode worker failed
            assert time.monotonic() - started < 5  # far inside the 10 s transfer timeout
            assert seen["status"] is OpStatus.IN_PROGRESS and seen["killed"]
            await zero_blocks(prefill)
            assert time.monotonic() - seen["killed_at"] < 5  # not the 60 s pin TTL
            stats = prefill.agent.stats  # type: ignore[union-attr]
            # errored by the dropped connection, or cancelled by the frontend that saw the
            # decode leg fail first: either way released now, never left to expire
            assert stats.num_errored + stats.num_cancelled == 1
            assert (stats.num_expired, stats.num_complete) == (0, 0)
            if survivor:
                await zero_blocks(decode)
    finally:
        proc.stop(grace_s=1)


async def _wait_prefill_pool(pool: Any) -> None:
    deadline = time.monotonic() + 10
    while await pool.router_for(MOCKER.model_name) is None:
        assert time.monotonic() < deadline, "the prefill worker never joined the pool"
        await asyncio.sleep(0.02)  # polls file discovery's watch


def _kill_when_pulled(prefill: DisaggEngine, proc: TandemProcess, agent_id: str,
                      seen: dict[str, Any]) -> None:  # fmt: skip
    """Hook the prefill agent's tcp owner side: when the doomed decode starts its pull,
    SIGKILL it before the first byte is sent (it is blocked reading them)."""
    assert prefill.agent is not None
    backend = prefill.agent.backend("tcp")
    serve = backend.serve

    def hooked(sock: Any, op: Any, region: Any) -> int:
        if op.peer == agent_id and not seen.get("killed"):
            seen.update(status=op.status, killed=True, killed_at=time.monotonic())
            proc.signal(signal.SIGKILL)
            proc.proc.wait(10)  # gone before the first byte is sent
        return serve(sock, op, region)

    backend.serve = hooked  # type: ignore[method-assign]
