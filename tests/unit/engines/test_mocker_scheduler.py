from __future__ import annotations

import random

import pytest

from tandem.engines.mocker import perf_model
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.scheduler import Scheduler
from tandem.errors import ContextLengthExceeded, InvalidRequest
from tandem.protocols.engine import (
    EngineOutput,
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
)
from tandem.protocols.kv_events import BlockRemoved, BlockStored
from tandem.tokens.hashing import sequence_hashes

BS = 4


def _config(**kw: object) -> MockerConfig:
    base: dict[str, object] = dict(
        num_blocks=64, block_size=BS, max_num_seqs=8, max_num_batched_tokens=64, tokenizer=None
    )
    base.update(kw)
    return MockerConfig(**base)  # type: ignore[arg-type]


def _req(rid: str, tokens: list[int], max_tokens: int = 5, **kw: object) -> PreprocessedRequest:
    stop_kw = {k: kw.pop(k) for k in ("stop_token_ids", "ignore_eos", "min_tokens") if k in kw}
    return PreprocessedRequest(
        request_id=rid,
        model="m",
        token_ids=tokens,
        stop=StopConditions(max_tokens=max_tokens, **stop_kw),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def _run(sched: Scheduler, max_steps: int = 10_000) -> dict[str, list[EngineOutput]]:
    outs: dict[str, list[EngineOutput]] = {}
    for _ in range(max_steps):
        if not sched.has_work:
            return outs
        for seq, out in sched.step().outputs:
            outs.setdefault(seq.request_id, []).append(out)
        sched.check_integrity()
    raise AssertionError("scheduler did not finish")


def _tokens(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def test_generates_max_tokens_then_length_and_frees_blocks() -> None:
    sched = Scheduler(_config())
    sched.add_request(_req("a", list(range(10)), max_tokens=7))
    outs = _run(sched)["a"]
    assert len(_tokens(outs)) == 7 and len(outs) == 7  # one output per step
    assert [o.finish_reason for o in outs] == [None] * 6 + ["length"]
    assert outs[0].num_cached_tokens == 0 and all(o.num_cached_tokens is None for o in outs[1:])
    assert sched.pool.num_active_blocks == 0


def test_prefix_reuse_reports_cached_tokens_and_stores_only_new_blocks() -> None:
    sched = Scheduler(_config())
    prompt = list(range(20))  # 5 full blocks
    sched.add_request(_req("a", prompt, max_tokens=1))
    sched.step()  # prefill + first token (finishes)
    sched.add_request(_req("b", [*prompt[:12], 90, 91, 92, 93, 94], max_tokens=1))
    result = sched.step()
    [(_, out)] = result.outputs
    assert out.num_cached_tokens == 12
    stored = [e for e in result.events if isinstance(e, BlockStored)]
    b_hashes = sequence_hashes([*prompt[:12], 90, 91, 92, 93, 94], BS)
    assert [h for e in stored for h in e.block_hashes] == b_hashes[3:]
    assert stored[0].parent_hash == b_hashes[2]


def test_fully_cached_prompt_still_computes_its_last_block() -> None:
    sched = Scheduler(_config())
    sched.add_request(_req("a", list(range(16)), max_tokens=1))
    _run(sched)
    sched.add_request(_req("b", list(range(16)), max_tokens=1))
    assert _run(sched)["b"][0].num_cached_tokens == 12


def test_stored_hashes_match_the_shared_block_hashing() -> None:
    sched = Scheduler(_config())
    prompt = list(range(9))
    sched.add_request(_req("a", prompt, max_tokens=8, cache_salt="s1"))
    outs: list[int] = []
    stored: list[int] = []
    while sched.has_work:
        result = sched.step()
        outs += [t for _, o in result.outputs for t in o.token_ids]
        stored += [h for e in result.events if isinstance(e, BlockStored) for h in e.block_hashes]
    # computed tokens = prompt + all outputs but the last (its KV is never computed)
    computed = prompt + outs[:-1]
    assert stored == sequence_hashes(computed, BS, cache_salt="s1")


def test_chunked_prefill_respects_token_budget() -> None:
    sched = Scheduler(_config(max_num_batched_tokens=8))
    sched.add_request(_req("a", list(range(30)), max_tokens=2))
    steps = []
    while sched.has_work:
        result = sched.step()
        steps.append((result.num_prefill_tokens, len(result.outputs)))
    assert steps == [(8, 0), (8, 0), (8, 0), (6, 1), (0, 1)]


def test_max_num_seqs_limits_the_batch() -> None:
    sched = Scheduler(_config(max_num_seqs=3))
    for i in range(5):
        sched.add_request(_req(f"r{i}", [i] * 5, max_tokens=4))
    sched.step()
    assert sched.num_running == 3 and sched.num_waiting == 2
    assert set(_run(sched)) == {"r0", "r1", "r2", "r3", "r4"}


def test_step_duration_follows_perf_model() -> None:
    sched = Scheduler(_config())
    sched.add_request(_req("a", list(range(10)), max_tokens=3))
    first = sched.step()
    assert first.duration_ms == pytest.approx(perf_model.prefill_ms(10))
    second = sched.step()
    assert second.num_decode_seqs == 1
    assert second.duration_ms == pytest.approx(perf_model.decode_ms(3 / 64))
    assert sched.clock_ms == pytest.approx(first.duration_ms + second.duration_ms)


def test_a_prefill_beside_decodes_charges_them_for_the_decodes_kv_only() -> None:
    """A long prompt mid-chunk holds blocks no decode reads: the decode pass beside it costs
    the decoding sequence's KV (3 blocks of 64), not the prompt's 20 blocks as well."""
    sched = Scheduler(_config(max_num_batched_tokens=16))
    sched.add_request(_req("a", list(range(10)), max_tokens=20))
    sched.step()  # a's prompt: 3 blocks
    sched.add_request(_req("long", list(range(100, 180)), max_tokens=4))
    mixed = sched.step()  # a decodes, long prefills its first 15 tokens
    assert (mixed.num_decode_seqs, mixed.num_prefill_tokens) == (1, 15)
    assert sched.pool.num_active_blocks == 3 + 4  # long's blocks so far, too
    assert mixed.duration_ms == pytest.approx(
        perf_model.prefill_ms(15) + perf_model.decode_ms(3 / 64)
    )
    while sched.step().num_prefill_tokens:  # long's chunks
        pass
    both = sched.step()  # both decode: all their blocks are read
    assert both.num_decode_seqs == 2 and both.num_prefill_tokens == 0
    usage = sched.pool.num_active_blocks / 64
    assert both.duration_ms == pytest.approx(perf_model.decode_ms(usage))


def test_preemption_is_lifo_and_recompute_gives_the_same_tokens() -> None:
    def run(num_blocks: int) -> tuple[dict[str, list[int]], int]:
        sched = Scheduler(_config(num_blocks=num_blocks))
        for i in range(3):
            sched.add_request(_req(f"r{i}", [i] * 6, max_tokens=20))
        outs = _run(sched)
        return {k: _tokens(v) for k, v in outs.items()}, sched.num_preemptions

    roomy, none = run(64)
    tight, preemptions = run(12)
    assert none == 0 and preemptions > 0
    assert tight == roomy and all(len(v) == 20 for v in tight.values())


def test_preemption_victim_is_the_last_admitted() -> None:
    sched = Scheduler(_config(num_blocks=6))
    sched.add_request(_req("old", [1] * 7, max_tokens=10))
    sched.add_request(_req("new", [2] * 7, max_tokens=10))
    sched.step()  # both admitted: 2 blocks each
    while sched.num_preemptions == 0:
        sched.step()
        sched.check_integrity()
    assert [s.request_id for s in sched._waiting] == ["new"]
    assert [s.request_id for s in sched._running] == ["old"]


def test_preemption_spares_a_more_urgent_request() -> None:
    """issue 33: the older request of the batch class yields to the younger high one."""
    sched = Scheduler(_config(num_blocks=6))
    sched.add_request(_req("old-batch", [1] * 7, max_tokens=10, priority=2))
    sched.add_request(_req("new-high", [2] * 7, max_tokens=10, priority=-1))
    sched.step()
    while sched.num_preemptions == 0:
        sched.step()
        sched.check_integrity()
    assert [s.request_id for s in sched._waiting] == ["old-batch"]
    assert [s.request_id for s in sched._running] == ["new-high"]


def test_waiting_requests_join_by_priority_class() -> None:
    sched = Scheduler(_config(max_num_seqs=1))
    for rid, priority in (("low", 1), ("normal-1", 0), ("high", -1), ("normal-2", 0)):
        sched.add_request(_req(rid, [3] * 5, max_tokens=2, priority=priority))
    outs = _run(sched)
    assert list(outs) == ["high", "normal-1", "normal-2", "low"]


def test_running_requests_take_the_step_budget_by_class() -> None:
    """A high request admitted after a normal one still gets its prefill tokens first."""
    sched = Scheduler(_config(max_num_batched_tokens=32))
    sched.add_request(_req("normal", [1] * 40, max_tokens=4))
    sched.step()  # normal: 32 of its 40
    sched.add_request(_req("high", [2] * 40, max_tokens=4, priority=-1))
    sched.step()  # normal: the last 8; high admitted with 24
    assert [s.request_id for s in sched._running] == ["high", "normal"]
    sched.step()
    high = next(s for s in sched._running if s.request_id == "high")
    assert high.num_computed_tokens == 40  # its 16 came before normal's decode token


def test_sequence_too_long_for_the_whole_pool_ends_with_length() -> None:
    sched = Scheduler(_config(num_blocks=3))
    sched.add_request(_req("a", [1] * 10, max_tokens=50))
    outs = _run(sched)["a"]
    assert outs[-1].finish_reason == "length"
    assert len(_tokens(outs)) == 3  # 12 computed tokens fill 3 blocks; the 13th has no room
    assert sched.pool.num_active_blocks == 0


def test_eviction_emits_removed_events_for_cached_blocks() -> None:
    sched = Scheduler(_config(num_blocks=6))
    sched.add_request(_req("a", list(range(12)), max_tokens=1))
    first = sched.step()
    a_hashes = [h for e in first.events if isinstance(e, BlockStored) for h in e.block_hashes]
    sched.add_request(_req("b", list(range(100, 120)), max_tokens=1))
    second = sched.step()
    removed = [h for e in second.events if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= set(a_hashes)
    sched.check_integrity()


def test_stop_token_eos_min_tokens_and_ignore_eos() -> None:
    probe = Scheduler(_config())
    probe.add_request(_req("p", [5, 6, 7], max_tokens=6, sampling=SamplingParams(seed=3)))
    toks = _tokens(_run(probe)["p"])
    seeded = {"sampling": SamplingParams(seed=3)}

    def finish(**kw: object) -> tuple[int, str | None]:
        sched = Scheduler(_config())
        sched.add_request(_req("x", [5, 6, 7], max_tokens=6, **seeded, **kw))
        outs = _run(sched)["x"]
        return len(_tokens(outs)), outs[-1].finish_reason

    assert finish(stop_token_ids=[toks[2]]) == (3, "stop")
    assert finish(stop_token_ids=[toks[1]], min_tokens=3) == (6, "length")
    assert finish(eos_token_ids=[toks[3]]) == (4, "stop")
    assert finish(eos_token_ids=[toks[3]], ignore_eos=True) == (6, "length")


def test_tokens_are_deterministic_and_depend_on_seed() -> None:
    def tokens(rid: str, **kw: object) -> list[int]:
        sched = Scheduler(_config())
        sched.add_request(_req(rid, [1, 2, 3], max_tokens=8, **kw))
        return _tokens(_run(sched)[rid])

    assert tokens("a", sampling=SamplingParams(seed=1)) == tokens(
        "b", sampling=SamplingParams(seed=1)
    )
    assert tokens("a", sampling=SamplingParams(seed=1)) != tokens(
        "a", sampling=SamplingParams(seed=2)
    )
    assert tokens("a") != tokens("b")  # unseeded sampling: per request id
    greedy = SamplingParams(temperature=0)
    assert tokens("a", sampling=greedy) == tokens("b", sampling=greedy)
    assert all(17 <= t < 49152 for t in tokens("a"))


def test_rejects_requests_that_can_never_run() -> None:
    sched = Scheduler(_config(context_length=32, num_blocks=4))
    with pytest.raises(InvalidRequest, match="empty"):
        sched.add_request(_req("a", []))
    with pytest.raises(ContextLengthExceeded, match="32"):
        sched.add_request(_req("b", [1] * 32))
    with pytest.raises(InvalidRequest, match="KV blocks"):
        sched.add_request(_req("c", [1] * 20))
    sched.add_request(_req("d", [1] * 3, max_tokens=1000))
    outs = _run(sched)["d"]
    # 16 KV slots hold prompt + 13 outputs; the 14th output is sampled, never computed
    assert len(_tokens(outs)) == 14 and outs[-1].finish_reason == "length"


def test_abort_frees_blocks_of_running_and_waiting_requests() -> None:
    sched = Scheduler(_config(max_num_seqs=1))
    sched.add_request(_req("run", [1] * 9, max_tokens=50))
    sched.add_request(_req("wait", [2] * 9, max_tokens=50))
    sched.step()
    assert sched.pool.num_active_blocks == 3
    assert sched.abort("run") is not None and sched.abort("wait") is not None
    assert sched.abort("run") is None
    sched.check_integrity()
    assert sched.pool.num_active_blocks == 0 and not sched.has_work


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(4))
def test_random_workload_keeps_integrity_after_every_step(seed: int) -> None:
    rng = random.Random(seed)
    sched = Scheduler(
        _config(num_blocks=24, max_num_seqs=6, max_num_batched_tokens=16, context_length=90)
    )
    expected: dict[str, int] = {}
    aborted: set[str] = set()
    got: dict[str, list[EngineOutput]] = {}
    prefixes = [[rng.randrange(50) for _ in range(12)] for _ in range(3)]
    for step in range(20_000):
        if step >= 600 and not sched.has_work:
            break
        if step < 600 and rng.random() < 0.2:
            rid = f"r{step}"
            prompt = rng.choice(prefixes)[: rng.randrange(0, 12)]
            prompt += [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            expected[rid] = rng.randrange(1, 40)
            sched.add_request(_req(rid, prompt, max_tokens=expected[rid]))
        if expected and rng.random() < 0.02:
            rid = rng.choice(sorted(expected))
            if sched.abort(rid) is not None:
                aborted.add(rid)
        for seq, out in sched.step().outputs:
            got.setdefault(seq.request_id, []).append(out)
        sched.check_integrity()
    assert not sched.has_work and sched.pool.num_active_blocks == 0
    for rid, max_tokens in expected.items():
        if rid in aborted:
            continue
        outs = got[rid]
        assert outs[-1].finish_reason == "length", rid
        assert len(_tokens(outs)) == max_tokens, rid
    assert sched.num_preemptions > 0  # the pool is small enough to force some
