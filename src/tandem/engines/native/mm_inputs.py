"""Image rows of a prompt (DESIGN.md §10): which positions take embedding rows instead of token
embeddings, checked at admission and gathered per step for the model's input."""

from __future__ import annotations

import torch

from tandem.engines.native.sequence import Sequence
from tandem.errors import InvalidRequest
from tandem.protocols.engine import PreprocessedRequest


def check_mm_items(request: PreprocessedRequest) -> None:
    """Raise InvalidRequest unless the items lie inside the prompt, in order, without overlap."""
    end = 0
    for i, item in enumerate(request.mm_items):
        if item.num_tokens < 1 or item.offset < end:
            raise InvalidRequest(
                f"mm_items[{i}] (offset {item.offset}, {item.num_tokens} rows) overlaps the "
                f"previous image or is empty; expected ordered, disjoint spans",
                param=f"mm_items[{i}]",
            )
        end = item.offset + item.num_tokens
        if end > len(request.token_ids):
            raise InvalidRequest(
                f"mm_items[{i}] ends at {end}, past the prompt's {len(request.token_ids)} tokens",
                param=f"mm_items[{i}]",
            )


def attach_embeddings(
    seq: Sequence,
    embeddings: list[torch.Tensor],
    hidden_size: int,
    dtype: torch.dtype,
    device: torch.device | None = None,
) -> None:
    """Give `seq` its images' rows (one tensor per mm_item, `[num_tokens, hidden_size]`), in the
    model's dtype, on its device (default: where they are). Raises InvalidRequest when the
    count or a shape is wrong."""
    items = seq.mm_items
    if len(embeddings) != len(items):
        raise InvalidRequest(f"got {len(embeddings)} image embeddings for {len(items)} mm_items")
    for i, (item, emb) in enumerate(zip(items, embeddings, strict=True)):
        if tuple(emb.shape) != (item.num_tokens, hidden_size):
            raise InvalidRequest(
                f"mm_items[{i}]: embedding shape {tuple(emb.shape)}; expected "
                f"[{item.num_tokens}, {hidden_size}] (rows x the model's hidden size)"
            )
    seq.mm_embeddings = [
        (item.offset, emb.to(device or emb.device, dtype).contiguous())
        for item, emb in zip(items, embeddings, strict=True)
    ]


def has_image_rows(seq: Sequence, start: int, end: int) -> bool:
    """Whether positions [start, end) of `seq` hold image rows."""
    return any(it.offset < end and start < it.offset + it.num_tokens for it in seq.mm_items)


def lacks_embeddings(seq: Sequence, start: int, end: int) -> bool:
    """Whether [start, end) holds image rows that `seq` has no embeddings for (a decode worker's
    sequence that was preempted and must recompute a prompt it only received as KV)."""
    return not seq.mm_embeddings and has_image_rows(seq, start, end)


def gather_input_embeds(
    seqs: list[Sequence], num_new_tokens: list[int], device: torch.device | None = None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(flat batch row indices, their embedding rows) of every image row this step computes,
    on `device` (default: the CPU); None when there are none. Rows follow
    `ModelRunner._forward`'s layout: each sequence's chunk [num_computed, num_computed +
    num_new) in batch order."""
    index: list[torch.Tensor] = []
    values: list[torch.Tensor] = []
    base = 0
    for seq, num_new in zip(seqs, num_new_tokens, strict=True):
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + num_new
        for offset, emb in seq.mm_embeddings:
            lo, hi = max(start, offset), min(end, offset + emb.shape[0])
            if lo < hi:
                index.append(torch.arange(base + lo - start, base + hi - start, device=device))
                values.append(emb[lo - offset : hi - offset].to(device=device))
        base += num_new
    if not index:
        return None
    return torch.cat(index), torch.cat(values)
