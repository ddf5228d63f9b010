"""`BlockGuard`: free a request's blocks only once nobody can still touch them.

A transfer runs in a thread that cancelling the awaiting task does not stop; the blocks it
reads or writes must stay allocated until it returns, or another request could get them
mid-copy. The guard frees exactly once: when the owner gave the blocks up *and* no
transfer thread is inside. Thread-safe.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import TypeVar

T = TypeVar("T")


class BlockGuard:
    def __init__(self, free: Callable[[], None]) -> None:
        self._free = free
        self._lock = threading.Lock()
        self._busy = 0
        self._given_up = False
        self._kept = False
        self._freed = False

    def give_up(self) -> None:
        """The owner no longer needs the blocks: free them now or when the transfer ends."""
        with self._lock:
            self._given_up = True
        self._maybe_free()

    def keep(self) -> None:
        """The blocks now belong to someone else (a resumed request): never free them."""
        with self._lock:
            self._kept = True

    async def run(self, fn: Callable[[], T], executor: Executor | None = None) -> T:
        """Run blocking ``fn`` in a thread of ``executor`` while holding the blocks."""
        with self._lock:
            self._busy += 1

        def call() -> T:
            try:
                return fn()
            finally:
                with self._lock:
                    self._busy -= 1
                self._maybe_free()

        return await asyncio.get_running_loop().run_in_executor(executor, call)

    def _maybe_free(self) -> None:
        with self._lock:
            if self._freed or self._kept or not self._given_up or self._busy:
                return
            self._freed = True
        self._free()
