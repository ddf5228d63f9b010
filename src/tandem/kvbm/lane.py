"""`Lane`: a bounded queue drained by one background thread; `submit` never blocks.

The caller (an engine's step loop) must never wait for a copy: when the queue is full the item
is refused and the caller counts the skip. The thread processes items in order.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")
_STOP = object()
_EMPTY = object()


class Lane(Generic[T]):
    """`handle(item)` runs on the lane's thread; an exception is logged and the lane goes on.
    `on_tick()` runs after each item and at least every `tick_s` while idle."""

    def __init__(
        self,
        name: str,
        *,
        maxsize: int,
        handle: Callable[[T], None],
        on_tick: Callable[[], None] | None = None,
        tick_s: float = 1.0,
    ) -> None:
        self.name = name
        self._queue: queue.Queue[object] = queue.Queue(maxsize)
        self._handle = handle
        self._on_tick = on_tick
        self._tick_s = tick_s
        self._pending = 0
        self._idle = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kvbm-{name}", daemon=True)
        self._thread.start()

    def submit(self, item: T) -> bool:
        """Queue `item`; False (nothing queued) when the queue is full or the lane closed.
        Never blocks on the thread's work: the lock it takes is only held for counting."""
        if self._closed:
            return False
        with self._idle:
            self._pending += 1
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._done()
            return False
        return True

    def flush(self, timeout_s: float) -> bool:
        """Wait until every submitted item was handled; False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Handle what is queued, then stop the thread (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(_STOP, timeout=timeout_s)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("kvbm lane %s did not stop within %.1fs", self.name, timeout_s)

    def _done(self) -> None:
        with self._idle:
            self._pending -= 1
            if self._pending == 0:
                self._idle.notify_all()

    def _run(self) -> None:
        last_tick = time.monotonic()
        while True:
            try:
                item = self._queue.get(timeout=self._tick_s)
            except queue.Empty:
                item = _EMPTY
            if item is _STOP:
                return
            if item is not _EMPTY:
                try:
                    self._handle(item)  # type: ignore[arg-type]
                except Exception:
                    logger.exception("kvbm lane %s failed on an item", self.name)
                finally:
                    self._done()
            if self._on_tick is not None and time.monotonic() - last_tick >= self._tick_s:
                last_tick = time.monotonic()
                try:
                    self._on_tick()
                except Exception:
                    logger.exception("kvbm lane %s tick failed", self.name)
