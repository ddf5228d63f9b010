"""The comparisons' shared cell helpers: a failing system never loses the others' numbers."""

from __future__ import annotations

import pytest

from tandem.bench.cell import format_number, measure_each

pytestmark = pytest.mark.timeout(10)


def test_measure_each_keeps_the_others_when_one_fails() -> None:
    def measure(name: str) -> str:
        if name == "dynamo":
            raise RuntimeError("anchor did not start")
        return name.upper()

    results, failures = measure_each(["tandem", "dynamo", "vllm"], measure)
    assert results == ["TANDEM", "VLLM"]
    assert failures == {"dynamo": "anchor did not start"}


def test_measure_each_lets_interrupts_through() -> None:
    def measure(name: str) -> str:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        measure_each(["tandem"], measure)


def test_format_number_dashes_missing_values() -> None:
    assert format_number(None) == "-"
    assert format_number(1.234) == "1.23"
    assert format_number(1.25, ".1f") == "1.2"
