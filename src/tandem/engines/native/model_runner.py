"""Turns a scheduled batch into tensors (token ids, positions, KV slots, attention
metadata), runs the model and samples. Owns the KV cache tensor.

Every step tensor is built on the model's device (one host-to-device copy per list); what
comes back to the host per step is the sampled token ids. A batch-1 decode takes
`LlamaModel.decode_one` on the CPU only: it reads norms back as Python scalars, which on a
GPU would be a device sync per layer, so there the flat-batch forward serves it."""

from __future__ import annotations

from collections import Counter

import torch

from tandem.engines.native.adapters import LoraStep, step_segments
from tandem.engines.native.attention import AttentionMetadata, PrefillSpan, SingleDecode
from tandem.engines.native.block_manager import BlockManager
from tandem.engines.native.mm_inputs import gather_input_embeds, has_image_rows
from tandem.engines.native.model import LlamaModel
from tandem.engines.native.sampler import Sampler
from tandem.engines.native.scheduler import ScheduledBatch
from tandem.engines.native.sequence import Sequence
from tandem.engines.native.speculation import accept_greedy
from tandem.engines.native.structured import GrammarMasks
from tandem.engines.native.thread_policy import ThreadPolicy

ROPE_MATRIX_MAX_TOKENS = 64  # steps this small apply RoPE as one bmm (fewer kernels)
PROBE_ROWS = 16  # rows of the thread policy's probe for steps of more than one row


class ModelRunner:
    """Not thread-safe; one step at a time on the engine thread."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, seed: int = 0):
        self.model = model
        self.device = model.device
        self.block_size = block_size
        self.kv_cache = model.new_kv_cache(num_blocks, block_size)
        self.sampler = Sampler(seed)
        self.grammar_masks = GrammarMasks(model.config.vocab_size)
        probe_linear = model.layers[0].gate_up
        one, many = (
            torch.ones(rows, probe_linear.in_features, dtype=model.dtype, device=self.device)
            for rows in (1, PROBE_ROWS)
        )
        threads = torch.get_num_threads()
        # a one-row step streams weights (2 threads measured 1.10-1.17x one on a free host),
        # a batched or prefill step computes (1.55-1.87x): each kind is probed with its own
        # shape, so a memory-bound probe never keeps a compute-bound step on one thread
        self.thread_policies = (
            ThreadPolicy(threads, lambda: probe_linear(one), min_speedup=1.05),
            ThreadPolicy(threads, lambda: probe_linear(many)),
        )
        self.steps_by_threads: Counter[int] = Counter()

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, block_manager: BlockManager) -> dict[int, list[int]]:
        """Forward the batch; returns {seq_id: new tokens} for sequences whose chunk
        reached the end of their tokens (the others are mid-prefill): one token, or for a
        sequence with a draft its accepted draft tokens and one more (speculation.py)."""
        policy = self.thread_policies[sum(batch.num_new_tokens) > 1]
        self.steps_by_threads[policy.before_step()] += 1
        single = len(batch.seqs) == 1 and batch.num_new_tokens[0] == 1
        # an adapter's row too where the model adds LoRA updates in its fused C decoder
        lora = batch.seqs[0].lora if single else None
        single = single and self.device.type == "cpu" and (lora is None or self.model.fuses_lora)
        if single and not _next_is_image_row(batch.seqs[0]):  # image rows take the batch path
            seq = batch.seqs[0]
            pos = seq.num_computed_tokens
            step = self._single(seq, block_manager)
            one = None if lora is None else LoraStep([(0, 1, lora)])
            hidden = self.model.decode_one(seq.token_ids[pos], step, self.kv_cache, one)
            sample_seqs = [seq] if pos + 1 == len(seq.token_ids) else []
        else:
            hidden, sample_seqs = self._forward(batch, block_manager)
        if not sample_seqs:
            return {}
        if any(seq.draft_token_ids for seq in sample_seqs):
            return self._verify(hidden, sample_seqs)
        grammars = [seq.grammar for seq in sample_seqs]
        if Sampler.is_plain_greedy(sample_seqs) and not any(g is not None for g in grammars):
            tokens = self.model.head.greedy(hidden)
        else:
            logits = self.model.head.logits(hidden)
            self.grammar_masks.apply(logits, grammars)  # returns at once when none is set
            tokens = self.sampler(logits, sample_seqs)
        return {seq.seq_id: [tok] for seq, tok in zip(sample_seqs, tokens, strict=True)}

    def _verify(self, hidden: torch.Tensor, seqs: list[Sequence]) -> dict[int, list[int]]:
        """Sample a batch where some sequences carry drafts: `hidden` has len(draft) + 1
        rows for each of those (in order), one for every other sequence. Drafting sequences
        have no grammar, penalties or logprobs (`speculation.can_speculate`)."""
        spans: list[tuple[int, int]] = []
        row = 0
        for seq in seqs:
            spans.append((row, row + len(seq.draft_token_ids) + 1))
            row = spans[-1][1]
        plain = [i for i, seq in enumerate(seqs) if not seq.draft_token_ids]
        out: dict[int, list[int]] = {}
        if Sampler.is_plain_greedy(seqs) and all(seqs[i].grammar is None for i in plain):
            greedy = self.model.head.greedy(hidden)
            for seq, (lo, hi) in zip(seqs, spans, strict=True):
                out[seq.seq_id] = accept_greedy(seq.draft_token_ids, greedy[lo:hi])
            return out
        logits = self.model.head.logits(hidden)
        if plain:
            plain_seqs = [seqs[i] for i in plain]
            rows = logits[[spans[i][0] for i in plain]]
            self.grammar_masks.apply(rows, [s.grammar for s in plain_seqs])
            for seq, tok in zip(plain_seqs, self.sampler(rows, plain_seqs), strict=True):
                out[seq.seq_id] = [tok]
        for seq, (lo, hi) in zip(seqs, spans, strict=True):
            if seq.draft_token_ids:
                out[seq.seq_id] = self.sampler.verify(logits[lo:hi], seq)
        return out

    def _forward(
        self, batch: ScheduledBatch, block_manager: BlockManager
    ) -> tuple[torch.Tensor, list[Sequence]]:
        batch, lora = _by_adapter(batch)
        ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start = seq.num_computed_tokens
            ids += seq.token_ids[start : start + num_new]
            positions += range(start, start + num_new)
            if draft := seq.draft_token_ids:  # verified rows: the last token and the draft
                ids += draft
                sample_rows += range(len(ids) - len(draft) - 1, len(ids))
                sample_seqs.append(seq)
            elif start + num_new == len(seq.token_ids):
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        meta = self._metadata(batch, block_manager, pos)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        ids_t = torch.tensor(ids, dtype=torch.long, device=dev)
        embeds = gather_input_embeds(batch.seqs, batch.num_new_tokens, dev)
        return self.model.hidden(ids_t, meta, self.kv_cache, rows, embeds, lora), sample_seqs

    def _single(self, seq: Sequence, block_manager: BlockManager) -> SingleDecode:
        """Where the one new token of `seq` goes and which blocks it reads."""
        bs, pos = self.block_size, seq.num_computed_tokens
        table = block_manager.block_table(seq)[: pos // bs + 1]
        return SingleDecode(slot=table[-1] * bs + pos % bs, ctx_len=pos + 1, table=table)

    def _metadata(
        self, batch: ScheduledBatch, block_manager: BlockManager, pos: torch.Tensor
    ) -> AttentionMetadata:
        bs, dev = self.block_size, self.device
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillSpan] = []
        row = 0
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            start, ctx_len = seq.num_computed_tokens, seq.num_computed_tokens + num_new
            table = block_manager.block_table(seq)[: -(-ctx_len // bs)]
            slots += [table[p // bs] * bs + p % bs for p in range(start, ctx_len)]
            if num_new == 1 or seq.draft_token_ids:
                # a draft's rows are decode rows, each over its own prefix: the same kernel
                # and arithmetic a plain decode step of that position runs
                decode_tables += [table] * num_new
                decode_lens += range(start + 1, ctx_len + 1)
            else:
                mask = None
                if start:
                    new_pos = torch.arange(start, ctx_len, device=dev)
                    mask = torch.arange(ctx_len, device=dev)[None, :] <= new_pos[:, None]
                prefills.append(
                    PrefillSpan(
                        start=row,
                        end=row + num_new,
                        ctx_len=ctx_len,
                        context_blocks=torch.tensor(table, dtype=torch.long, device=dev),
                        mask=mask,
                    )
                )
            row += num_new
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            cos=self.model.cos[pos].unsqueeze(1),
            sin=self.model.sin[pos].unsqueeze(1),
            num_decode=len(decode_tables),
            prefills=prefills,
        )
        c_ops = self.model.c_ops(self.kv_cache) is not None
        if c_ops:  # RoPE from positions, decode attention through the block tables
            meta.positions = pos
        elif len(pos) <= ROPE_MATRIX_MAX_TOKENS:
            meta.rope = self.model.rope_matrices(pos)
        if decode_tables:
            width = max(map(len, decode_tables))
            padded = [t + [0] * (width - len(t)) for t in decode_tables]
            meta.decode_blocks = torch.tensor(padded, dtype=torch.long, device=dev).view(-1)
            lens = torch.tensor(decode_lens, dtype=torch.long, device=dev)
            if c_ops:
                meta.decode_lens = lens
            else:
                mask = torch.arange(width * bs, device=dev)[None, :] < lens[:, None]
                # additive float mask built once: SDPA would convert a bool mask in every layer
                additive = torch.zeros(mask.shape, dtype=self.model.dtype, device=dev)
                meta.decode_mask = additive.masked_fill_(~mask, float("-inf"))[:, None, None, :]
        return meta

    def export_blocks(self, block_ids: list[int]) -> list[torch.Tensor]:
        """Per layer, a contiguous host copy [2, n, block_size, kv_heads, head_dim] of the
        blocks (gathered on the device, then one copy to the host per layer)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return [layer.index_select(1, index).cpu() for layer in self.kv_cache]

    def import_blocks(self, block_ids: list[int], data: list[torch.Tensor]) -> None:
        """Write per-layer data (as from `export_blocks`, on any device) into the given
        blocks."""
        if len(data) != self.kv_cache.shape[0]:
            raise ValueError(
                f"got {len(data)} layers of KV data; expected {self.kv_cache.shape[0]}"
            )
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for layer, part in zip(self.kv_cache, data, strict=True):
            layer.index_copy_(1, index, part.to(layer.device, layer.dtype))

    @property
    def bytes_per_block(self) -> int:
        kv = self.kv_cache
        return kv[:, :, 0].numel() * kv.element_size()


def _by_adapter(batch: ScheduledBatch) -> tuple[ScheduledBatch, LoraStep | None]:
    """The batch with each adapter's sequences next to each other (decodes still first,
    then prefills: only the order within each part changes, stably) and its LoraStep; the
    batch itself and None when no sequence has an adapter."""
    if all(seq.lora is None for seq in batch.seqs):
        return batch, None
    first: dict[int, int] = {}  # adapter -> order of its first sequence
    for seq in batch.seqs:
        if seq.lora is not None:
            first.setdefault(id(seq.lora), len(first) + 1)

    def key(i: int) -> tuple[int, int]:
        seq, num_new = batch.seqs[i], batch.num_new_tokens[i]
        prefill = num_new > 1 and not seq.draft_token_ids
        return (prefill, 0 if seq.lora is None else first[id(seq.lora)])

    order = sorted(range(len(batch.seqs)), key=key)
    seqs = [batch.seqs[i] for i in order]
    nums = [batch.num_new_tokens[i] for i in order]
    ordered = ScheduledBatch(seqs=seqs, num_new_tokens=nums)  # a draft's rows are counted
    return ordered, step_segments([seq.lora for seq in seqs], nums)


def _next_is_image_row(seq: Sequence) -> bool:
    pos = seq.num_computed_tokens
    return bool(seq.mm_items) and has_image_rows(seq, pos, pos + 1)
