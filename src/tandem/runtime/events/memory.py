"""In-process event bus: one object shared by every component of a process (or a test)."""

from __future__ import annotations

from tandem.runtime.events.subject import validate_subject
from tandem.runtime.events.subscription import BufferedSubscription


class MemoryEventBus:
    """Delivers each publish synchronously into the bounded buffers of matching subscriptions.
    `close` ends every subscription."""

    error: str | None = None  # in process: it cannot lose its publishers

    def __init__(self, *, buffer_size: int = 10_000) -> None:
        self._buffer_size = buffer_size
        self._subs: list[BufferedSubscription] = []

    async def publish(self, subject: str, payload: bytes) -> None:
        validate_subject(subject)
        for sub in self._subs:
            if sub.matches(subject):
                sub.push(subject, payload)

    async def subscribe(self, subject: str) -> BufferedSubscription:
        sub = BufferedSubscription(subject, self._buffer_size, on_close=self._remove)
        self._subs.append(sub)
        return sub

    async def _remove(self, sub: BufferedSubscription) -> None:
        if sub in self._subs:
            self._subs.remove(sub)

    async def close(self) -> None:
        for sub in list(self._subs):
            await sub.close()
