"""`PeerFetch` on the mocker: a fetch is charged the simulated transfer time of the blocks it
pulls (`MockerKvHandoff.transfer_delay_s`: their bytes over `kv_transfer_bandwidth_gbps`, over
the speedup ratio), the same figures the router's fetch plan reads (`fetch_figures`)."""

from __future__ import annotations

import time

import pytest

from tandem.disagg.config import DisaggWorkerConfig
from tandem.disagg.peer_fetch import PeerFetch
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.disagg import MockerKvHandoff
from tandem.engines.mocker.engine import MockerEngine
from tandem.protocols.engine import KvFetchHint, PreprocessedRequest, StopConditions
from tandem.tokens.hashing import sequence_hashes
from tandem.transfer import OpRef
from tandem.transfer.agent import TransferResult

pytestmark = pytest.mark.timeout(10)
# 1 MB of KV per token over 0.028 GB/s at speedup 4: 7 blocks of 4 tokens take 0.25 s
MOCKER = MockerConfig(num_blocks=64, block_size=4, speedup_ratio=4.0, tokenizer=None,
                      kv_bytes_per_token=1_000_000, kv_transfer_bandwidth_gbps=0.028)  # fmt: skip
PROMPT = list(range(100, 130))  # 7 full blocks and 2 tokens: (30 - 1) // 4 blocks fetched


class LoopbackAgent:
    """What `PeerFetch` asks of its transfer agent, answered at once: the holder exports
    every block asked for and a pull moves one byte per block (the mocker's region)."""

    def __init__(self) -> None:
        self.exporter = None
        self.pulled: list[int] = []

    def request_export(
        self, target: OpRef, block_hashes: list[int], *, ttl_s: float, timeout_s: float
    ) -> int:
        return len(block_hashes)

    def pull(
        self, source: OpRef, region: str, block_ids: list[int], *, timeout_s: float | None = None
    ) -> TransferResult:
        self.pulled += block_ids
        return TransferResult(source.op_id, "loopback", len(block_ids), 0.0)

    def cancel_remote_soon(self, target: OpRef, reason: str) -> None:
        raise AssertionError(f"the fetch gave up: {reason}")


async def test_the_simulated_transfer_time_is_bytes_over_bandwidth_over_speedup() -> None:
    handoff = MockerKvHandoff(MockerEngine(MOCKER))
    assert handoff.transfer_delay_s(28) == pytest.approx(0.25)  # 28 MB at 112 MB/s
    assert handoff.transfer_delay_s(56) == pytest.approx(0.5)
    figures = handoff.fetch_figures()  # what the router charges a fetch: the same time
    assert 28 * figures.bytes_per_token / figures.bandwidth_bytes_per_s == pytest.approx(0.25)
    fastest = MockerKvHandoff(MockerEngine(MockerConfig(speedup_ratio=0, tokenizer=None)))
    assert fastest.transfer_delay_s(10_000) == 0.0


async def test_a_fetch_waits_the_simulated_transfer_time() -> None:
    """A request whose 7 blocks are fetched takes no less than the 0.25 s they take to move,
    and the bandwidth the fetch measures is the simulated one, not the loopback's."""
    engine = MockerEngine(MOCKER)
    await engine.start()
    handoff = MockerKvHandoff(engine)
    agent = LoopbackAgent()
    figures = handoff.fetch_figures()
    fetch = PeerFetch(
        engine, handoff, agent, DisaggWorkerConfig(kv_fetch=True),  # type: ignore[arg-type]
        block_size=MOCKER.block_size, bytes_per_token=figures.bytes_per_token,
        bandwidth_bytes_per_s=figures.bandwidth_bytes_per_s,
    )  # fmt: skip
    hint = KvFetchHint(source_instance_id="holder", address=("127.0.0.1", 9), agent_id="a",
                       block_hashes=sequence_hashes(PROMPT, 4), block_size=4)  # fmt: skip
    request = PreprocessedRequest(request_id="r", model=MOCKER.model_name, token_ids=PROMPT,
                                  stop=StopConditions(max_tokens=2, ignore_eos=True),
                                  kv_fetch=hint)  # fmt: skip
    try:
        began = time.monotonic()
        outs = [out async for out in fetch.generate(request)]
        elapsed_s = time.monotonic() - began
        assert len(agent.pulled) == 7 and outs[0].num_cached_tokens == 28
        assert fetch.stats.num_succeeded == 1 and fetch.stats.num_bytes == 28_000_000
        assert 0.25 <= elapsed_s < 0.9
        # one fetch moves the estimate a fifth of the way to what it measured (28 MB over
        # at least 0.25 s): it stays at most the simulated bandwidth
        assert fetch.stats.bandwidth_bytes_per_s <= figures.bandwidth_bytes_per_s * (1 + 1e-9)
        engine.scheduler.check_integrity()
    finally:
        await engine.stop()
