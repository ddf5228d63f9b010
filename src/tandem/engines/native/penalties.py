"""Batched logits processing before sampling: logit_bias, then repetition, frequency and
presence penalties (the order vLLM applies them in), each one tensor pass over the batch.

Definitions (OpenAI / vLLM):
- logit_bias: `logits[t] += bias[t]`.
- repetition_penalty r (vLLM, CTRL paper): for every token seen in prompt or output,
  a positive logit is divided by r, a negative one multiplied by r.
- frequency_penalty f, presence_penalty p (OpenAI): with `c[t]` = times t occurs in the
  output so far, `logits[t] -= f * c[t] + p * (c[t] > 0)`.

"Output" includes tokens generated before a prefill/decode handoff or a migration (they
arrive at the end of the prompt; `Sequence.output_start` says where the output begins).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

import numpy as np
import torch

from tandem.engines.native.sequence import Sequence
from tandem.protocols.engine import SamplingParams


def has_penalties(params: SamplingParams) -> bool:
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
        or bool(params.logit_bias)
    )


def apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """Apply every row's logit_bias and penalties to `logits` [len(seqs), vocab] in place.
    Rows that use none are left untouched (their neutral values are exact no-ops). Only the
    (row, token) cells that occur are touched, so the cost grows with the tokens seen, not
    with batch × vocab. `logits` must be contiguous (the head's output is)."""
    params = [s.sampling for s in seqs]
    if any(p.logit_bias for p in params):
        _apply_logit_bias(logits, params)
    flat = logits.view(-1)  # cell (row, token) is flat[row * vocab + token]
    dtype, dev = logits.dtype, logits.device
    if any(p.repetition_penalty != 1.0 for p in params):
        cells, rows, _ = _occurrences(logits, [s.token_ids for s in seqs])
        rep = torch.tensor([p.repetition_penalty for p in params], dtype=dtype, device=dev)[rows]
        seen = flat.index_select(0, cells)
        flat.index_copy_(0, cells, torch.where(seen > 0, seen / rep, seen * rep))
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        cells, rows, counts = _occurrences(logits, [s.token_ids[s.output_start :] for s in seqs])
        freq = torch.tensor([p.frequency_penalty for p in params], dtype=dtype, device=dev)[rows]
        pres = torch.tensor([p.presence_penalty for p in params], dtype=dtype, device=dev)[rows]
        flat.index_add_(0, cells, -(freq * counts + pres))


def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    biases, dev = [p.logit_bias or {} for p in params], logits.device
    lengths = torch.tensor([len(b) for b in biases], dtype=torch.long, device=dev)
    rows = torch.repeat_interleave(  # output_size: no device sync to learn it
        torch.arange(len(biases), device=dev), lengths, output_size=sum(map(len, biases))
    )
    cols = _long_tensor(itertools.chain.from_iterable(b.keys() for b in biases), dev)
    vals = np.fromiter(itertools.chain.from_iterable(b.values() for b in biases), np.float64)
    bias = torch.as_tensor(vals, dtype=logits.dtype, device=dev)
    logits.index_put_((rows, cols), bias, accumulate=True)


def _occurrences(
    logits: torch.Tensor, token_lists: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct cells (`row * vocab + token`, flat indices into `logits`) of each row's
    tokens, their rows, and how often each occurs: one `torch.unique` over the whole batch."""
    vocab, dev = logits.shape[1], logits.device
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long, device=dev)
    tokens = _long_tensor(itertools.chain.from_iterable(token_lists), dev)
    row_of = torch.repeat_interleave(
        torch.arange(len(token_lists), device=dev), lengths, output_size=len(tokens)
    )
    cells, counts = torch.unique(row_of * vocab + tokens, return_counts=True)
    return cells, cells // vocab, counts.to(logits.dtype)


def _long_tensor(values: Iterable[int], device: torch.device) -> torch.Tensor:
    # numpy reads a Python iterable of ints ~5x faster than torch.tensor(list) does
    return torch.as_tensor(np.fromiter(values, dtype=np.int64), device=device)
