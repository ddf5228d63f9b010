"""Peer KV fetch between vLLM workers, without vLLM: the three steps' requests (the same
prompt head, one token, the holder's params), the lease check, and every way the pull (step
2) gives up leaving the request to be computed, counted as the native fetcher counts."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tandem.engines.vllm.config import VllmWorkerConfig
from tandem.engines.vllm.peer_fetch import (
    EXPORT_KEY,
    EXPORT_S_KEY,
    PROTOCOL,
    START_BY_KEY,
    VllmPeerFetch,
    export_request,
    exported,
    is_export,
    prefix_tokens,
    usable,
)
from tandem.engines.vllm.sampling import VLLM_PARAMS_KEY
from tandem.protocols.engine import (
    EngineOutput,
    KvFetchHint,
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
)

pytestmark = pytest.mark.timeout(10)
B = 16
PARAMS = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [1, 2],
          "remote_engine_id": "a", "remote_host": "127.0.0.1", "remote_port": 5600,
          "remote_prefill_cached_tokens": 48}  # fmt: skip


def hint(num_blocks: int = 3, **export: Any) -> KvFetchHint:
    return KvFetchHint(
        source_instance_id="A", address=("127.0.0.1", 5600), agent_id="a",
        block_hashes=list(range(num_blocks)), block_size=B, protocol=PROTOCOL,
        source_address="tcp://127.0.0.1:9", export=export or None,
    )  # fmt: skip


def request(num_tokens: int = 3 * B + 5, h: KvFetchHint | None = None) -> PreprocessedRequest:
    return PreprocessedRequest(
        request_id="r", model="m", token_ids=list(range(100, 100 + num_tokens)),
        sampling=SamplingParams(temperature=0.7, seed=3), stop=StopConditions(max_tokens=20),
        cache_salt="salt", lora_name="ad", priority=2, kv_fetch=h,
    )  # fmt: skip


def fresh_export() -> dict[str, Any]:
    return {VLLM_PARAMS_KEY: dict(PARAMS), START_BY_KEY: time.time() + 10, EXPORT_S_KEY: 0.05}


def test_the_export_is_one_greedy_token_on_the_prefix_and_one_more() -> None:
    req = request()
    step = export_request(req, hint())
    assert step.token_ids == req.token_ids[: 3 * B + 1]
    assert step.stop.max_tokens == 1 and step.sampling == SamplingParams()
    assert (step.cache_salt, step.lora_name, step.priority) == ("salt", "ad", 2)
    assert step.request_id == "r-kv-export" and step.kv_fetch is None
    assert is_export(step) and step.disagg_params == {EXPORT_KEY: True}
    assert not is_export(req)


def test_the_prefix_never_takes_the_prompts_last_token() -> None:
    assert prefix_tokens(request(3 * B + 5), hint(3)) == 3 * B
    assert prefix_tokens(request(3 * B), hint(3)) == 2 * B  # block-aligned prompt: one less
    assert not usable(request(B), hint(3))  # not one whole block before the last token
    other = KvFetchHint(source_instance_id="A", address=("h", 1), agent_id="a",
                        block_hashes=[1, 2], block_size=B)  # fmt: skip
    assert not usable(request(), other)  # tandem's own transfer plane, not vLLM's


def test_an_export_says_until_when_a_pull_may_start() -> None:
    out = EngineOutput(finish_reason="stop", disagg_params={VLLM_PARAMS_KEY: PARAMS})
    before = time.time()
    params = exported(out, lease_s=30).disagg_params
    assert params is not None and params[VLLM_PARAMS_KEY] == PARAMS
    assert before + 15 <= params[START_BY_KEY] <= time.time() + 15
    failed = EngineOutput(finish_reason="error", error="no params")
    assert exported(failed, 30) is failed


class Runs:
    """A fake engine for step 2: what it was asked, and what it answers."""

    def __init__(self, outputs: list[EngineOutput], external: int = 0, hang: bool = False):
        self.outputs, self.external, self.hang = outputs, external, hang
        self.calls: list[tuple[PreprocessedRequest, dict[str, Any]]] = []
        self.moved = 0
        self.closed = False

    async def run(
        self, req: PreprocessedRequest, extra: dict[str, Any]
    ) -> AsyncIterator[EngineOutput]:
        self.calls.append((req, extra))
        try:
            if self.hang:
                await asyncio.sleep(60)
            self.moved += self.external
            for out in self.outputs:
                yield out
        finally:
            self.closed = True


def fetcher(runs: Runs, timeout_s: float = 5.0) -> VllmPeerFetch:
    return VllmPeerFetch(block_size=B, bytes_per_token=1000, timeout_s=timeout_s, lease_s=30,
                         external_tokens=lambda: runs.moved)  # fmt: skip


async def test_the_pull_asks_for_the_exported_head_and_counts_what_moved() -> None:
    runs = Runs([EngineOutput(finish_reason="length")], external=2 * B)  # one block was local
    f = fetcher(runs)
    req = request(h=hint(**fresh_export()))
    await f.pull(req, runs.run)
    ((step, extra),) = runs.calls
    assert step.token_ids == export_request(req, hint()).token_ids  # vLLM asserts they match
    assert step.request_id == "r-kv-fetch" and step.stop.max_tokens == 1
    assert step.cache_salt == "salt" and step.lora_name == "ad"
    params = extra["kv_transfer_params"]
    assert params["do_remote_prefill"] and not params["do_remote_decode"]
    assert params["remote_block_ids"] == [1, 2] and "remote_prefill_cached_tokens" not in params
    s = f.stats
    assert (s.num_started, s.num_succeeded, s.num_fell_back) == (1, 1, 0)
    assert (s.num_blocks, s.num_bytes) == (2, 2 * B * 1000)
    assert s.setup_s is not None and s.setup_s >= 0.05  # the holder's export is setup
    names = {m.name for m in s.families()}
    assert {"tandem_kv_fetch_started", "tandem_kv_fetch_fell_back"} <= names


STALE = {VLLM_PARAMS_KEY: PARAMS, START_BY_KEY: 0.0}  # half the lease passed long ago


@pytest.mark.parametrize(
    ("export", "outputs", "is_pulled"),
    [
        ({}, [], False),  # the holder exported nothing (the frontend could not reach it)
        (STALE, [], False),  # never started: a read of freed blocks would be silent
        (None, [EngineOutput(finish_reason="error", error="KV load failed")], True),
        (None, [], True),  # the stream ended without a finish
    ],
    ids=["no-export", "stale-export", "load-failed", "no-finish"],
)
async def test_a_pull_that_cannot_be_done_is_given_up(
    export: dict[str, Any] | None, outputs: list[EngineOutput], is_pulled: bool
) -> None:
    runs = Runs(outputs)
    f = fetcher(runs)
    await f.pull(request(h=hint(**(fresh_export() if export is None else export))), runs.run)
    s = f.stats
    assert (s.num_started, s.num_succeeded, s.num_fell_back) == (1, 0, 1)
    assert bool(runs.calls) == is_pulled


async def test_a_slow_pull_is_aborted_at_the_timeout() -> None:
    runs = Runs([EngineOutput(finish_reason="stop")], hang=True)
    f = fetcher(runs, timeout_s=0.05)
    await f.pull(request(h=hint(**fresh_export())), runs.run)
    assert runs.closed  # the engine's stream closed: vLLM aborts the sub-request
    assert (f.stats.num_succeeded, f.stats.num_fell_back) == (0, 1)


async def test_no_pull_for_a_hint_it_cannot_use() -> None:
    runs = Runs([])
    f = fetcher(runs)
    await f.pull(request(num_tokens=B, h=hint(**fresh_export())), runs.run)
    assert runs.calls == [] and f.stats.num_started == 0


def test_config_peer_fetch_only_on_an_aggregated_worker() -> None:
    assert VllmWorkerConfig(kv_fetch=True).kv_lease_s == 30
    with pytest.raises(ValueError, match="kv_fetch with disagg_mode='decode'"):
        VllmWorkerConfig(kv_fetch=True, disagg_mode="decode")
    with pytest.raises(ValueError, match="kv_lease_s"):
        VllmWorkerConfig(kv_fetch=True, kv_lease_s=2)
