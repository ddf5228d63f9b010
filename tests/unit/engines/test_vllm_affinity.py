"""`kept_affinity`: what vLLM's NixlConnector moves to another core (the calling thread, and
the threads it starts meanwhile) comes back to the worker's cores; nothing else is touched."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest

from tandem.engines.vllm.affinity import kept_affinity

pytestmark = [
    pytest.mark.timeout(30),
    pytest.mark.skipif(
        not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
        reason="needs thread affinity and at least two cores",
    ),
]


class _Parked(threading.Thread):
    """A thread that sets its own cores (or keeps the inherited ones) and lives until `done`
    (it must not end before the test reads its cores: a test thread pinned to a busy core can
    wait seconds to run)."""

    def __init__(self, cores: set[int] | None = None) -> None:
        super().__init__(daemon=True)
        self.cores, self.ready, self.done = cores, threading.Event(), threading.Event()
        self.tid = 0

    def run(self) -> None:
        self.tid = threading.get_native_id()
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)
        self.ready.set()
        self.done.wait()


@pytest.fixture
def cores() -> Iterator[set[int]]:
    """The calling thread's cores, put back after the test whatever it did."""
    original = os.sched_getaffinity(0)
    yield original
    os.sched_setaffinity(0, original)


def _start(cores: set[int] | None = None) -> _Parked:
    thread = _Parked(cores)
    thread.start()
    assert thread.ready.wait(20)
    return thread


def test_the_pinned_caller_and_the_threads_it_started_come_back(cores: set[int]) -> None:
    first, last = min(cores), max(cores)
    before = _start()  # started before: not the caller's to move back
    os.sched_setaffinity(before.tid, {first})
    with kept_affinity():
        os.sched_setaffinity(0, {last})  # as vLLM's connector pins its caller
        inherited = _start()  # a NIXL thread started after the pin
        chosen = _start({first})  # a thread that picked its own core
    try:
        assert os.sched_getaffinity(0) == cores
        assert os.sched_getaffinity(inherited.tid) == cores
        assert os.sched_getaffinity(chosen.tid) == {first}
        assert os.sched_getaffinity(before.tid) == {first}
    finally:
        for thread in (before, inherited, chosen):
            thread.done.set()


def test_nothing_moved_nothing_touched(cores: set[int]) -> None:
    first = min(cores)
    with kept_affinity():
        chosen = _start({first})
    try:
        assert os.sched_getaffinity(0) == cores
        assert os.sched_getaffinity(chosen.tid) == {first}
    finally:
        chosen.done.set()


def test_an_error_inside_still_puts_the_caller_back(cores: set[int]) -> None:
    with pytest.raises(RuntimeError), kept_affinity():
        os.sched_setaffinity(0, {max(cores)})
        raise RuntimeError("vLLM failed to build the connector")
    assert os.sched_getaffinity(0) == cores
