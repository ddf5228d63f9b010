"""Real-process faults: a `tandem worker --disagg-mode prefill` SIGKILLed while it holds pinned
KV blocks, and a `--disagg-mode decode` worker SIGKILLed while its rendezvous is open. The
surviving (in-process) side ends its request within the bound — completed by a local
prefill with the aggregated tokens, or a clear TransferError — and its block accounting
returns to zero."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import msgspec
import pytest
from tests.support.tandem_procs import TandemProcess, start_tandem

from tandem.disagg.config import DisaggWorkerConfig
from tandem.disagg.params import DisaggParams
from tandem.disagg.worker_engine import DisaggEngine
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.errors import TransferError
from tandem.protocols.engine import (
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
    decode_output,
    encode,
)
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.runtime import open_runtime

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(60)]
MOCKER = MockerConfig(num_blocks=256, block_size=4, speedup_ratio=0, tokenizer=None)
FAST = ("shm", "tcp")


def request(rid: str, **kw: object) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id=rid, model=MOCKER.model_name, token_ids=list(range(100, 130)),
        sampling=SamplingParams(temperature=0.0),
        stop=StopConditions(max_tokens=8, ignore_eos=True), **kw,  # type: ignore[arg-type]
    )  # fmt: skip


def worker(tmp: Path, mode: str) -> TandemProcess:
    flags = ["--engine", "mocker", "--speedup-ratio", "0", "--block-size", "4"]
    flags += ["--num-blocks", "256", "--disagg-mode", mode, "--disagg-transfer-backends", "shm,tcp"]
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
