"""`check_range`: the one range check of every config validator (STYLE.md: a `ValueError`
naming field, value and allowed range)."""

from __future__ import annotations

from tandem.errors import ConfigError

__all__ = ["check_range"]


def check_range(
    name: str,
    value: float,
    *,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
    note: str = "",
) -> None:
    """Raise ConfigError (a ValueError) unless `low <= value <= high` (`<` on an open side; no
    bound where None). NaN is out of every range. `note` follows the expected range, e.g.
    "(0 = off)". The message: `lease_ttl_s=0.1 out of range; expected 0.5 <= lease_ttl_s <= 60`,
    `max_image_bytes=0 out of range; expected >= 1`."""
    above_low = low is None or (value > low if low_open else value >= low)
    below_high = high is None or (value < high if high_open else value <= high)
    if above_low and below_high and value == value:  # value != value: NaN
        return
    raise ConfigError(
        f"{name}={value} out of range; expected {_expected(name, low, high, low_open, high_open)}"
        + (f" {note}" if note else "")
    )


def _expected(
    name: str, low: float | None, high: float | None, low_open: bool, high_open: bool
) -> str:
    lower = "<" if low_open else "<="
    upper = "<" if high_open else "<="
    if low is not None and high is not None:
        return f"{low} {lower} {name} {upper} {high}"
    if low is not None:
        return f"{'>' if low_open else '>='} {low}"
    if high is not None:
        return f"{upper} {high}"
    return "a number"
