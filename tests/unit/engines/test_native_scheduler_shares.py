"""The native scheduler's seats and step tokens by class and tenant (engines/step_policy.py,
issue 33), with a tiny model: greedy tokens stay exact through the preemptions it adds."""

from __future__ import annotations

import random

import pytest
from native_reference import Reference
from native_tiny import TINY, TINY_WEIGHTS, request, tiny_core

from tandem.protocols.engine import PreprocessedRequest
from tandem.protocols.tenancy import PRIORITY_CLASSES

pytestmark = pytest.mark.timeout(60)
BATCH = PRIORITY_CLASSES["batch"]


def _req(rid: str, n: int, tenant: str, priority: int = 0, max_tokens: int = 6):
    req: PreprocessedRequest = request(rid, [3 + (hash(rid) + i) % 250 for i in range(n)],
                                       max_tokens=max_tokens)  # fmt: skip
    req.tenant, req.priority = tenant, priority
    return req


def test_an_under_share_tenant_takes_a_seat_and_prefills_in_the_next_step() -> None:
    core = tiny_core(num_blocks=200, max_num_seqs=4, max_num_batched_tokens=64)
    for i in range(5):
        core.add(_req(f"a{i}", 40, "a", max_tokens=30))
    for _ in range(4):
        core.step()
    assert len(core.scheduler.running) == 4
    core.add(_req("b0", 12, "b"))
    b = core.seqs["b0"]
    core.step()
    assert b.num_computed_tokens >= 12 and core.scheduler.num_preemptions == 1


@pytest.mark.parametrize(("slack", "extra"), [(None, 2), (0.0, 0), (1.0, 20)])
def test_batch_prefill_shrinks_while_a_higher_class_runs(slack: float | None, extra: int) -> None:
    """Beside the chat's 20-token prefill the batch gets `slack` x 20 tokens (the engine's
    --background-step-slack; default 0.1) and, alone again, the whole budget."""
    kw = {} if slack is None else {"background_step_slack": slack}
    core = tiny_core(num_blocks=200, max_num_seqs=4, max_num_batched_tokens=64, **kw)
    core.add(_req("bulk", 200, "x", priority=BATCH, max_tokens=2))
    bulk = core.seqs["bulk"]
    core.step()
    assert bulk.num_computed_tokens == 64  # alone: the whole budget
    core.add(_req("chat", 20, "y", max_tokens=4))
    core.step()
    assert core.seqs["chat"].num_computed_tokens == 20
    assert bulk.num_computed_tokens - 64 == extra  # slack x the chat's 20 tokens
    while "chat" in core.seqs:
        core.step()
    before = bulk.num_computed_tokens
    core.step()
    assert bulk.num_computed_tokens - before == 64  # alone again: work-conserving


@pytest.mark.parametrize("seed", [0])
def test_mixed_classes_and_tenants_keep_integrity_and_exact_tokens(seed: int) -> None:
    rng = random.Random(seed)
    core = tiny_core(num_blocks=16, max_num_seqs=4, max_num_batched_tokens=rng.choice([8, 24]))
    ref = Reference(TINY, TINY_WEIGHTS)
    prompts: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    for _ in range(3000):
        if len(prompts) < 40 and rng.random() < 0.4:
            rid = f"r{len(prompts)}"
            req = _req(rid, rng.randrange(2, 20), rng.choice("abc"),
                       rng.choice((-1, 0, 0, BATCH)), rng.randrange(1, 10))  # fmt: skip
            prompts[rid], outputs[rid] = list(req.token_ids), []
            core.add(req)
        for rid, out in core.step():
            outputs[rid] += out.token_ids
        core.block_manager.check_integrity()
        if len(prompts) == 40 and not core.has_work():
            break
    assert not core.has_work() and core.block_manager.num_active_blocks == 0
    assert core.scheduler.num_preemptions > 0
    for rid, prompt in prompts.items():
        ref.check_greedy(prompt, outputs[rid])
