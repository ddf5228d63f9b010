"""A generate request's engine streams as batches of choice events, for the streaming and
unary answers of chat, completions and /v1/responses.

Each engine output is processed (detokenized, stop strings applied) into one `Event`; the
events come in batches, as the engine stream hands its outputs over: every one that had
already arrived. A request of several choices (n > 1, several prompts, best_of) merges its
choices' streams, batch by batch."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from contextlib import aclosing

from tandem.frontend.pipeline.postprocess import ChoiceState, Event
from tandem.frontend.pipeline.preprocess import Prepared
from tandem.frontend.pipeline.streamer import Streamer
from tandem.protocols.engine import PreprocessedRequest

Events = AsyncGenerator[list[Event], None]


def engine_events(
    streamer: Streamer, prepared: Prepared, states: list[ChoiceState], *, keep_text: bool
) -> Events:
    """The events of `prepared`'s engine requests, `states[i]` processing `requests[i]`;
    `keep_text` keeps each choice's whole text (unary answers)."""
    if len(states) == 1:
        return _choice_events(streamer, prepared, prepared.requests[0], states[0], keep_text)
    return _merged_events(streamer, prepared, states, keep_text)


async def _choice_events(
    streamer: Streamer,
    prepared: Prepared,
    request: PreprocessedRequest,
    state: ChoiceState,
    keep_text: bool,
) -> Events:
    """One choice's batches. An engine error comes after the events before it."""
    batches = streamer.stream_batches(request, prepared.model.router)
    async with aclosing(batches):
        async for outputs in batches:
            events: list[Event] = []
            error = None
            for out in outputs:
                try:
                    state.process(out, keep_text=keep_text)
                except Exception as exc:
                    error = exc
                    break
                finish = state.finish_reason
                events.append(
                    (state, state.delta_text, state.delta_logprobs, finish, state.num_tokens)
                )
                if finish is not None:
                    break
            if events:
                yield events
            if error is not None:
                raise error
            if state.finish_reason is not None:
                return  # closing `batches` cancels the worker (e.g. a stop string hit)


async def _merged_events(
    streamer: Streamer, prepared: Prepared, states: list[ChoiceState], keep_text: bool
) -> Events:
    queue: asyncio.Queue[list[Event] | BaseException | None] = asyncio.Queue(maxsize=256)

    async def pump(request: PreprocessedRequest, state: ChoiceState) -> None:
        try:
            async with aclosing(
                _choice_events(streamer, prepared, request, state, keep_text)
            ) as choice_events:
                async for batch in choice_events:
                    await queue.put(batch)
            await queue.put(None)
        except Exception as exc:
            await queue.put(exc)

    tasks = [
        asyncio.create_task(pump(r, s)) for r, s in zip(prepared.requests, states, strict=True)
    ]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
