"""The mocker scheduler's seats and step tokens by class and tenant (engines/step_policy.py,
issue 33)."""

from __future__ import annotations

import random

import pytest

from tandem.engines.mocker import perf_model
from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.scheduler import Scheduler
from tandem.engines.step_policy import BACKGROUND_STEP_SLACK
from tandem.protocols.engine import EngineOutput, PreprocessedRequest, StopConditions
from tandem.protocols.tenancy import PRIORITY_CLASSES

BS = 16
BATCH = PRIORITY_CLASSES["batch"]


def _sched(**kw: object) -> Scheduler:
    base: dict[str, object] = dict(
        num_blocks=1024, block_size=BS, max_num_seqs=4, max_num_batched_tokens=2048,
        tokenizer=None,
    )  # fmt: skip
    base.update(kw)
    return Scheduler(MockerConfig(**base))  # type: ignore[arg-type]


_ids = iter(range(1 << 30))


def _req(tenant: str, n: int, max_tokens: int = 8, priority: int = 0) -> PreprocessedRequest:
    k = next(_ids)
    return PreprocessedRequest(
        request_id=f"{tenant}-{k}",
        model="m",
        token_ids=[100 + (k * 7 + i) % 5000 for i in range(n)],  # no shared prefix
        stop=StopConditions(max_tokens=max_tokens, ignore_eos=True),
        tenant=tenant,
        priority=priority,
    )


def _new_tokens(sched: Scheduler, rid: str) -> int:
    before = sched._requests[rid].num_computed_tokens
    sched.step()
    sched.check_integrity()
    seq = sched._requests.get(rid)
    return (seq.num_computed_tokens if seq else 0) - before


def test_an_under_share_tenant_takes_a_seat_from_the_flooding_one_at_once() -> None:
    sched = _sched()
    for _ in range(6):
        sched.add_request(_req("a", 1024, max_tokens=64))
    for _ in range(3):
        sched.step()
    assert sched.num_running == 4  # every seat is A's; two more of A's wait
    b = sched.add_request(_req("b", 128))
    out = sched.step()
    sched.check_integrity()
    assert b.num_computed_tokens == 128  # its whole prefill in the very next step
    assert any(s is b for s, _ in out.outputs)
    assert sched.num_preemptions == 1 and sched.num_running == 4
    assert sum(s.tenant == "a" for s in sched._running) == 3


def test_a_waiting_higher_class_takes_a_seat_from_a_lower_one() -> None:
    sched = _sched()
    for _ in range(4):
        sched.add_request(_req("batch", 512, max_tokens=64, priority=BATCH))
    sched.step()
    chat = sched.add_request(_req("chat", 128))
    sched.step()
    assert chat.num_computed_tokens == 128
    assert sched._running[0] is chat and sched.num_preemptions == 1


@pytest.mark.parametrize("slack", [BACKGROUND_STEP_SLACK, 0.0, 1.0])
def test_batch_prefill_shrinks_while_interactive_work_runs(slack: float) -> None:
    """The step with the chat's prefill stays within (1 + slack) x the chat's own step, the
    slack being the engine's --background-step-slack (0: the batch waits the step out)."""
    sched = _sched(background_step_slack=slack)
    batch = sched.add_request(_req("batch", 4096, max_tokens=4, priority=BATCH))
    assert _new_tokens(sched, batch.request_id) == 2048  # alone: the whole budget
    chat = sched.add_request(_req("chat", 128, max_tokens=16))
    step = sched.step()
    assert chat.num_computed_tokens == 128
    chunk = batch.num_computed_tokens - 2048
    own = perf_model.prefill_ms(128)
    assert step.duration_ms <= own * (1 + slack) + 1e-9
    assert step.duration_ms > own * (1 + slack) * 0.9  # the allowance is used, not left
    assert chunk < 2048 if slack else chunk == 0  # far below the budget
    while chat.finish_reason is None:  # the chat decodes: a decode step takes no prefill
        assert _new_tokens(sched, batch.request_id) == 0
    left = 4096 - batch.num_computed_tokens
    assert _new_tokens(sched, batch.request_id) == min(left, 2048)  # alone: work-conserving


def test_one_class_and_one_tenant_keep_the_whole_budget() -> None:
    sched = _sched()
    first = sched.add_request(_req("a", 4096))
    sched.step()
    second = sched.add_request(_req("a", 4096))
    sched.step()
    assert first.num_computed_tokens == 4096 and second.num_computed_tokens == 0
    assert sched.num_preemptions == 0


def test_a_tenant_within_its_share_is_not_preempted() -> None:
    """Two tenants holding two seats each: a third request of either waits, nobody yields."""
    sched = _sched()
    for tenant in ("a", "b", "a", "b"):
        sched.add_request(_req(tenant, 256, max_tokens=32))
    sched.step()
    sched.add_request(_req("b", 256))
    sched.add_request(_req("c", 256))  # c has room (share 4/3) but nobody is over
    sched.step()
    assert sched.num_preemptions == 0 and sched.num_waiting == 2


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(3))
def test_mixed_classes_and_tenants_keep_integrity_and_all_finish(seed: int) -> None:
    rng = random.Random(seed)
    sched = _sched(num_blocks=40, max_num_seqs=5, max_num_batched_tokens=64, block_size=4)
    expected: dict[str, int] = {}
    got: dict[str, list[EngineOutput]] = {}
    for step in range(50_000):
        if step >= 800 and not sched.has_work:
            break
        if step < 800 and rng.random() < 0.25:
            req = _req(rng.choice("abc"), rng.randrange(2, 60), rng.randrange(1, 20),
                       priority=rng.choice((-1, 0, 0, BATCH)))  # fmt: skip
            req.tenant_weight = rng.choice((1.0, 2.0))
            expected[req.request_id] = req.stop.max_tokens
            sched.add_request(req)
        for seq, out in sched.step().outputs:
            got.setdefault(seq.request_id, []).append(out)
        sched.check_integrity()
    assert not sched.has_work and sched.pool.num_active_blocks == 0
    for rid, max_tokens in expected.items():
        assert sum(len(o.token_ids) for o in got[rid]) == max_tokens, rid
        assert got[rid][-1].finish_reason == "length", rid


def test_batch_decodes_wait_while_they_would_lengthen_an_interactive_prefill() -> None:
    sched = _sched()
    bulk = sched.add_request(_req("batch", 64, max_tokens=100, priority=BATCH))
    sched.step()
    sched.step()
    assert bulk.num_output_tokens == 2  # decoding
    chat = sched.add_request(_req("chat", 128))
    step = sched.step()
    assert chat.num_computed_tokens == 128 and bulk.num_output_tokens == 2
    assert step.duration_ms == pytest.approx(perf_model.prefill_ms(128))  # no decode pass
    sched.step()  # the chat decodes: a decode pass costs the same for both
    assert bulk.num_output_tokens == 3
