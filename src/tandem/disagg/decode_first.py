"""The decode-first (SGLang-style bootstrap) leg pair of `DisaggStreamer` (DESIGN.md §4).

Both legs start together: the decode worker allocates and publishes a rendezvous op under
an id chosen here, the prefill worker pushes the prompt's KV into it at the decode agent's
address. The prefill's first token goes to the client as soon as the prefill has it (as
in prefill-first); the push carries it along, so the decode resumes from prompt + that
token instead of recomputing it, and its stream starts with that token (what a migration
of the decode leg must replay). Here the decode stream's copy is dropped.

When the decode prefilled itself instead (the push failed or came late) its stream starts
with its own first token: equal under greedy decoding, so it is dropped the same way; a
different one (sampling) cannot follow the token the client already has, so that decode
leg is closed and the request continues from prompt + the client's token, aggregated on
the same decode worker. A prefill leg that fails cancels the rendezvous at once, so the
decode prefills locally without waiting out its transfer timeout.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator

import msgspec

from tandem.disagg.legs import LegPair
from tandem.disagg.params import DisaggParams, without_image_bytes
from tandem.protocols.engine import EngineOutput, PreprocessedRequest
from tandem.router.base import RouteDecision, Router
from tandem.transfer import OpRef, cancel_soon

logger = logging.getLogger(__name__)


async def decode_first(
    s: LegPair,
    request: PreprocessedRequest,
    pinned: PreprocessedRequest,
    router: Router,
    prefill_router: Router,
    prefill_at: RouteDecision,
    room_at: OpRef,  # the decode agent's address and agent id; op_id unset
) -> AsyncGenerator[EngineOutput, None]:
    room = msgspec.structs.replace(room_at, op_id=f"{request.request_id}-{secrets.token_hex(4)}")
    rendezvous = DisaggParams(mode="rendezvous", op_id=room.op_id,
                              num_tokens=len(request.token_ids))  # fmt: skip
    push = DisaggParams(mode="push", op_id=room.op_id, address=room.address,
                        agent_id=room.agent_id)  # fmt: skip
    head: asyncio.Future[EngineOutput | None] = asyncio.get_running_loop().create_future()
    prefill_req = msgspec.structs.replace(request, disagg_params=push.to_dict())
    prefill = asyncio.create_task(s.prefill_or_none(prefill_req, prefill_router, prefill_at, head))
    decode_req = msgspec.structs.replace(
        without_image_bytes(pinned), disagg_params=rendezvous.to_dict()
    )
    decode = s.aggregated.stream(decode_req, router)
    pending = asyncio.ensure_future(anext(decode))  # the decode leg starts: allocate, publish
    try:
        await asyncio.wait((head, pending), return_when=asyncio.FIRST_COMPLETED)
        first = head.result() if head.done() else None
        if first is None:
            if not head.done():  # the decode answered first: it prefilled itself
                prefill.cancel()
            elif not pending.done():  # the prefill leg failed: stop the decode waiting
                cancel_soon(
                    room,
                    "the prefill leg failed",
                    sender_id="frontend",
                    cluster_secret=s.cluster_secret,
                    tls=s.transfer_tls,
                )
            async for out in _chain(pending, decode):
                yield out
            return
        yield msgspec.structs.replace(first, disagg_params=None)
        if first.finish_reason is not None:  # it ended at its first token
            return
        async for rest in _without_first(first.token_ids, _chain(pending, decode)):
            if rest is None:  # the decode leg chose another first token
                await decode.aclose()
                async for cont in _continue(s, pinned, first.token_ids, router):
                    yield cont
                return
            yield rest
    finally:
        if not pending.done():
            pending.cancel()
        await asyncio.gather(pending, return_exceptions=True)
        await decode.aclose()
        if not prefill.done():
            prefill.cancel()
        await asyncio.gather(prefill, return_exceptions=True)


async def _chain(
    pending: asyncio.Future[EngineOutput], rest: AsyncIterator[EngineOutput]
) -> AsyncIterator[EngineOutput]:
    out = await pending
    yield out
    if out.finish_reason is None:
        async for out in rest:
            yield out


async def _without_first(
    tokens: list[int], outs: AsyncIterator[EngineOutput]
) -> AsyncIterator[EngineOutput | None]:
    """``outs`` less its leading ``tokens`` (the client has them); None, then nothing
    more, if ``outs`` starts with other tokens."""
    expect = list(tokens)
    async for out in outs:
        if expect:
            n = min(len(expect), len(out.token_ids))
            if out.token_ids[:n] != expect[:n]:
                yield None
                return
            expect = expect[n:]
            out = _drop_head(out, n)
            if not out.token_ids and out.finish_reason is None:
                continue
        yield msgspec.structs.replace(out, num_cached_tokens=None)


def _drop_head(out: EngineOutput, n: int) -> EngineOutput:
    return msgspec.structs.replace(
        out,
        token_ids=out.token_ids[n:],
        logprobs=None if out.logprobs is None else out.logprobs[n:],
        top_logprobs=None if out.top_logprobs is None else out.top_logprobs[n:],
    )


async def _continue(
    s: LegPair, pinned: PreprocessedRequest, tokens: list[int], router: Router
) -> AsyncIterator[EngineOutput]:
    s.num_rejoined += 1
    logger.warning("request_id=%s: the decode prefilled itself and chose another first token; "
                   "continuing after the client's", pinned.request_id)  # fmt: skip
    cont = pinned.continued_after(tokens)
    cont = msgspec.structs.replace(cont, request_id=f"{pinned.request_id}-f", disagg_params=None)
    async for out in s.aggregated.stream(cont, router):
        yield msgspec.structs.replace(out, num_cached_tokens=None)
