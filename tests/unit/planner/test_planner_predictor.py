from __future__ import annotations

import pytest

from tandem.planner.predictor import (
    ConstantPredictor,
    HoltPredictor,
    MovingAveragePredictor,
    make_predictor,
)


def test_constant_repeats_the_last_value() -> None:
    p = ConstantPredictor()
    assert p.predict() == 0.0
    for x in (3.0, 7.0):
        p.observe(x)
    assert p.predict() == 7.0


def test_moving_average_over_its_window() -> None:
    p = MovingAveragePredictor(window=3)
    for x in (1.0, 2.0, 3.0, 10.0):
        p.observe(x)
    assert p.predict() == pytest.approx(5.0)


def test_holt_follows_a_ramp_where_the_average_lags() -> None:
    holt, avg = HoltPredictor(), MovingAveragePredictor(window=5)
    for i in range(20):
        holt.observe(2.0 * i)
        avg.observe(2.0 * i)
    assert holt.predict() == pytest.approx(40.0, abs=0.5)  # the next point of the ramp
    assert avg.predict() == pytest.approx(34.0)


def test_holt_never_forecasts_below_zero() -> None:
    p = HoltPredictor()
    for x in (100.0, 50.0, 0.0, 0.0):
        p.observe(x)
    assert p.predict() >= 0.0


def test_unknown_predictor_names_the_choices() -> None:
    with pytest.raises(ValueError, match="unknown predictor 'arima'; expected one of: constant"):
        make_predictor("arima")
