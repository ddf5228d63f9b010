"""Turning a `PreprocessedRequest` into a scheduler `Sequence`, rejecting what can never run."""

from __future__ import annotations

import logging
from array import array
from collections.abc import Mapping

import msgspec

from tandem.engines.mocker.config import MockerConfig
from tandem.engines.mocker.sequence import Sequence, request_seed
from tandem.errors import ContextLengthExceeded, InvalidRequest
from tandem.protocols.engine import PreprocessedRequest, prompt_array
from tandem.tokens.hashing import hashes_match_sample

logger = logging.getLogger(__name__)
_warned_bad_hashes = False


def make_sequence(
    config: MockerConfig, request: PreprocessedRequest, live: Mapping[str, Sequence]
) -> Sequence:
    """Validate `request` against the engine's limits. `max_tokens` is capped to the context
    left after the prompt. Raises InvalidRequest (or ContextLengthExceeded)."""
    num_prompt = request.num_prompt_tokens
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
    try:  # the wire's u32 buffer as is, or the list's ids copied into one
        token_ids = prompt_array(request)
    except OverflowError:
        raise InvalidRequest("token_ids holds an id outside [0, 2^32)") from None
    stop = request.stop
    eos = request.eos_token_ids or list(config.eos_token_ids)
    # a continued request (migrated after tokens generated elsewhere) goes on with the stream
    # its original prompt seeds, those tokens counted as output, as a greedy engine would
    num_done = min(request.num_generated_tokens, num_prompt - 1)
    original = request
    if num_done > 0:
        original = msgspec.structs.replace(
            request, token_ids=list(token_ids[:-num_done]), token_bytes=None
        )
    return Sequence(
        request_id=request.request_id,
        token_ids=token_ids,
        num_prompt_tokens=num_prompt - num_done,
        max_tokens=min(stop.max_tokens, config.context_length - num_prompt) + num_done,
        min_tokens=stop.min_tokens + num_done,
        stop_token_ids=frozenset(stop.stop_token_ids),
        eos_token_ids=frozenset() if stop.ignore_eos else frozenset(eos),
        seed=request_seed(original),
        block_size=config.block_size,
        lora_name=request.lora_name,
        cache_salt=request.cache_salt,
        priority=request.priority,
        tenant=request.tenant,
        tenant_weight=request.tenant_weight,
        mm_items=list(request.mm_items),
        block_hashes=_shipped_hashes(config, request, token_ids),
    )


def _shipped_hashes(
    config: MockerConfig, request: PreprocessedRequest, token_ids: array[int]
) -> list[int]:
    """The router's hashes of the prompt's full blocks, when they are for this block size and
    check out on a sample; else [] (the sequence hashes its blocks itself)."""
    shipped, size = request.block_hashes, config.block_size
    if not shipped or request.hash_block_size != size:
        return []
    hashes = shipped[: len(token_ids) // size]
    if hashes_match_sample(token_ids, hashes, size, lora_name=request.lora_name,
                           cache_salt=request.cache_salt, mm_items=request.mm_items):  # fmt: skip
        return list(hashes)
    global _warned_bad_hashes
    if not _warned_bad_hashes:
        _warned_bad_hashes = True
        logger.warning(
            "request_id=%s: its block_hashes (block size %d) do not match its tokens; hashing "
            "prompts here instead (logged once)", request.request_id, size,
        )  # fmt: skip
    return []
