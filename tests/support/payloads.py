"""`AwaitedPayloads`: a fake request plane's response stream (`ResponsePayloads`) over an
async iterator of payloads; nothing is ever ready without awaiting."""

from __future__ import annotations

from collections.abc import AsyncGenerator


class AwaitedPayloads:
    def __init__(self, payloads: AsyncGenerator[bytes, None]) -> None:
        self._payloads = payloads

    def __aiter__(self) -> AwaitedPayloads:
        return self

    async def __anext__(self) -> bytes:
        return await anext(self._payloads)

    def next_ready(self) -> bytes | None:
        return None

    async def aclose(self) -> None:
        await self._payloads.aclose()
