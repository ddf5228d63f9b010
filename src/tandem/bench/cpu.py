"""CPU seconds (user + system) spent by server processes over a benchmark run.

This is how frontend cost is compared: CPU-ms per request of the frontend's own process,
not wall time, so a busy shared machine does not blur it.
"""

from __future__ import annotations

import logging

import psutil

logger = logging.getLogger(__name__)


def cpu_seconds(pid: int, *, children: bool = False) -> float | None:
    """User + system CPU seconds of `pid` (plus its waited-for children); None if it is gone."""
    try:
        times = psutil.Process(pid).cpu_times()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    total = float(times.user + times.system)
    if children:
        total += times.children_user + times.children_system
        try:
            for child in psutil.Process(pid).children(recursive=True):
                child_times = child.cpu_times()
                total += child_times.user + child_times.system
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


class CpuMeter:
    """`start()` then `stop()`: CPU seconds each pid used in between (pids that died are left
    out, with a warning)."""

    def __init__(self, pids: tuple[int, ...] | list[int], *, children: bool = False) -> None:
        self.pids = tuple(pids)
        self.children = children
        self._start: dict[int, float] = {}

    def start(self) -> None:
        self._start = {}
        for pid in self.pids:
            value = cpu_seconds(pid, children=self.children)
            if value is None:
                logger.warning("server pid=%s not found; its CPU is not measured", pid)
            else:
                self._start[pid] = value

    def stop(self) -> dict[int, float]:
        used = {}
        for pid, before in self._start.items():
            after = cpu_seconds(pid, children=self.children)
            if after is None:
                logger.warning("server pid=%s exited during the run", pid)
                continue
            used[pid] = after - before
        return used
