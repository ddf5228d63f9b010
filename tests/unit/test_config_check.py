"""`check_range`: one message shape naming field, value and allowed range, for every bound."""

from __future__ import annotations

import math

import pytest

from tandem.config_check import check_range
from tandem.errors import ConfigError


@pytest.mark.parametrize(
    ("value", "kwargs"),
    [
        (0.5, {"low": 0.5, "high": 60}),
        (60, {"low": 0.5, "high": 60}),
        (1, {"low": 1}),
        (-5, {"high": 0}),
        (1e-9, {"low": 0, "low_open": True}),
        (0.0, {"low": 0, "high": 1, "high_open": True}),
        (7, {}),
    ],
)
def test_values_in_range_pass(value: float, kwargs: dict[str, float | bool]) -> None:
    check_range("x", value, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("value", "kwargs", "message"),
    [
        (
            0.1,
            {"low": 0.5, "high": 60},
            "lease_ttl_s=0.1 out of range; expected 0.5 <= lease_ttl_s <= 60",
        ),
        (
            61,
            {"low": 0.5, "high": 60},
            "lease_ttl_s=61 out of range; expected 0.5 <= lease_ttl_s <= 60",
        ),
        (0, {"low": 1}, "lease_ttl_s=0 out of range; expected >= 1"),
        (0.0, {"low": 0, "low_open": True}, "lease_ttl_s=0.0 out of range; expected > 0"),
        (2, {"high": 1}, "lease_ttl_s=2 out of range; expected <= 1"),
        (1, {"high": 1, "high_open": True}, "lease_ttl_s=1 out of range; expected < 1"),
        (0, {"low": 0, "high": 1, "low_open": True}, "expected 0 < lease_ttl_s <= 1"),
        (
            -1,
            {"low": 0, "note": "(0 = off)"},
            "lease_ttl_s=-1 out of range; expected >= 0 (0 = off)",
        ),
    ],
)
def test_out_of_range_names_field_value_and_range(
    value: float, kwargs: dict[str, float | bool | str], message: str
) -> None:
    with pytest.raises(ConfigError) as info:
        check_range("lease_ttl_s", value, **kwargs)  # type: ignore[arg-type]
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)  # callers and tests catch ValueError


@pytest.mark.parametrize("kwargs", [{}, {"low": 0}, {"high": 1}, {"low": 0, "high": 1}])
def test_nan_is_out_of_every_range(kwargs: dict[str, float]) -> None:
    with pytest.raises(ConfigError, match="x=nan out of range"):
        check_range("x", math.nan, **kwargs)
