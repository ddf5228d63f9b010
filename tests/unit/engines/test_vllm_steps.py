"""vLLM's per-iteration stats → the planner's `StepSample`s (no vLLM needed: fake stats)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tandem.engines.vllm.metrics import SchedulerSnapshot
from tandem.protocols.scaling import StepSample


def sched(running: int, waiting: int = 0, usage: float = 0.0, details: Any = None) -> Any:
    return SimpleNamespace(
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        num_skipped_waiting_reqs=0,
        kv_cache_usage=usage,
        iteration_details=details,
    )


def it(ts: float, computed: int = 0, ttfts: tuple[float, ...] = ()) -> Any:
    return SimpleNamespace(
        iteration_timestamp=ts,
        prompt_token_stats=SimpleNamespace(computed=computed),
        time_to_first_tokens_iter=list(ttfts),
    )


def snapshot() -> SchedulerSnapshot:
    snap = SchedulerSnapshot()
    snap.kv_capacity_tokens = 100 * 16
    return snap


def test_prefill_after_idle_is_bounded_by_first_token_latency_then_steps_are_gaps() -> None:
    snap = snapshot()
    # first record after idle: the 10 s since nothing is not step time; the TTFT bounds it
    snap.record_step(sched(1, usage=0.05), it(1000.0, computed=70, ttfts=(0.030,)))
    snap.record_step(sched(1, usage=0.05), it(1000.012))
    steps = snap.take_steps()
    assert len(steps) == 2
    first, second = steps
    assert abs(first.wall_ms - 30.0) < 1e-6
    assert (first.num_prefill_tokens, first.num_decode_kv_tokens) == (70, 80)
    assert (first.num_running, first.num_waiting) == (1, 0)
    assert abs(second.wall_ms - 12.0) < 1e-6
    assert second.num_prefill_tokens == 0
    assert snap.take_steps() == []


def test_step_after_idle_without_first_token_is_not_sampled() -> None:
    snap = snapshot()
    snap.record_step(sched(0), it(5.0))
    snap.record_step(sched(1, waiting=2), it(50.0))  # 45 s gap spans idle time
    assert snap.take_steps() == []
    snap.record_step(sched(1, waiting=2), it(50.02))
    (step,) = snap.take_steps()
    assert abs(step.wall_ms - 20.0) < 1e-6 and step.num_waiting == 2


def test_a_record_without_outputs_leaves_the_next_gap_unknown() -> None:
    snap = snapshot()
    snap.record_step(sched(2), it(1.0, ttfts=(0.01,)))
    snap.record_step(sched(2), None)  # e.g. a chunked-prefill step: no IterationStats
    snap.record_step(sched(2), it(9.0))  # the gap spans two steps (or more): not one step
    snap.record_step(sched(2), it(9.005))
    assert [round(s.wall_ms, 6) for s in snap.take_steps()] == [10.0, 5.0]


def test_engine_core_iteration_details_win_when_vllm_measures_them() -> None:
    snap = snapshot()
    details = SimpleNamespace(elapsed_ms=7.5, num_ctx_tokens=33, is_dummy=False)
    snap.record_step(sched(2, usage=0.5, details=details), it(1.0, computed=999))
    assert snap.take_steps() == [
        StepSample(
            wall_ms=7.5, num_prefill_tokens=33, num_decode_kv_tokens=800, num_running=2,
            num_waiting=0,
        )
    ]  # fmt: skip


def test_buffer_is_bounded_and_missing_stats_record_nothing() -> None:
    snap = snapshot()
    snap.record_step(None, it(1.0))
    snap.record_step(sched(1), None)
    assert snap.take_steps() == []
    details = SimpleNamespace(elapsed_ms=3.0, num_ctx_tokens=0, is_dummy=False)
    snap.record_step(sched(1, details=details), None)  # engine-core timing needs no outputs
    assert [s.wall_ms for s in snap.take_steps()] == [3.0]
    for i in range(5000):
        snap.record_step(sched(1), it(float(i), ttfts=(0.001,)))
    assert len(snap.take_steps()) == 4096
