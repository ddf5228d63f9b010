"""The thread policy keeps all threads only while a probe on all threads beats one thread
clearly, re-measures once per interval, and leaves a 1-thread configuration alone."""

from __future__ import annotations

import torch

from tandem.engines.native.thread_policy import ThreadPolicy


class FakeClock:
    """Time advances only through the probe, by a cost that depends on the thread count."""

    def __init__(self) -> None:
        self.now = 0.0
        self.cost = {1: 1.0, 2: 0.6}

    def __call__(self) -> float:
        return self.now

    def probe(self) -> None:
        self.now += self.cost[torch.get_num_threads()]


def test_all_threads_while_they_win_one_thread_when_contended():
    before = torch.get_num_threads()
    clock = FakeClock()
    policy = ThreadPolicy(2, clock.probe, interval_s=10.0, clock=clock)
    try:
        assert policy.before_step() == 2 and torch.get_num_threads() == 2
        clock.cost[2] = 5.0  # another process took the second core
        assert policy.before_step() == 2  # not re-measured within the interval
        clock.now += 10.0
        assert policy.before_step() == 1 and torch.get_num_threads() == 1
        clock.cost[2] = 0.9  # free again, but barely faster: below min_speedup
        clock.now += 10.0
        assert policy.before_step() == 1
        clock.cost[2] = 0.55
        clock.now += 10.0
        assert policy.before_step() == 2
    finally:
        torch.set_num_threads(before)


def test_single_thread_configuration_never_probes():
    calls = []
    policy = ThreadPolicy(1, lambda: calls.append(1))
    assert policy.before_step() == 1 and calls == []


def test_one_row_and_batched_steps_each_follow_their_own_probe():
    """A decode step of one row streams weights and a batched or prefill step computes, so
    the runner keeps one policy per kind, each probing its own shape."""
    from native_tiny import request, tiny_core

    core = tiny_core()
    one_row, many_rows = core.runner.thread_policies
    assert one_row.min_speedup < many_rows.min_speedup
    one_row.before_step = lambda: 1  # type: ignore[method-assign]
    many_rows.before_step = lambda: 2  # type: ignore[method-assign]
    core.add(request("a", list(range(5, 17)), max_tokens=3))
    while core.has_work():
        core.step()
    # the 12-token prefill ran as a many-row step, the two decodes as one-row steps
    assert core.runner.steps_by_threads == {2: 1, 1: 2}
