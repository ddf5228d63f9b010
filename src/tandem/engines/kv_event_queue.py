"""Hand-off of KV event lists from an engine's step loop to its one `kv_events()` consumer
(every engine adapter: the mocker, the native engine)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator

from tandem.protocols.kv_events import KvEvent

MAX_PENDING_EVENT_LISTS = 1024  # beyond it, a step's events join the newest list (none lost)


class KvEventQueue:
    """One list per step that produced events, in order. Bounded in lists, not in events: a
    lagging consumer gets later steps merged into the newest list, so nothing is dropped.
    Push only from the event loop that consumes (threads: `loop.call_soon_threadsafe`)."""

    def __init__(self) -> None:
        self._lists: deque[list[KvEvent]] = deque()
        self._ready = asyncio.Event()
        self._closed = False

    def push(self, events: list[KvEvent]) -> None:
        if not events:
            return
        if len(self._lists) >= MAX_PENDING_EVENT_LISTS:
            self._lists[-1].extend(events)
        else:
            self._lists.append(events)
        self._ready.set()

    def close(self) -> None:
        """The stream ends once what is queued has been consumed."""
        self._closed = True
        self._ready.set()

    async def stream(self) -> AsyncIterator[list[KvEvent]]:
        while True:
            while not self._lists:
                if self._closed:
                    return
                self._ready.clear()
                await self._ready.wait()
            yield self._lists.popleft()
