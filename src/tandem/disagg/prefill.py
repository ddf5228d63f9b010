"""Prefill worker side: run the prompt, pin its KV, hand it over (DESIGN.md §4 steps 3–4).

Prefill-first: the pinned blocks become a *readable* transfer op (TTL = `pin_ttl_s`); the
output carries the first token and `DisaggParams(mode="pull")`. The op's release — a
decode's completed pull (the ack), a cancel from the decode or the frontend, the TTL, or
the agent closing — unpins the blocks. Decode-first: the first token is streamed out at
once (finish_reason None), then the blocks are pushed into the decode worker's rendezvous
op with that first output as the push's annex (the decode resumes after it), then unpinned
and a last empty "stop" output ends the leg; a failed push cancels that op so the decode
learns at once instead of waiting out its timeout. A request that ends at its first token
pushes nothing and cancels the rendezvous.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import AsyncGenerator
from concurrent.futures import Executor

import msgspec

from tandem.disagg.config import DisaggWorkerConfig
from tandem.disagg.guard import BlockGuard
from tandem.disagg.params import DisaggParams
from tandem.engines.handoff import KvHandoff
from tandem.errors import EngineError, TransferError
from tandem.protocols.engine import EngineOutput, PreprocessedRequest, encode
from tandem.runtime import tracing
from tandem.transfer import OpRef, TransferAgent, encode_meta

logger = logging.getLogger(__name__)
REGION = "kv"


def _target(params: DisaggParams) -> OpRef:
    return OpRef(address=params.address, op_id=params.op_id, agent_id=params.agent_id)


def finishes_at_first(request: PreprocessedRequest, token: int, eos_ids: list[int]) -> str | None:
    """The finish reason if the request's own stop conditions end it at its first token."""
    stop = request.stop
    if stop.min_tokens <= 1:
        if token in stop.stop_token_ids:
            return "stop"
        if not stop.ignore_eos and token in (request.eos_token_ids or eos_ids):
            return "stop"
    return "length" if stop.max_tokens <= 1 else None


class PrefillSide:
    """Serves the `generate` endpoint of a prefill worker. One per worker."""

    def __init__(
        self,
        handoff: KvHandoff,
        agent: TransferAgent,
        config: DisaggWorkerConfig,
        eos_token_ids: list[int],
        executor: Executor | None = None,
    ) -> None:
        self.handoff, self.agent, self.config = handoff, agent, config
        self.eos_token_ids = eos_token_ids
        self.executor = executor  # transfer threads (kept off the loop's default pool)

    async def generate(self, request: PreprocessedRequest) -> AsyncGenerator[EngineOutput, None]:
        params = DisaggParams.from_dict(request.disagg_params) if request.disagg_params else None
        rid = request.request_id
        loop = asyncio.get_running_loop()
        # created first: an abort after the engine pinned the prompt must still unpin it
        guard = BlockGuard(lambda: self.handoff.unpin(rid))
        handed = False
        try:
            first = await self._run_prompt(msgspec.structs.replace(request, disagg_params=None))
            if first.finish_reason in ("error", "cancelled") or not first.token_ids:
                yield first
                return
            blocks = self.handoff.pinned_blocks(rid)
            if params is None:
                out = self._export(request, first, blocks, guard)
                handed = out.disagg_params is not None
                yield out
            else:  # decode-first: the first token goes out before the KV moves
                reason = finishes_at_first(request, first.token_ids[-1], self.eos_token_ids)
                head = msgspec.structs.replace(first, finish_reason=reason)
                yield head
                target = _target(params)
                if reason is not None:  # nothing left to decode: free the rendezvous now
                    self._cancel_soon(target, "request ended at its first token")
                    return
                await self._push(target, blocks, guard, len(request.token_ids), encode(head))
                yield EngineOutput(finish_reason="stop")  # the KV (and the token) arrived
        finally:
            if not handed:
                loop.run_in_executor(None, guard.give_up)

    async def _run_prompt(self, request: PreprocessedRequest) -> EngineOutput:
        last = EngineOutput(finish_reason="error", error="prefill produced no output")
        tokens: list[int] = []
        async for out in self.handoff.prefill(request):
            tokens += out.token_ids
            last = msgspec.structs.replace(out, token_ids=tokens)
        if last.finish_reason is None:
            raise EngineError(f"prefill of request_id={request.request_id} did not finish")
        return last

    def _export(
        self,
        request: PreprocessedRequest,
        first: EngineOutput,
        blocks: list[int],
        guard: BlockGuard,
    ) -> EngineOutput:
        token = first.token_ids[-1]
        reason = finishes_at_first(request, token, self.eos_token_ids)
        if reason is not None:  # nothing left to decode: no handoff
            return msgspec.structs.replace(first, finish_reason=reason)
        op = self.agent.create_readable(
            REGION,
            blocks,
            ttl_s=self.config.pin_ttl_s,
            op_id=f"{request.request_id}-{secrets.token_hex(4)}",
            on_release=lambda _op: guard.give_up(),
        )
        params = DisaggParams(
            mode="pull",
            num_tokens=len(request.token_ids),
            meta=encode_meta(op.meta),
            agent_id=self.agent.agent_id,
            expires_at=op.meta.expires_at,
        )
        logger.debug("request_id=%s: %d blocks pinned as op=%s", request.request_id,
                     len(blocks), op.op_id)  # fmt: skip
        return msgspec.structs.replace(
            first, finish_reason="length", disagg_params=params.to_dict()
        )

    async def _push(
        self, target: OpRef, blocks: list[int], guard: BlockGuard, num_tokens: int, annex: bytes
    ) -> None:
        """Push the prompt's KV into the decode's rendezvous; ``annex`` (the encoded first
        output) lets the decode resume after the first token instead of recomputing it."""
        timeout = self.config.transfer_timeout_s

        def push() -> object:
            return self.agent.push(REGION, blocks, target, timeout_s=timeout, annex=annex)

        span = tracing.start("kv_transfer", mode="push", num_tokens=num_tokens,
                             num_blocks=len(blocks))  # fmt: skip
        try:
            await asyncio.sleep(self.handoff.transfer_delay_s(num_tokens))
            await guard.run(push, self.executor)
        except BaseException as exc:
            tracing.end(span, exc)
            if isinstance(exc, TransferError):
                self._cancel_soon(target, str(exc))
            raise
        tracing.end(span)

    def _cancel_soon(self, target: OpRef, reason: str) -> None:
        self.agent.cancel_remote_soon(target, f"prefill push failed: {reason}")
