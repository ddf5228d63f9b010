from __future__ import annotations

import random

import pytest

from tandem.planner.regression import StepCoefficients, StepTimeModel
from tandem.protocols.scaling import StepSample


def _sample(prefill: int, kv: int, ms: float) -> StepSample:
    return StepSample(
        wall_ms=ms,
        num_prefill_tokens=prefill,
        num_decode_kv_tokens=kv,
        num_running=1,
        num_waiting=0,
    )


def test_fit_recovers_the_coefficients_of_a_linear_engine() -> None:
    rng = random.Random(0)
    model = StepTimeModel()
    for _ in range(500):
        p, k = rng.randrange(0, 4000), rng.randrange(0, 100_000)
        model.observe(_sample(p, k, 5.0 + 0.02 * p + 3e-4 * k + rng.uniform(-0.1, 0.1)))
    c = model.fit()
    assert c.base_ms == pytest.approx(5.0, abs=0.1)
    assert c.ms_per_prefill_token == pytest.approx(0.02, rel=0.01)
    assert c.ms_per_decode_kv_token == pytest.approx(3e-4, rel=0.01)
    assert model.predict(1000, 10_000) == pytest.approx(5 + 20 + 3, abs=0.2)


def test_prior_until_enough_samples_and_for_a_term_that_never_varies() -> None:
    prior = StepCoefficients(1.0, 0.5, 0.25)
    model = StepTimeModel(min_samples=10, prior=prior)
    for k in range(5):
        model.observe(_sample(0, 1000 * k, 2.0 + 0.001 * 1000 * k))
    assert model.fit() == prior
    for k in range(5, 20):
        model.observe(_sample(0, 1000 * k, 2.0 + 0.001 * 1000 * k))
    c = model.fit()
    assert c.ms_per_prefill_token == 0.5  # decode-only steps say nothing about prefill
    assert c.ms_per_decode_kv_token == pytest.approx(0.001)
    assert c.base_ms == pytest.approx(2.0)


def test_coefficients_never_negative() -> None:
    model = StepTimeModel(min_samples=3)
    for p, ms in ((0, 10.0), (100, 9.0), (200, 8.0), (300, 7.0)):
        model.observe(_sample(p, 0, ms))
    assert model.fit().ms_per_prefill_token == 0.0
