"""A bounded subscription buffer shared by every event-bus backend."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable

from tandem.runtime.events.subject import compile_matcher


class BufferedSubscription:
    """Messages matching `pattern`, oldest dropped (and counted in `num_dropped`) once
    `max_messages` are buffered. `push` is called by the bus (sync, never blocks);
    iteration ends after `close()`. One consumer at a time."""

    def __init__(
        self,
        pattern: str,
        max_messages: int,
        on_close: Callable[[BufferedSubscription], Awaitable[None]] | None = None,
    ) -> None:
        self.pattern = pattern
        self.matches = compile_matcher(pattern)
        self.num_dropped = 0
        self._max = max_messages
        self._buf: deque[tuple[str, bytes]] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._closed = False
        self._on_close = on_close

    @property
    def closed(self) -> bool:
        return self._closed

    def push(self, subject: str, payload: bytes) -> None:
        if self._closed:
            return
        if len(self._buf) >= self._max:
            self._buf.popleft()
            self.num_dropped += 1
        self._buf.append((subject, payload))
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def __aiter__(self) -> BufferedSubscription:
        return self

    async def __anext__(self) -> tuple[str, bytes]:
        while not self._buf:
            if self._closed:
                raise StopAsyncIteration
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._buf.popleft()

    async def close(self) -> None:
        """Stop receiving; a blocked iterator ends. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._buf.clear()
        self._wake()
        if self._on_close is not None:
            await self._on_close(self)
