"""Pooled embeddings from the llama decoder: one forward over a batch of inputs, no KV kept.

Pooling: the mean over an input's tokens of the last hidden layer (after the final RMSNorm,
its weight included, as HF's `last_hidden_state`), then L2-normalised, computed in fp32.
Mean rather than last-token pooling because SmolLM2 and the other instruct models served here
were never trained as embedders: their last token's state is shaped to predict the next token,
so it is dominated by how the input ends (measured on SmolLM2: unrelated sentences that end in
"." score 0.85-0.91 cosine against each other with the last token, 0.76-0.89 with the mean;
both rank "A cat was sitting on the mat." first for "The cat sat on the mat."). The mean keeps
what every token contributed. A model trained for last-token pooling would want a flag; none
is served yet.

K/V are written into a scratch cache sized to the batch and dropped after the forward: an
embedding never takes, evicts or announces a block of the engine's pool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.engines.native.attention import AttentionMetadata, PrefillSpan
from tandem.engines.native.model import LlamaModel

ROPE_MATRIX_MAX_TOKENS = 64  # as the model runner: small batches apply RoPE as one bmm


@torch.inference_mode()
def pooled_embeddings(model: LlamaModel, inputs: list[list[int]]) -> torch.Tensor:
    """[len(inputs), hidden] fp32 unit vectors on the host, one forward on the model's device
    for the whole batch (each input attends only to itself: one causal prefill span per
    input). Inputs must be non-empty, in the vocabulary and within the model's positions (the
    caller checks)."""
    dev = model.device
    lens = [len(ids) for ids in inputs]
    num_tokens = sum(lens)
    ids = torch.tensor([t for seq in inputs for t in seq], dtype=torch.long, device=dev)
    pos = torch.cat([torch.arange(n, device=dev) for n in lens])
    spans, row = [], 0
    for n in lens:
        spans.append(
            PrefillSpan(
                start=row,
                end=row + n,
                ctx_len=n,
                context_blocks=torch.empty(0, dtype=torch.long, device=dev),
                mask=None,  # no cached prefix: pure causal over the span's own K/V
            )
        )
        row += n
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=dev),
        cos=model.cos[pos].unsqueeze(1),
        sin=model.sin[pos].unsqueeze(1),
        prefills=spans,
    )
    if num_tokens <= ROPE_MATRIX_MAX_TOKENS:
        meta.rope = model.rope_matrices(pos)
    c = model.config
    scratch = torch.empty(
        (c.num_layers, 2, num_tokens, 1, c.num_kv_heads, c.head_dim), dtype=model.dtype, device=dev
    )  # one slot per token; attention reads the span's fresh K/V, never this cache
    hidden = model.hidden(ids, meta, scratch, torch.arange(num_tokens, device=dev)).float()
    counts = torch.tensor(lens, dtype=torch.long, device=dev)
    segment = torch.repeat_interleave(  # output_size: no device sync to learn it
        torch.arange(len(lens), device=dev), counts, output_size=num_tokens
    )
    sums = torch.zeros(len(lens), hidden.shape[1], device=dev).index_add_(0, segment, hidden)
    means = sums / counts.float().unsqueeze(1)
    return F.normalize(means * model.final_norm.float(), dim=1).cpu()


def token_groups(inputs: list[list[int]], max_tokens: int) -> list[list[list[int]]]:
    """Consecutive groups of inputs of at most `max_tokens` tokens each (an input longer than
    that is a group of its own), so one request's forwards interleave with generation steps
    and its activations stay bounded."""
    groups: list[list[list[int]]] = []
    current: list[list[int]] = []
    size = 0
    for ids in inputs:
        if current and size + len(ids) > max_tokens:
            groups.append(current)
            current, size = [], 0
        current.append(ids)
        size += len(ids)
    if current:
        groups.append(current)
    return groups
