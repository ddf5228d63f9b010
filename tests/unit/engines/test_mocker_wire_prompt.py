"""The mocker reads the request plane's u32 prompt buffer without a list of ints and uses the
router's shipped block hashes instead of hashing again, with the same simulation and the
same KV events (hashes, parents, order) as from a version-1 list of ids it hashes itself."""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import pytest

from tandem.engines.mocker import sequence as mocker_sequence
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.scheduler import Scheduler
from tandem.protocols.engine import (
    EngineOutput,
    PreprocessedRequest,
    StopConditions,
    decode_request,
    encode_request,
)
from tandem.protocols.kv_events import BlockStored, KvEvent
from tandem.tokens.hashing import sequence_hashes

pytestmark = pytest.mark.timeout(30)
BS = 4
Send = Callable[[PreprocessedRequest], PreprocessedRequest]


def _config() -> MockerConfig:
    return MockerConfig(
        num_blocks=24, block_size=BS, max_num_seqs=6, max_num_batched_tokens=16,
        context_length=90, tokenizer=None,
    )  # fmt: skip


def as_list(request: PreprocessedRequest) -> PreprocessedRequest:
    return request  # version 1: a list of ids, no hashes


def as_buffer(request: PreprocessedRequest) -> PreprocessedRequest:
    got = decode_request(encode_request(request), materialize=False)
    assert got.token_ids == [] and got.token_bytes  # the mocker's prompt stays a buffer
    return got


def with_hashes(block_size: int = BS, corrupt: bool = False) -> Send:
    def send(request: PreprocessedRequest) -> PreprocessedRequest:
        hashes = sequence_hashes(request.token_ids, block_size, lora_name=request.lora_name)
        if corrupt and hashes:
            hashes[-1] ^= 1
        payload = encode_request(request, block_hashes=hashes, hash_block_size=block_size)
        return decode_request(payload, materialize=False)

    return send


def _workload(send: Send, seed: int) -> tuple[list[object], list[KvEvent]]:
    """Shared prefixes (hits, concurrent duplicates), LoRA seeds, evictions, preemption and
    aborts; what each step produced and every KV event."""
    sched = Scheduler(_config())
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
            request = PreprocessedRequest(
                request_id=f"r{step}", model="m", token_ids=prompt,
                stop=StopConditions(max_tokens=rng.randrange(1, 30)),
                lora_name="a" if rng.random() < 0.2 else None,
                sampling=msgspec_greedy() if rng.random() < 0.3 else msgspec_default(),
            )  # fmt: skip
            sched.add_request(send(request))
        if step % 7 == 0 and rng.random() < 0.1 and sched.num_running:
            sched.abort(f"r{rng.randrange(step + 1)}")
        result = sched.step()
        outs: list[tuple[str, EngineOutput]] = [(s.request_id, o) for s, o in result.outputs]
        trace.append((outs, result.duration_ms, result.num_prefill_tokens, sched.clock_ms))
        events += result.events
    assert sched.num_preemptions > 0
    return trace, events


def msgspec_greedy():  # type: ignore[no-untyped-def]
    from tandem.protocols.engine import SamplingParams

    return SamplingParams(temperature=0.0)


def msgspec_default():  # type: ignore[no-untyped-def]
    from tandem.protocols.engine import SamplingParams

    return SamplingParams()


@pytest.mark.parametrize("seed", range(3))
def test_buffer_and_shipped_hashes_simulate_exactly_like_a_list(seed: int) -> None:
    trace, events = _workload(as_list, seed)
    assert any(isinstance(e, BlockStored) for e in events)
    for send in (as_buffer, with_hashes(), with_hashes(corrupt=True), with_hashes(BS * 2)):
        assert _workload(send, seed) == (trace, events)


def _count_hashing(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    hashed: list[int] = []  # tokens hashed by the mocker's sequences

    def counting(token_ids, *args, **kwargs):  # type: ignore[no-untyped-def]
        hashed.append(len(token_ids))
        return sequence_hashes(token_ids, *args, **kwargs)

    monkeypatch.setattr(mocker_sequence, "sequence_hashes", counting)
    return hashed


def _prefill(send: Send) -> list[int]:
    sched = Scheduler(_config())
    prompt = list(range(1, 42))  # 10 full blocks and one token
    sched.add_request(send(PreprocessedRequest(
        request_id="r", model="m", token_ids=prompt, stop=StopConditions(max_tokens=1),
    )))  # fmt: skip
    stored: list[int] = []
    while sched.has_work:
        stored += [
            h for e in sched.step().events if isinstance(e, BlockStored) for h in e.block_hashes
        ]
    assert stored == sequence_hashes(prompt, BS)  # the router's definition, either way
    return stored


def test_shipped_hashes_spare_the_mocker_hashing_the_prompt(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hashed = _count_hashing(monkeypatch)
    _prefill(with_hashes())
    assert sum(hashed) == 0
    _prefill(as_buffer)
    assert sum(hashed) >= 40


def test_wrong_or_foreign_hashes_are_recomputed_and_logged_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    hashed = _count_hashing(monkeypatch)
    monkeypatch.setattr("tandem.engines.mocker.admission._warned_bad_hashes", False)
    with caplog.at_level(logging.WARNING, "tandem.engines.mocker.admission"):
        _prefill(with_hashes(corrupt=True))
        _prefill(with_hashes(corrupt=True))
    assert sum(hashed) >= 80
    assert len([r for r in caplog.records if "do not match its tokens" in r.message]) == 1
    hashed.clear()
    _prefill(with_hashes(BS * 2))  # another block size: not even checked, just hashed here
    assert sum(hashed) >= 40
