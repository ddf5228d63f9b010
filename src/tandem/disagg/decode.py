"""Decode worker side: receive a prompt's KV, then decode (DESIGN.md §4 steps 5–7).

``pull`` (prefill-first): allocate blocks, pull the prefill's readable op into them (its
completion is the ack that unpins the prefill), resume from prompt + first token.
``rendezvous`` (decode-first): allocate blocks, publish them as a writable op under the
frontend's op id, wait for a prefill to push, resume after the prefill's first token that
came with the push (its stream leads with that token), or — from a prefill that sent none —
by recomputing the last prompt token.

Any failure — no room, the source expired, the prefill died, the transfer erred or passed
`transfer_timeout_s` — frees the blocks and, with ``on_transfer_failure="local"``, prefills
here instead (same tokens), else ends the request with a TransferError naming the cause.
Closing the stream (an abort) cancels the peer's side too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from concurrent.futures import Executor
from typing import Any

import msgspec

from tandem.disagg.config import DisaggWorkerConfig
from tandem.disagg.guard import BlockGuard
from tandem.disagg.params import DisaggParams
from tandem.disagg.prefill import REGION
from tandem.engines.base import Engine
from tandem.engines.handoff import KvHandoff
from tandem.errors import InvalidRequest, Overloaded, TransferError
from tandem.protocols.engine import EngineOutput, PreprocessedRequest, decode_output
from tandem.runtime import tracing
from tandem.transfer import OpStatus, TransferAgent, decode_meta

logger = logging.getLogger(__name__)


class DecodeSide:
    """Serves requests that carry `disagg_params` on a decode worker. One per worker."""

    def __init__(
        self,
        engine: Engine,
        handoff: KvHandoff,
        agent: TransferAgent,
        config: DisaggWorkerConfig,
        executor: Executor | None = None,
    ) -> None:
        self.engine, self.handoff, self.agent, self.config = engine, handoff, agent, config
        self.executor = executor  # transfer threads (kept off the loop's default pool)
        self.num_fallbacks = 0
        self.num_resumed_after_first = 0  # decode-first legs that got the prefill's token

    async def generate(self, request: PreprocessedRequest) -> AsyncGenerator[EngineOutput, None]:
        assert request.disagg_params is not None
        params = DisaggParams.from_dict(request.disagg_params)
        local = msgspec.structs.replace(request, disagg_params=None)
        if params.mode == "pull":
            num_tokens, num_computed = params.num_tokens, params.num_tokens
        elif params.mode == "rendezvous":
            num_tokens, num_computed = len(request.token_ids), len(request.token_ids) - 1
        else:
            raise InvalidRequest(f"disagg_params mode '{params.mode}' is for a prefill worker")
        if not 0 < num_tokens <= len(request.token_ids):
            raise InvalidRequest(f"disagg_params num_tokens={num_tokens} outside the prompt")
        try:
            blocks = await self.handoff.allocate(local, num_tokens)
        except Overloaded as exc:  # no room for the KV now: the engine queues it instead
            self._check_policy(local, exc)
            stream: AsyncIterator[EngineOutput] = self.engine.generate(local)
        else:
            has_kv, first = await self._receive(local, params, blocks, num_tokens)
            if not has_kv:  # prefill here, into the blocks already allocated
                stream = self.handoff.resume(local, 0)
            elif first is not None:  # decode-first: resume after the prefill's first token
                self.num_resumed_after_first += 1
                resumed = local.continued_after(first.token_ids)
                stream = _led_by(first, self.handoff.resume(resumed, num_tokens))
            else:
                stream = self.handoff.resume(local, num_computed)
        async for out in stream:
            yield out

    async def _receive(
        self, request: PreprocessedRequest, params: DisaggParams, blocks: list[int], n: int
    ) -> tuple[bool, EngineOutput | None]:
        """Fill the allocated blocks: (True, the prefill's first output when a push carried
        one) when they hold the KV, (False, None) to prefill locally (policy 'local');
        raises TransferError (policy 'fail'). The blocks are kept for the caller to resume
        unless this raises or is cancelled (then they are freed)."""
        rid = request.request_id
        guard = BlockGuard(lambda: self.handoff.release(rid))
        keep = False
        span = tracing.start("kv_transfer", mode=params.mode, num_tokens=n, num_blocks=len(blocks))
        try:
            try:
                first = None
                if params.mode == "pull":
                    await self._pull(params, blocks, guard)
                else:
                    first = _first_output(await self._await_push(params, blocks))
                await asyncio.sleep(self.handoff.transfer_delay_s(n))
                keep = True
                tracing.end(span)
                return True, first
            except TransferError as exc:
                tracing.end(span, exc, fallback=self.config.on_transfer_failure)
                if params.mode == "pull":
                    self._cancel_source(params, f"decode failed: {exc.message}")
                self._check_policy(request, exc)
                keep = True
                return False, None
        finally:
            if span is not None and span.is_recording():  # cancelled, or policy 'fail'
                tracing.end(span, "KV transfer aborted")
            if keep:
                guard.keep()
            else:
                asyncio.get_running_loop().run_in_executor(None, guard.give_up)
                if params.mode == "pull":
                    self._cancel_source(params, "decode leg aborted")

    async def _pull(self, params: DisaggParams, blocks: list[int], guard: BlockGuard) -> None:
        meta = decode_meta(params.meta)
        if time.time() > meta.expires_at:
            raise TransferError(
                f"transfer op={meta.op_id} from prefill agent {meta.agent_id} expired "
                f"{time.time() - meta.expires_at:.1f}s ago (pin ttl passed before decode)"
            )
        timeout = self.config.transfer_timeout_s
        pull = lambda: self.agent.pull(meta, REGION, blocks, timeout_s=timeout)  # noqa: E731
        await guard.run(pull, self.executor)

    async def _await_push(self, params: DisaggParams, blocks: list[int]) -> bytes:
        """Publish the rendezvous and wait for it without holding a thread; returns the
        annex the prefill pushed with the KV."""
        timeout = self.config.transfer_timeout_s
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()

        def settle() -> None:
            if not ended.done():
                ended.set_result(None)

        def released(_op: object) -> None:  # any agent thread, once, at the terminal status
            loop.call_soon_threadsafe(settle)

        op = self.agent.create_writable(
            REGION, blocks, op_id=params.op_id, ttl_s=timeout, on_release=released
        )
        try:
            try:
                await asyncio.wait_for(asyncio.shield(ended), timeout)
            except TimeoutError:
                raise TransferError(
                    f"transfer op={op.op_id}: no prefill pushed within {timeout:.3g}s "
                    f"(status {op.status.value})"
                ) from None
            if op.status is not OpStatus.COMPLETE:
                raise TransferError(f"transfer op={op.op_id} {op.status.value}: {op.reason}")
            return op.annex
        finally:
            in_flight = op.status is OpStatus.IN_PROGRESS
            self.agent.cancel(op.op_id, "decode stopped waiting (timeout or abort)")
            if in_flight:  # a peer may still be writing into the blocks: let it finish
                await asyncio.shield(asyncio.sleep(min(timeout, 1.0)))

    def _cancel_source(self, params: DisaggParams, reason: str) -> None:
        self.agent.cancel_remote_soon(decode_meta(params.meta), reason)

    def _check_policy(self, request: PreprocessedRequest, exc: TransferError | Overloaded) -> None:
        """Raise a clear TransferError under policy 'fail'; else count a local fallback."""
        if self.config.on_transfer_failure != "local":
            raise TransferError(
                f"request_id={request.request_id}: KV from the prefill worker did not arrive: "
                f"{exc.message} (--disagg-on-transfer-failure=fail; 'local' would prefill here)"
            ) from exc
        self.num_fallbacks += 1
        logger.warning("request_id=%s: KV transfer failed (%s); prefilling locally",
                       request.request_id, exc.message)  # fmt: skip


def _first_output(annex: bytes) -> EngineOutput | None:
    """The prefill's first output a push carried, or None (an older prefill sent none: the
    decode then recomputes the last prompt token, which gives the same greedy token)."""
    if not annex:
        return None
    try:
        out = decode_output(annex)
    except msgspec.DecodeError:
        logger.warning("rendezvous annex of %d bytes is not an EngineOutput; ignored", len(annex))
        return None
    return out if out.token_ids else None


async def _led_by(
    first: EngineOutput, stream: AsyncIterator[EngineOutput]
) -> AsyncIterator[EngineOutput]:
    """``stream`` with ``first``'s tokens (and logprobs) in front of its first chunk, so the
    decode leg reads as the whole answer (its consumer, or a migration, sees every token).
    Closing it closes ``stream`` (the engine aborts the request)."""
    is_first = True
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        async for out in stream:
            if is_first:
                is_first = False
                out = msgspec.structs.replace(
                    out,
                    token_ids=first.token_ids + out.token_ids,
                    logprobs=_joined(first.logprobs, out.logprobs),
                    top_logprobs=_joined(first.top_logprobs, out.top_logprobs),
                    num_cached_tokens=first.num_cached_tokens,
                )
            yield out


def _joined(a: list[Any] | None, b: list[Any] | None) -> list[Any] | None:
    return None if a is None or b is None else a + b
