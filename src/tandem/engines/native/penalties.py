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
    Rows that use none are left untouched (their neutral values are exact no-ops)."""
    params = [s.sampling for s in seqs]
    if any(p.logit_bias for p in params):
        _apply_logit_bias(logits, params)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = _token_counts(logits, [s.token_ids for s in seqs]) > 0
        rep = _column(logits, [p.repetition_penalty for p in params])
        scaled = torch.where(logits > 0, logits / rep, logits * rep)
        logits.copy_(torch.where(seen, scaled, logits))
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        counts = _token_counts(logits, [s.token_ids[s.output_start :] for s in seqs])
        freq = _column(logits, [p.frequency_penalty for p in params])
        pres = _column(logits, [p.presence_penalty for p in params])
        logits -= freq * counts + pres * (counts > 0).to(logits.dtype)


def _apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, p in enumerate(params):
        if p.logit_bias:
            rows += [i] * len(p.logit_bias)
            cols += p.logit_bias.keys()
            vals += p.logit_bias.values()
    index = (torch.tensor(rows, dtype=torch.long), torch.tensor(cols, dtype=torch.long))
    logits.index_put_(index, torch.tensor(vals, dtype=logits.dtype), accumulate=True)


def _token_counts(logits: torch.Tensor, token_lists: list[list[int]]) -> torch.Tensor:
    """[batch, vocab] occurrence counts of each row's tokens: one scatter_add over a padded
    [batch, max_len] id tensor (padding goes to an extra column that is dropped)."""
    batch, vocab = logits.shape
    width = max((len(t) for t in token_lists), default=0)
    ids = torch.full((batch, max(width, 1)), vocab, dtype=torch.long)
    for i, tokens in enumerate(token_lists):
        if tokens:
            ids[i, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    counts = torch.zeros(batch, vocab + 1, dtype=logits.dtype)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=logits.dtype))
    return counts[:, :vocab]


def _column(logits: torch.Tensor, values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=logits.dtype).unsqueeze(1)
