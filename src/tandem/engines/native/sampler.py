"""Next-token choice per sequence: logit_bias and penalties (batched, tandem.engines.native.
penalties), min_tokens (stop ids masked), greedy, temperature, top_k, top_p, seeded sampling,
and logprobs of the processed distribution (after bias, penalties and masks, before
temperature).

A temperature below `MIN_TEMPERATURE` is greedy: dividing fp32 logits by it overflows to
inf (1e-38 does) and the distribution it stands for is the argmax anyway.

Logits stay on the model's device; a sampled row's probabilities come to the host for the
draw, so seeded requests use CPU generators and draw the same tokens on every device."""

from __future__ import annotations

import math

import torch

from tandem.engines.native.penalties import apply_penalties, has_penalties
from tandem.engines.native.sequence import Sequence
from tandem.engines.native.speculation import accept_greedy, accept_sampled
from tandem.errors import InvalidRequest
from tandem.protocols.engine import SamplingParams, TopLogprob

MIN_TEMPERATURE = 1e-5  # below it, sampling is greedy (logits / T would overflow)
MAX_PENALTY = 2.0  # presence/frequency penalties lie in [-2, 2] (OpenAI)
MAX_LOGIT_BIAS = 100.0  # each bias lies in [-100, 100] (OpenAI)
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit on logit_bias entries


def is_greedy(params: SamplingParams) -> bool:
    """True for temperature 0 and for temperatures too small to divide the logits by."""
    return params.temperature < MIN_TEMPERATURE


def check_sampling(params: SamplingParams, vocab_size: int) -> None:
    """Raise InvalidRequest for sampling values this sampler cannot honour (the request
    plane carries whatever a sender wrote; the frontend checks the same ranges first)."""
    t, p = params.temperature, params.top_p
    if not (math.isfinite(t) and t >= 0):
        raise InvalidRequest(f"temperature={t} is invalid; expected a finite number >= 0")
    if not 0 < p <= 1:
        raise InvalidRequest(f"top_p={p} is invalid; expected a number in (0, 1]")
    if params.top_k < -1:
        raise InvalidRequest(f"top_k={params.top_k} is invalid; expected -1, 0 (off) or > 0")
    if params.logprobs is not None and not 0 <= params.logprobs <= vocab_size:
        raise InvalidRequest(
            f"logprobs={params.logprobs} is invalid; expected an integer in [0, {vocab_size}]"
        )
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):
            raise InvalidRequest(
                f"{name}={value} is invalid; expected a number in [-2, 2]", param=name
            )
    r = params.repetition_penalty
    if not (math.isfinite(r) and r > 0):
        raise InvalidRequest(
            f"repetition_penalty={r} is invalid; expected a finite number > 0 (1 = off)",
            param="repetition_penalty",
        )
    if params.logit_bias:
        _check_logit_bias(params.logit_bias, vocab_size)


def _check_logit_bias(bias: dict[int, float], vocab_size: int) -> None:
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequest(
            f"logit_bias has {len(bias)} entries; expected at most {MAX_LOGIT_BIAS_ENTRIES}",
            param="logit_bias",
        )
    for token_id, value in bias.items():
        if not 0 <= token_id < vocab_size:
            raise InvalidRequest(
                f"logit_bias token id {token_id} is out of range; expected [0, {vocab_size})",
                param="logit_bias",
            )
        if not (math.isfinite(value) and -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS):
            raise InvalidRequest(
                f"logit_bias[{token_id}]={value} is invalid; expected a number in [-100, 100]",
                param="logit_bias",
            )


class SamplingError(RuntimeError):
    """A row's distribution has no finite probability mass (NaN/inf logits)."""


class Sampler:
    """Stateless apart from the fallback generator for unseeded requests."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """One token per row of `logits` [len(seqs), vocab] (fp32); fills the sequences'
        pending logprobs when they asked for them. Raises SamplingError when a row has no
        finite distribution (the engine then fails this step's requests)."""
        if any(has_penalties(s.sampling) for s in seqs):
            apply_penalties(logits, seqs)
        self._mask_min_tokens(logits, seqs)
        if all(is_greedy(s.sampling) for s in seqs):
            tokens = logits.max(dim=-1).indices.tolist()  # faster than argmax on CPU
        else:
            tokens = [self._sample_row(logits[i], seq) for i, seq in enumerate(seqs)]
        if any(s.sampling.logprobs is not None for s in seqs):
            self._logprobs(logits, seqs, tokens)
        return tokens

    @staticmethod
    def is_plain_greedy(seqs: list[Sequence]) -> bool:
        """True when every row is the argmax of unmasked logits (no temperature, no
        logprobs, no bias or penalties, no stop ids banned by min_tokens): the head may pick
        tokens itself."""
        return all(
            is_greedy(s.sampling)
            and s.sampling.logprobs is None
            and not has_penalties(s.sampling)
            and s.num_output_tokens >= s.stop.min_tokens
            for s in seqs
        )

    @staticmethod
    def _mask_min_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> None:
        for i, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.stop.min_tokens:
                banned = seq.stop_token_ids | (set() if seq.stop.ignore_eos else seq.eos_token_ids)
                if banned:
                    logits[i, list(banned)] = float("-inf")

    def _sample_row(self, row: torch.Tensor, seq: Sequence) -> int:
        if is_greedy(seq.sampling):
            return int(row.argmax())
        gen = seq.generator or self.generator
        return int(torch.multinomial(self._probs(row, seq), 1, generator=gen))

    def verify(self, logits: torch.Tensor, seq: Sequence) -> list[int]:
        """The tokens `seq` emits from its draft, given the target's logits at the draft's
        rows [len(draft) + 1, vocab] (tandem.engines.native.speculation)."""
        draft = seq.draft_token_ids
        if is_greedy(seq.sampling):
            return accept_greedy(draft, logits.max(dim=-1).indices.tolist())
        probs = torch.stack([self._probs(row, seq) for row in logits])
        return accept_sampled(probs, draft, seq.generator or self.generator)

    @staticmethod
    def _probs(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
        """The row's sampling distribution (temperature, top-k, top-p) on the host."""
        params = seq.sampling
        row = row / params.temperature
        if 0 < params.top_k < row.shape[0]:
            kth = torch.topk(row, params.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_vals, order = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_vals, dim=-1)
            drop = probs.cumsum(-1) - probs > params.top_p  # keep the smallest set >= top_p
            sorted_vals = sorted_vals.masked_fill(drop, float("-inf"))
            row = torch.full_like(row, float("-inf")).scatter_(0, order, sorted_vals)
        probs = torch.softmax(row, dim=-1)
        if not bool(torch.isfinite(probs).all()):
            raise SamplingError(
                f"request_id={seq.request_id}: no finite distribution to sample from "
                f"(temperature={params.temperature}, top_k={params.top_k}, top_p={params.top_p})"
            )
        return probs.cpu()

    @staticmethod
    def _logprobs(logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]) -> None:
        logprobs = torch.log_softmax(logits, dim=-1)
        for i, seq in enumerate(seqs):
            k = seq.sampling.logprobs
            if k is None:
                continue
            seq.pending_logprobs.append(float(logprobs[i, tokens[i]]))
            if k > 0:
                vals, ids = torch.topk(logprobs[i], k)
                seq.pending_top_logprobs.append(
                    [
                        TopLogprob(int(t), float(v))
                        for t, v in zip(ids.tolist(), vals.tolist(), strict=False)
                    ]
                )
            else:
                seq.pending_top_logprobs.append([])
