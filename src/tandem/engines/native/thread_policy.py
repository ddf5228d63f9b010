"""How many intra-op threads the next step uses: all of them while the cores are free, one
while other processes hold them.

Every parallel region (each matmul of a step) ends at a barrier that waits for all its
threads; when another process owns the second core, that wait is a scheduler slice (ms).
Measured on the 2-core box: a batch-1 step took 32 ms on 2 threads beside one busy
process, 55 ms on 1 thread, and 100-2000 ms on 2 threads beside processes that themselves
run 2 OpenMP threads. So the runner re-measures about once a second: one weight-sized
mat-vec timed on 1 thread and on all threads, and keeps all threads only while they win.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


class ThreadPolicy:
    """Sets torch's intra-op thread count from `before_step()` on the calling (step)
    thread. `probe` runs one representative kernel. Not thread-safe: the step thread only."""

    def __init__(
        self,
        max_threads: int,
        probe: Callable[[], object],
        *,
        interval_s: float = 1.0,
        min_speedup: float = 1.25,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.max_threads = max_threads
        self.probe = probe
        self.interval_s = interval_s
        self.min_speedup = min_speedup
        self.clock = clock
        self.threads = max_threads
        self.next_probe_s = float("-inf")

    def before_step(self) -> int:
        """The thread count for this step (re-measured when the interval has passed)."""
        if self.max_threads > 1 and self.clock() >= self.next_probe_s:
            threads = self._measure()
            if threads != self.threads:
                logger.debug("intra-op threads %d -> %d", self.threads, threads)
            self.threads = threads
            self.next_probe_s = self.clock() + self.interval_s
        torch.set_num_threads(self.threads)
        return self.threads

    def _measure(self) -> int:
        seconds = {n: self._time(n) for n in (1, self.max_threads)}
        return self.max_threads if seconds[self.max_threads] * self.min_speedup < seconds[1] else 1

    def _time(self, threads: int, repeats: int = 2) -> float:
        torch.set_num_threads(threads)
        self.probe()  # wakes the thread team
        best = float("inf")
        for _ in range(repeats):
            start = self.clock()
            self.probe()
            best = min(best, self.clock() - start)
        return best
