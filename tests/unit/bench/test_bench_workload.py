from __future__ import annotations

import itertools

import numpy as np
import pytest

from tandem.bench.workload import (
    FIRST_PLAIN_TOKEN_ID,
    SyntheticConfig,
    poisson_send_times,
    synthetic_requests,
    tokens_to_text,
)


def test_random_prompts_have_isl_tokens_in_vocab_and_are_seeded():
    config = SyntheticConfig(isl=50, osl=7, vocab_size=1000, seed=3)
    specs = synthetic_requests(config, 5)
    assert all(len(s.token_ids) == 50 and s.max_tokens == 7 for s in specs)
    assert all(FIRST_PLAIN_TOKEN_ID <= t < 1000 for s in specs for t in s.token_ids)
    assert specs[0].token_ids != specs[1].token_ids
    again = synthetic_requests(config, 5)
    assert [s.token_ids for s in again] == [s.token_ids for s in specs]


def test_shared_prefix_groups_share_prefix_and_interleave():
    config = SyntheticConfig(num_groups=3, prompts_per_group=2, prefix_len=20, suffix_len=5)
    specs = synthetic_requests(config, 12)
    assert [s.group_id for s in specs[:6]] == [0, 1, 2, 0, 1, 2]
    for s in specs:
        assert len(s.token_ids) == 25
        assert s.token_ids[:20] == specs[s.group_id].token_ids[:20]
    assert specs[0].token_ids[:20] != specs[1].token_ids[:20]
    # same group, different prompt → different suffix; the cycle repeats after 6 requests
    assert specs[0].token_ids[20:] != specs[3].token_ids[20:]
    assert specs[6].token_ids == specs[0].token_ids


@pytest.mark.parametrize(
    ("field", "value"), [("isl", 0), ("osl", 0), ("num_groups", -1), ("vocab_size", 10)]
)
def test_config_rejects_bad_values_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SyntheticConfig(**{field: value})


def test_poisson_schedule_mean_gap_and_determinism():
    times = poisson_send_times(200.0, 20_000, seed=1)
    assert times[0] == 0.0 and all(b >= a for a, b in itertools.pairwise(times))
    gaps = np.diff(times)
    assert np.mean(gaps) == pytest.approx(1 / 200.0, rel=0.03)
    assert np.std(gaps) == pytest.approx(1 / 200.0, rel=0.05)  # exponential: std == mean
    assert poisson_send_times(200.0, 100, seed=1) == times[:100]
    assert poisson_send_times(200.0, 100, seed=2) != times[:100]
    with pytest.raises(ValueError, match="rate_per_s"):
        poisson_send_times(0.0, 5)


def test_text_prompts_keep_length_and_shared_prefixes():
    a = tokens_to_text([5, 6, 7, 8])
    b = tokens_to_text([5, 6, 7, 9])
    assert len(a.split()) == 4
    assert a.split()[:3] == b.split()[:3]
