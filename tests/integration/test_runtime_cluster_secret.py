"""A worker whose runtime has the cluster secret serves only peers that hold it: `generate` and
`kv_state` are not callable by a raw client without it (or with another cluster's)."""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator

import pytest

from tandem import errors
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.engine import MockerEngine
from tandem.engines.worker import Worker, WorkerConfig
from tandem.protocols import kv_events as kv
from tandem.protocols.discovery import Instance
from tandem.protocols.engine import PreprocessedRequest, StopConditions, decode_output, encode
from tandem.runtime.config import RuntimeConfig
from tandem.runtime.discovery.memory import MemoryDiscovery
from tandem.runtime.events.memory import MemoryEventBus
from tandem.runtime.runtime import Runtime, open_runtime
from tandem.runtime.tcp import TcpRequestClient

pytestmark = pytest.mark.timeout(15)
SECRET = secrets.token_hex(32)  # as `openssl rand -hex 32` makes one


@pytest.fixture
async def stack() -> AsyncIterator[tuple[Instance, Runtime]]:
    disc, bus = MemoryDiscovery(), MemoryEventBus()
    cfg = RuntimeConfig(namespace="t", cluster_secret=SECRET)
    engine = MockerEngine(MockerConfig(num_blocks=64, block_size=4, tokenizer=None))
    async with (
        open_runtime(cfg, discovery=disc, events=bus) as worker_rt,
        open_runtime(cfg, discovery=disc, events=bus) as frontend_rt,
    ):
        worker = Worker(engine, worker_rt, WorkerConfig())
        instance = await worker.start()
        yield instance, frontend_rt
        await worker.stop(grace_s=0)


def _generate_payload() -> bytes:
    return encode(
        PreprocessedRequest(
            request_id="r",
            model="smollm2",
            token_ids=list(range(8)),
            stop=StopConditions(max_tokens=1_000_000_000),  # what validation would refuse
        )
    )


async def test_peer_with_the_secret_is_served(stack) -> None:
    instance, frontend = stack
    payload = encode(
        PreprocessedRequest(
            request_id="ok", model="smollm2", token_ids=[1, 2, 3], stop=StopConditions(max_tokens=2)
        )
    )
    outs = [decode_output(p) async for p in frontend.stream(instance, payload, request_id="ok")]
    assert sum(len(o.token_ids) for o in outs) == 2


@pytest.mark.parametrize("secret", [None, "another-clusters-secret-0123456789"])
@pytest.mark.parametrize("endpoint", ["generate", "kv_state"])
async def test_generate_and_kv_state_refuse_a_client_without_the_secret(
    stack, secret, endpoint
) -> None:
    instance, _ = stack
    payload = (
        _generate_payload()
        if endpoint == "generate"
        else kv.encode(kv.KvStateRequest(after_event_id=None))
    )
    client = TcpRequestClient(secret=secret)
    try:
        stream = client.stream(instance.address, f"t.backend.{endpoint}", payload, request_id="x")
        with pytest.raises(errors.PeerGone, match="authentication failed"):
            [p async for p in stream]
    finally:
        await client.close()
