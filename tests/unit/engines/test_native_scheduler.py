"""Scheduling under pressure with a tiny model: block accounting stays intact after every
step, greedy tokens stay exact through chunked prefill, prefix hits and preemption, and
aborts free every block."""

from __future__ import annotations

import random

import pytest
from native_reference import Reference
from native_tiny import TINY, TINY_WEIGHTS, request, tiny_core

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_randomized_scheduling_keeps_integrity_and_exact_tokens(seed):
    rng = random.Random(seed)
    core = tiny_core(num_blocks=14, max_num_seqs=5, max_num_batched_tokens=rng.choice([8, 13, 32]))
    ref = Reference(TINY, TINY_WEIGHTS)
    prefixes = [[rng.randrange(3, 256) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    prompts: dict[str, list[int]] = {}
    outputs: dict[str, list[int]] = {}
    finished: dict[str, str] = {}
    for _ in range(1000):
        if len(prompts) < 60 and rng.random() < 0.5:
            rid = f"r{len(prompts)}"
            tail = [rng.randrange(3, 256) for _ in range(rng.randrange(1, 12))]
            prompts[rid] = rng.choice(prefixes) + tail
            outputs[rid] = []
            core.add(request(rid, prompts[rid], max_tokens=rng.randrange(1, 12)))
        if prompts and rng.random() < 0.05:
            core.abort(rng.choice(list(prompts)))
        for rid, out in core.step():
            outputs[rid] += out.token_ids
            if out.finish_reason:
                finished[rid] = out.finish_reason
        core.block_manager.check_integrity()
        if len(prompts) == 60 and not core.has_work():
            break
    assert not core.has_work() and set(finished) == set(prompts)
    assert core.block_manager.num_active_blocks == 0
    assert core.scheduler.num_preemptions > 0, "the test should exercise preemption"
    for rid, reason in finished.items():
        if reason == "length":
            ref.check_greedy(prompts[rid], outputs[rid])


def test_aborting_100_requests_mid_flight_frees_every_block():
    core = tiny_core(num_blocks=200, max_num_seqs=64)
    rng = random.Random(3)
    for i in range(100):
        core.add(request(f"r{i}", [rng.randrange(3, 256) for _ in range(20)], max_tokens=50))
    for _ in range(4):
        core.step()
        core.block_manager.check_integrity()
    assert core.block_manager.num_active_blocks > 0 and core.scheduler.running
    for i in range(100):
        core.abort(f"r{i}")
    outputs = core.step()
    core.block_manager.check_integrity()
    assert sorted(rid for rid, out in outputs if out.finish_reason == "cancelled") == sorted(
        f"r{i}" for i in range(100)
    )
    assert core.block_manager.num_active_blocks == 0
    assert not core.has_work() and not core.seqs


def test_chunked_prefill_respects_token_budget():
    core = tiny_core(max_num_batched_tokens=8)
    core.add(request("a", list(range(3, 30)), max_tokens=2))
    batch = core.scheduler.schedule()
    assert batch.num_new_tokens == [8]
    core.runner.run(batch, core.block_manager)
    core.scheduler.update(batch)
    assert core.seqs["a"].num_computed_tokens == 8


def test_max_num_seqs_limits_running():
    core = tiny_core(max_num_seqs=3)
    for i in range(5):
        core.add(request(f"r{i}", [5, 6, 7], max_tokens=4))
    core.step()
    assert len(core.scheduler.running) == 3 and len(core.scheduler.waiting) == 2


def _with_priority(req, priority):  # type: ignore[no-untyped-def]
    req.priority = priority
    return req


def test_waiting_requests_are_admitted_by_priority_class():
    """issue 33: lower `priority` first; arrival order within a class."""
    core = tiny_core(max_num_seqs=1)
    for rid, priority in (("low", 1), ("normal-1", 0), ("high", -1), ("normal-2", 0)):
        core.add(_with_priority(request(rid, [5, 6, 7], max_tokens=2), priority))
    admitted = []
    while core.has_work():
        core.step()
        for seq in core.scheduler.running:
            if seq.request_id not in admitted:
                admitted.append(seq.request_id)
    assert admitted == ["high", "normal-1", "normal-2", "low"]


def test_preemption_spares_the_more_urgent_request():
    """Blocks run out while an older batch-class request and a younger high-class one decode:
    the batch one yields (youngest-first alone would have preempted the high one). The batch
    one prefills first: beside the high one its prefill would wait (step_policy.py)."""
    core = tiny_core(num_blocks=8, block_size=4)
    core.add(_with_priority(request("batch", list(range(3, 15)), max_tokens=12), 2))
    seqs = dict(core.seqs)
    core.step()
    core.add(_with_priority(request("high", list(range(20, 32)), max_tokens=12), -1))
    seqs.update(core.seqs)
    while core.has_work():
        core.step()
        core.block_manager.check_integrity()
    assert seqs["batch"].num_preemptions >= 1
    assert seqs["high"].num_preemptions == 0
