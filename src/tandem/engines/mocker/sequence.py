"""One request's state inside the mocker scheduler, and its deterministic pseudo-tokens."""

from __future__ import annotations

import struct
from array import array
from collections.abc import MutableSequence
from dataclasses import dataclass, field

import xxhash

from tandem.protocols.engine import FinishReason, MmItem, PreprocessedRequest, prompt_array
from tandem.tokens.hashing import sequence_hashes

_M64 = (1 << 64) - 1
_INDEX = struct.Struct("<Q")
_xxh3 = xxhash.xxh3_64_intdigest


def pseudo_token(seed: int, index: int, first_id: int, vocab_size: int) -> int:
    """Token number `index` of the stream seeded by `seed`: a pure function (xxh3 of the
    index, keyed by the seed), so a preempted and recomputed request produces the same
    tokens. One C hash call: the mocker's per-token cost at thousands of tokens a second."""
    return first_id + _xxh3(_INDEX.pack(index), seed) % (vocab_size - first_id)


def request_seed(request: PreprocessedRequest) -> int:
    """The sampling seed if given; for greedy requests (temperature 0) the prompt, so equal
    prompts give equal answers; otherwise the request id."""
    if request.sampling.seed is not None:
        return request.sampling.seed & _M64
    if request.sampling.temperature == 0:  # images are part of the prompt: their hashes too
        return xxhash.xxh3_64_intdigest(_prompt_bytes(request))
    return xxhash.xxh3_64_intdigest(request.request_id.encode())


def _prompt_bytes(request: PreprocessedRequest) -> bytes:
    """The prompt's ids, then its images' hashes, as int64s: one C pass (a `repr` of the id
    list cost ~2-5 ms at 32 000 tokens); ids beyond int64 fall back to their repr."""
    try:
        data = array("q", prompt_array(request))
        data += array("q", [(item.mm_hash & _M64) - (1 << 63) for item in request.mm_items])
    except OverflowError:
        return repr([request.token_ids, [item.mm_hash for item in request.mm_items]]).encode()
    data.append(len(request.mm_items))  # ids and image hashes never read as each other
    return data.tobytes()


@dataclass(slots=True, eq=False, kw_only=True)
class Sequence:
    """Prompt + generated tokens, the blocks holding their KV and how much is computed.

    `block_hashes[i]` is the chained hash of full block i of `token_ids` (extended lazily);
    blocks `[0, num_committed_blocks)` of `block_ids` are cached in the pool (or duplicates).
    """

    request_id: str
    token_ids: MutableSequence[int]  # an array('I') from admission
    num_prompt_tokens: int
    max_tokens: int
    min_tokens: int
    stop_token_ids: frozenset[int]
    eos_token_ids: frozenset[int]
    seed: int
    block_size: int
    lora_name: str | None = None
    cache_salt: str | None = None
    priority: int = 0  # lower = admitted first, preempted last (issue 33)
    tenant: str | None = None  # whose seat share it counts against (engines/step_policy.py)
    tenant_weight: float = 1.0
    mm_items: list[MmItem] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_committed_blocks: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit when first scheduled
    is_cached_reported: bool = False
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def hashes_upto(self, num_blocks: int) -> list[int]:
        """Chained hashes of the first `num_blocks` full blocks (computed once, then kept)."""
        size, hashes = self.block_size, self.block_hashes
        done = len(hashes)
        if done < num_blocks:
            hashes += sequence_hashes(
                self.token_ids[done * size : num_blocks * size],
                size,
                lora_name=self.lora_name,
                cache_salt=self.cache_salt,
                parent_hash=hashes[-1] if hashes else None,
                mm_items=self.mm_items,
                token_offset=done * size,
            )
        return hashes[:num_blocks]

    def append_next_token(self, first_id: int, vocab_size: int) -> tuple[int, FinishReason | None]:
        """Sample (deterministically) and append the next token; return it and why the
        sequence stops now, if it does (stop/eos ids only after min_tokens)."""
        num_out = len(self.token_ids) - self.num_prompt_tokens  # before this one
        token = pseudo_token(self.seed, num_out, first_id, vocab_size)
        self.token_ids.append(token)
        num_out += 1
        if num_out >= self.min_tokens and (
            token in self.stop_token_ids or token in self.eos_token_ids
        ):
            return token, "stop"
        if num_out >= self.max_tokens:
            return token, "length"
        return token, None
