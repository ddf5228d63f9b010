"""The batched logit_bias / penalty pass against a plain per-row, per-token reference, and the
sampler's checks and greedy fast path around it."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.engines.native.penalties import apply_penalties, has_penalties
from tandem.engines.native.sampler import Sampler, check_sampling
from tandem.engines.native.sequence import Sequence
from tandem.errors import InvalidRequest
from tandem.protocols.engine import (
    PreprocessedRequest,
    SamplingParams,
    StopConditions,
)

VOCAB = 50


def _seq(
    prompt: list[int], output: list[int], sampling: SamplingParams, num_generated: int = 0
) -> Sequence:
    request = PreprocessedRequest(
        request_id=f"r{random.random()}",
        model="m",
        token_ids=prompt,
        num_generated_tokens=num_generated,
        sampling=sampling,
        stop=StopConditions(max_tokens=64),
    )
    seq = Sequence(request, (0,))
    seq.token_ids += output
    return seq


def _reference(row: list[float], seq: Sequence) -> list[float]:
    """One row, token by token, straight from the definitions."""
    p = seq.sampling
    out = list(row)
    for t, b in (p.logit_bias or {}).items():
        out[t] += b
    seen = set(seq.token_ids)
    for t in seen:
        r = p.repetition_penalty
        out[t] = out[t] / r if out[t] > 0 else out[t] * r
    generated = seq.token_ids[seq.output_start :]
    for t in set(generated):
        out[t] -= p.frequency_penalty * generated.count(t) + p.presence_penalty
    return out


def _random_params(rng: random.Random) -> SamplingParams:
    bias = {rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(4))}
    return SamplingParams(
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.5, 2.0)]),
        logit_bias=bias or None,
    )


@pytest.mark.parametrize("seed", range(20))
def test_batched_penalties_match_the_per_row_reference(seed: int) -> None:
    rng = random.Random(seed)
    seqs = []
    for _ in range(rng.randrange(1, 9)):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 12))]
        carried = rng.randrange(0, len(prompt))  # tokens generated before a handoff
        seqs.append(_seq(prompt, output, _random_params(rng), carried))
    logits = torch.randn(len(seqs), VOCAB, generator=torch.Generator().manual_seed(seed))
    expected = [_reference(logits[i].tolist(), s) for i, s in enumerate(seqs)]
    apply_penalties(logits, seqs)
    torch.testing.assert_close(logits, torch.tensor(expected), rtol=1e-5, atol=1e-4)


def test_tokens_generated_before_a_handoff_count_as_output() -> None:
    params = SamplingParams(frequency_penalty=1.0)
    moved = _seq([1, 2, 7, 7], [7], params, num_generated=2)  # 7, 7 came from a prefill
    fresh = _seq([1, 2, 7, 7], [7], params)
    logits = torch.zeros(2, VOCAB)
    apply_penalties(logits, [moved, fresh])
    assert logits[0, 7] == -3.0  # three generated 7s
    assert logits[1, 7] == -1.0  # only one; the prompt's do not count
    assert logits[0, 1] == logits[1, 1] == 0.0


def test_logit_bias_steers_greedy_and_the_fast_path_steps_aside() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 5.0
    plain = _seq([1], [], SamplingParams(temperature=0))
    banned = _seq([1], [], SamplingParams(temperature=0, logit_bias={3: -100.0, 9: 1.0}))
    assert Sampler.is_plain_greedy([plain]) and not Sampler.is_plain_greedy([plain, banned])
    assert Sampler()(logits, [plain, banned]) == [3, 9]


def test_neutral_values_are_no_ops() -> None:
    assert not has_penalties(SamplingParams())
    logits = torch.randn(1, VOCAB)
    before = logits.clone()
    seqs = [_seq([1, 2], [3], SamplingParams()), _seq([4], [4], SamplingParams(logit_bias={5: 1}))]
    logits = torch.cat([logits, torch.zeros(1, VOCAB)])
    apply_penalties(logits, seqs)
    assert torch.equal(logits[0], before[0])


@pytest.mark.parametrize(
    ("params", "param"),
    [
        (SamplingParams(presence_penalty=2.5), "presence_penalty"),
        (SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
        (SamplingParams(repetition_penalty=0.0), "repetition_penalty"),
        (SamplingParams(logit_bias={VOCAB: 1.0}), "logit_bias"),
        (SamplingParams(logit_bias={1: 101.0}), "logit_bias"),
        (SamplingParams(logit_bias=dict.fromkeys(range(301), 1.0)), "logit_bias"),
    ],
)
def test_values_the_sampler_cannot_honour_are_refused(params: SamplingParams, param: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_sampling(params, VOCAB)
    assert info.value.param == param
