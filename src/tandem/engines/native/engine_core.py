"""The synchronous engine: requests in, one `step()` at a time, outputs and KV events out.

`NativeEngine` drives it from a dedicated thread; tests drive it directly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from tandem.engines.lora import LoraSlots
from tandem.engines.native.adapters import NativeAdapter
from tandem.engines.native.block_manager import BlockManager
from tandem.engines.native.config import NativeConfig
from tandem.engines.native.mm_inputs import attach_embeddings, check_mm_items, lacks_embeddings
from tandem.engines.native.model import LlamaModel
from tandem.engines.native.model_runner import ModelRunner
from tandem.engines.native.sampler import check_sampling
from tandem.engines.native.scheduler import ScheduledBatch, Scheduler
from tandem.engines.native.sequence import Sequence
from tandem.engines.native.speculation import NgramProposer, Speculator
from tandem.engines.native.structured import GrammarCompiler, advance
from tandem.engines.native.tiering import KvTiering
from tandem.errors import ContextLengthExceeded, EngineError, InvalidRequest
from tandem.protocols.engine import EngineOutput, PreprocessedRequest
from tandem.protocols.kv_events import KvEvent

logger = logging.getLogger(__name__)


MAX_FAILED_STEPS = 8  # consecutive failed steps that declare the engine itself broken


def num_blocks_for(config: NativeConfig, bytes_per_block: int) -> int:
    if config.num_blocks is not None:
        return config.num_blocks
    return max(1, int(config.kv_cache_memory_gb * (1 << 30)) // bytes_per_block)


class EngineCore:
    """Not thread-safe: one caller at a time (the engine thread)."""

    def __init__(self, config: NativeConfig, model: LlamaModel) -> None:
        self.config = config
        self.model = model
        mc = model.config
        bytes_per_block = (
            (2 * mc.num_layers * config.block_size * mc.num_kv_heads * mc.head_dim)
            * torch.finfo(model.kv_dtype).bits
            // 8
        )
        self.num_blocks = num_blocks_for(config, bytes_per_block)
        self.max_model_len = min(config.max_model_len or mc.context_length, mc.context_length)
        self.block_manager = BlockManager(
            self.num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.runner = ModelRunner(model, self.num_blocks, config.block_size, seed=config.seed)
        # structured output; its tokenizer_spec is set by whoever knows the model's files
        self.grammars = GrammarCompiler(None, mc.vocab_size, mc.eos_token_ids)
        # host/disk KV events arrive on kvbm's threads: buffered here until `take_events`,
        # or handed straight to `kvbm_event_sink` once an async engine sets one
        self.kvbm_event_sink: Callable[[list[KvEvent]], None] | None = None
        self._kvbm_events: list[KvEvent] = []
        self._kvbm_events_lock = threading.Lock()
        self.tiering: KvTiering | None = None
        if config.kvbm is not None:
            self.tiering = KvTiering(
                config.kvbm, self.block_manager, self.runner, on_events=self._on_kvbm_events
            )
        self.speculator: Speculator | None = None
        if config.spec_method == "ngram":
            proposer = NgramProposer(
                config.spec_tokens, config.spec_ngram_min, config.spec_ngram_max
            )
            self.speculator = Speculator(
                proposer,
                max_model_len=self.max_model_len,
                capacity_tokens=self.capacity_tokens,
                adaptive=config.spec_length == "adaptive",
            )
        self.scheduler = Scheduler(
            self.block_manager,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            background_step_slack=config.background_step_slack,
            onboard=self.tiering.onboard if self.tiering is not None else None,
            draft=self.speculator.draft if self.speculator is not None else None,
        )
        self.seqs: dict[str, Sequence] = {}
        # resident LoRA adapters (LRU); a sequence binds its adapter's weights at admission
        self.loras: LoraSlots[NativeAdapter] = LoraSlots(config.max_loras)
        self.num_failed_steps = 0  # consecutive; reset by a step that succeeds
        # called with each sequence that finished in a step, before its blocks are freed
        # (disaggregated prefill pins the prompt blocks there: tandem.engines.native.kv_transfer)
        self.on_finish: Callable[[Sequence], None] | None = None

    def add(
        self,
        request: PreprocessedRequest,
        mm_embeddings: list[torch.Tensor] | None = None,
        grammar: Any = None,
    ) -> Sequence:
        """Queue a request; raises InvalidRequest / ContextLengthExceeded when it cannot fit.
        A request with images needs `mm_embeddings` (one `[num_tokens, hidden]` per mm_item).
        A structured request takes `grammar` (from `grammars.matcher`, compiled off this
        thread) or has its matcher compiled here."""
        if request.request_id in self.seqs:
            raise InvalidRequest(f"request_id={request.request_id} is already running")
        self.check(request)
        seq = Sequence(request, self.model.config.eos_token_ids)
        self.bind_lora(seq)
        if request.sampling.structured is not None:
            seq.grammar = grammar or self.grammars.matcher(
                request.sampling.structured, request.token_ids, request.num_generated_tokens
            )
        if request.mm_items:
            if mm_embeddings is None:
                raise InvalidRequest(
                    f"request_id={request.request_id} has {len(request.mm_items)} images and no "
                    "embeddings; this worker has no vision encoder (see --mm-encoder)"
                )
            mc = self.model.config
            model = self.model
            attach_embeddings(seq, mm_embeddings, mc.hidden_size, model.dtype, model.device)
        self.seqs[request.request_id] = seq
        self.scheduler.add(seq)
        return seq

    def check(self, request: PreprocessedRequest) -> None:
        """Raise when the request can never run here. Reads only immutable state: safe
        from any thread."""
        num_prompt = len(request.token_ids)
        if num_prompt == 0:
            raise InvalidRequest("token_ids is empty; expected at least one prompt token")
        total = num_prompt + request.stop.max_tokens
        if total > self.max_model_len:
            raise ContextLengthExceeded(
                f"prompt {num_prompt} + max_tokens {request.stop.max_tokens} = {total} exceeds "
                f"max_model_len {self.max_model_len}; lower max_tokens or shorten the prompt"
            )
        if num_prompt >= self.capacity_tokens:
            raise ContextLengthExceeded(
                f"prompt {num_prompt} does not fit the KV cache ({self.capacity_tokens} tokens); "
                "raise --kv-cache-memory-gb / --num-blocks"
            )
        vocab = self.model.config.vocab_size
        if any(not 0 <= t < vocab for t in request.token_ids):
            raise InvalidRequest(f"token_ids must be in [0, {vocab}) for this model")
        check_sampling(request.sampling, vocab)
        for name, ids in (
            ("stop_token_ids", request.stop.stop_token_ids),
            ("eos_token_ids", request.eos_token_ids),
        ):
            if bad := [t for t in ids if not 0 <= t < vocab]:
                raise InvalidRequest(f"{name} {bad[:4]} out of range; expected ids in [0, {vocab})")
        if request.stop.min_tokens > 0:
            banned = set(request.stop.stop_token_ids)
            if not request.stop.ignore_eos:
                banned |= set(request.eos_token_ids or self.model.config.eos_token_ids)
            if len(banned) >= vocab:
                raise InvalidRequest(
                    f"min_tokens={request.stop.min_tokens} bans every one of the {vocab} "
                    "tokens (stop_token_ids + eos); nothing could be sampled"
                )
        check_mm_items(request)
        if request.lora_name and request.lora_name not in self.loras:
            self.loras.use(request.lora_name)  # ModelNotFound naming it

    def bind_lora(self, seq: Sequence) -> None:
        """Give `seq` its adapter's weights (ModelNotFound when its lora_name is not
        resident); the adapter becomes the most recently used."""
        if seq.lora_name:
            seq.lora = self.loras.use(seq.lora_name)

    def add_lora(self, adapter: NativeAdapter) -> list[str]:
        """Make `adapter` resident (under its name); returns the adapters evicted for it
        (least recently used, none that a live sequence uses). Overloaded when all are."""
        busy = {seq.lora_name for seq in self.seqs.values() if seq.lora_name}
        return self.loras.add(adapter.name, adapter, busy)

    def abort(self, request_id: str) -> None:
        if request_id in self.seqs:
            self.scheduler.abort(request_id)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.config.block_size

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    last_step_tokens: tuple[int, int] = (
        0,
        0,
    )  # (prefill tokens, decode KV tokens) of the last step

    def step(self) -> list[tuple[str, EngineOutput]]:
        """Schedule, run the model, sample; returns (request_id, output) for every request
        that produced a token or finished this step.

        A step that raises while running its batch (model, sampler, a finish hook) fails
        the batch's requests with finish_reason "error" and frees their blocks; the engine
        carries on with the rest. A failure outside a batch (scheduling, KV offload) and
        MAX_FAILED_STEPS failed steps in a row (the engine itself is broken, not a request)
        raise: the engine is dead."""
        batch = self.scheduler.schedule()
        self.last_step_tokens = step_tokens(batch)
        outputs = [(s.request_id, EngineOutput(finish_reason="cancelled")) for s in batch.aborted]
        for seq in batch.aborted:
            del self.seqs[seq.request_id]
        outputs += self._drop_without_embeddings(batch)
        if not batch.seqs:
            return outputs
        self.flush_evicted()
        try:
            outputs += self._run_batch(batch)
        except Exception as exc:  # step boundary: this batch's requests fail, never the engine
            self.num_failed_steps += 1
            logger.exception(
                "native engine step failed (%d in a row); failing its %d request(s): %s",
                self.num_failed_steps,
                len(batch.seqs),
                ", ".join(s.request_id for s in batch.seqs),
            )
            outputs += self._fail(batch.seqs, f"engine step failed: {type(exc).__name__}: {exc}")
            if self.num_failed_steps >= MAX_FAILED_STEPS:
                raise EngineError(
                    f"{self.num_failed_steps} steps failed in a row, the last with "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        else:
            self.num_failed_steps = 0
        return outputs

    def _run_batch(self, batch: ScheduledBatch) -> list[tuple[str, EngineOutput]]:
        # a step that only decodes (plain or verifying drafts) times what its rows cost
        timed = self.speculator is not None and all(
            n == 1 or seq.draft_token_ids
            for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)
        )
        started = time.perf_counter()
        sampled = self.runner.run(batch, self.block_manager)
        if timed:
            assert self.speculator is not None
            ms = (time.perf_counter() - started) * 1e3
            self.speculator.observe_step(sum(batch.num_new_tokens), ms)
        outputs: list[tuple[str, EngineOutput]] = []
        finished: list[Sequence] = []
        for i, seq in enumerate(batch.seqs):
            tokens = sampled.get(seq.seq_id)
            if tokens is None:
                continue
            first = seq.num_output_tokens == 0
            decoding = not first and seq.num_uncomputed_tokens == 1
            reason: str | None = None
            emitted = 0
            for token in tokens:  # a speculative run ends where the sequence does
                emitted += 1
                if (reason := self._append(seq, token)) is not None:
                    break
            if seq.draft_token_ids:  # KV kept: the last token's and the accepted drafts'
                batch.num_new_tokens[i] = emitted
            if decoding and self.speculator is not None:
                self.speculator.record(seq, emitted)
            out = EngineOutput(token_ids=tokens[:emitted], finish_reason=reason)  # type: ignore[arg-type]
            if first:
                out.num_cached_tokens = seq.num_cached_tokens or 0
            if seq.pending_logprobs:
                out.logprobs, out.top_logprobs = seq.pending_logprobs, seq.pending_top_logprobs
                seq.pending_logprobs, seq.pending_top_logprobs = [], []
            outputs.append((seq.request_id, out))
            if reason is not None:
                seq.finish_reason = reason
                finished.append(seq)
        self.scheduler.update(batch)  # after the append: it hashes blocks of committed tokens
        if self.on_finish is not None:
            for seq in finished:
                self.on_finish(seq)
        self.scheduler.retire(finished)
        for seq in finished:
            del self.seqs[seq.request_id]
        return outputs

    def _fail(self, seqs: list[Sequence], error: str) -> list[tuple[str, EngineOutput]]:
        """End `seqs` (still live) with finish_reason "error": out of the queues, blocks
        freed. Tokens they appended in the failed step are never reported."""
        outputs: list[tuple[str, EngineOutput]] = []
        for seq in seqs:
            if self.seqs.pop(seq.request_id, None) is None:
                continue
            seq.pending_logprobs, seq.pending_top_logprobs = [], []
            self.scheduler.drop(seq, "error")
            outputs.append((seq.request_id, EngineOutput(finish_reason="error", error=error)))
        return outputs

    def _drop_without_embeddings(self, batch: ScheduledBatch) -> list[tuple[str, EngineOutput]]:
        """Fail the sequences that must compute image rows they have no embeddings for (a
        decode worker's sequence, received as KV, preempted and now recomputed): never run
        placeholder embeddings as if they were the image."""
        outputs: list[tuple[str, EngineOutput]] = []
        keep: list[tuple[Sequence, int]] = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            if seq.mm_items and lacks_embeddings(seq, start, start + num_new):
                self.scheduler.running.remove(seq)
                self.scheduler.finish(seq, "error")
                del self.seqs[seq.request_id]
                error = (
                    f"request_id={seq.request_id} must recompute image rows whose embeddings are "
                    "not on this worker (preempted after a KV handoff); retry the request"
                )
                outputs.append((seq.request_id, EngineOutput(finish_reason="error", error=error)))
            else:
                keep.append((seq, num_new))
        if len(keep) < len(batch.seqs):
            batch.seqs = [s for s, _ in keep]
            batch.num_new_tokens = [n for _, n in keep]
        return outputs

    def _append(self, seq: Sequence, token: int) -> str | None:
        seq.token_ids.append(token)
        num_out = seq.num_output_tokens
        if num_out >= seq.stop.min_tokens and (
            token in seq.stop_token_ids or (not seq.stop.ignore_eos and token in seq.eos_token_ids)
        ):
            return "stop"
        if seq.grammar is not None:
            accepted, complete = advance(seq.grammar, token)
            if not accepted:  # the mask allowed it: a matcher out of step with the sequence
                logger.warning(
                    "request_id=%s: token %d rejected by its grammar: %s",
                    seq.request_id,
                    token,
                    seq.grammar.get_error(),
                )
                return "error"
            if complete:  # nothing but EOS could follow: end now, not a step later
                return "stop"
        if num_out >= seq.stop.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        if len(seq.token_ids) >= self.capacity_tokens:  # it could never get another block
            return "length"
        return None

    def flush_evicted(self) -> None:
        """Offload blocks evicted since the last call before anything writes the KV cache
        (a step does it; call it after allocating outside a step, e.g. in run_locked)."""
        if self.tiering is not None:
            self.tiering.flush_evicted()

    def take_events(self) -> list[KvEvent]:
        """Device KV events of the steps so far, then buffered host/disk ones."""
        events = self.block_manager.take_events()
        if self._kvbm_events:
            with self._kvbm_events_lock:
                events += self._kvbm_events
                self._kvbm_events = []
        return events

    def kv_snapshot(self) -> list[KvEvent]:
        """BlockStored for every block on device, then in host memory and on disk."""
        events = self.block_manager.snapshot()
        if self.tiering is not None:
            events += self.tiering.kvbm.kv_snapshot()
        return events

    def prometheus_lines(self) -> list[str]:
        """kvbm's tier metrics (transfers, hit rates, occupancy) and speculation's counters
        (acceptance, tokens per step) and step-cost fit; empty without tiers and speculation."""
        lines = [] if self.tiering is None else self.tiering.kvbm.prometheus_lines()
        if self.speculator is not None:
            lines += self.speculator.prometheus_lines()
        return lines

    def close(self) -> None:
        """Finish queued offloads and stop kvbm's threads (idempotent)."""
        if self.tiering is not None:
            self.tiering.close()

    def _on_kvbm_events(self, events: list[KvEvent]) -> None:
        sink = self.kvbm_event_sink
        if sink is not None:
            sink(events)
            return
        with self._kvbm_events_lock:
            self._kvbm_events += events


def step_tokens(batch: ScheduledBatch) -> tuple[int, int]:
    """(prompt tokens computed, context tokens the decoding sequences attend over) of a batch
    (the planner's step metrics)."""
    prefill = decode_kv = 0
    for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        if (n == 1 or seq.draft_token_ids) and seq.num_output_tokens > 0:
            decode_kv += seq.num_computed_tokens + 1
        else:
            prefill += n
    return prefill, decode_kv
