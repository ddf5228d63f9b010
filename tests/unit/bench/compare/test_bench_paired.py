"""The statistics behind `tandem bench vllm`'s verdicts: Student's t quantiles against the
published table, the t interval of paired per-round values against a hand computation, and
the met / missed / unresolved reading of an interval against a target."""

from __future__ import annotations

import math

import pytest

from tandem.bench.compare.paired import (
    MET,
    MISSED,
    UNRESOLVED,
    Interval,
    combined,
    paired_interval,
    t_quantile,
    verdict,
)


@pytest.mark.parametrize(
    ("p", "df", "table"),
    [(0.975, 1, 12.7062), (0.975, 2, 4.3027), (0.975, 5, 2.5706), (0.975, 9, 2.2622),
     (0.975, 30, 2.0423), (0.995, 4, 4.6041), (0.95, 19, 1.7291)],
)  # fmt: skip
def test_t_quantiles_match_the_table(p: float, df: int, table: float) -> None:
    assert t_quantile(p, df) == pytest.approx(table, abs=1e-4)


def test_interval_of_known_pairs() -> None:
    # mean 3, s = sqrt(2.5), t(0.975, 4) = 2.776445: half width 2.776445 * sqrt(2.5 / 5)
    got = paired_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    half = 2.776445 * math.sqrt(0.5)
    assert got is not None and got.n == 5 and got.mean == 3.0
    assert (got.low, got.high) == (pytest.approx(3 - half, abs=1e-5),
                                   pytest.approx(3 + half, abs=1e-5))  # fmt: skip
    wider = paired_interval([1.0, 2.0, 3.0, 4.0, 5.0], confidence=0.99)
    assert wider is not None and wider.low < got.low and wider.high > got.high
    assert paired_interval([4.0]) is None  # one pair has no spread to estimate


def test_a_large_spread_is_a_wide_interval() -> None:
    # issue 28's c=8 rounds: -322 .. +180 ms; a median of +3 would have "met" 5 ms
    got = paired_interval([-322.0, 180.0, 3.0, -40.0, 60.0, 2.0])
    assert got is not None and got.low < -150 and got.high > 150
    assert verdict(got, 5.0, at_most=True) == UNRESOLVED


@pytest.mark.parametrize(
    ("low", "high", "at_most", "want"),
    [(-2.0, 4.9, True, MET), (5.1, 9.0, True, MISSED), (1.0, 6.0, True, UNRESOLVED),
     (0.96, 1.02, False, MET), (0.90, 0.949, False, MISSED), (0.93, 0.99, False, UNRESOLVED)],
)  # fmt: skip
def test_verdict_reads_the_interval_not_its_centre(
    low: float, high: float, at_most: bool, want: str
) -> None:
    target = 5.0 if at_most else 0.95
    interval = Interval((low + high) / 2, low, high, 6, 0.95)
    assert verdict(interval, target, at_most=at_most) == want
    assert verdict(None, target, at_most=at_most) == UNRESOLVED


def test_combined() -> None:
    assert combined([MET, MET]) == MET
    assert combined([MET, UNRESOLVED]) == UNRESOLVED
    assert combined([UNRESOLVED, MISSED]) == MISSED


def test_bad_arguments_say_what_was_expected() -> None:
    with pytest.raises(ValueError, match=r"expected 0\.5 < p < 1"):
        t_quantile(0.2, 3)
    with pytest.raises(ValueError, match=r"confidence=1\.5"):
        paired_interval([1.0, 2.0], confidence=1.5)
