"""One request's state inside the engine: its tokens, progress and sampling state."""

from __future__ import annotations

import enum
import itertools
from typing import TYPE_CHECKING, Any

import torch

from tandem.engines.native.draft_odds import DraftOdds
from tandem.protocols.engine import PreprocessedRequest, TopLogprob
from tandem.tokens.hashing import sequence_hashes

if TYPE_CHECKING:
    from tandem.engines.native.adapters import NativeAdapter

_seq_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Mutated only by the engine thread (scheduler, block manager, sampler)."""

    def __init__(self, request: PreprocessedRequest, default_eos_ids: tuple[int, ...]) -> None:
        self.seq_id = next(_seq_ids)
        self.request_id = request.request_id
        self.token_ids: list[int] = list(request.token_ids)
        self.num_prompt_tokens = len(request.token_ids)
        # where the output begins for penalties (tokens generated before a handoff count)
        self.output_start = max(self.num_prompt_tokens - request.num_generated_tokens, 0)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        # this step's speculative tokens after token_ids (set by the scheduler, [] when none):
        # computed with the step, never part of token_ids until verified (speculation.py)
        self.draft_token_ids: list[int] = []
        self.spec_skip = 0  # decode steps left without drafting (after rejected drafts)
        self.spec_backoff = 0  # the next skip after a draft with nothing accepted
        self.spec_odds = DraftOdds()  # its recent drafts' outcomes (how long to draft)
        self.num_cached_tokens: int | None = None  # prefix-cache hits on first schedule
        self.sampling = request.sampling
        self.stop = request.stop
        self.eos_token_ids = set(request.eos_token_ids or default_eos_ids)
        self.stop_token_ids = set(request.stop.stop_token_ids)
        self.lora_name = request.lora_name
        self.priority = request.priority  # lower = admitted first, preempted last (issue 33)
        self.tenant = request.tenant  # whose seat share it counts against (step_policy.py)
        self.tenant_weight = request.tenant_weight
        # the adapter's weights, bound at admission (EngineCore.bind_lora): an unload while
        # the sequence runs leaves it these
        self.lora: NativeAdapter | None = None
        self.cache_salt = request.cache_salt
        self.mm_items = request.mm_items  # images: their rows in token_ids and mm_hashes
        # per image (offset, [num_tokens, hidden] rows in the model's dtype); set at admission
        self.mm_embeddings: list[tuple[int, torch.Tensor]] = []
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of token_ids
        self.generator: torch.Generator | None = None
        if request.sampling.seed is not None:
            self.generator = torch.Generator().manual_seed(request.sampling.seed)
        # produced since the last EngineOutput was emitted
        self.pending_token_ids: list[int] = []
        self.pending_logprobs: list[float] = []
        self.pending_top_logprobs: list[list[TopLogprob]] = []
        self.num_preemptions = 0
        # llguidance matcher enforcing sampling.structured (engines/native/structured.py)
        self.grammar: Any = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    def full_block_hashes(self, block_size: int) -> list[int]:
        """Chained hashes (DESIGN.md §5) of every full block of token_ids, computed lazily."""
        num_full = len(self.token_ids) // block_size
        done = len(self.block_hashes)
        if num_full > done:
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes += sequence_hashes(
                self.token_ids[done * block_size : num_full * block_size],
                block_size,
                lora_name=self.lora_name,
                cache_salt=self.cache_salt,
                parent_hash=parent,
                mm_items=self.mm_items,
                token_offset=done * block_size,
            )
        return self.block_hashes
