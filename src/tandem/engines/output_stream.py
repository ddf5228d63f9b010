"""Per-request hand-off of engine outputs from the step loop to a `generate()` consumer
(every engine adapter: the mocker, the native engine)."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable

from tandem.protocols.engine import EngineOutput

logger = logging.getLogger(__name__)


# Takes an output past the consumer (e.g. straight onto the request plane) and says whether it
# did; False leaves it to the consumer. Never raises for an output it refuses.
DirectSink = Callable[[EngineOutput], bool]


class OutputStream:
    """Unbounded only in principle: a request gets at most one output per step and at most
    max_tokens steps produce one. One producer (step loop, or callbacks on the event loop),
    one consumer; create it on the event loop that runs both and push only from that loop.

    The consumer waits on a bare future rather than an `asyncio.Event`: this runs once per
    token per request, and an Event's wait/set (waiter deque, loop lookup) cost several times
    more.

    With a `direct` sink, an output pushed while the consumer is parked in `wait` with nothing
    queued (so everything before it has been consumed) is offered to the sink first; one the
    sink takes never reaches the consumer, which stays parked (no task wake-up per token).
    Order holds: once anything is queued, later outputs queue behind it.

    The consumer drains it with `async for out in stream.until_finished()`; `finished` then
    says whether the finishing output came (if not, the consumer left early: abort)."""

    __slots__ = ("_loop", "_outputs", "_waiter", "direct", "finished")

    def __init__(self, direct: DirectSink | None = None) -> None:
        self._outputs: deque[EngineOutput] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()
        self.direct = direct
        self.finished = False  # the output with finish_reason was handed to the consumer

    def push(self, output: EngineOutput) -> None:
        """Queue `output` for the consumer (or hand it to the direct sink, see above)."""
        direct, waiter = self.direct, self._waiter
        if direct is not None and waiter is not None and not self._outputs and not waiter.done():
            try:
                if direct(output):
                    return
            except Exception:  # a faulty sink must not kill the producer (the step loop)
                logger.exception("direct output sink failed; the consumer takes over")
                self.direct = None
        self._outputs.append(output)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        """Return once at least one output is queued (at once if one is)."""
        if self._outputs:
            return
        self._waiter = waiter = self._loop.create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def take_all(self) -> list[EngineOutput]:
        outputs = list(self._outputs)
        self._outputs.clear()
        return outputs

    async def get(self) -> EngineOutput:
        """All outputs queued so far, merged into one (waits for at least one)."""
        await self.wait()
        return merge_outputs(self.take_all())

    def until_finished(self) -> AsyncIterator[EngineOutput]:
        """The outputs as they come (merged when the consumer lags), the finishing one last."""
        return self

    def __aiter__(self) -> AsyncIterator[EngineOutput]:
        return self

    async def __anext__(self) -> EngineOutput:
        if self.finished:
            raise StopAsyncIteration
        out = await self.get()
        self.finished = out.finish_reason is not None
        return out


def merge_outputs(outputs: list[EngineOutput]) -> EngineOutput:
    """Tokens and logprobs of consecutive outputs in one; the first's cached count, the
    finishing one's reason (anything after it dropped)."""
    if len(outputs) == 1:
        return outputs[0]
    merged = EngineOutput(token_ids=[])
    for out in outputs:
        merged.token_ids.extend(out.token_ids)
        if out.logprobs is not None:
            merged.logprobs = (merged.logprobs or []) + out.logprobs
            merged.top_logprobs = (merged.top_logprobs or []) + (out.top_logprobs or [])
        if merged.num_cached_tokens is None:
            merged.num_cached_tokens = out.num_cached_tokens
        if out.finish_reason is not None:
            merged.finish_reason, merged.error = out.finish_reason, out.error
            break
    return merged
