"""The mocker's KV events carry token ids only with `--kv-events-token-ids`; without them the
simulation (outputs, step times, cached tokens) and the events' blocks, parents and order are
exactly the same, which is all a router's indexer reads."""

from __future__ import annotations

import argparse
import random

import msgspec
import pytest

from tandem.engines.mocker.args import add_args, config_from_args
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.scheduler import Scheduler
from tandem.kvbm.base import KvbmConfig
from tandem.protocols.engine import EngineOutput, PreprocessedRequest, StopConditions
from tandem.protocols.kv_events import BlockStored, KvEvent, KvEventBatch, encode

BS = 4


def _config(token_ids: bool, **kw: object) -> MockerConfig:
    base: dict[str, object] = dict(
        num_blocks=24,
        block_size=BS,
        max_num_seqs=6,
        max_num_batched_tokens=16,
        context_length=90,
        tokenizer=None,
        kv_events_token_ids=token_ids,
    )
    base.update(kw)
    return MockerConfig(**base)  # type: ignore[arg-type]


def _workload(sched: Scheduler, seed: int) -> tuple[list[object], list[KvEvent]]:
    """A random mix with shared prefixes (hits, concurrent duplicates), evictions, preemption
    and aborts; returns what each step produced and every KV event, snapshots included."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    trace: list[object] = []
    events: list[KvEvent] = []
    for step in range(5000):
        if step >= 300 and not sched.has_work:
            break
        if step < 300 and rng.random() < 0.2:
            prompt = rng.choice(prefixes)[: rng.randrange(0, 12)]
            prompt += [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            stop = StopConditions(max_tokens=rng.randrange(1, 30))
            sched.add_request(
                PreprocessedRequest(request_id=f"r{step}", model="m", token_ids=prompt, stop=stop)
            )
        if step % 7 == 0 and rng.random() < 0.1 and sched.num_running:
            sched.abort(f"r{rng.randrange(step + 1)}")
        result = sched.step()
        outs: list[tuple[str, EngineOutput]] = [(s.request_id, o) for s, o in result.outputs]
        trace.append((outs, result.duration_ms, result.num_prefill_tokens, sched.clock_ms))
        events += result.events
        if step % 50 == 0:
            events += sched.pool.snapshot()
            if sched.kvbm is not None:
                events += sched.kvbm.kv_snapshot()
    return trace, events


def _without_tokens(events: list[KvEvent]) -> list[KvEvent]:
    return [
        msgspec.structs.replace(e, token_ids=[]) if isinstance(e, BlockStored) else e
        for e in events
    ]


@pytest.mark.parametrize("kvbm", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_same_simulation_and_blocks_with_and_without_token_ids(seed: int, kvbm: bool) -> None:
    extra: dict[str, object] = {"kvbm": KvbmConfig(host_blocks=16)} if kvbm else {}
    with_ids = Scheduler(_config(True, **extra))
    without = Scheduler(_config(False, **extra))
    trace_a, events_a = _workload(with_ids, seed)
    trace_b, events_b = _workload(without, seed)
    assert trace_a == trace_b  # outputs, cached tokens, simulated step times
    stored = [e for e in events_a if isinstance(e, BlockStored)]
    assert stored and all(len(e.token_ids) == len(e.block_hashes) * BS for e in stored)
    assert all(not e.token_ids for e in events_b if isinstance(e, BlockStored))
    assert _without_tokens(events_a) == events_b
    assert without.num_preemptions > 0  # the workload reached the paths that matter


def test_events_on_the_wire_have_no_token_ids_by_default() -> None:
    sched = Scheduler(_config(False))
    sched.add_request(
        PreprocessedRequest(
            request_id="r", model="m", token_ids=list(range(10)), stop=StopConditions(max_tokens=1)
        )
    )
    events = sched.step().events
    assert [type(e) for e in events] == [BlockStored]
    batch = KvEventBatch(worker_id="w", event_id=1, timestamp_s=0.0, events=events)
    wire = msgspec.msgpack.decode(encode(batch))
    assert "token_ids" not in wire["events"][0]
    assert wire["events"][0]["block_hashes"] == events[0].block_hashes


def test_flag_and_env_turn_token_ids_on(monkeypatch: pytest.MonkeyPatch) -> None:
    from tandem.runtime.flag_parser import parse_args

    def parse(*argv: str) -> MockerConfig:
        parser = argparse.ArgumentParser()
        add_args(parser)
        return config_from_args(parse_args(parser, ["--tokenizer", "none", *argv]))

    assert parse().kv_events_token_ids is False
    assert parse("--kv-events-token-ids").kv_events_token_ids is True
    monkeypatch.setenv("TANDEM_KV_EVENTS_TOKEN_IDS", "1")
    assert parse().kv_events_token_ids is True
    assert parse("--no-kv-events-token-ids").kv_events_token_ids is False
    monkeypatch.setenv("TANDEM_KV_EVENTS_TOKEN_IDS", "maybe")
    # tandem.runtime.flag_parser: "... (from env ...): invalid boolean"
    with pytest.raises(SystemExit):
        parse()
