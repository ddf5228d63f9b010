"""Turning a `PreprocessedRequest` into a scheduler `Sequence`, rejecting what can never run."""

from __future__ import annotations

from collections.abc import Mapping

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.sequence import Sequence, request_seed
from tandem.errors import ContextLengthExceeded, InvalidRequest
from tandem.protocols.engine import PreprocessedRequest


def make_sequence(
    config: MockerConfig, request: PreprocessedRequest, live: Mapping[str, Sequence]
) -> Sequence:
    """Validate `request` against the engine's limits. `max_tokens` is capped to the context
    left after the prompt. Raises InvalidRequest (or ContextLengthExceeded)."""
    num_prompt = len(request.token_ids)
    if request.request_id in live:
        raise InvalidRequest(f"request_id={request.request_id!r} is already in flight")
    if num_prompt == 0:
        raise InvalidRequest("token_ids is empty; expected at least one prompt token")
    if request.stop.max_tokens < 1:
        raise InvalidRequest(f"max_tokens={request.stop.max_tokens} must be >= 1")
    if num_prompt >= config.context_length:
        raise ContextLengthExceeded(
            f"prompt of {num_prompt} tokens leaves no room to generate "
            f"(model limit {config.context_length})"
        )
    num_prompt_blocks = -(-(num_prompt + 1) // config.block_size)
    if num_prompt_blocks > config.num_blocks:
        raise InvalidRequest(
            f"prompt of {num_prompt} tokens needs {num_prompt_blocks} KV blocks; "
            f"this worker has {config.num_blocks}"
        )
    stop = request.stop
    eos = request.eos_token_ids or list(config.eos_token_ids)
    return Sequence(
        request_id=request.request_id,
        token_ids=list(request.token_ids),
        num_prompt_tokens=num_prompt,
        max_tokens=min(stop.max_tokens, config.context_length - num_prompt),
        min_tokens=stop.min_tokens,
        stop_token_ids=frozenset(stop.stop_token_ids),
        eos_token_ids=frozenset() if stop.ignore_eos else frozenset(eos),
        seed=request_seed(request),
        block_size=config.block_size,
        lora_name=request.lora_name,
        cache_salt=request.cache_salt,
        mm_items=list(request.mm_items),
    )
