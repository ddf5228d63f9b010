"""An asyncio event loop on simulated time, for benchmarks of in-process components (mocker
engines, routers) whose figures must not depend on how busy the machine is.

`run_virtual(main())` runs a coroutine on a loop whose `time()` starts at 0 and advances only
when every task waits: then it jumps to the next timer instead of sleeping. The code under test
runs unchanged (its `asyncio.sleep`, `wait_for` and `call_later` see the simulated time); give
it `loop.time` wherever it takes a clock. CPU work costs no simulated time, so a result is the
same on any machine. The loop refuses to jump when nothing is scheduled and no fd is ready (a
deadlock: the coroutine could never finish).
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class _JumpingSelector(selectors.DefaultSelector):
    """Polls the real fds (the loop's own wake-up pipe) without blocking; a wait for a timer
    becomes a jump of the loop's clock."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:
            raise RuntimeError("virtual-time loop: every task waits and no timer is set")
        assert self.loop is not None
        self.loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = 0.0

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(seconds, 0.0)


def run_virtual(main: Coroutine[Any, Any, T]) -> T:
    """Run `main` to completion on a fresh `VirtualTimeLoop`, then close the loop."""
    loop = VirtualTimeLoop()
    try:
        return loop.run_until_complete(main)
    finally:
        loop.run_until_complete(loop.shutdown_asyncgens())
        loop.close()
